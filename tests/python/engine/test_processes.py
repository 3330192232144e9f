"""fork, and multiprocessing with fork / spawn / forkserver, under a policy."""
import json
import os

from conftest import CONFIGS, UNDER_ASAN, run_py

FORK = r"""
import os, numpy as np, datamem
big = np.arange(1 << 20, dtype=np.float64)      # 8 MiB, arena "big"
small = np.arange(10.0)
pid = os.fork()
if pid == 0:
    ok = big.sum() == (1 << 20) * ((1 << 20) - 1) / 2 and small[9] == 9.0
    big[:] = 1.0                               # the child's copy, freed in the child
    del big, small
    fresh = np.ones(1 << 20)
    ok = ok and datamem.arena_of(fresh) == "big" and fresh.sum() == 1 << 20
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), big[5], datamem.arena_of(big))
"""

POOL = r"""
import json, multiprocessing as mp, numpy as np, datamem
try:
    from numpy._core.multiarray import get_handler_name
except ImportError:
    from numpy.core.multiarray import get_handler_name

def work(n):
    a = np.full(n, 2.0)
    return get_handler_name(a), datamem.arena_of(a), a

if __name__ == "__main__":
    out = {}
    for method in ("fork", "spawn", "forkserver"):
        ctx = mp.get_context(method)
        with ctx.Pool(2) as pool:
            res = pool.map(work, [10, 100_000, 1 << 20] * 4, chunksize=1)
        out[method] = sorted({(h, ar) for h, ar, _ in res})
        assert all(a.sum() == 2.0 * a.size for _, _, a in res)
        out[method + "_returned"] = sorted({str(datamem.arena_of(a)) for _, _, a in res})
    print(json.dumps(out))
"""


