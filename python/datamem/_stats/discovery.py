"""Finding the processes that serve datamem stats: the discovery directory
(one <pid>.json per serving process, written by service/discovery.c), its entries
checked, and dead processes' entries pruned. Used by the stats commands
(_cli/stats.py) and by reload (_stats/reload.py).
"""
import json
import math
import os
import re
import sys
import urllib.parse

from .. import _files
from .._text import printable

# A discovery file the C side writes is under 2 KiB.
_ENTRY_MAX = 64 << 10


class TargetError(Exception):
    """Bad input from a target or the discovery directory; its text is one line."""


# ---- what reaches the terminal ----------------------------------------------------------

# C0 and C1 controls, DEL, and the Unicode line separators and bidirectional
# overrides: a path, arena or thread name that holds them could move the cursor,
# retitle the terminal or hide text.
_warned = set()


def _warn(text):
    """One line on stderr, once per distinct text (top and --prometheus-sd loop)."""
    if text not in _warned:
        _warned.add(text)
        sys.stderr.write("datamem: %s\n" % printable(text))
        sys.stderr.flush()


# ---- discovery -----------------------------------------------------------------

def stats_dir():
    """Where serving processes announce themselves ($DATAMEM_STATS_DIR if set and
    not empty, else /tmp/datamem-<uid>). The C side writes the same rule
    (service/discovery.c, dm__discovery_dir). It stays written twice: asking C
    would take a new wrapper in pyext/ for a one-line rule and tie this
    pure-Python module to the extension;
    tests/python/stats/test_stats_export.py::test_stats_dir_rule_is_the_c_sides pins
    the two equal in every branch instead."""
    return os.environ.get("DATAMEM_STATS_DIR") or "/tmp/datamem-%d" % os.getuid()


def _open_stats_dir():
    """An fd on the discovery directory, or None if there is none. Its rule is the
    C side's (service/discovery.c, stats_dir_open: files.h's dm__files_dir_open_owned)
    and _files.owned_dir's: a real directory, owned by this user, not writable by
    others; the C side does not announce a process in any other, so whatever is
    there is not ours (another user's fake targets would reach root's file_sd
    output)."""
    d = stats_dir()
    try:
        return _files.owned_dir(d)
    except FileNotFoundError:
        return None
    except _files.UnsafeError as e:
        raise TargetError("discovery directory refused: %s; set DATAMEM_STATS_DIR" % e)
    except OSError as e:
        raise TargetError("cannot open the discovery directory %s: %s" % (d, e.strerror))


_NUMBER = (int, float)
_ENTRY_FIELDS = (  # what service/discovery.c writes; all of it, with these types
    ("datamem", int), ("pid", int), ("url", (str, type(None))), ("unix_socket", (str, type(None))),
    ("argv0", str), ("cmdline", str), ("started", _NUMBER), ("version", str))
_ENTRY_NAME = re.compile(r"([1-9][0-9]{0,9})\.json")


def _is_number(v):
    if isinstance(v, bool) or not isinstance(v, _NUMBER):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _entry_problem(entry, pid):
    """Why `entry` (parsed JSON of <pid>.json) is not a discovery entry the C side
    wrote, or None."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    for key, types in _ENTRY_FIELDS:
        if key not in entry:
            return "no %r" % key
        v = entry[key]
        if isinstance(v, bool) or not isinstance(v, types):
            return "%r is a %s" % (key, type(v).__name__)
    if entry["datamem"] != 1:  # the mark (DISCOVERY_MARK in service/discovery.c)
        return "'datamem' is not 1"
    if entry["pid"] != pid:
        return "pid %d in %d.json" % (entry["pid"], pid)
    if not _is_number(entry["started"]):
        return "'started' is not a finite number"
    if not (entry["url"] or entry["unix_socket"]):
        return "no endpoint"
    if entry["url"]:
        try:
            u = urllib.parse.urlsplit(entry["url"])
            ok = u.scheme == "http" and u.hostname and u.port
        except ValueError:
            ok = False
        if not ok:
            return "'url' is not http://HOST:PORT/..."
    return None


def _read_entry(dir_fd, name, pid):
    """The discovery entry in file `name`, or None (absent; anything else is
    skipped with a warning, never a traceback)."""
    where = os.path.join(stats_dir(), name)
    try:
        data, _ = _files.read_owned(dir_fd, name, _ENTRY_MAX, what=where)
        entry = json.loads(data)
        problem = _entry_problem(entry, pid)
    except FileNotFoundError:
        return None
    except _files.UnsafeError as e:
        _warn("skipping %s" % e)
        return None
    except OSError as e:
        _warn("skipping %s: %s" % (where, e.strerror))
        return None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        problem = "not JSON"
    if problem:
        _warn("skipping %s: not a datamem discovery entry (%s)" % (where, problem))
        return None
    return entry


def _boot_time():
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return int(line.split()[1])
    return 0


def _proc_start_time(pid):
    """Unix time process `pid` started, or None if there is no such process."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _alive(entry):
    """The process is there and is the one that wrote the file (not a reused pid)."""
    start = _proc_start_time(entry["pid"])
    return start is not None and start <= entry["started"] + 2


def list_processes(prune=True):
    """Discovery entries of live processes, oldest first; files of dead ones are
    removed when `prune` (pool workers killed by SIGTERM cannot clean up). Only
    files the C side wrote are removed: <pid>.json, a regular file of this
    user's, holding a whole discovery entry with the mark ("datamem": 1) and its
    own pid: the test service/discovery.c's prune applies (any <number>.json that
    parses as JSON is not enough: it may be someone else's file). Raises TargetError when the
    directory is refused."""
    fd = _open_stats_dir()
    if fd is None:
        return []
    out = []
    try:
        for name in os.listdir(fd):
            m = _ENTRY_NAME.fullmatch(name)
            if not m:
                continue
            entry = _read_entry(fd, name, int(m.group(1)))
            if entry is None:
                continue
            if _alive(entry):
                out.append(entry)
            elif prune:
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
    finally:
        os.close(fd)
    return sorted(out, key=lambda e: (e["started"], e["pid"]))


def registered(pid, strict=False):
    """The discovery entry of live process `pid`, or None. `strict`: a refused
    directory raises TargetError (it is None otherwise)."""
    try:
        fd = _open_stats_dir()
    except TargetError:
        if strict:
            raise
        return None
    if fd is None:
        return None
    try:
        entry = _read_entry(fd, "%d.json" % pid, pid)
    finally:
        os.close(fd)
    return entry if entry is not None and _alive(entry) else None
