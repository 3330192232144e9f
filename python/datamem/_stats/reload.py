"""SIGHUP reload (`python -m datamem reload PID | --all`): which processes are
this user's datamem processes, and signalling them through a pidfd.
"""
import errno
import os
import re
import stat
import sys

from .discovery import TargetError, _warn, list_processes, registered
from .._text import printable

# ---- every process on the host -------------------------------------------------------------

def _cmdline(pid):
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()


def _uids(pid):
    """Real, effective and saved uid of process `pid` (/proc/PID/status)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("Uid:"):
                return [int(x) for x in line.split()[1:4]]
    raise OSError("no Uid line")


_EXT = re.compile(r"_ext(\.[A-Za-z0-9_-]+)*\.so")


def _maps_datamem(pid):
    """True if process `pid` has a datamem install loaded: its maps hold both
    libdatamem_tls.so and the extension (_ext*.so) from one directory, and each
    is the very file (device and inode) now at that path, a regular file owned
    by this user or root and not writable by every user, in such a directory. A
    file that is merely named libdatamem_tls.so (anyone can make one and map it)
    is not enough. Group write is allowed here: an install made under
    umask 002 is still an install, and the uid check in not_ours() is what keeps
    other users' processes out."""
    files = {}
    with open("/proc/%d/maps" % pid) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5].rstrip("\n")
            base = os.path.basename(path)
            if base == "libdatamem_tls.so" or _EXT.fullmatch(base):
                major, minor = parts[3].split(":")
                files[path] = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
    trusted = (0, os.geteuid())
    for path in files:
        if os.path.basename(path) != "libdatamem_tls.so":
            continue
        d = os.path.dirname(path)
        exts = [p for p in files if os.path.dirname(p) == d and p != path]
        try:
            dst = os.lstat(d)
            ok = bool(exts) and stat.S_ISDIR(dst.st_mode) and dst.st_uid in trusted and \
                not dst.st_mode & stat.S_IWOTH
            for p in [path] + exts[:1]:
                st = os.lstat(p)
                ok = ok and stat.S_ISREG(st.st_mode) and st.st_uid in trusted and \
                    not st.st_mode & stat.S_IWOTH and \
                    (st.st_dev, st.st_ino) == files[p]
        except OSError:
            ok = False
        if ok:
            return True
    return False


def not_ours(pid, announced=None):
    """None if `pid` is one of this user's datamem processes (reload may signal
    it), else why not, in words. Ours: its real, effective and saved uid are
    this process's effective uid, and it either announced itself (a live
    discovery entry of this user's: processes serving stats) or has a datamem
    install loaded (_maps_datamem: the others, which register nowhere).
    `announced`: the pids with a live discovery entry, if known. Issue
    24: as root, `reload --all` signalled other users' processes that mapped a
    file named libdatamem_tls.so, and `reload PID` any process."""
    if pid == os.getpid():
        return "is this process"
    try:
        uids = _uids(pid)
        if any(u != os.geteuid() for u in uids):
            return "belongs to uid %d, not to this user (uid %d)" % (
                next(u for u in uids if u != os.geteuid()), os.geteuid())
        if announced is None:
            announced = {pid} if registered(pid) is not None else set()
        if pid in announced or _maps_datamem(pid):
            return None
    except (OSError, ValueError) as e:
        if isinstance(e, FileNotFoundError) or not os.path.exists("/proc/%d" % pid):
            return "does not exist"
        return "cannot be inspected (%s)" % (getattr(e, "strerror", None) or e)
    return "has no datamem loaded"


def datamem_pids(match=None):
    """Pids of this user's datamem processes (not_ours() is None), whether or not
    they serve stats; never this process. `match`: only those whose command
    line contains it."""
    me = os.getpid()
    try:
        announced = {e["pid"] for e in list_processes(prune=False)}
    except TargetError as e:
        _warn(str(e))
        announced = set()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            if os.stat("/proc/" + name).st_uid != os.geteuid():
                continue
            with open("/proc/%s/maps" % name) as f:
                if "/libdatamem_tls.so" not in f.read() and pid not in announced:
                    continue
            if not_ours(pid, announced) is None and (match is None or match in _cmdline(pid)):
                out.append(pid)
        except OSError:  # gone, or not ours to read
            continue
    return sorted(out)


def catches_sighup(pid):
    """True if process `pid` has a SIGHUP handler (SigCgt in /proc/PID/status)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & 1)
    return False


def _pidfd(pid):
    """A pidfd on `pid` (signals sent through it cannot reach a process that took
    over the pid after the checks), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except AttributeError:
        return None
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            return None
        raise


def _sighup(pid, pidfd):
    import signal
    if pidfd is None:
        os.kill(pid, signal.SIGHUP)
    else:
        signal.pidfd_send_signal(pidfd, signal.SIGHUP)


def _reload_one(pid, announced=None):
    """Checks and signals `pid`: (True, "") when SIGHUP was sent, else (False,
    why not)."""
    try:
        pidfd = _pidfd(pid)
    except OSError as e:
        return False, "no process %d (%s)" % (pid, e.strerror)
    try:
        why = not_ours(pid, announced)
        if why:
            return False, "process %d %s; not signalled (reload signals only this user's " \
                          "datamem processes)" % (pid, why)
        try:
            if not catches_sighup(pid):
                return False, "process %d does not handle SIGHUP; set `reload: {signal: " \
                              "true}` in its policy, or use the file watcher (`reload: " \
                              "{watch: true}`)" % pid
            _sighup(pid, pidfd)
        except (OSError, ValueError) as e:
            return False, "no process %d (%s)" % (pid, getattr(e, "strerror", None) or e)
        return True, ""
    finally:
        if pidfd is not None:
            os.close(pidfd)


def reload_pid(pid, out=sys.stdout, err=sys.stderr):
    """Asks process `pid` to reload its policy (SIGHUP), refusing a process that
    is not one of this user's datamem processes (not_ours) or has not opted in
    with `reload: {signal: true}` (SIGHUP would terminate it)."""
    ok, why = _reload_one(pid)
    if not ok:
        err.write("datamem: %s\n" % why)
        return 1
    out.write("sent SIGHUP to %d\n" % pid)
    return 0


def reload_all(match=None, out=sys.stdout, err=sys.stderr):
    """SIGHUP to every datamem process of this user (datamem_pids) that asked for
    it (`reload: {signal: true}`); the others are named and left alone (SIGHUP
    would end them). Exit status 0 only if every datamem process found was
    signalled."""
    pids = datamem_pids(match)
    if not pids:
        err.write("datamem: no process of this user has datamem loaded%s\n" %
                  (" with %r in its command line" % printable(match) if match else ""))
        return 1
    sent, skipped = [], []
    for pid in pids:
        ok, why = _reload_one(pid)  # checked again: the pid may have changed hands
        if ok:
            sent.append(pid)
        elif "does not handle SIGHUP" in why:
            skipped.append(pid)
    if sent:
        out.write("sent SIGHUP to %d process(es): %s\n" % (len(sent), " ".join(map(str, sent))))
    for pid in skipped:
        err.write("datamem: process %d does not handle SIGHUP (its policy has no "
                  "`reload: {signal: true}`); not signalled\n" % pid)
    return 0 if sent and not skipped else 1
