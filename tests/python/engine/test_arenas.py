"""Arenas and their settings beyond placement: byte limits that raise
MemoryError, page-locked (`lock`) and CUDA-registered (`pinned: cuda`) arenas,
sizes the machine cannot give and address-space limits.

Each job runs in its own interpreter. The CUDA runtime is replaced by a stand-in
(conftest.py's fake_cudart: a small C library compiled here, named by
DATAMEM_CUDART) that records every cudaHostRegister call: no GPU or CUDA install
is needed to check the logic.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, last_json, run_py, skip_under_asan

MiB = 1 << 20

LIMITED = textwrap.dedent("""\
    version: 1
    default: general
    fallback: {fallback}
    arenas:
      general: {{}}
      loader: {{limit: {limit}}}
      spare: {{limit: {spare}}}
    rules:
      - name: loader
        match: {{thread: "loader*"}}
        arena: loader
""")


def limited(write_policy, limit="64MiB", fallback='""', spare="never"):
    return write_policy(LIMITED.format(limit=limit, fallback=fallback, spare=spare))


def test_a_leaking_loader_gets_memoryerror_while_the_main_thread_works(write_policy):
    pol = limited(write_policy)
    code = r"""
import json, threading, numpy as np, datamem
out = {}
def loader():
    leak = []
    try:
        while True:
            leak.append(np.empty(4 << 20, np.uint8))  # 4 MiB a batch, never freed
    except MemoryError as e:
        out["n"] = len(leak)
        out["numpy"] = str(e)
        out["why"] = datamem.last_failure()
        out["live"] = datamem.stats()["arenas"]["loader"]["live_bytes"]
t = threading.Thread(target=loader, name="loader-1"); t.start(); t.join()
main = [np.ones(16 << 20, np.uint8) for _ in range(8)]   # 128 MiB, past the loader's limit
s = datamem.stats()
out["main_arena"] = datamem.arena_of(main[0])
out["main_why"] = datamem.last_failure()
out["limit_hits"] = s["arenas"]["loader"]["limit_hits"]
out["rule_hits"] = s["rules"]["loader"]["limit_hits"]
out["limit_bytes"] = s["arenas"]["loader"]["limit_bytes"]
out["general_limit"] = s["arenas"]["general"]["limit_bytes"]
print(json.dumps(out))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # 64 MiB of 4 MiB blocks (usable size 4 MiB): 16 fit, the 17th is refused.
    assert out["n"] == 16, out
    assert out["live"] <= 64 * MiB, out
    assert out["why"]["arena"] == "loader" and out["why"]["rule"] == "loader", out
    assert out["why"]["request"] == 4 * MiB and out["why"]["limit"] == 64 * MiB, out
    assert out["why"]["live"] + 4 * MiB > 64 * MiB and not out["why"]["fallback_tried"], out
    assert "Unable to allocate" in out["numpy"]  # NumPy's own MemoryError
    assert out["main_arena"] == "general" and out["main_why"] is None, out  # per thread
    assert out["limit_hits"] == 1 and out["rule_hits"] == 1, out
    assert out["limit_bytes"] == 64 * MiB and out["general_limit"] is None, out
    # The line a user sees next to NumPy's message names arena, rule, limit, request.
    assert ("datamem: MemoryError: arena 'loader' (rule 'loader') is at its limit of "
            "64.0 MiB") in r.stderr and "a request of 4.0 MiB was refused" in r.stderr, r.stderr


def test_fallback_absorbs_a_burst_until_it_is_full_too(write_policy):
    pol = limited(write_policy, limit="32MiB", fallback="spare", spare="32MiB")
    code = r"""
import json, threading, numpy as np, datamem
out = {}
def burst():
    keep = []
    try:
        while True:
            keep.append(np.empty(8 << 20, np.uint8))
    except MemoryError:
        out["n"] = len(keep)
        out["arenas"] = sorted(set(datamem.arena_of(a) for a in keep))
        out["why"] = datamem.last_failure()
    del keep
    out["after"] = datamem.arena_of(np.ones(8 << 20, np.uint8))   # room again
t = threading.Thread(target=burst, name="loader-burst"); t.start(); t.join()
s = datamem.stats()["arenas"]
out["fallbacks"] = s["spare"]["fallbacks"]
out["live"] = {a: s[a]["live_bytes"] for a in ("loader", "spare")}
print(json.dumps(out))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n"] == 8 and out["arenas"] == ["loader", "spare"], out  # 4 + 4 blocks
    assert out["fallbacks"] == 4, out
    assert out["why"]["arena"] == "loader" and out["why"]["fallback_tried"], out
    assert out["after"] == "loader", out
    assert out["live"] == {"loader": 0, "spare": 0}, out  # all freed: the counts are back at 0
    assert "the fallback arena had no room either" in r.stderr


def test_a_reload_below_current_use_refuses_new_blocks_and_keeps_live_ones(write_policy,
                                                                              tmp_path):
    pol = limited(write_policy, limit="256MiB")
    low = str(tmp_path / "low.yaml")
    with open(low, "w") as f:
        f.write(LIMITED.format(limit="16MiB", fallback='""', spare="never"))
    code = r"""
