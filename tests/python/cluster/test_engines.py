"""datamem under the engines people move to when one process is not enough:
Dask (`distributed`, a real LocalCluster of worker processes), Ray (a
local cluster) and joblib/loky. Each test runs its engine in a fresh interpreter,
as a user would, and skips with the reason when the engine is not installed
(scripts/test.sh installs them in its "Dask, Ray and joblib workers" stage)."""
import json
import os
import stat

import pytest

from conftest import last_json, need, run_py

POLICY = """version: 1
default: general
arenas:
  general: {alignment: 64}
  tasks: {alignment: 4096}
rules:
  - name: task-arrays            # exactly the arrays the tasks below make
    match: {size: {min: 1000000, max: 1000000}}
    arena: tasks
"""






# Made in the tasks: 1,000,000 bytes, which only the rule "task-arrays" matches.
TASK = r"""
def task(i):
    import os, numpy as np, datamem
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:
        from numpy.core.multiarray import get_handler_name
    a = np.empty(125000)
    a[:] = i
    return os.getpid(), get_handler_name(a), datamem.arena_of(a), float(a.sum())
"""

# ---- Dask -------------------------------------------------------------------------------------

DASK = TASK + r"""
import json, os, sys, time, urllib.request
from dask.distributed import Client, LocalCluster
import datamem.dask

def counts(c):
    return {w: s["rules"]["task-arrays"]["allocations"] for w, s in datamem.dask.stats(c).items()}

def metrics_of(c):
    out = {}
    for addr, w in c.scheduler_info(n_workers=-1)["workers"].items():
        url = "http://%s:%d/metrics" % (w["host"], w["services"]["dashboard"])
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out[addr] = [l for l in text.splitlines()
                     if l.startswith("datamem_rule_allocations_total{")
                     and 'rule="task-arrays"' in l]
    return out

if __name__ == "__main__":
    policy, n = sys.argv[1], int(sys.argv[2])
    out = {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster, \
            Client(cluster) as c:
        out["before"] = sorted({r[1] for r in c.gather(c.map(task, range(4), pure=False))})
        c.register_plugin(datamem.dask.Policy(policy))
        res = c.gather(c.map(task, range(n), pure=False))
        out["handlers"] = sorted({(r[1], r[2]) for r in res})
        out["sums_ok"] = all(r[3] == 125000.0 * i for i, r in enumerate(res))
        out["task_pids"] = len({r[0] for r in res})
        out["counted"] = sum(counts(c).values())       # through datamem's own stats
        out["n"] = n
        out["metrics"] = metrics_of(c)
        # A worker killed: its nanny starts a new process, under the policy.
        pid = c.run(os.getpid)
        victim = sorted(pid)[0]
        os.kill(pid[victim], 9)
        deadline = time.time() + 60
        while time.time() < deadline:
            info = c.scheduler_info(n_workers=-1)["workers"]
            if len(info) == 2 and victim not in info:
                break
            time.sleep(0.1)
        c.wait_for_workers(2, timeout=60)
        res = c.gather(c.map(task, range(6), pure=False))
        out["after_restart"] = sorted({(r[1], r[2]) for r in res})
        out["workers_after"] = all(c.run(datamem.current_policy).values())
        # A new worker joins: the scheduler gives its nanny the plugin first.
        cluster.scale(3)
        c.wait_for_workers(3, timeout=60)
        out["joined"] = sorted(c.run(datamem.current_policy).values())
        # Reload from the client: every worker, no restart.
        pids = c.run(os.getpid)
        with open(policy) as f:
            text = f.read()
        new = policy + ".v2"
        with open(new, "w") as f:
            f.write(text.replace("min: 1000000, max: 1000000", "min: 999999, max: 1000001"))
        out["reload"] = sorted(r["ok"] for r in datamem.dask.reload(c, new).values())
        out["same_pids"] = c.run(os.getpid) == pids
        out["hashes"] = len(set(s["policy_hash"] for s in datamem.dask.stats(c).values()))
        res = c.gather(c.map(task, range(3), pure=False))
        out["after_reload"] = sorted({(r[1], r[2]) for r in res})
    print(json.dumps(out))
"""