def test_fork_keeps_arrays_valid():
    r = run_py(FORK, config=os.path.join(CONFIGS, "demo.yaml"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "5.0", "big"]


def test_multiprocessing_start_methods(tmp_path):
    script = tmp_path / "pool_job.py"
    script.write_text(POOL)
    r = run_py("import runpy; runpy.run_path(%r, run_name='__main__')" % str(script),
               config=os.path.join(CONFIGS, "demo.yaml"), timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = [["datamem", "big"], ["datamem", "general"], ["datamem", "small"]]
    for method in ("fork", "spawn", "forkserver"):
        assert out[method] == want, (method, out[method])
        # arrays unpickled in the parent are the parent's own, from its policy, or
        # alias the pickle's bytes object (NumPy does that for large aligned data)
        assert set(out[method + "_returned"]) <= {"small", "general", "big", "None"}


# Both fork jobs below wait for each child the same way: bounded, and a child
# that does not exit in time is counted as hung (a deadlock), killed and reaped.
WAIT_CHILD = r"""
def wait_child(pid, timeout):
    # the child's exit code, or None when it had not exited after `timeout` s
    deadline = time.monotonic() + timeout
    while True:
        r, status = os.waitpid(pid, os.WNOHANG)
        if r:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9); os.waitpid(pid, 0)
            return None
        time.sleep(0.002)
"""

FORK_STRESS = r"""
import os, sys, threading, time, numpy as np, datamem
""" + WAIT_CHILD + r"""
stop = threading.Event()
def churn():
    keep = []
    while not stop.is_set():
        keep.append(np.ones(1 + len(keep) * 131 % 300_000))
        if len(keep) > 30:
            keep.clear()
threads = [threading.Thread(target=churn) for _ in range(3)]
[t.start() for t in threads]
live = np.arange(1000.0)
bad = 0
for i in range(60):
    pid = os.fork()
    if pid == 0:   # the child forked while other threads held datamem/jemalloc state
        ok = live.sum() == 499500.0
        arrs = [np.ones(n) for n in (10, 10_000, 1 << 20)]
        ok = ok and all(datamem.arena_of(a) for a in arrs)
        t = threading.Thread(target=lambda: np.ones(5000)); t.start(); t.join()
        os._exit(0 if ok else 7)
    rc = wait_child(pid, 20)
    if rc is None:
        print("deadlock in child", i); sys.exit(3)
    bad += rc != 0
stop.set()
[t.join() for t in threads]
print("children failed:", bad)
"""


def test_fork_while_threads_allocate():
    r = run_py(FORK_STRESS, config=os.path.join(CONFIGS, "demo.yaml"), timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.strip().splitlines()[-1] == "children failed: 0"


# fork() while other threads take fresh memory for big arrays: jemalloc calls
# the arena's extent hook holding its grow lock, and the forking thread must
# take the hook's lock after jemalloc's, not before (taken before, parent and
# busy thread could deadlock in fork(); runtime_test's
# test_fork_while_arenas_grow makes that likely). Each child then allocates on
# its own: it crashed in every child while the child destroyed the explicit
# jemalloc caches made before the fork (runtime/thread.c). faulthandler bounds
# a deadlock: it prints every thread's stack and exits 1.
FORK_GROW = r"""
import faulthandler, os, sys, threading, numpy as np, datamem
faulthandler.dump_traceback_later(90, exit=True)
stop = threading.Event()
def grow():
    i = 0
    while not stop.is_set():   # ever-new big sizes, never touched: fresh extents
        np.empty((64 << 17) + (i % 97) * (3 << 17)); i += 1
threads = [threading.Thread(target=grow) for _ in range(2)]
[t.start() for t in threads]
bad = 0
for i in range(40):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if np.ones(1 << 20).sum() == 1 << 20 else 7)
    bad += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
stop.set()
[t.join() for t in threads]
print("children failed:", bad)
"""


def test_fork_while_threads_grow_arenas():
    r = run_py(FORK_GROW, config=os.path.join(CONFIGS, "demo.yaml"), timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert r.stdout.strip().splitlines()[-1] == "children failed: 0"


# A fork storm with every service on: threads allocating, a full-mode profile,
# the HTTP endpoint and the policy watcher. Each child starts a thread, joins
# it, reads stats (which walk the thread registry), and does it again. Bug
# pinned: the parent's dead threads stayed in the child's registry, a new
# thread reused one's address, the registry became a cycle and the child spun
# forever in a stats snapshot holding the runtime lock (5 of 5 children hung).
FORK_STORM = r"""
import os, sys, threading, time, numpy as np, datamem
""" + WAIT_CHILD.replace("%", "%%") + r"""
stop = threading.Event()
def busy():
    keep = []
    while not stop.is_set():
        keep.append(np.empty(8 + len(keep) * 977 %% 70_000))
        if len(keep) > 40:
            keep.clear()
threads = [threading.Thread(target=busy) for _ in range(3)]
[t.start() for t in threads]
def child():
    for _ in range(2):
        base = datamem.stats()["threads"]   # the forking thread, if it ever allocated
        t = threading.Thread(target=lambda: [np.ones(n) for n in (10, 1000, 100_000)])
        t.start(); t.join()
        # Thread.join returns before the OS thread's exit handlers run: wait for
        # the count to come back to what it was before the thread, bounded (">
        # 1" ended at once when the forking thread was not counted).
        deadline = time.monotonic() + 10
        while datamem.stats()["threads"] != base:
            if time.monotonic() > deadline:
                return 4   # the parent's threads or this one still counted
            time.sleep(0.001)
    return 0
N = int(sys.argv[1]) if len(sys.argv) > 1 else %d
hung = bad = 0
for i in range(N):
    pid = os.fork()
    if pid == 0:
        rc = 5
        try:
            rc = child()
        finally:
            os._exit(rc)
    rc = wait_child(pid, 30)
    hung += rc is None
    bad += rc not in (0, None)
stop.set()
[t.join() for t in threads]
print("forks %%d hung %%d failed %%d" %% (N, hung, bad))
"""


def test_fork_storm_with_profiler_endpoint_and_watcher(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault: general\narenas:\n  general: {alignment: 64}\n"
                      "stats:\n  http: \"127.0.0.1:0\"\nreload:\n  watch: true\n")
    prof = tmp_path / "prof"
    prof.mkdir(mode=0o700)
    n = 60 if UNDER_ASAN else 200
    env = {"DATAMEM_PROFILE": str(prof), "DATAMEM_PROFILE_SAMPLE": "full",
           "PYTHONWARNINGS": "ignore::DeprecationWarning"}  # 3.12+: fork with threads
    r = run_py(FORK_STORM % n, config=str(policy), env=env, timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert r.stdout.strip().splitlines()[-1] == "forks %d hung 0 failed 0" % n, r.stdout
