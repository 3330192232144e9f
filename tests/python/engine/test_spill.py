"""File-backed (spill) arenas from Python: a rule routes arrays to a file,
their contents are right, a fork child gets a copy (multiprocessing's fork
start method), tag and worker limits spill instead of raising MemoryError,
and stats show the bytes on disk. The C side (hole punching, max, a full
disk, reload) is //runtime:spill_test."""
import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import UNDER_ASAN, run_in_group, run_py, spill_policy

MiB = 1 << 20


@pytest.fixture
def spill_dir(tmp_path):
    d = tmp_path / "spill"
    d.mkdir(mode=0o700)
    return str(d)


def test_a_rule_routes_an_array_to_the_file(write_policy, spill_dir):
    pol = spill_policy(write_policy, spill_dir, spill_from="8MiB")
    code = r"""
import json, numpy as np, datamem
a = np.arange(8 << 20, dtype=np.int64)          # 64 MiB: the rule's
b = np.arange(1000, dtype=np.int64)
c = np.zeros(6 << 20)                          # 48 MiB of zeros from the file
a[::4096] *= 3
s = datamem.stats()["arenas"]["disk"]
print(json.dumps({"a": datamem.arena_of(a), "b": datamem.arena_of(b),
                  "sum": int(a.sum()), "want": int(np.arange(8 << 20, dtype=np.int64).sum()
                                                   + 2 * np.arange(0, 8 << 20, 4096).sum()),
                  "zeros": float(c.sum()), "backed": s["backed"],
                  "disk": s["backing_disk_bytes"], "reserved": s["backing_reserved_bytes"]}))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["a"] == "disk" and out["b"] == "general", out
    assert out["sum"] == out["want"] and out["zeros"] == 0.0, out
    assert out["backed"] and out["disk"] >= 64 * MiB and out["reserved"] >= 64 * MiB, out
    assert os.listdir(spill_dir) == []  # the file has no name


def test_a_fork_child_gets_a_copy_not_a_shared_mapping(write_policy, spill_dir):
    pol = spill_policy(write_policy, spill_dir, spill_from="8MiB")
    code = r"""
import json, multiprocessing as mp, numpy as np, datamem
ctx = mp.get_context("fork")
a = np.full(4 << 20, 1.0)                      # 32 MiB on disk
def child(conn, go):
    seen = float(a[0])
    a[:] = 2.0                                 # the child's own write
    conn.send("written")
    go.wait()                                  # the parent has written 3.0 meanwhile
    conn.send({"before": seen, "after": float(a.min()), "max": float(a.max()),
               "arena": datamem.arena_of(a)})
parent_end, child_end = ctx.Pipe()
go = ctx.Event()
p = ctx.Process(target=child, args=(child_end, go))
p.start()
assert parent_end.recv() == "written"
seen_by_parent = float(a.max())
a[:] = 3.0
go.set()
child_saw = parent_end.recv()
p.join()
print(json.dumps({"parent_saw": seen_by_parent, "child": child_saw, "parent_now": float(a.min()),
                  "exit": p.exitcode,
                  "copies": datamem.stats()["arenas"]["disk"]["backing_fork_copies"]}))
"""
    r = run_py(code, config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["exit"] == 0, out
    assert out["parent_saw"] == 1.0, out          # the child's write is not the parent's
    assert out["child"]["before"] == 1.0, out     # the child starts with the parent's data
    assert out["child"]["after"] == 2.0 and out["child"]["max"] == 2.0, out  # not the parent's 3.0
    assert out["parent_now"] == 3.0 and out["copies"] >= 1, out


# Bug pinned: freed spilled arrays kept their disk blocks. jemalloc decays an
# arena only from its own allocations and frees, so once the spill arena's
# arrays were freed nothing purged them: 20 arrays of 8 MiB left 170 MiB in the
# file 10 s later with `decay.dirty: 1s`, and through 13 M create/free cycles of
# small arrays (which live in another arena). The spill thread drives decay.
# The file's blocks are read with fstat (st_blocks), not from datamem's stats.
DECAY_JOB = r"""
import json, os, time
import numpy as np, datamem
def target(f):
    try:
        return os.readlink("/proc/self/fd/" + f)
    except OSError:                                        # listdir's own descriptor
        return ""