import json, sys, threading, numpy as np, datamem
out = {}
keep = []
def loader():
    keep.extend(np.full(8 << 20, 7, np.uint8) for _ in range(8))   # 64 MiB live
    datamem.reload(sys.argv[1])                                  # limit now 16 MiB
    try:
        np.empty(1 << 20, np.uint8)
        out["refused"] = False
    except MemoryError:
        out["refused"] = True
t = threading.Thread(target=loader, name="loader-2"); t.start(); t.join()
# Checked from the main thread (the loader's arena refuses even temporaries now).
out["intact"] = all(int(a.sum()) == 7 * (8 << 20) for a in keep)
out["live"] = datamem.stats()["arenas"]["loader"]["live_bytes"]
del keep[:7]                                                     # down to 8 MiB
def again():
    out["after_free"] = datamem.arena_of(np.empty(4 << 20, np.uint8))
t = threading.Thread(target=again, name="loader-3"); t.start(); t.join()
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code, low], env=dict(os.environ, DATAMEM_CONFIG=pol),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"refused": True, "intact": True, "live": 64 * MiB,
                   "after_free": "loader"}, out


def test_the_limit_holds_under_threads(write_policy):
    """8 threads race for a 64 MiB arena with 1 MiB blocks: never more than 64
    blocks live at once (the count reserves before it allocates)."""
    pol = limited(write_policy)
    code = r"""
import json, threading, numpy as np, datamem
lock = threading.Lock(); held = []; peak = [0]; refused = [0]
def loader():
    mine = []; mine_refused = 0
    for _ in range(400):
        try:
            mine.append(np.empty(1 << 20, np.uint8))
        except MemoryError:
            mine_refused += 1
            if mine:
                mine.pop()
        live = datamem.stats()["arenas"]["loader"]["live_bytes"] if len(mine) % 16 == 0 else 0
        with lock:
            peak[0] = max(peak[0], live)
    with lock:  # `+=` on a shared list slot is not atomic without the GIL (3.13t)
        refused[0] += mine_refused
ts = [threading.Thread(target=loader, name="loader-%d" % i) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
s = datamem.stats()["arenas"]["loader"]
print(json.dumps({"peak": peak[0], "refused": refused[0], "hits": s["limit_hits"],
                  "live_end": s["live_bytes"]}))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0 < out["peak"] <= 64 * MiB, out
    assert out["refused"] == out["hits"] > 0, out
    assert out["live_end"] == 0, out  # every block freed: the count comes back to zero


# Bug pinned: a limit's MemoryError named only the 8-byte scalar that came after the
# 64 MiB of arrays that filled it ("Unable to allocate 8 bytes for an array with
# shape ()"). NumPy's own error now names the limit that refused, live against
# limit and the largest holders, caught or not.
FULL = """\
version: 1
default: general
arenas:
  general: {limit: 64MiB}
  side: {}
rules:
  - {name: side, match: {size: {min: 4MiB}}, arena: side}
tag_bytes: true
"""


FILL = r"""
def fill(held):
    # np.empty makes no scalar on its way: fill with smaller and smaller arrays
    # until not even 8 bytes fit
    for n in (2**17, 2**13, 2**9, 2**5, 1):
        while True:
            try:
                held.append(np.empty(n))
            except MemoryError:
                break
"""


def test_the_scalar_after_the_fill_names_the_limit_and_its_holders(write_policy):
    code = r"""
import json, threading, numpy as np, datamem
""" + FILL + r"""
with datamem.tag("load"):
    held = [np.empty(2**17) for _ in range(48)]   # 48 MiB of 1 MiB arrays
