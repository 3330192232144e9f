"""A full disk under a spill arena on the copy-on-write filesystems the docs
name for fork copies, btrfs and XFS (reflinks), and on XFS and ext4 filled to
the last block, each a 300 MiB image on a loop device made by the test (XFS
takes no less): a full disk is a MemoryError at an
allocation, never a SIGBUS at a page fault, in a process and in a fork child
and its parent, and the data is right wherever an allocation succeeded.

What failed before: the fork copy was a reflink (copy_file_range), so parent
and child shared every spilled block, and the first rewrite of one needed a
fresh block that no fallocate had reserved: SIGBUS on both filesystems once the
disk filled. And btrfs copies a block on every write, so a full btrfs SIGBUSed
on a plain rewrite of a page already written back, fork or not.

And on a filesystem with large page-cache folios (XFS; ext4 since Linux 6.16)
a write fault reserves blocks for the whole folio, up to 2 MiB, which reached
past the end of a range reserved page by page into the unreserved rest of the
file: an allocation that took the last free blocks SIGBUSed writing its last
pages, until reservations became whole 2 MiB chunks (docs/spill-and-limits.md, "A
full disk is a MemoryError"): test_several_processes_filling_a_disk_to_its_last_block.
The fork tests' fills stop at MARGIN free, where one allocation larger than
what is left shows the refusal itself: a MemoryError."""
import array
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import spill_policy

IMAGE = 300 << 20   # mkfs.xfs 6.1: "Filesystem must be larger than 300MB" below this
FILESYSTEMS = ("btrfs", "xfs")
PACKAGE = {"btrfs": "btrfs-progs", "xfs": "xfsprogs", "ext4": "e2fsprogs"}
MKFS = {"btrfs": ["mkfs.btrfs", "-q", "-f"], "xfs": ["mkfs.xfs", "-q", "-f"],
        "ext4": ["mkfs.ext4", "-q", "-F"]}


def _why_not(fs):
    """Why this machine cannot make the image, or None."""
    if os.geteuid() != 0:
        return "mounting a loop device needs root"
    if not os.path.exists("/dev/loop-control") or not shutil.which("losetup"):
        return "no loop device (/dev/loop-control, losetup)"
    if not shutil.which("mkfs." + fs):
        return "no mkfs.%s (Debian: apt-get install %s)" % (fs, PACKAGE[fs])
    return None


@pytest.fixture(params=FILESYSTEMS)
def cow_dir(request, tmp_path):
    """A spill directory on a fresh `fs` image of IMAGE bytes, mounted on a
    temporary directory; unmounted and detached afterwards, whatever happened."""
    fs = request.param
    why = _why_not(fs)
    if why:
        print("SKIP %s: %s" % (fs, why))
        pytest.skip("SKIP %s: %s" % (fs, why))
    img, mnt = tmp_path / (fs + ".img"), tmp_path / "mnt"
    with open(img, "wb") as f:
        f.truncate(IMAGE)
    mnt.mkdir()
    subprocess.run(MKFS[fs] + [str(img)], check=True, capture_output=True, timeout=120)
    dev = subprocess.run(["losetup", "--find", "--show", str(img)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    try:
        subprocess.run(["mount", "-t", fs, dev, str(mnt)], check=True, capture_output=True,
                       timeout=60)
        try:
            spill = mnt / "spill"
            spill.mkdir(mode=0o700)
            yield fs, str(spill)
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "--detach", dev], capture_output=True)