def test_dask_workers_run_the_policy(tmp_path):
    need("distributed", "dask")
    # No shared file system assumed: the policy lives where only the client reads
    # it; the plugin carries its text.
    pol = tmp_path / "client-only" / "policy.yaml"
    pol.parent.mkdir()
    pol.write_text(POLICY)
    script = tmp_path / "dask_job.py"
    script.write_text(DASK)
    r = run_py("import runpy, sys; sys.argv = ['dask_job.py', %r, '40']; "
               "runpy.run_path(%r, run_name='__main__')" % (str(pol), str(script)), timeout=240)
    out = last_json(r)
    assert out["before"] == ["default_allocator"]        # no policy before registering
    assert out["handlers"] == [["datamem", "tasks"]] and out["sums_ok"]
    assert out["task_pids"] == 2
    assert out["counted"] == out["n"] == 40               # 100% of the task arrays
    # Each worker's datamem metrics on the worker's own /metrics (the dashboard port).
    assert len(out["metrics"]) == 2
    assert sum(float(v[0].split()[-1]) for v in out["metrics"].values()) == 40
    assert out["after_restart"] == [["datamem", "tasks"]] and out["workers_after"]
    assert len(out["joined"]) == 3 and all(out["joined"])
    assert out["reload"] == [True, True, True] and out["same_pids"] and out["hashes"] == 1
    assert out["after_reload"] == [["datamem", "tasks"]]


def test_dask_policy_refuses_a_bad_policy_on_the_client(tmp_path):
    need("distributed", "dask")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: nowhere\narenas:\n  general: {}\n")
    r = run_py("import datamem, datamem.dask\n"
               "try:\n    datamem.dask.Policy(%r)\n"
               "except datamem.PolicyError as e:\n    print('refused:', e)\n" % str(bad))
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "bad.yaml:2:" in r.stdout


# datamem.dask.policy_file: where each nanny writes the policy its workers
# load. It needs nothing from `distributed`, so it is tested in every
# environment: without distributed, datamem.dask imports against a stub.

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="SKIP: needs root, to play another "
                             "user (chown to uid 65534)")


@pytest.fixture
def dask_module(tmp_path, monkeypatch):
    """datamem.dask, with tempfile's directory at tmp_path/tmp."""
    import importlib
    import sys
    import tempfile
    import types
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    stubbed = importlib.util.find_spec("distributed") is None
    if stubbed:
        for name in ("distributed", "distributed.diagnostics", "distributed.diagnostics.plugin"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules["distributed.diagnostics.plugin"].NannyPlugin = object
        sys.modules.pop("datamem.dask", None)
    mod = importlib.import_module("datamem.dask")
    yield mod
    if stubbed:  # the next import of datamem.dask must not find the stub's
        sys.modules.pop("datamem.dask", None)
        import datamem
        if getattr(datamem, "dask", None) is mod:
            del datamem.dask


def _policy_dir(tmp_path):
    return tmp_path / "tmp" / ("datamem-dask-%d" % os.geteuid())


def test_dask_policy_file_is_written_once_and_kept(tmp_path, dask_module):
    text = POLICY.encode()
    path = dask_module.policy_file(text)
    assert os.path.dirname(path) == str(_policy_dir(tmp_path))
    st = os.lstat(path)
    assert open(path, "rb").read() == text and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(os.path.dirname(path)).st_mode) == 0o700
    assert dask_module.policy_file(text) == path
    assert os.lstat(path).st_ino == st.st_ino   # a file in use is never rewritten
    assert os.listdir(_policy_dir(tmp_path)) == [os.path.basename(path)]


@pytest.mark.parametrize("how", ["symlink", "world-writable",
                                 pytest.param("other-owner", marks=as_root)])
def test_dask_policy_file_refuses_a_directory_it_cannot_trust(tmp_path, dask_module, how):
    # Attack: $TMPDIR/datamem-dask-<uid> is a predictable name. Its owner was
    # checked with os.stat, which follows a symbolic link: a link to a directory
    # of the user's passed, and swapped afterwards made a worker load the
    # attacker's policy. A directory others can write to is as bad.
    d = _policy_dir(tmp_path)
    if how == "symlink":
        (tmp_path / "mine").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "mine")
    else:
        d.mkdir(mode=0o700)
        if how == "other-owner":
            os.chown(d, NOBODY, NOBODY)
        else:
            os.chmod(d, 0o777)
    with pytest.raises(PermissionError) as e:
        dask_module.policy_file(POLICY.encode())
    assert str(d) in str(e.value) and "TMPDIR" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    assert os.listdir(tmp_path / "mine" if how == "symlink" else d) == []


@pytest.mark.parametrize("how", [pytest.param("other-owner", marks=as_root), "symlink"])
def test_dask_policy_file_adopts_only_a_file_it_wrote(tmp_path, dask_module, how):
    # Attack: a file already at policy-<sha>.yaml with the right bytes was used
    # as it was, whoever owned it (they could rewrite it later) or wherever a
    # symbolic link there pointed.
    text = POLICY.encode()
    d = _policy_dir(tmp_path)
    d.mkdir(mode=0o700)
    name = dask_module.policy_file(text)
    os.unlink(name)
    other = tmp_path / "other.yaml"
    other.write_bytes(text)
    if how == "symlink":
        os.symlink(other, name)
    else:
        os.rename(other, name)
        os.chown(name, NOBODY, NOBODY)
    assert dask_module.policy_file(text) == name
    st = os.lstat(name)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid(), st
    assert open(name, "rb").read() == text