fill(held)                                        # the rest untagged: the limit is full
try:
    np.array(2.5)                                 # 8 bytes, shape ()
except MemoryError as e:
    caught = str(e)
print(json.dumps({"caught": caught}), flush=True)
np.array(1.5)                                     # and uncaught
"""
    r = run_py(code, config=write_policy(FULL))
    assert r.stdout, r.stderr
    caught = json.loads(r.stdout.splitlines()[0])["caught"]
    assert caught.startswith("datamem: arena 'general' is at its limit of 64.0 MiB ("), caught
    assert ("a request of 8 bytes was refused; largest holders: tags 'load' 48.0 MiB, "
            "(untagged) ") in caught, caught
    assert caught.endswith("; Unable to allocate 8 bytes for an array with shape () and data "
                           "type float64"), caught
    assert r.returncode == 1, r
    last = r.stderr.strip().splitlines()[-1]
    # the class's module: numpy._core._exceptions on NumPy 2, numpy.core._exceptions on 1.x
    assert last in ("numpy._core._exceptions._ArrayMemoryError: " + caught,
                    "numpy.core._exceptions._ArrayMemoryError: " + caught), r.stderr


def test_the_worker_limit_names_the_arenas_that_hold_it(write_policy):
    code = r"""
import json, threading, numpy as np, datamem
""" + FILL + r"""
held = [np.empty(2**20) for _ in range(3)]        # 24 MiB in side
fill(held)                                        # the rest in general
try:
    np.array(2.5)
except MemoryError as e:
    print(json.dumps({"caught": str(e)}))
"""
    # 96 MiB: the 24 MiB in side and the interpreter's own memory fit under it
    r = run_py(code, config=write_policy(FULL.replace("tag_bytes: true", "worker_limit: 96MiB")))
    caught = last_json(r)["caught"]
    assert caught.startswith("datamem: the worker limit of 96.0 MiB is reached ("), caught
    holders = re.search(r"a request of 8 bytes was refused; largest holders: arenas ([^;]*);",
                        caught)
    assert holders and sorted(holders.group(1).split(", "))[1] == "'side' 24.0 MiB", caught
    assert holders.group(1).count("'general' ") == 1, caught
    assert "; tags (untagged) " in caught and "; Unable to allocate 8 bytes" in caught, caught
    # the interpreter's and NumPy's own memory counts against the limit too
    assert re.search(r"; beside the arrays \(malloc, Arrow, Python objects\) [\d.]+ MiB; ",
                     caught), caught


def test_an_arena_without_a_limit_counts_nothing(write_policy):
    pol = limited(write_policy)
    r = run_py("import json, numpy as np, datamem\nkeep = [np.ones(1 << 20) for _ in range(4)]\n"
               "a = datamem.stats()['arenas']\n"
               "print(json.dumps([a['general']['live_bytes'], a['general']['limit_bytes']]))",
               config=pol)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [0, None]


# ---- lock: true --------------------------------------------------------------------------

LOCKED = "version: 1\ndefault: general\narenas:\n  general: {}\n  locked: {lock: true}\n" \
         "rules:\n  - name: big\n    match: {size: {min: 1MiB}}\n    arena: locked\n"

LOCK_JOB = r"""
import json, re, numpy as np, datamem
def vmlck():
    return int(re.search(r"VmLck:\s+(\d+)", open("/proc/self/status").read()).group(1)) << 10
def smaps_locked(lo, n):
    # Locked bytes of the mappings over [lo, lo + n) (per-extent mlock may
    # split the range over several), each capped at its overlap.
    total, cur = 0, None
    for l in open("/proc/self/smaps").read().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", l)
        if m:
            s, e = int(m.group(1), 16), int(m.group(2), 16)
            cur = max(0, min(e, lo + n) - max(s, lo))
        elif l.startswith("Locked:") and cur:
            total += min(cur, int(l.split()[1]) << 10)
    return total
before = vmlck()
a = np.ones(32 << 20, np.uint8)
out = {"arena": datamem.arena_of(a), "vmlck": vmlck() - before,
       "smaps": smaps_locked(a.ctypes.data, a.nbytes),
       "stats": datamem.stats()["arenas"]["locked"]["locked_bytes"],
       "errors": datamem.stats()["arenas"]["locked"]["placement_errors"]}