fd = next(int(f) for f in os.listdir("/proc/self/fd")      # the O_TMPFILE: "dir/#ino (deleted)"
          if target(f).startswith(spill_dir + "/"))
disk = lambda: os.fstat(fd).st_blocks * 512
held = [np.full(1 << 20, float(i)) for i in range(20)]      # 20 x 8 MiB, written
where = sorted({datamem.arena_of(a) for a in held})
before = disk()
del held
t0 = time.monotonic()
seen, cycles = disk(), 0
while seen >= 8 << 20 and time.monotonic() - t0 < 5.0:     # 5x decay.dirty
    if churn:
        for _ in range(2000):                              # small arrays: the RAM arena
            a = np.empty(16)
            del a
        cycles += 2000
    else:
        time.sleep(0.05)                                   # idle: no allocation at all
    seen = disk()
print(json.dumps({"where": where, "before": before, "after": seen,
                  "seconds": time.monotonic() - t0, "cycles": cycles}))
"""


@pytest.mark.parametrize("job", ["idle", "churn"])
def test_freed_spilled_arrays_give_their_disk_blocks_back_within_decay(write_policy,
                                                                        spill_dir, job):
    """After 160 MiB of spilled arrays are freed, the file's allocated blocks
    (st_blocks) drop under 8 MiB within 5x `decay.dirty: 1s`, while the job
    sleeps (idle) or makes and frees small arrays in its RAM arena (churn)."""
    pol = spill_policy(write_policy, spill_dir, spill_from="4MiB", dirty="1s")
    r = run_py("spill_dir, churn = %r, %r\n" % (spill_dir, job == "churn") + DECAY_JOB,
               config=pol)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["where"] == ["disk"] and out["before"] >= 160 * MiB, out
    assert out["after"] < 8 * MiB, out          # old code: 170 MiB, idle or churning
    assert job == "idle" or out["cycles"] > 0, out

ANON_RESIDENT = r"""
import os
import re
with open("/proc/self/statm") as f:
    size, resident, shared = (int(v) for v in f.read().split()[:3])
print((resident - shared) * os.sysconf("SC_PAGE_SIZE"))
"""


def test_limits_spill_instead_of_raising(write_policy, spill_dir):
    # The worker limit counts the process's resident anonymous memory (the
    # interpreter, NumPy: ~30 MiB here) beside its arrays: it is set to what a
    # process of this policy holds after its first array, plus 96 MiB + 8 MiB
    # of slack (half an array of the job's second half). Under ASan its shadow of
    # what the job writes (1/8 of it, resident) counts too: one array more or less.
    pol = spill_policy(write_policy, spill_dir, textwrap.dedent("""\
        worker_limit: 100%
        worker_spill: disk
        tag_limits:
          - {tag: "task-*", limit: 32MiB, spill: disk}
        """))
    probe = run_py("import numpy as np, datamem; a = np.ones(1)\n" + ANON_RESIDENT, config=pol,
                   env={"DATAMEM_MEMORY_LIMIT": "1GiB"})
    assert probe.returncode == 0, probe.stderr
    limit = int(probe.stdout) + 104 * MiB
    code = r"""
import json, numpy as np, datamem
out = {}
with datamem.tag("task-1"):
    held = [np.ones(4 << 20, np.uint8) for _ in range(16)]     # 64 MiB: 8 past the tag's 32
    out["task"] = [datamem.arena_of(x) for x in held]
    out["task_sum"] = int(sum(int(x.sum()) for x in held))
    out["tag_live"] = datamem.stats()["tags"]["task-1"]["live"]