def test_dask_policy_file_never_writes_through_a_planted_link(tmp_path, dask_module):
    # Attack: the file was written through "<path>.tmp.<pid>", opened with
    # open("wb"): a symbolic link there made the nanny overwrite any file.
    import hashlib
    text = POLICY.encode()
    d = _policy_dir(tmp_path)
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    name = d / ("policy-%s.yaml" % hashlib.sha256(text).hexdigest()[:20])
    os.symlink(victim, "%s.tmp.%d" % (name, os.getpid()))
    assert dask_module.policy_file(text) == str(name)
    assert victim.read_text() == "precious\n"
    assert name.read_bytes() == text and not name.is_symlink()


# ---- joblib / loky ------------------------------------------------------------------------------

JOBLIB = TASK + r"""
import json, os
from joblib import Parallel, delayed
if __name__ == "__main__":
    res = Parallel(n_jobs=2, backend="loky")(delayed(task)(i) for i in range(12))
    print(json.dumps({"handlers": sorted({(r[1], r[2]) for r in res}),
                      "pids": len({r[0] for r in res}), "me": os.getpid() in {r[0] for r in res}}))
"""


def test_joblib_loky_workers_run_the_policy(tmp_path):
    need("joblib", "joblib")
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    script = tmp_path / "joblib_job.py"
    script.write_text(JOBLIB)
    r = run_py("import runpy; runpy.run_path(%r, run_name='__main__')" % str(script),
               config=str(pol), timeout=180)
    out = last_json(r)
    assert out["handlers"] == [["datamem", "tasks"]]
    assert out["pids"] >= 1 and not out["me"]            # really other processes


# ---- Ray ----------------------------------------------------------------------------------------

RAY = TASK + r"""
import json, os, sys, urllib.request
import ray, datamem.ray
def setup():
    # A job with a worker_process_setup_hook of its own calls datamem's from it.
    import datamem.ray
    datamem.ray.worker_setup()

if __name__ == "__main__":
    env = datamem.ray.runtime_env(sys.argv[1], stats_http="127.0.0.1:0", tag_tasks=False,
                                  base={"worker_process_setup_hook": setup})
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=env, log_to_driver=False)
    try:
        @ray.remote
        def remote_task(i):
            import datamem
            from datamem import _ext
            return task(i) + (datamem.stats_url(), datamem.current_policy(),
                              list(_ext.handler_tags(_ext.get_handler()) or []))

        @ray.remote
        class Holder:
            def make(self):
                import datamem
                self.a = [task(i) for i in range(3)]
                return [r[1:3] for r in self.a], datamem.stats_url()

        res = ray.get([remote_task.remote(i) for i in range(6)])
        h = Holder.remote()
        actor, actor_url = ray.get(h.make.remote())
        urls = {r[4] for r in res} | {actor_url}
        scraped = {}
        for u in urls:
            text = urllib.request.urlopen(u, timeout=10).read().decode()
            scraped[u] = [l for l in text.splitlines()
                          if l.startswith("datamem_rule_allocations_total{")
                     and 'rule="task-arrays"' in l]
        print(json.dumps({"tasks": sorted({(r[1], r[2]) for r in res}),
                          "actor": sorted({tuple(x) for x in actor}),
                          "policies": sorted({os.path.basename(r[5]) for r in res}),
                          "tags": sorted({tuple(r[6]) for r in res}),
                          "scraped": scraped}))
    finally:
        ray.shutdown()
"""


