"""Per-task memory on a cluster: datamem.dask and datamem.ray run each
task under a tag named after it, count live and peak bytes per tag on each
worker, and a task that passes its tag's limit fails alone with a MemoryError
that names the tag, the limit and the request. The engines run in a fresh
interpreter, as a user would run them, and skip with the reason when not
installed (scripts/test.sh installs them in its "Dask, Ray and joblib workers"
stage, which runs this file). The name rule (datamem._tasks) is tested
everywhere."""

import json

import pytest

import datamem
from datamem._tasks import format_table, tag_rows, task_tag

from conftest import get, job, last_json, need, run_py, run_script


# ---- names: what a Dask key prefix or a Ray function name becomes ----------------------------

@pytest.mark.parametrize("name, tag", [
    ("runaway", "runaway"),
    ("random_sample", "random_sample"),
    ("getitem-hlgfinalize", "getitem-hlgfinalize"),
    ("my.tag", "my_tag"),                  # dots, slashes, spaces: "_"
    ("a/b c", "a_b_c"),
    ("('x', 0)", "__x___0_"),              # a tuple key's str
    ("3d-fft", "_3d-fft"),                 # a tag starts with a letter or "_"
    ("-lead", "_-lead"),
    ("", "_"),
    ("données", "donn_es"),                # non-ASCII: one "_" per character
    ("é", "_"),
    ("x" * 80, "x" * 63),                  # at most 63 bytes
    ("9" + "y" * 80, "_9" + "y" * 61),
    (42, "_42"),
])
def test_task_tag_makes_any_name_a_valid_tag(name, tag):
    got = task_tag(name)
    assert got == tag
    datamem.tag(got)  # accepted by the grammar tag() enforces (raises ValueError if not)


def test_tag_rows_and_table():
    per_worker = {
        "tcp://a:1": {"tags": {"keep": {"live": 10 << 20, "peak": 12 << 20, "limit": None,
                                         "refused": 0},
                                "runaway": {"live": 0, "peak": 256 << 20, "limit": 256 << 20,
                                            "refused": 1}}},
        "tcp://b:2": {"tags": {"keep": {"live": 20 << 20, "peak": 20 << 20, "limit": None,
                                         "refused": 0}}},
        "tcp://c:3": {},  # a worker without per-tag counting
    }
    rows = tag_rows(per_worker)
    assert rows[0] == ("tcp://b:2", "keep", 20 << 20, 20 << 20, None, 0)  # biggest live first
    assert [r[1] for r in rows] == ["keep", "keep", "runaway"]
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["worker", "tag", "live", "peak", "limit", "refused"]
    assert any(l.startswith("(all workers)") and "30.0 MiB" in l and " keep " in l
               for l in lines), text
    assert any("runaway" in l and "256.0 MiB" in l and l.rstrip().endswith("1")
               for l in lines), text



def test_tag_rows_reads_a_workers_stats_json(tmp_path):
    # datamem.ray.tag_table() reads each worker's /stats.json, whose "tags" has
    # stats()'s shape: {tag: {live, peak, limit, refused}}, biggest live first.
    with job(tmp_path, extra={"DATAMEM_TAG_BYTES": "1"}) as (_, info):
        status, _, body = get(info["url"].replace("/metrics", "/stats.json"))
    assert status == 200
    snap = json.loads(body)
    assert isinstance(snap["tags"], dict)
    rows = tag_rows({"w1": snap})
    assert sorted(rows) == sorted(("w1", k, t["live"], t["peak"], t["limit"], t["refused"])
                                  for k, t in snap["tags"].items())
    ingest = [r for r in rows if r[1] == "ingest"]
    assert len(ingest) == 1 and ingest[0][2] >= 8000, rows  # np.ones(1000), kept
    assert "ingest" in format_table(rows)


POLICY = """version: 1
default: general
arenas:
  general: {}
tag_limits:
  - {tag: "runaway*", limit: 256MiB}
"""

# ---- Dask -------------------------------------------------------------------------------------