big = [np.ones(16 << 20, np.uint8) for _ in range(8)]           # 128 MiB untagged
out["worker"] = [datamem.arena_of(x) for x in big]
out["failure"] = datamem.last_failure()
out["beside"] = datamem.stats()["tag_bytes"]["worker_beside"]
out["tb"] = datamem.stats()["tag_bytes"]
out["metrics"] = [l for l in datamem.metrics().splitlines() if l.startswith("datamem_worker")]
print(json.dumps(out))
"""
    r = run_py(code, config=pol, env={"DATAMEM_MEMORY_LIMIT": str(limit)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["task"][:8] == ["general"] * 8 and out["task"][8:] == ["disk"] * 8, out
    assert out["task_sum"] == 64 * MiB and out["tag_live"] <= 32 * MiB, out
    # 32 MiB of the tag's in RAM, then 96 MiB of worker limit: 4 more in RAM
    assert 0 < out["beside"] < limit - 96 * MiB, out
    k = out["worker"].count("general")
    assert out["worker"] == ["general"] * k + ["disk"] * (8 - k), out
    assert k == 4 or (UNDER_ASAN and 3 <= k <= 5), out
    # the worker limit said no 8 - k times, and worker_spill served each (the
    # tag's spills are its own, not the budget's)
    assert out["tb"]["worker_refused"] == out["tb"]["worker_spilled"] == 8 - k, out["tb"]
    assert "datamem_worker_limit_spills_total %d" % (8 - k) in out["metrics"], out["metrics"]
    assert "datamem_worker_limit_refusals_total %d" % (8 - k) in out["metrics"], out["metrics"]
    assert out["failure"] is None, out
    assert "MemoryError" not in r.stderr, r.stderr


def test_a_directory_others_can_write_is_refused(write_policy, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    pol = spill_policy(write_policy, str(d))
    r = run_py("import numpy, datamem; print(datamem.current_policy())", config=pol)
    assert "arenas.disk.backing.dir" in r.stderr, r.stderr
    assert "directory writable by other users (mode 0777)" in r.stderr, r.stderr


def test_explain_says_when_an_allocation_would_spill(write_policy, spill_dir):
    pol = spill_policy(write_policy, spill_dir, textwrap.dedent("""\
        worker_limit: 1GiB
        worker_spill: disk
        tag_limits:
          - {tag: "task-*", limit: 32MiB, spill: disk}
        rules:
          - {name: big, match: {size: {min: 8MiB}}, arena: disk}
        """))
    r = run_py("import datamem\n"
               "print(datamem.explain(%r, 1 << 30))\n"
               "print(datamem.explain(%r, 4096, tags=['task-7']))" % (pol, pol))
    assert r.returncode == 0, r.stderr
    big, small = r.stdout.split("-> default", 1)
    assert "-> rule 'big' -> arena 'disk'" in big, r.stdout
    assert "spills: arena 'disk' is a file in %s" % spill_dir in big, r.stdout
    assert "past tag 'task-7''s limit of 33554432 bytes: spills to arena 'disk'" in small, r.stdout
    assert "past worker_limit 1GiB: spills to arena 'disk'" in small, r.stdout


EXPLAIN = r"""
import sys, datamem
for size in (64 << 20, 600 << 20):
    print(datamem.explain(sys.argv[1], size))
"""


def test_explain_says_what_the_budget_would_do_now(write_policy, spill_dir, memory_groups):
    """`explain` resolves worker_limit here and now: with a share of a
    cgroup's limit, the group's budget, what the group holds now (a neighbour's
    400 MiB) and whether an array of the size asked fits or spills; with
    DATAMEM_MEMORY_LIMIT, a budget per process; a limit that cannot be read,
    why."""
    version, make = memory_groups
    group = make([1 << 30])
    pol = spill_policy(write_policy, spill_dir, "worker_limit: 70%\nworker_spill: disk\n")
    with neighbour(group):
        e = {k: v for k, v in os.environ.items() if k != "DATAMEM_MEMORY_LIMIT"}
        r = subprocess.run([sys.executable, "-c", EXPLAIN, pol], env=e, capture_output=True,
                           text=True, timeout=60, preexec_fn=lambda: join(group))
    assert r.returncode == 0, r.stderr
    fits, past = r.stdout.split("-> default", 2)[1:]
    assert ("budget now: 716.8MiB (70%% of the cgroup v%d limit 1.0GiB), one budget for every "
            "process in\n     cgroup %s\n" % (version, group)) in fits, r.stdout
    held = re.search(r"the cgroup holds (\S+) now \(anonymous and shmem pages\): (\S+) left",
                     fits)
    assert held and 400 << 20 <= _parse_size(held.group(1)) < 600 << 20, r.stdout
    assert "an array of 64.0MiB now: fits" in fits, r.stdout
    assert "an array of 600.0MiB now: spills to arena 'disk'" in past, r.stdout
    # per process: what each process holds is its own, known only to `top PID`
    r = run_py(EXPLAIN.replace("sys.argv[1]", repr(pol)), env={"DATAMEM_MEMORY_LIMIT": "2GiB"})
    assert ("budget now: 1.4GiB (70% of DATAMEM_MEMORY_LIMIT 2.0GiB) per process: each "
            "process's arrays and what it holds\n     beside them count against its own") in \
        r.stdout, r.stdout + r.stderr
    assert "an array past it: spills to arena 'disk'" in r.stdout, r.stdout
    r = run_py(EXPLAIN.replace("sys.argv[1]", repr(pol)), env={"DATAMEM_MEMORY_LIMIT": "lots"})
    assert "budget now: cannot be read here: 70% of the process's memory limit" in r.stdout, \
        r.stdout + r.stderr


def _parse_size(cell):
    """A `top` size cell ("264.0MiB", "0B") in bytes."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    for u in ("KiB", "MiB", "GiB", "TiB", "B"):
        if cell.endswith(u):
            return float(cell[:-len(u)]) * units[u]
    raise AssertionError("not a size: %r" % cell)