# argv: mode, spill dir. Prints one JSON line per process ("who"). Every
# allocation is a 16 MiB array, in the file. The fills stop short of the brim,
# at MARGIN free (the brim is test_several_processes_filling_a_disk_to_its_last_block's);
# then one allocation larger than what is left must fail with a MemoryError, the only exception caught: anything else (a SIGBUS above all)
# ends the process.
JOB = r"""
import ctypes, faulthandler, json, os, signal, sys, numpy as np, datamem
faulthandler.enable()                    # a SIGBUS prints where it struck
mode, where = sys.argv[1], sys.argv[2]
MiB = 1 << 20
MARGIN = 48 * MiB
N = 2 << 20                              # float64: 16 MiB an array

def free():
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize

def fill(arrays, upto, first):           # until upto bytes held, MARGIN free, or refused
    while sum(a.nbytes for a in arrays) < upto and free() - 16 * MiB >= MARGIN:
        try:                             # btrfs's f_bavail counts space data cannot use
            arrays.append(np.full(N, float(first + len(arrays))))
        except MemoryError:
            break

def refused():                           # more than the disk has left: a MemoryError
    try:
        np.full((free() + 64 * MiB) // 8, 1.0)
    except MemoryError:
        return True
    return False

def wrong(arrays, first):
    return [i for i, a in enumerate(arrays) if not a.min() == a.max() == first + i]

def rewrite(arrays, first):              # every page: a shared block needs a fresh one
    for i, a in enumerate(arrays):
        a[:] = first + i

def report(who, **kw):
    s = datamem.stats()["arenas"]["disk"]
    kw.update(who=who, full=s["backing_full"], copies=s["backing_fork_copies"],
              failures=s["backing_fork_failures"], free=free())
    print(json.dumps(kw), flush=True)

held = []
fill(held, free() / 3 if mode == "fork-third" else float("inf"), 0)
held_ok = wrong(held, 0)
os.sync()                                # written back: a rewrite faults on clean pages
if mode == "full":
    no = refused()
    rewrite(held, 100)
    report("parent", held=len(held), refused=no, wrong=held_ok + wrong(held, 100))
    sys.exit(0)
c2p, p2c = os.pipe(), os.pipe()
pid = os.fork()
who, base = ("child", 2000) if pid == 0 else ("parent", 1000)
if pid == 0:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG: no orphan holds the mount
    os.close(c2p[0]), os.close(p2c[1])
else:
    os.close(c2p[1]), os.close(p2c[0])   # a dead child's end reads EOF
more = []
fill(more, float("inf"), base + 500)
more_ok = wrong(more, base + 500)
no = None
if pid == 0:
    os.write(c2p[1], b"f")               # filled: the parent's refusal comes after
else:
    os.read(c2p[0], 1)                   # (EOF if the child died)
    no = refused()
at_rewrite = free()
rewrite(held, base)
if pid == 0:
    os.read(p2c[0], 1)                   # the parent has rewritten its arrays
else:
    try:
        os.write(p2c[1], b"x")
    except BrokenPipeError:              # the child is gone: its status says how
        pass
    _, status = os.waitpid(pid, 0)
seen = wrong(held, base)                 # the other's rewrite must not show here
kw = dict(held=len(held), more=len(more), refused=no, at_rewrite=at_rewrite, wrong=held_ok + more_ok + seen)
if pid == 0:
    report(who, **kw)
    os._exit(0)
kw.update(child_signal=signal.Signals(os.WTERMSIG(status)).name
          if os.WIFSIGNALED(status) else None,
          child_exit=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None)
report(who, **kw)
"""


def run_job(mode, fs, spill_dir, pol):
    """Runs JOB in a fresh interpreter; returns each process's report by "who"."""
    r = subprocess.run([sys.executable, "-c", JOB, mode, spill_dir],
                       env=dict(os.environ, DATAMEM_CONFIG=pol), capture_output=True, text=True,
                       timeout=300)
    # -7: the parent died of SIGBUS (a page fault with no block for it)
    assert r.returncode == 0, (fs, mode, r.returncode, r.stderr[-3000:])
    out = {}
    for line in r.stdout.splitlines():
        d = json.loads(line)
        out[d["who"]] = d
    return out, r.stderr


def test_a_rewrite_on_a_nearly_full_disk_needs_no_new_block(cow_dir, write_policy):
    """Filled until less than MARGIN is free, written back, then every page
    rewritten, and an allocation past what is left refused: btrfs copied each
    block on write (SIGBUS) until the spill file was made nodatacow."""
    fs, d = cow_dir
    out, err = run_job("full", fs, d, spill_policy(write_policy, d, spill_from="8MiB"))
    p = out["parent"]
    assert p["held"] >= 8 and p["refused"] and p["full"] >= 1, (fs, p)
    assert p["wrong"] == [], (fs, p)