small = np.ones(1000)
out["small_smaps"] = smaps_locked(small.ctypes.data, small.nbytes)
print(json.dumps(out))
"""


@skip_under_asan
def test_lock_page_locks_the_arena_and_only_it(write_policy):
    pol = write_policy(LOCKED)
    r = run_py(LOCK_JOB, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["arena"] == "locked" and out["errors"] == 0, out
    assert out["vmlck"] >= 32 * MiB and out["smaps"] >= 32 * MiB, out
    assert out["stats"] >= 32 * MiB, out
    assert out["small_smaps"] == 0, out  # the general arena is not locked


@skip_under_asan
def test_lock_returns_pages_unlocked(write_policy):
    """Decay gives freed pages back: they are unlocked first (madvise refuses
    locked pages, so they would otherwise stay resident and locked)."""
    pol = write_policy(LOCKED.replace("{lock: true}", "{lock: true, decay: {dirty: 0ms}}"))
    code = r"""
import json, re, numpy as np, datamem
def vmlck():
    return int(re.search(r"VmLck:\s+(\d+)", open("/proc/self/status").read()).group(1)) << 10
a = np.ones(64 << 20, np.uint8); held = vmlck(); del a
b = np.ones(1 << 20, np.uint8)     # an allocation lets decay run
print(json.dumps({"held": held, "after": vmlck(),
                  "stats": datamem.stats()["arenas"]["locked"]["locked_bytes"]}))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # The 64 MiB array's pages were unlocked before they went back (what stays
    # locked is the extent serving the 1 MiB array).
    assert out["held"] >= 64 * MiB and out["after"] <= out["held"] - 60 * MiB, out
    assert out["stats"] <= out["held"] - 60 * MiB, out


def test_lock_failure_is_counted_and_memory_served(write_policy):
    """A failing mlock (RLIMIT_MEMLOCK without CAP_IPC_LOCK; injected here, as
    tests run as root) is counted and logged once; the array is served."""
    pol = write_policy(LOCKED)
    code = r"""
import json, numpy as np, datamem
from datamem import _ext
_ext.fault_lock(-1)
a = np.ones(8 << 20, np.uint8); b = np.ones(8 << 20, np.uint8)
s = datamem.stats()["arenas"]["locked"]
print(json.dumps({"arena": datamem.arena_of(a), "sum": int(a.sum()),
                  "errors": s["placement_errors"], "locked": s["locked_bytes"]}))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["arena"] == "locked" and out["sum"] == 8 << 20, out
    assert out["errors"] >= 1 and out["locked"] == 0, out
    assert r.stderr.count("cannot page-lock (mlock)") == 1 and "RLIMIT_MEMLOCK" in r.stderr


@skip_under_asan
def test_lock_under_a_real_memlock_limit_without_the_capability(write_policy):
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv:
        pytest.skip("SKIP: needs root and setpriv to drop CAP_IPC_LOCK")
    pol = write_policy(LOCKED)
    env = dict(os.environ, DATAMEM_CONFIG=pol)
    cmd = ["prlimit", "--memlock=1048576", setpriv, "--inh-caps=-ipc_lock",
           "--bounding-set=-ipc_lock", sys.executable, "-c", LOCK_JOB]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if r.returncode != 0 and "setpriv" in r.stderr:
        pytest.skip("SKIP: setpriv cannot drop capabilities here: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["arena"] == "locked" and out["errors"] >= 1, out
    assert "RLIMIT_MEMLOCK, ulimit -l, is 1024 KiB" in r.stderr, r.stderr


# ---- pinned: cuda ------------------------------------------------------------------------

PINNED = "version: 1\ndefault: general\narenas:\n  general: {}\n  gpu: {pinned: cuda}\n" \
         "rules:\n  - name: big\n    match: {size: {min: 1MiB}}\n    arena: gpu\n"


def test_pinned_registers_every_extent_that_serves_arrays(write_policy, tmp_path, fake_cudart):
    pol = write_policy(PINNED)
    log = tmp_path / "cuda.log"
    code = r"""
import json, numpy as np, datamem
a = np.ones(16 << 20, np.uint8)
small = np.ones(100)
s = datamem.stats()["arenas"]
print(json.dumps({"a": a.ctypes.data, "n": a.nbytes, "arena": datamem.arena_of(a),
                  "pinned": s["gpu"]["pinned_bytes"], "general": s["general"]["pinned_bytes"],
                  "small": small.ctypes.data, "setting": s["gpu"]["pinned"]}))