def test_stats_and_top_show_bytes_on_disk_and_in_memory(write_policy, spill_dir, tmp_path):
    """A spill arena's resident bytes are its file's pages in memory, not what
    jemalloc once touched (the pager drops them behind its back), and `top`
    shows its bytes on disk and in memory under the arena table."""
    pol = write_policy(textwrap.dedent("""\
        version: 1
        default: general
        arenas:
          general: {{}}
          disk: {{backing: {{dir: '{d}', resident_max: 8MiB}}}}
        rules:
          - {{name: big, match: {{size: {{min: 8MiB}}}}, arena: disk}}
        """).format(d=spill_dir))
    code = r"""
import json, os, subprocess, sys, time
import numpy as np, datamem
held = [np.ones(4 << 20) for _ in range(2)]          # 64 MiB in the file
deadline = time.monotonic() + 30                      # the pager runs five times a second
while True:
    s = datamem.stats()["arenas"]["disk"]
    if s["backing_resident_bytes"] <= 8 << 20 or time.monotonic() > deadline:
        break
    time.sleep(0.1)
top = subprocess.run([sys.executable, "-m", "datamem", "top", str(os.getpid()), "--once",
                      "--interval", "0.2"], capture_output=True, text=True, timeout=60)
after = datamem.stats()["arenas"]["disk"]
print(json.dumps({"s": s, "after": after, "top": top.stdout, "err": top.stderr,
                  "sum": float(sum(x.sum() for x in held))}))
"""
    r = run_py(code, config=pol, env={"DATAMEM_STATS_HTTP": "127.0.0.1:0",
                                      "DATAMEM_STATS_DIR": str(tmp_path / "discovery")})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["s"]
    assert s["backing_resident_bytes"] <= 8 * MiB, s
    assert s["allocated_bytes"] >= 64 * MiB and s["backing_disk_bytes"] >= 64 * MiB, s
    # The arena's resident bytes are the file's pages in memory (jemalloc's own
    # count would be every page of the 64 MiB it touched).
    assert s["resident_bytes"] <= 8 * MiB, s
    assert out["sum"] == float(8 << 20)

    lines = out["top"].splitlines()
    assert lines and all(len(l) <= 80 for l in lines), out["top"] + out["err"]
    head = next(i for i, l in enumerate(lines) if l.startswith("SPILL ARENA"))
    cols = lines[head].replace("SPILL ARENA", "SPILL_ARENA").replace("ON DISK", "ON_DISK") \
        .replace("DISK MAX", "DISK_MAX").replace("RES MAX", "RES_MAX") \
        .replace("PAGED OUT", "PAGED_OUT").split()
    row = dict(zip(cols, lines[head + 1].split()))
    assert row["SPILL_ARENA"] == "disk" and row["DISK_MAX"] == "-", row
    assert row["RES_MAX"] == "8.0MiB" and row["REFUSED"] == "0", row
    both = (s, out["after"])
    for col, key in (("ON_DISK", "backing_disk_bytes"), ("RESIDENT", "backing_resident_bytes"),
                     ("PAGED_OUT", "backing_paged_out_bytes")):
        shown = _parse_size(row[col])
        lo, hi = min(x[key] for x in both), max(x[key] for x in both)
        assert lo * 0.99 - 1 <= shown <= hi * 1.01 + 1, (col, row[col], lo, hi)
    assert _parse_size(row["ON_DISK"]) >= 64 * MiB and _parse_size(row["PAGED_OUT"]) >= 56 * MiB
    # Only spill arenas have a row.
    assert not any(l.split()[:1] == ["general"] for l in lines[head + 1:]), out["top"]