def test_a_fork_copy_then_a_nearly_full_disk_needs_no_new_block(cow_dir, write_policy):
    """A third of the free space spilled, a fork (its copy takes another
    third), then parent and child each allocate until less than MARGIN is free
    and rewrite every page of the arrays they had before the fork; an
    allocation past what is left is refused. A reflinked copy shared every
    block, and the rewrites needed a third of the disk that was not there:
    SIGBUS in both."""
    fs, d = cow_dir
    out, err = run_job("fork-third", fs, d, spill_policy(write_policy, d, spill_from="8MiB"))
    p, c = out["parent"], out.get("child")
    assert p["child_signal"] is None and p["child_exit"] == 0, (fs, p, err[-3000:])
    assert c is not None, (fs, out, err[-3000:])
    assert p["refused"] and p["full"] >= 1, (fs, p)
    if fs == "xfs":                                # btrfs's f_bavail is no measure
        assert p["at_rewrite"] < 64 << 20, (fs, p)   # nearly full when they rewrote
    for x in (p, c):
        assert x["copies"] == 1 and x["failures"] == 0, (fs, x)   # the copy path ran
        assert x["held"] >= 4, (fs, x)
        assert x["wrong"] == [], (fs, x)


def test_a_fork_without_room_for_the_copy_maps_copy_on_write(cow_dir, write_policy):
    """Nearly full before the fork: no room for the copy, so the child maps
    the parent's file copy-on-write (logged, counted); both rewrite every page
    (the child's writes land in its own memory), and neither dies of SIGBUS.
    The reflink copy fitted here (each run's blocks, reserved first, went back
    when the reflink replaced them) and both died of SIGBUS on XFS."""
    fs, d = cow_dir
    out, err = run_job("fork-full", fs, d, spill_policy(write_policy, d, spill_from="8MiB"))
    p, c = out["parent"], out.get("child")
    assert p["child_signal"] is None and p["child_exit"] == 0, (fs, p, err[-3000:])
    assert c is not None, (fs, out, err[-3000:])
    assert p["held"] >= 8 and p["refused"], (fs, p)
    for x in (p, c):
        assert x["copies"] == 0 and x["failures"] == 1, (fs, x)
        assert x["wrong"] == [], (fs, x)
    assert "could not get its own copy" in err, err[-3000:]


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_COMPR_FL = 0x80086601, 0x40086602, 0x4   # <linux/fs.h>


@pytest.mark.parametrize("cow_dir", ["btrfs"], indirect=True)
def test_a_compressed_btrfs_directory_still_spills(cow_dir, write_policy):
    """A btrfs directory marked compressed (chattr +c) passes the flag on to the
    files made there, and btrfs refuses nodatacow with it: the spill file
    drops it (a nodatacow file compresses nothing), and the arena works."""
    fs, d = cow_dir
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] |= FS_COMPR_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    finally:
        os.close(fd)
    out, err = run_job("full", fs, d, spill_policy(write_policy, d, spill_from="8MiB"))
    p = out["parent"]
    assert p["held"] >= 8 and p["refused"] and p["wrong"] == [], (fs, p)