DASK = r"""
import json, os, sys, time
import dask, dask.array as da, numpy as np
from dask.distributed import Client, LocalCluster, wait
from distributed.diagnostics.plugin import SchedulerPlugin
import datamem, datamem.dask

MiB = 1 << 20

def keep(i):
    return np.full(MiB // 8, float(i))

def runaway():
    hold = []
    for _ in range(60):
        hold.append(np.ones(128 * MiB // 8))   # 7.5 GiB, touched, on a 1.5 GiB worker
    return len(hold)

def hold10():
    return np.ones(10 * MiB // 8)

def block_of(b):
    return np.full(MiB // 8, 2.0)

class Deaths(SchedulerPlugin):
    name = "deaths"
    def __init__(self):
        self.removed = 0
    def remove_worker(self, *args, **kwargs):
        self.removed += 1

def add_deaths(dask_scheduler):
    dask_scheduler.add_plugin(Deaths(), name="deaths")

def deaths(dask_scheduler):
    return dask_scheduler.plugins["deaths"].removed

def tag_live(c, tag):
    return {w: (s["tags"].get(tag) or {}) for w, s in datamem.dask.stats(c).items()}

def poll(what, cond, bound=20.0):
    deadline = time.monotonic() + bound
    while True:
        v = what()
        if cond(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.05)

if __name__ == "__main__":
    policy, plugin = sys.argv[1], sys.argv[2] == "plugin"
    out = {}
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True, memory_limit="1.5GiB",
                      dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster, \
            Client(cluster) as c:
        if plugin:
            c.register_plugin(datamem.dask.Policy(policy))
            c.wait_for_workers(2, timeout=60)
        out["env"] = sorted(set((e.get("DATAMEM_TAG_BYTES"), e.get("DATAMEM_MEMORY_LIMIT"))
                                for e in c.run(lambda: dict(os.environ)).values()))
        c.run_on_scheduler(add_deaths)
        # One task keeps 10 MiB: its bytes show under its key prefix, on its worker.
        h = c.submit(hold10, pure=False)
        wait([h])
        where = c.who_has([h])[h.key][0]
        s = datamem.dask.stats(c)[where]["tags"].get("hold10", {})
        out["hold10"] = [s.get("live"), s.get("peak")]
        del h
        gone = poll(lambda: tag_live(c, "hold10")[where].get("live"), lambda v: v == 0)
        out["hold10_after"] = gone
        # An annotation names the tag (made safe: "my.loader" -> "my_loader").
        with dask.annotate(datamem="my.loader"):
            a = c.submit(hold10, pure=False)
        wait([a])
        out["annotated"] = sum(t.get("live", 0) for t in tag_live(c, "my_loader").values())
        # A collection: each block's task carries its function's name.
        x = da.ones((8, MiB // 8), chunks=(1, MiB // 8)).map_blocks(block_of).persist()
        wait(x)
        out["blocks"] = sum(t.get("live", 0) for t in tag_live(c, "block_of").values())
        del x, a
        # 200 tasks keep their results; then one runaway.
        kept = c.map(keep, range(200), pure=False)
        wait(kept)
        bad = c.submit(runaway, pure=False)
        wait([bad], timeout=120)
        try:
            out["runaway"] = ["ok", bad.result()]
        except Exception as e:
            out["runaway"] = [type(e).__name__, str(e)]
        # `bad` still held: its worker keeps the error and its traceback for it
        out["runaway_after"] = poll(
            lambda: sum(t.get("live", 0) for t in tag_live(c, "runaway").values()),
            lambda v: v == 0)
        got = c.gather(kept)
        out["results"] = sum(1 for i, r in enumerate(got) if float(r[0]) == float(i))
        out["deaths"] = c.run_on_scheduler(deaths)
        out["table"] = datamem.dask.format_table(datamem.dask.tag_table(c))
    print(json.dumps(out))
"""


def test_dask_runaway_task_fails_alone_and_names_its_tag(tmp_path):
    need("distributed", "dask")
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    r = run_script(tmp_path, "dask_tasks.py", DASK, [pol, "plugin"], timeout=240)
    out = last_json(r)
    assert out["env"] == [["1", str(int(1.5 * 2**30))]]  # counting on; the nanny's limit
    live, peak = out["hold10"]
    assert 10 << 20 <= live <= (10 << 20) + (1 << 20) and peak >= live, out["hold10"]
    assert out["hold10_after"] == 0                      # released: live back to 0
    assert out["annotated"] >= 10 << 20
    assert out["blocks"] >= 8 << 20                      # 8 blocks of 1 MiB
    kind, msg = out["runaway"]
    assert kind == "MemoryError", out["runaway"]
    assert "tag 'runaway'" in msg and "256.0 MiB" in msg and "request of" in msg, msg
    assert out["results"] == 200 and out["deaths"] == 0  # nothing else lost, no restart
    assert "runaway" in out["table"] and "keep" in out["table"]


