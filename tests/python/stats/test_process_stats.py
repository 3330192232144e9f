"""The process around the arenas (service/process.c, python/datamem/_arrow.py):
the process's resident set, the part of it outside datamem's arenas and
pyarrow's pool, in datamem.stats(), /metrics, /stats.json and `top`
(docs/what-a-policy-governs.md).

Each job runs in its own interpreter under the demo policy.
"""
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import CONFIGS, ROOT, UNDER_ASAN, job_died, run_py, wait_for

from datamem import _text
from datamem._stats import client, tables

DEMO = os.path.join(CONFIGS, "demo.yaml")
MIB = 1 << 20

try:
    import pyarrow  # noqa: F401  only to know whether the pyarrow tests can run
    HAVE_PYARROW = True
except ImportError:
    HAVE_PYARROW = False
needs_pyarrow = pytest.mark.skipif(not HAVE_PYARROW, reason="pyarrow is not installed "
                                   "(requirements-dev.txt installs it)")


def run_json(code, config=DEMO, env=None):
    r = run_py(code, config=config, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


GROW = r"""
import json
import numpy as np
import datamem

def snap():
    s = datamem.stats()
    return {"rss": s["process_resident_bytes"], "outside": s["outside_arenas_resident_bytes"],
            "arenas": sum(a["resident_bytes"] for a in s["arenas"].values()),
            "pyarrow": s.get("pyarrow_allocated_bytes", "absent")}

out = {"start": snap()}
b = bytearray(200 << 20)            # not NumPy's: glibc's, outside every arena
b[::4096] = b"\1" * len(b[::4096])  # every page touched
out["bytearray"] = snap()
a = np.ones(200 << 17)              # 200 MiB of float64 through the policy
out["numpy"] = snap()
print(json.dumps(out))
"""


@pytest.mark.skipif(UNDER_ASAN, reason="SKIP under ASan: RSS includes its shadow and quarantine")
def test_outside_grows_with_other_allocators_and_arenas_with_numpy():
    o = run_json(GROW)
    for k, s in o.items():
        assert s["outside"] == max(0, s["rss"] - s["arenas"]), (k, s)  # one snapshot
        assert s["pyarrow"] == "absent", k  # pyarrow never imported
    start, ba, npy = o["start"], o["bytearray"], o["numpy"]
    assert ba["outside"] - start["outside"] >= 195 * MIB, o
    assert abs(ba["arenas"] - start["arenas"]) < 4 * MIB, o
    assert npy["arenas"] - ba["arenas"] >= 200 * MIB, o
    # jemalloc counts a live block's pages whether touched or not: the array's
    # 224 MiB size class shows as resident, so `outside` may shrink a little.
    assert -32 * MIB < npy["outside"] - ba["outside"] < 8 * MIB, o


SERVE = r"""
import json, os, sys
import numpy as np
import datamem
keep = [np.ones(1 << 20)]
print(json.dumps({"pid": os.getpid(), "url": datamem.stats_url()}), flush=True)
sys.stdin.readline()
"""


def serve(tmp_path, code=SERVE):
    env = dict(os.environ, DATAMEM_CONFIG=DEMO, DATAMEM_STATS_HTTP="127.0.0.1:0",
               DATAMEM_STATS_DIR=str(tmp_path / "discovery"))
    p = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise AssertionError(job_died(p))
    return p, json.loads(line)


def stop(p):
    p.stdin.close()
    p.wait(timeout=30)
    p.stdout.close()
    p.stderr.close()


def scrape(url):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


def stats_json(url):
    return json.load(urllib.request.urlopen(url.rsplit("/", 1)[0] + "/stats.json", timeout=10))


def test_metrics_and_stats_json_carry_the_process(tmp_path):
    p, info = serve(tmp_path)
    try:
        m = scrape(info["url"])
        s = stats_json(info["url"])
        with open("/proc/%d/statm" % p.pid) as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE")
    finally:
        stop(p)
    assert abs(m["datamem_process_resident_bytes"] - rss) < 16 * MIB, (m, rss)
    assert 0 <= m["datamem_outside_arenas_resident_bytes"] <= m["datamem_process_resident_bytes"]
    assert "datamem_pyarrow_allocated_bytes" not in m  # pyarrow not loaded: no sample
    arenas = sum(a["resident_bytes"] for a in s["arenas"].values())
    assert s["outside_arenas_resident_bytes"] == max(0, s["process_resident_bytes"] - arenas)
    assert "pyarrow_allocated_bytes" not in s


ARROW = r"""
import json, os, sys, threading
import datamem
watching = any(getattr(f, "__name__", "") == "_Watch" for f in sys.meta_path)
before = [t.name for t in threading.enumerate()]
import pyarrow as pa
buf = pa.allocate_buffer(64 << 20)    # from pyarrow's default pool
s = datamem.stats()
print(json.dumps({"pid": os.getpid(), "url": datamem.stats_url(), "watching": watching,
                  "before": before, "stats": s.get("pyarrow_allocated_bytes"),
                  "pool": pa.total_allocated_bytes(),
                  "threads": [t.name for t in threading.enumerate()]}), flush=True)
sys.stdin.readline()
del buf
pid = os.fork()
if pid == 0:  # the child runs its own refresher
    ok = datamem._arrow._state["thread"].is_alive()
    os._exit(0 if ok else 1)
_, st = os.waitpid(pid, 0)
print(json.dumps({"after_free": datamem.stats().get("pyarrow_allocated_bytes"),
                  "child": st}), flush=True)
sys.stdin.readline()
"""


@needs_pyarrow
def test_pyarrow_pool_in_stats_metrics_and_json(tmp_path):
    p, info = serve(tmp_path, ARROW)
    try:
        assert info["watching"] and "datamem-pyarrow" not in info["before"], info
        assert "datamem-pyarrow" in info["threads"], info  # started by the import
        assert info["stats"] == info["pool"] >= 64 * MIB, info
        # The endpoint's figure comes from the refresher: within a few seconds.
        m = wait_for(lambda: scrape(info["url"]), 10, "pyarrow's bytes in /metrics",
                     until=lambda m: m.get("datamem_pyarrow_allocated_bytes", 0) >= 64 * MIB,
                     interval=0.2)
        assert m["datamem_pyarrow_allocated_bytes"] == info["pool"]
        assert stats_json(info["url"])["pyarrow_allocated_bytes"] == info["pool"]
        r = subprocess.run([sys.executable, "-m", "datamem", "top", str(info["pid"]), "--once",
                            "--interval", "0.1"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, DATAMEM_STATS_DIR=str(tmp_path / "discovery")))
        assert r.returncode == 0, r.stderr
        assert "pyarrow " + _text.short_bytes(info["pool"]) in r.stdout.splitlines()[-1], \
            r.stdout
        p.stdin.write("\n")
        p.stdin.flush()
        after = json.loads(p.stdout.readline())
    finally:
        stop(p)
    assert after["after_free"] < 64 * MIB, after
    assert after["child"] == 0, "the fork child has no refresher thread"


def test_no_refresher_thread_without_pyarrow():
    # pandas tries `import pyarrow` where it is not installed: the watcher must
    # not start a thread for a module that will never load.
    o = run_json(r"""
import json, sys, threading
import datamem
try:
    import pyarrow_not_installed_anywhere
except ImportError:
    pass
sys.modules.pop("pyarrow", None)
sys.path.insert(0, "/nonexistent")
real = sys.path[:]
sys.path[:] = ["/nonexistent"]       # pyarrow cannot be found from here
try:
    import pyarrow
except ImportError:
    pass
sys.path[:] = real
print(json.dumps({"threads": [t.name for t in threading.enumerate()],
                  "stats": "pyarrow_allocated_bytes" in datamem.stats()}))
""")
    assert "datamem-pyarrow" not in o["threads"] and not o["stats"], o


# ---- top ----------------------------------------------------------------------------------

def _snap(**process):
    arena = {"allocated_bytes": 200 * MIB, "active_bytes": 200 * MIB,
             "resident_bytes": 256 * MIB, "dirty_bytes": 0, "hugepage_bytes": 0,
             "allocations": 1, "failures": 0, "limit_bytes": None}
    s = {"time": 1.0, "pid": 1, "version": "x", "reloads": 1, "reload_failures": 0,
         "threads": 1, "policy_path": "/p.yaml", "arenas": {"a": arena}}
    s.update(process)
    return s


def test_top_shows_the_worker_budget_and_what_counts_against_it():
    """`top` says where the worker limit comes from and what counts: the arrays
    and what is held beside them, with a cgroup's limit by the whole group."""
    tb = {"live": 512 * MIB, "worker_limit": 1792 * MIB, "worker_limit_source": "cgroup v1",
          "worker_beside": 1434 * MIB, "worker_refused": 14, "worker_spilled": 11}
    last = tables.top_text(_snap(tag_bytes=tb), None, "x").splitlines()[-2:]
    assert last == ["budget 1.8GiB cgroup v1 group  arrays 512.0MiB  beside 1.4GiB  109%",
                    "  past it: 11 spilled (worker_spill), 3 MemoryError"], last
    tb.update(worker_limit_source="env", worker_beside=0, worker_refused=0, worker_spilled=0)
    last = tables.top_text(_snap(tag_bytes=tb), None, "x").splitlines()[-1]
    assert last == "budget 1.8GiB env  arrays 512.0MiB  beside 0B  29%", last
    # no worker limit (none set: UINT64_MAX, or an older datamem): no line
    tb["worker_limit"] = 2 ** 64 - 1
    assert not tables.top_text(_snap(tag_bytes=tb), None, "x").splitlines()[-1].startswith(
        "budget")
    assert not tables.top_text(_snap(), None, "x").splitlines()[-1].startswith("budget")
    tb.update(worker_limit=1, worker_limit_source="\x1b[31m" * 40, live=2 ** 60)
    assert all(len(l) <= 80 and "\x1b" not in l
               for l in tables.top_text(_snap(tag_bytes=tb), None, "x").splitlines())


def test_top_shows_the_process_under_the_arenas():
    s = _snap(process_resident_bytes=1 << 30, outside_arenas_resident_bytes=768 * MIB)
    lines = tables.top_text(s, None, "x").splitlines()
    assert lines[-1] == "process 1.0GiB  arenas 256.0MiB (25%)  outside 768.0MiB"
    s["pyarrow_allocated_bytes"] = 100 * MIB
    lines = tables.top_text(s, None, "x").splitlines()
    assert lines[-1].endswith("outside 768.0MiB  pyarrow 100.0MiB")
    # An endpoint without the numbers (an older datamem): no line.
    assert not tables.top_text(_snap(), None, "x").splitlines()[-1].startswith("process")
    big = 1023.9 * 2 ** 40
    s = _snap(process_resident_bytes=big, outside_arenas_resident_bytes=big,
              pyarrow_allocated_bytes=big)
    assert all(len(l) <= 80 for l in tables.top_text(s, None, "x").splitlines())


@pytest.mark.parametrize("key", ["process_resident_bytes", "outside_arenas_resident_bytes",
                                 "pyarrow_allocated_bytes"])
def test_top_refuses_a_snapshot_whose_process_numbers_are_not_numbers(key):
    assert "is not a number" in client._snapshot_problem(_snap(**{key: "1 GiB"}))