# argv: spill dir, process number, a file to make when ready. One of several
# processes started at once (each, ready, waits for "go": stdin's end), each
# filling the same disk to its last block: arrays of sizes that are jemalloc
# size classes but not multiples of 2 MiB (so their ends fall inside 2 MiB
# chunks), every page written as it is made, until each size has been refused
# once. Then half the processes free 40 MiB at a time and take it again with
# np.zeros (a calloc of reused blocks, zeroed in the file) while the others
# take what they can; then everything is written back and every page
# rewritten, twice.
# Prints one JSON line; a SIGBUS ends the process (-7).
BRIM = r"""
import faulthandler, json, os, sys, numpy as np, datamem
faulthandler.enable()
where, me, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
MiB = 1 << 20

def free():
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize

start = free()
open(ready, "w").close()
sys.stdin.read()                          # go

held, refused, low = [], 0, None
sizes = [7 * MiB, 5 * MiB, 3 * MiB + MiB // 2, 5 * MiB // 2, 5 * MiB // 4]
k = me
while sizes:                              # until each size is refused
    size = sizes[k % len(sizes)]
    k += 1
    try:
        a = np.empty(size // 8)
    except MemoryError:
        refused += 1
        low = free() if low is None else min(low, free())
        sizes.remove(size)
        continue
    a[:] = me * 1000 + len(held)          # the write faults the last pages need
    held.append(a)
nonzero = 0
for r in range(40):                       # reuse: np.zeros of freed blocks (calloc,
    if me % 2 == 0 and held:              # zeroed in the file) while others take blocks
        gone = 0
        while held and gone < 40 * MiB:
            gone += held.pop().nbytes
        try:
            z = np.zeros(40 * MiB // 8)
        except MemoryError:
            continue
        nonzero += int(z.any())
        z[:] = me * 1000 + len(held)
        held.append(z)
    else:
        try:
            a = np.empty(5 * MiB // 2 // 8)
        except MemoryError:
            continue
        a[:] = me * 1000 + len(held)
        held.append(a)
wrong = [i for i, a in enumerate(held) if not a.min() == a.max()]
for r in (1, 2):
    os.sync()                             # written back: a rewrite faults on clean pages
    for i, a in enumerate(held):
        a[:] = me * 1000 + i + r * 100000
    wrong += [i for i, a in enumerate(held) if not a.min() == a.max() == me * 1000 + i + r * 100000]
s = datamem.stats()["arenas"]["disk"]
print(json.dumps(dict(me=me, start=start, nonzero=nonzero, held=len(held), mib=sum(a.nbytes for a in held) >> 20,
                      refused=refused, low=low, full=s["backing_full"], wrong=wrong)), flush=True)
"""
BRIM_PROCS = 4


@pytest.mark.parametrize("cow_dir", ["xfs", "ext4"], indirect=True)
def test_several_processes_filling_a_disk_to_its_last_block(cow_dir, write_policy, tmp_path):
    """Large page-cache folios (XFS; ext4 since Linux 6.16): a write fault
    reserves blocks for its whole folio, up to 2 MiB, and when the reservation
    ended inside a folio, the disk's last blocks taken by another process, the
    fault had none: SIGBUS (before reservations were whole 2 MiB chunks, 4
    processes filling a 300 MiB XFS or ext4 image to the brim died so in 9
    runs of 10 on XFS, 10 of 10 on ext4, Linux 6.18). And XFS's zero range
    (a calloc of a reused block of 32 MiB or more) frees the blocks before it
    allocates them again: another process took them, and the next write there
    was a SIGBUS (1 run of 5 of the same fill with np.zeros reuse). Each
    process must end with its data right and at least one MemoryError, the
    disk full to within a few MiB, and no signal."""
    fs, d = cow_dir
    pol = spill_policy(write_policy, d, spill_from="1MiB")
    env = dict(os.environ, DATAMEM_CONFIG=pol)
    logs = [(tmp_path / ("brim%d.out" % i), tmp_path / ("brim%d.err" % i))
            for i in range(BRIM_PROCS)]
    procs = []
    for i, (o, e) in enumerate(logs):
        with open(o, "w") as fo, open(e, "w") as fe:
            procs.append(subprocess.Popen([sys.executable, "-c", BRIM, d, str(i),
                                           str(o) + ".ready"], env=env,
                                          stdin=subprocess.PIPE, stdout=fo, stderr=fe))
    deadline = time.monotonic() + 60
    while not all(os.path.exists(str(o) + ".ready") for o, _ in logs):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
            ("not all ready", [p.poll() for p in procs], [e.read_text()[-2000:] for _, e in logs])
        time.sleep(0.02)
    for p in procs:                       # go: all at once
        p.stdin.close()
    rcs = [p.wait(timeout=300) for p in procs]
    outs = [(o.read_text(), e.read_text()) for o, e in logs]
    # -7: SIGBUS, a write fault with no block for its folio
    assert rcs == [0] * BRIM_PROCS, (fs, rcs, [e[-2000:] for _, e in outs if e])
    reps = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    for r in reps:
        assert r["refused"] >= 1 and r["full"] >= 1 and r["wrong"] == [], (fs, r)
        assert r["nonzero"] == 0, (fs, r)     # np.zeros read zeros
    assert min(r["low"] for r in reps) < 4 << 20, (fs, reps)   # filled to the brim