# A worker stopped running tasks for good after about 4,095 distinct task names:
# datamem.tag() raised in the execute wrapper, outside the task, which then stayed
# `executing`, and once every thread slot held one the worker ran nothing more.
# One in-process worker (the same execute wrapper the plugin's preload installs)
# runs tasks of 20,000 distinct key prefixes, then tasks whose tagging is made to
# fail (they run untagged, said once), then a fresh task.
DASK_MANY = r"""
import json, logging, sys, time
import numpy as np
import datamem
datamem.install(sys.argv[1])
import datamem.dask
from dask.distributed import Client, LocalCluster, wait

def small(i):
    return int(np.ones(16).sum())        # an array made and freed under the task's tag

def boom(*names):
    raise RuntimeError("tagging broke")

class Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())

if __name__ == "__main__":
    said = Said()
    logging.getLogger("datamem").addHandler(said)
    out = {"done": 0}
    n, batch, bound = int(sys.argv[2]), 2000, float(sys.argv[3])
    with LocalCluster(n_workers=1, threads_per_worker=4, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.run(lambda dask_worker: datamem.dask.dask_setup(dask_worker))
        for start in range(0, n, batch):
            fs = c.map(small, range(start, start + batch),
                       key=["p%d-0" % i for i in range(start, start + batch)])  # prefix p<i>
            try:
                wait(fs, timeout=bound)
            except Exception:
                out["stuck"] = [start, sum(f.status == "finished" for f in fs)]
                break
            out["done"] += sum(1 for r in c.gather(fs) if r == 16)
        s = datamem.stats()
        out["rows"], out["contexts"] = len(s["tags"]), s["contexts"]
        if "stuck" not in out:
            datamem.tag = boom
            fs = c.map(small, range(50), key=["q%d-0" % i for i in range(50)])
            wait(fs, timeout=bound)
            out["untagged"] = sum(1 for r in c.gather(fs) if r == 16)
        out["fresh"] = c.submit(small, -1, key="fresh-0").result(timeout=bound)
    out["said"] = [l for l in said.lines if "runs untagged" in l]
    print(json.dumps(out))
"""


def test_dask_worker_runs_any_number_of_distinct_task_names(tmp_path):
    need("distributed", "dask")
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    r = run_script(tmp_path, "dask_many.py", DASK_MANY, [pol, 20000, 300], timeout=1500)
    out = last_json(r)
    assert "stuck" not in out, out
    assert out["done"] == 20000, out
    assert out["rows"] <= 4096 and out["contexts"] <= 4097, out
    assert out["untagged"] == 50 and out["fresh"] == 16, out
    assert len(out["said"]) == 1 and "tagging broke" in out["said"][0], out


# ---- Ray --------------------------------------------------------------------------------------

# On Ray, about 200 of 4,300 distinct remote functions failed with
# RayTaskError(ValueError) once the runtime's tables were full. Ray's task
# wrapper (what worker_setup() puts around each function, no cluster needed)
# runs 6,000 distinct names, each under its own tag, then functions whose
# tagging is made to fail: they run untagged, said once.
RAY_WRAPPER = r"""
import json, logging, numpy as np, datamem, datamem.ray
lines = []
class Said(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("datamem").addHandler(Said())
def make():
    return datamem._ext.handler_tags(datamem._ext.get_handler()), int(np.ones(16).sum())
ok = 0
for i in range(6000):
    tags, total = datamem.ray._tagged(make, "fn%d" % i)()
    ok += tags == ("fn%d" % i,) and total == 16
def boom(*names):
    raise RuntimeError("tagging broke")
datamem.tag = boom
untagged = [datamem.ray._tagged(make, "late%d" % i)() for i in range(20)]
print(json.dumps({"ok": ok, "untagged": untagged[0], "n": len(untagged),
                  "said": [l for l in lines if "runs untagged" in l]}))
"""