def test_ray_tasks_and_actors_run_the_policy(tmp_path):
    need("ray", "ray")
    pol = tmp_path / "client-only.yaml"
    pol.write_text(POLICY)
    script = tmp_path / "ray_job.py"
    script.write_text(RAY)
    r = run_py("import runpy, sys; sys.argv = ['ray_job.py', %r]; "
               "runpy.run_path(%r, run_name='__main__')" % (str(pol), str(script)),
               env={"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}, timeout=240)
    out = last_json(r)
    assert out["tasks"] == [["datamem", "tasks"]]
    assert out["actor"] == [["datamem", "tasks"]]
    # The text shipped with the job, written by each worker into its own directory.
    assert len(out["policies"]) == 1 and out["policies"][0].startswith("policy-"), out
    assert out["tags"] == [["remote_task"]]               # tagged by the job's own hook
    # Every worker's metrics are reachable and count its task arrays.
    assert out["scraped"] and all(v and float(v[0].split()[-1]) >= 1
                                  for v in out["scraped"].values())


# Attack: runtime_env() checked the policy, then copied it by name
# (shutil.copyfile) without the policy's rule: a policy another user could write
# was shipped to every worker. It is refused now, and what is shipped is the
# bytes read under the rule, written into a private (0700) directory.
def test_ray_runtime_env_ships_only_a_policy_the_rule_accepts(tmp_path):
    import datamem
    import datamem.ray
    pol = tmp_path / "p.yaml"
    pol.write_text(POLICY)
    env = datamem.ray.runtime_env(str(pol), tag_tasks=False)
    # The bytes travel in the job's environment, never through Ray's
    # world-writable /tmp/ray (where the rule would refuse them, rightly).
    assert env["env_vars"]["DATAMEM_CONFIG_TEXT"] == POLICY
    assert "working_dir" not in env and "DATAMEM_CONFIG" not in env["env_vars"]
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "p.yaml").write_text(POLICY)
    with pytest.raises(datamem.PolicyError, match="refused: %s: directory writable by other "
                       "users" % shared):
        datamem.ray.runtime_env(str(shared / "p.yaml"), tag_tasks=False)


# ---- 4 Dask workers in one Prometheus query --------------------------------------------------

DASK4 = TASK + r"""
import json, sys
from dask.distributed import Client, LocalCluster
import datamem.dask
if __name__ == "__main__":
    policy, n = sys.argv[1], int(sys.argv[2])
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                      dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster, \
            Client(cluster) as c:
        # stats_http: each worker also serves datamem's own endpoint and is listed in
        # DATAMEM_STATS_DIR (inherited), for `ls --prometheus-sd`.
        c.register_plugin(datamem.dask.Policy(policy, stats_http="127.0.0.1:0"))
        res = c.gather(c.map(task, range(n), pure=False))
        stats = datamem.dask.stats(c)
        workers = c.scheduler_info(n_workers=-1)["workers"].values()
        print(json.dumps({
            "handlers": sorted({(r[1], r[2]) for r in res}),
            "pids": sorted(c.run(__import__("os").getpid).values()),
            "counted": {a: s["rules"]["task-arrays"]["allocations"] for a, s in stats.items()},
            "dask_targets": ["%s:%d" % (w["host"], w["services"]["dashboard"]) for w in workers]}),
            flush=True)
        sys.stdin.readline()                      # scraped meanwhile
"""


def test_four_dask_workers_in_one_prometheus_query(tmp_path):
    need("distributed", "dask")
    import subprocess
    import sys
    from conftest import ROOT
    from _prometheus import Prometheus, skip_reason
    if skip_reason():
        pytest.skip(skip_reason())
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    script = tmp_path / "dask4.py"
    script.write_text(DASK4)
    disc = tmp_path / "discovery"
    env = dict(os.environ, DATAMEM_STATS_DIR=str(disc))
    env.pop("DATAMEM_CONFIG", None)
    n = 100
    p = subprocess.Popen([sys.executable, str(script), str(pol), str(n)], env=env, cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(p.communicate(timeout=60)[1][-6000:])
        out = json.loads(line)
        assert out["handlers"] == [["datamem", "tasks"]]
        assert len(out["counted"]) == 4 and all(v > 0 for v in out["counted"].values())
        assert sum(out["counted"].values()) == n          # 100% of task arrays, by the stats
        # The datamem endpoints of the same 4 workers, as file_sd targets.
        sd = tmp_path / "datamem-sd.json"
        r = subprocess.run([sys.executable, "-m", "datamem", "ls", "--prometheus-sd", str(sd),
                            "--once"], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        groups = [g for g in json.loads(sd.read_text())
                  if int(g["labels"]["pid"]) in out["pids"]]
        assert len(groups) == 4, groups
        with Prometheus(tmp_path, targets=out["dask_targets"], labels={"via": "dask"},
                        file_sd=groups) as prom:
            q = 'datamem_rule_allocations_total{rule="task-arrays",via%s"dask"}'
            # One query, all 4 workers, through the Dask worker endpoints ...
            prom.wait_for("count(%s) == 4" % (q % "="), timeout=30)
            total = prom.query("sum(%s)" % (q % "="))
            assert float(total[0]["value"][1]) == n
            # ... and through the file_sd targets, one series per pid label.
            res = prom.wait_for("count by (pid) (%s)" % (q % "!="), timeout=30,
                                ok=lambda r: len(r) == 4)
            assert sorted(int(s["metric"]["pid"]) for s in res) == out["pids"]
            total = prom.query("sum(%s)" % (q % "!="))
            assert float(total[0]["value"][1]) == n
    finally:
        if p.poll() is None:
            p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