"""
    r = run_py(code, config=pol, env={"DATAMEM_CUDART": fake_cudart, "FAKE_CUDART_LOG": str(log)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    regs = [tuple(map(int, l.split()[1:])) for l in log.read_text().splitlines()
            if l.startswith("register-portable ")]
    assert any(p <= out["a"] and out["a"] + out["n"] <= p + n for p, n in regs), (regs, out)
    assert not any(p <= out["small"] < p + n for p, n in regs), "general arena not registered"
    assert out["arena"] == "gpu" and out["setting"] == "cuda", out
    assert out["pinned"] >= 16 * MiB and out["general"] == 0, out


def test_pinned_without_a_cuda_runtime_is_a_policy_error(write_policy):
    pol = write_policy(PINNED)
    r = run_py("import numpy", config=pol,
               env={"DATAMEM_CUDART": "/nonexistent/libcudart.so"})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "policy.yaml:5:3: error: arenas.gpu.pinned: cuda:" in r.stderr, r.stderr
    assert "lock: true" in r.stderr  # says what to do without a GPU


def test_pinned_registration_failure_is_counted_and_memory_served(write_policy, fake_cudart):
    pol = write_policy(PINNED)
    r = run_py("import json, numpy as np, datamem\na = np.ones(4 << 20, np.uint8)\n"
               "s = datamem.stats()['arenas']['gpu']\n"
               "print(json.dumps([datamem.arena_of(a), s['placement_errors'], s['pinned_bytes']]))",
               config=pol, env={"DATAMEM_CUDART": fake_cudart, "FAKE_CUDART_FAIL": "1"})
    assert r.returncode == 0, r.stderr
    arena, errors, pinned = json.loads(r.stdout)
    assert arena == "gpu" and errors >= 1 and pinned == 0
    assert "cudaHostRegister: out of memory (2)" in r.stderr


# ---- sizes the machine cannot give, address-space limits ---------------------------------

def test_impossible_sizes_raise_memoryerror_at_once():
    """Bug pinned: with MAP_NORESERVE reservations committed by mprotect (never
    accounted), np.zeros(2**45) (32 TiB) on a 24 GiB machine succeeds and the job
    is OOM-killed later; NumPy's default raises."""
    code = r"""
import numpy as np, datamem
for make, n in ((np.zeros, 2**45), (np.empty, 2**40), (np.ones, 2**38)):
    try:
        make(n, np.uint8)
        print("allocated", make.__name__, n)
    except MemoryError:
        print("MemoryError", make.__name__, n)
a = np.ones(1 << 20)        # the job goes on
print("after", datamem.arena_of(a), float(a.sum()))
"""
    r = run_py(code, config=os.path.join(ROOT, "configs", "minimal.yaml"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:3] == ["MemoryError zeros 35184372088832", "MemoryError empty 1099511627776",
                         "MemoryError ones 274877906944"], r.stdout
    assert lines[3].startswith("after ") and lines[3].endswith(" 1048576.0")
    assert "None" not in lines[3]


def _interpreter_reserve():
    """Address space a free-threaded CPython reserves for itself before the job
    runs (its mimalloc's first arena: about 1 GiB, against 0.2 GiB for a GIL
    build with NumPy and datamem imported), in bytes, whole MiB; 0 on a GIL
    build. An address-space limit is raised by it there, so that the job is
    left what it is left on a GIL build."""
    import sysconfig
    if not sysconfig.get_config_var("Py_GIL_DISABLED"):
        return 0
    r = subprocess.run([sys.executable, "-c", "import numpy, datamem\n"
                        "print(open('/proc/self/status').read().split('VmSize:')[1].split()[0])"],
                       capture_output=True, text=True, timeout=60, check=True)
    return -(-int(r.stdout) // 1024) << 20


def _limited(gib):
    """The preexec_fn that sets RLIMIT_AS to `gib` GiB (plus the interpreter's
    own reservation), and that limit in MiB."""
    import resource
    limit = (gib << 30) + _interpreter_reserve()

    def set_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return set_limit, limit >> 20


GROW = r"""
import numpy as np, datamem
keep, n = [], 0
try:
    while n < 20000:
        keep.append(np.ones(100 << 17)); n += 100     # 100 MiB each
except MemoryError:
    pass
arena = datamem.arena_of(keep[0]) if keep else None
print(n, arena, datamem.stats()["arenas"][arena]["jemalloc_arenas"] if arena else 0)
"""


@skip_under_asan
@pytest.mark.parametrize("policy,gib", [("demo.yaml", 5), ("minimal.yaml", 2)])
def test_jobs_start_under_an_address_space_limit(policy, gib):
    """Bug pinned: if every arena reserves 1 GiB when created, `prlimit --as=5GiB`
    (what HPC schedulers set) stops demo.yaml at start-up ("cannot create arenas:
    cannot create arena"). An arena costs address space only once it serves arrays."""
    e = dict(os.environ, DATAMEM_CONFIG=os.path.join(ROOT, "configs", policy))
    set_limit, mib = _limited(gib)
    r = subprocess.run([sys.executable, "-c", GROW], env=e, capture_output=True, text=True,
                       timeout=120, cwd=ROOT, preexec_fn=set_limit)
    assert r.returncode == 0, r.stderr
    reached, arena, njemalloc = r.stdout.split()
    assert int(reached) >= 500 and arena != "None", r.stdout
    # No big half under the limit: one 1 GiB reservation per arena, not two.
    assert njemalloc == "1", r.stdout
    # Where it stops, the message names the limit.
    assert "RLIMIT_AS" in r.stderr and "%d MiB" % mib in r.stderr, r.stderr


@skip_under_asan
def test_an_address_space_limit_is_mostly_usable():
    """At 8 GiB NumPy's default reaches ~8000 MiB of 100 MiB arrays; datamem used
    to stop at 3700 (jemalloc's geometric retained growth committed far ahead of
    use, and every reservation briefly needed twice its size). What remains is
    jemalloc's size-class rounding (100 MiB is served from a 112 MiB class)."""
    e = dict(os.environ, DATAMEM_CONFIG=os.path.join(ROOT, "configs", "minimal.yaml"))
    r = subprocess.run([sys.executable, "-c", GROW], env=e, capture_output=True, text=True,
                       timeout=120, cwd=ROOT, preexec_fn=_limited(8)[0])
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[0]) >= 5200, r.stdout
    assert r.stdout.split()[2] == "1", r.stdout
    # Without the limit, the same arena has its big half (docs/design.md).
    r = subprocess.run([sys.executable, "-c", GROW.replace("20000", "300")], env=e,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.split()[2] == "2", (r.stdout, r.stderr)


# The colour of big blocks (design.md): the arrays a sparse matvec streams at once
# (a CSR matrix's data and indices, the vector) all started at 0 mod 2 MiB in a big
# half, and shared cache sets (scipy_cg's matvecs 5-7x slower on this VM). Arrays
# with room in their size class now start at offsets that vary, in steps of the
# arena's alignment, resize and free as before, and an exact size class stays on
# its frame.
def test_big_arrays_start_at_varied_offsets(write_policy):
    pol = write_policy("version: 1\ndefault: a\narenas:\n  a: {}\n  paged: {alignment: 4096}\n"
                       "rules:\n  - {name: paged, match: {dtype: int32}, arena: paged}\n")
    code = r"""
import json, numpy as np, datamem
F = 2 << 20
out = {}
for dt, unit in (("float64", 64), ("int32", 4096)):
    held = [np.full((5 << 20) // np.dtype(dt).itemsize + 100, i, dt) for i in range(16)]
    offs = [a.ctypes.data % F for a in held]
    grown = [np.resize(a, a.size * 4) for a in held[:4]]     # copies: realloc'd blocks too
    out[dt] = {"offsets": len(set(offs)), "steps": all(o % unit == 0 for o in offs),
               "arena": {datamem.arena_of(a) for a in held} == {"a" if unit == 64 else "paged"},
               "data": all(int(a[0]) == i and int(a[-1]) == i for i, a in enumerate(held))
                       and all(int(g[-1]) == i for i, g in enumerate(grown))}
whole = np.empty((8 << 20) // 8)                                  # an 8 MiB class exactly
out["whole"] = whole.ctypes.data % F
print(json.dumps(out))
"""
    out = last_json(run_py(code, config=pol))
    for dt in ("float64", "int32"):
        o = out[dt]
        assert o["offsets"] >= 8 and o["steps"] and o["arena"] and o["data"], (dt, out)
    assert out["whole"] == 0, out