def test_ray_task_wrapper_never_fails_a_task_for_its_tag(tmp_path):
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    out = last_json(run_py(RAY_WRAPPER, config=str(pol)))
    assert out["ok"] == 6000, out
    assert out["untagged"] == [[], 16] and out["n"] == 20, out
    assert len(out["said"]) == 1 and "tagging broke" in out["said"][0], out



RAY = r"""
import json, sys
import numpy as np, ray
import datamem, datamem.ray

MiB = 1 << 20

def current():
    from datamem import _ext
    return list(_ext.handler_tags(_ext.get_handler()) or ["(not datamem)"])

@ray.remote
def plain():
    return current()

@ray.remote
@datamem.ray.tag("my.loader")
def named():
    return current()

@ray.remote
def keep(i):
    return float(np.full(MiB // 8, float(i))[0])

@ray.remote(max_retries=0)
def runaway():
    hold = []
    for _ in range(8):   # 1 GiB: past the tag's 256 MiB, harmless to the machine if not
        hold.append(np.ones(128 * MiB // 8))
    return len(hold)

@ray.remote
class Store:
    def put(self):
        self.a = np.ones(10 * MiB // 8)
        return current()
    def tags(self):
        return datamem.stats()["tags"].get("Store", {}).get("live", 0)

@ray.remote
class Async:
    async def run(self):
        return current()

if __name__ == "__main__":
    # stats_http: each worker serves its stats, which datamem.ray.tag_table() reads;
    # announced in this test's own discovery directory.
    env = datamem.ray.runtime_env(sys.argv[1], stats_http="127.0.0.1:0",
                                  base={"env_vars": {"DATAMEM_STATS_DIR": sys.argv[2]}})
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env=env)
    out = {"plain": ray.get(plain.remote()), "named": ray.get(named.remote())}
    s = Store.remote()
    out["actor"] = ray.get(s.put.remote())
    out["actor_live"] = ray.get(s.tags.remote())
    out["stats"] = sorted(isinstance(v.get("tags"), dict) for v in datamem.ray.stats().values())
    rows = datamem.ray.tag_table()
    out["table"] = [r for r in rows if r[1] == "Store"]
    out["text"] = datamem.ray.format_table(rows)
    out["async"] = ray.get(Async.remote().run.remote())
    kept = [keep.remote(i) for i in range(50)]
    try:
        out["runaway"] = ["ok", ray.get(runaway.remote(), timeout=120)]
    except ray.exceptions.RayTaskError as e:
        out["runaway"] = [type(e.cause).__name__, str(e.cause)]
    out["results"] = sum(1 for i, v in enumerate(ray.get(kept)) if v == float(i))
    out["after"] = ray.get(plain.remote())
    ray.shutdown()
    print(json.dumps(out))
"""


def test_ray_tasks_and_actors_are_tagged_and_a_runaway_fails_alone(tmp_path):
    need("ray", "ray")
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    r = run_script(tmp_path, "ray_tasks.py", RAY, [pol, tmp_path / "discovery"], timeout=300)
    out = last_json(r)
    assert out["plain"] == ["plain"] and out["named"] == ["my_loader"]
    assert out["actor"] == ["Store"] and out["actor_live"] >= 10 << 20
    # The cluster-wide table, read from each worker's /stats.json ("tags" by name, as in
    # stats()): the actor's 10 MiB, under its class's tag, in its worker's row.
    assert out["stats"] and all(out["stats"]), out["stats"]
    assert len(out["table"]) == 1 and out["table"][0][2] >= 10 << 20, out["text"]
    assert "Store" in out["text"] and "(all workers)" in out["text"]
    # An async actor's methods run in a context Ray copies from its C++ thread, where
    # NumPy's handler is the default one: tagging puts them under the policy too.
    assert out["async"] == ["Async"]
    kind, msg = out["runaway"]
    assert kind == "MemoryError", out["runaway"]
    assert "tag 'runaway'" in msg and "256.0 MiB" in msg and "request of" in msg, msg
    assert out["results"] == 50 and out["after"] == ["plain"]