# argv: spill dir, a file to make when filled, a file to wait for, a file to
# make when done. Fills the disk to 48 MiB free with 4 MiB arrays and holds a
# 40 MiB np.zeros array; then, once THIEF runs, frees it and takes it again
# with np.zeros (a calloc of a reused block of 32 MiB or more: zeroed in the
# file), 40 times, writing each. The arena's decay.dirty is 30 s, so the
# freed block is reused as it is, its blocks kept: only a zeroing that gives
# them up lets THIEF have them.
ZEROS = r"""
import json, os, sys, time, numpy as np, datamem
where, filled, go, done = sys.argv[1:5]
MiB = 1 << 20
held = []
while os.statvfs(where).f_bavail * os.statvfs(where).f_frsize >= 48 * MiB:
    a = np.empty(4 * MiB // 8)
    a[:] = 1
    held.append(a)
z = np.zeros(40 * MiB // 8)
z[:] = 1
open(filled, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
ok = refused = nonzero = 0
for i in range(40):
    del z
    try:
        z = np.zeros(40 * MiB // 8)
    except MemoryError:
        z = np.zeros(1)
        refused += 1
        continue
    nonzero += int(z.any())
    z[:] = 2                              # every page: a SIGBUS where a block is gone
    ok += 1
open(done, "w").close()
print(json.dumps(dict(ok=ok, refused=refused, nonzero=nonzero,
                      wrong=sum(int(not (a == 1).all()) for a in held))), flush=True)
"""

# argv: directory, a file to make when running, the job's done file. Takes
# every block that comes free (fallocate, 64 KiB at a time) until it appears.
THIEF = r"""
import os, sys, time
where, ready, done = sys.argv[1:4]
fd = os.open(os.path.join(where, "thief"), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
off, deadline = 0, time.monotonic() + 120
open(ready, "w").close()
while not os.path.exists(done) and time.monotonic() < deadline:
    try:
        os.posix_fallocate(fd, off, 65536)
        off += 65536
    except OSError:
        pass
print(off, flush=True)
"""


@pytest.mark.parametrize("cow_dir", ["xfs", "ext4"], indirect=True)
def test_zeros_of_a_reused_block_while_another_process_takes_blocks(cow_dir, write_policy,
                                                                   tmp_path):
    """np.zeros of a reused block of 32 MiB or more zeroes it in the file.
    XFS's FALLOC_FL_ZERO_RANGE frees the range's blocks, then allocates it
    again: a process taking every block that comes free got them in between,
    the range was left a hole in memory in use, and the write that followed
    was a SIGBUS (3 runs of 3 on XFS, Linux 6.18). The job must end with a signal in
    none, its zeros zero, its other arrays intact."""
    fs, d = cow_dir
    pol = spill_policy(write_policy, d, spill_from="1MiB", dirty="30s")
    filled, go, done = (str(tmp_path / n) for n in ("filled", "go", "done"))
    job = subprocess.Popen([sys.executable, "-c", ZEROS, d, filled, go, done],
                           env=dict(os.environ, DATAMEM_CONFIG=pol), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(filled):
        assert job.poll() is None and time.monotonic() < deadline, \
            ("the job did not fill the disk", job.poll(), job.stderr.read()[-2000:]
             if job.poll() is not None else "")
        time.sleep(0.02)
    thief = subprocess.Popen([sys.executable, "-c", THIEF, os.path.dirname(d), go, done],
                             stdout=subprocess.PIPE, text=True)
    out, err = job.communicate(timeout=300)
    if not os.path.exists(done):          # the job died: stop the thief
        open(done, "w").close()
    stolen = int(thief.communicate(timeout=300)[0].strip() or 0)
    # -7: SIGBUS, a write where the zero range had lost the blocks
    assert job.returncode == 0, (fs, job.returncode, err[-3000:])
    r = json.loads(out.strip().splitlines()[-1])
    assert r["nonzero"] == 0 and r["wrong"] == 0, (fs, r)
    assert r["ok"] >= 1 and stolen > 0, (fs, r, stolen)   # it ran, and blocks changed hands
