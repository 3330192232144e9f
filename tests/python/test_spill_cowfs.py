"""A full disk under a spill arena on the copy-on-write filesystems the docs
name for fork copies, btrfs and XFS (reflinks), each a 300 MiB image on a loop
device made by the test (XFS takes no less): a full disk is a MemoryError at an
allocation, never a SIGBUS at a page fault, in a process and in a fork child
and its parent, and the data is right wherever an allocation succeeded.

What failed before: the fork copy was a reflink (copy_file_range), so parent
and child shared every spilled block, and the first rewrite of one needed a
fresh block that no fallocate had reserved: SIGBUS on both filesystems once the
disk filled. And btrfs copies a block on every write, so a full btrfs SIGBUSed
on a plain rewrite of a page already written back, fork or not.

What still fails, so the fills stop at MARGIN free: on a filesystem with large
page-cache folios (XFS here, Linux 6.18) a write fault reserves blocks for the
whole folio, up to 2 MiB, past the end of the range datamem reserved into the
unreserved rest of the file; an allocation that took the last free blocks
SIGBUSed writing its last pages (docs/operations.md, "A full disk is a
MemoryError"). Past MARGIN, one allocation larger than what is left shows
the refusal itself: a MemoryError."""
import array
import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

IMAGE = 300 << 20   # mkfs.xfs 6.1: "Filesystem must be larger than 300MB" below this
FILESYSTEMS = ("btrfs", "xfs")
PACKAGE = {"btrfs": "btrfs-progs", "xfs": "xfsprogs"}


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
    mkfs = ["mkfs.btrfs", "-q", "-f", str(img)] if fs == "btrfs" else \
        ["mkfs.xfs", "-q", "-f", str(img)]
    subprocess.run(mkfs, check=True, capture_output=True, timeout=120)
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


def cow_policy(write_policy, spill_dir):
    return write_policy(textwrap.dedent("""\
        version: 1
        default: general
        arenas:
          general: {{}}
          disk: {{decay: {{dirty: 0}}, backing: {{dir: '{d}'}}}}
        rules:
          - {{name: big, match: {{size: {{min: 8MiB}}}}, arena: disk}}
        """).format(d=spill_dir))


# argv: mode, spill dir. Prints one JSON line per process ("who"). Every
# allocation is a 16 MiB array, in the file. The fills stop short of the brim,
# at MARGIN free (see the module docstring: a write fault at the end of a range
# reserved with the last free blocks can still SIGBUS on a filesystem with
# large folios); then one allocation larger than what is left must fail with a
# MemoryError, the only exception caught: anything else (a SIGBUS above all)
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
    out, err = run_job("full", fs, d, cow_policy(write_policy, d))
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
    out, err = run_job("fork-third", fs, d, cow_policy(write_policy, d))
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
    out, err = run_job("fork-full", fs, d, cow_policy(write_policy, d))
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
    out, err = run_job("full", fs, d, cow_policy(write_policy, d))
    p = out["parent"]
    assert p["held"] >= 8 and p["refused"] and p["wrong"] == [], (fs, p)