CGROUP_SPILL_JOB = r"""
import json, numpy as np, datamem
tb = datamem.stats()["tag_bytes"]
held = [np.full(2 << 20, float(i)) for i in range(40)]   # 40 x 16 MiB = 640 MiB, written
s = datamem.stats()["arenas"]["spill"]
print(json.dumps({"limit": tb["worker_limit"], "source": tb["worker_limit_source"],
                  "where": [datamem.arena_of(a) for a in held],
                  "sums_ok": all(float(a.sum()) == float(i) * (2 << 20) for i, a in enumerate(held)),
                  "disk": s["backing_disk_bytes"], "failure": datamem.last_failure()}))
"""


def test_a_worker_limit_share_spills_under_a_real_cgroup_limit(write_policy, spill_dir,
                                                                memory_groups):
    """`worker_limit: 50%` of a real memory cgroup's limit (512 MiB), with
    `worker_spill`: a job holding 640 MiB of written arrays, 1.25x the group's
    limit, is neither OOM-killed nor refused: the arrays past 256 MiB live in
    the file, and every sum is right."""
    version, make = memory_groups
    pol = write_policy(textwrap.dedent("""\
        version: 1
        default: general
        arenas:
          general: {{}}
          spill: {{decay: {{dirty: 1s}}, backing: {{dir: '{d}', resident_max: 32MiB}}}}
        worker_limit: 50%
        worker_spill: spill
        """).format(d=spill_dir))
    r = run_in_group(make([512 << 20]), CGROUP_SPILL_JOB, pol, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -9: the OOM killer
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["source"] == "cgroup v%d" % version and out["limit"] == 256 * MiB, out
    where = out["where"]
    n_ram = where.count("general")
    assert 12 <= n_ram <= 16 and where == ["general"] * n_ram + ["spill"] * (40 - n_ram), out
    assert out["sums_ok"] and out["failure"] is None, out
    assert out["disk"] >= (40 - n_ram) * 16 * MiB, out


NEIGHBOUR = r"""
import sys
held = b"\x01" * (400 << 20)                     # 400 MiB, written: the group is charged
print("ready", flush=True)
sys.stdin.read()                                 # held until the test closes stdin
"""


def join(group):
    """Moves the calling process into cgroup `group` (a preexec_fn)."""
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


@contextlib.contextmanager
def neighbour(group):
    """Another process of cgroup `group` holding 400 MiB, written, while the
    block runs (the Popen is yielded)."""
    other = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, preexec_fn=lambda: join(group))
    try:
        assert other.stdout.readline().strip() == "ready"
        yield other
    finally:
        other.stdin.close()
        other.wait(timeout=60)

GROUP_BUDGET_JOB = r"""
import json, numpy as np, datamem
held = []
try:
    while len(held) < 64:
        held.append(np.ones(4 << 20))            # 32 MiB each, written
    caught = None
except MemoryError as e:
    caught = str(e)
print(json.dumps({"n": len(held), "caught": caught,
                  "source": datamem.stats()["tag_bytes"]["worker_limit_source"]}))
"""


def test_a_cgroup_share_is_one_budget_for_every_process_in_the_group(write_policy,
                                                                    memory_groups):
    """`worker_limit: 70%` of a real cgroup's limit (1 GiB) is a budget for
    the group, not for each process: beside another process of the group that
    holds 400 MiB, a job's arrays stop at what is left of the 70% (MemoryError,
    no spill arena here), where counting its own memory alone it would take
    about 680 MiB and the kernel would OOM-kill one of the two."""
    version, make = memory_groups
    group = make([1 << 30])
    pol = write_policy("version: 1\ndefault: general\narenas:\n  general: {}\n"
                       "worker_limit: 70%\n")
    with neighbour(group) as other:
        r = run_in_group(group, GROUP_BUDGET_JOB, pol, timeout=300)
        assert other.poll() is None, "the neighbour was killed"
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -9: the OOM killer
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["source"] == "cgroup v%d" % version, out
    # 70% of 1 GiB is 716.8 MiB; the neighbour's 400 MiB leave at most 316.8 MiB
    assert 1 <= out["n"] <= 9, out
    assert out["caught"] and "the cgroup's other processes" in out["caught"], out
