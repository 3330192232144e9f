"""Client side of datamem's stats endpoint: find processes, scrape them, show a
live table, record snapshots and plot them. Used by `python -m datamem stats |
ls | top | record | plot`; imports nothing heavy (matplotlib only for plot).

A TARGET is a pid (looked up in the discovery directory), a URL
(http://127.0.0.1:PORT, with or without /metrics), host:port, or the path of
a Unix socket.
"""
import errno
import http.client
import json
import math
import os
import re
import socket
import stat
import sys
import time
import urllib.parse

from . import _files
from ._text import printable

_ENDPOINTS = ("/metrics", "/stats.json")

# The most a reply from a target may hold (`top`, `stats`, `record`): /metrics of
# a process with every arena and rule is well under 1 MiB; an endless or huge
# reply is refused, not held (one grew the client to 3 GB: issue 24).
MAX_REPLY = 16 << 20
# A discovery file the C side writes is under 2 KiB.
_ENTRY_MAX = 64 << 10


class TargetError(Exception):
    """Bad input from a target or the discovery directory; its text is one line."""


# ---- what reaches the terminal ----------------------------------------------------------

# C0 and C1 controls, DEL, and the Unicode line separators and bidirectional
# overrides: a path, arena or thread name that holds them could move the cursor,
# retitle the terminal or hide text (issue 24).
_warned = set()


def _warn(text):
    """One line on stderr, once per distinct text (top and --prometheus-sd loop)."""
    if text not in _warned:
        _warned.add(text)
        sys.stderr.write("datamem: %s\n" % printable(text))
        sys.stderr.flush()


# ---- discovery -----------------------------------------------------------------

def stats_dir():
    """Where serving processes announce themselves ($DATAMEM_STATS_DIR or
    /tmp/datamem-<uid>); the C runtime uses the same rule."""
    return os.environ.get("DATAMEM_STATS_DIR") or "/tmp/datamem-%d" % os.getuid()


def _open_stats_dir():
    """An fd on the discovery directory, or None if there is none. Its rule is the
    C side's (service/export.c, stats_dir_ok) and _files.owned_dir's: a real
    directory, owned by this user, not writable by others; the C side does not
    announce a process in any other, so whatever is there is not ours (issue 24:
    fake targets reached root's file_sd output)."""
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
_ENTRY_FIELDS = (  # what service/export.c writes; all of it, with these types
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
    if entry["datamem"] != 1:  # the mark (DISCOVERY_MARK in service/export.c)
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
    own pid: the test service/export.c's prune applies (issue 24: `ls` deleted
    any <number>.json that parsed as JSON). Raises TargetError when the
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


# ---- scraping ----------------------------------------------------------------------

class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._unix_path)
        except OSError:
            s.close()
            raise
        self.sock = s


def _strip_endpoint(url):
    for e in _ENDPOINTS:
        if url.endswith(e):
            return url[: -len(e)]
    return url.rstrip("/")


def resolve(target):
    """("http", base URL) or ("unix", socket path) for a TARGET."""
    t = str(target)
    if t.isdigit():
        pid = int(t)
        entry = registered(pid, strict=True)
        if entry is None:
            raise TargetError("process %d is not serving datamem stats (no live entry %s/%d.json;"
                              " see `python -m datamem ls`)" % (pid, stats_dir(), pid))
        if entry["url"]:
            return "http", _strip_endpoint(entry["url"])
        return "unix", entry["unix_socket"]
    if t.startswith(("http://", "https://")):
        return "http", _strip_endpoint(t)
    try:
        if stat.S_ISSOCK(os.stat(t).st_mode):
            return "unix", t
    except (OSError, ValueError):
        pass
    if ":" in t and "/" not in t:
        return "http", "http://" + t
    raise TargetError("%r is not a pid, a URL, host:port or a Unix socket" % t)


class _Deadline:
    """read(n) of an HTTP response that fails once the whole reply has taken
    longer than `seconds` (a socket timeout bounds each read, not a trickle)."""

    def __init__(self, r, seconds):
        self.r, self.end = r, time.monotonic() + seconds

    def read(self, n):
        if time.monotonic() > self.end:
            raise socket.timeout("the reply took too long")
        return self.r.read(n)


def fetch(target, path="/metrics", timeout=5.0):
    """GETs `path` from TARGET; returns the body (bytes, at most MAX_REPLY; the
    whole reply within 4 x `timeout` seconds). Raises TargetError."""
    kind, where = target if isinstance(target, tuple) else resolve(target)
    try:
        if kind == "unix":
            conn = _UnixHTTPConnection(where, timeout)
        else:
            u = urllib.parse.urlsplit(where)
            conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            if r.status != 200:
                raise TargetError("%s%s: HTTP %d" % (where, path, r.status))
            body = _files.read_bounded(_Deadline(r, 4 * timeout), MAX_REPLY)
        finally:
            conn.close()
    except _files.TooLargeError:
        raise TargetError("%s%s: reply larger than %d MiB; not a datamem endpoint?"
                          % (where, path, MAX_REPLY >> 20))
    except (OSError, http.client.HTTPException, ValueError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TargetError("cannot reach %s: %s" % (where, text[:200]))
    return body


def _snapshot_problem(snap):
    """Why `snap` (parsed /stats.json) is not something `top` can show, or None."""
    if not isinstance(snap, dict):
        return "not a JSON object"
    for key in ("time", "reloads", "reload_failures", "threads") + _PROCESS_NUMBERS:
        if key in snap and not _is_number(snap[key]):
            return "%r is not a number" % key
    if not 0 <= snap.get("time", 0) < 1e11:
        return "'time' out of range"
    arenas = snap.get("arenas", {})
    if not isinstance(arenas, dict):
        return "'arenas' is not an object"
    for name, a in arenas.items():
        if not isinstance(a, dict):
            return "arena %r is not an object" % name
        for key in _ARENA_NUMBERS:
            if a.get(key) is not None and not _is_number(a[key]):  # limit_bytes: null
                return "arena %r: %r is not a number" % (name, key)
    return None


def fetch_json(target, timeout=5.0):
    """/stats.json of TARGET, checked to have the shape `top` reads. Raises
    TargetError (one line) for a reply that is not JSON or not that shape."""
    where = target if isinstance(target, tuple) else resolve(target)
    body = fetch(where, "/stats.json", timeout)
    try:
        snap = json.loads(body)
    except (ValueError, RecursionError):
        raise TargetError("%s/stats.json: the reply is not JSON" % where[1])
    problem = _snapshot_problem(snap)
    if problem:
        raise TargetError("%s/stats.json: not a datamem snapshot (%s)" % (where[1], problem))
    return snap


# ---- formatting ------------------------------------------------------------------------

WIDTH = 80  # every line `top` prints fits a classic terminal (issue #11)


def human_bytes(n):
    """1536 -> "1.5 KiB" (the long form, for messages)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024
    return "%.1f TiB" % n


def short_bytes(n):
    """1536 -> "1.5KiB": at most 9 characters up to 1023.9 TiB (table cells)."""
    return human_bytes(n).replace(" ", "")


def human_rate(n):
    n = float(n)
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return ("%.0f" % n) if unit == "" else ("%.1f%s" % (n, unit))
        n /= 1000
    return "%.1fG" % n


# Columns of `top PID`; to fit 80 columns it leaves out mapped, retained and muzzy
# bytes, frees and requested bytes per second (all in `stats` and /metrics).
_COLUMNS = [  # header, key, formatter
    ("ALLOCATED", "allocated_bytes", short_bytes),
    ("ACTIVE", "active_bytes", short_bytes),
    ("RESIDENT", "resident_bytes", short_bytes),
    ("DIRTY", "dirty_bytes", short_bytes),
    ("HUGE", "hugepage_bytes", short_bytes),
]
_RATES = [  # header, counter key, formatter
    ("ALLOC/s", "allocations", human_rate),
    ("FAIL/s", "failures", human_rate),
]
# Numbers read from each arena of a snapshot (checked by fetch_json).
_ARENA_NUMBERS = [c[1] for c in _COLUMNS + _RATES] + ["limit_bytes", "live_bytes"]
# The process around the arenas, under the table (memory_line).
_PROCESS_NUMBERS = ("process_resident_bytes", "outside_arenas_resident_bytes",
                    "pyarrow_allocated_bytes")
# `top --all` adds a PID column and so drops ACTIVE as well.
_ALL_COLUMNS = [c for c in _COLUMNS if c[0] != "ACTIVE"]
# When an arena has a `limit`, LIMIT (live bytes as a share of it; "-" for
# arenas without one) takes ACTIVE's place.
_LIMIT_COLUMN = ("LIMIT", None, None)


def _limit_cell(a):
    limit = a.get("limit_bytes")
    if not limit:
        return "-"
    return "%d%%" % min(999, round(100.0 * a.get("live_bytes", 0) / limit))


def _with_limit(columns, arenas):
    if not any(a.get("limit_bytes") for a in arenas):
        return columns
    cols = [c for c in columns if c[0] != "ACTIVE"]
    return cols[:1] + [_LIMIT_COLUMN] + cols[1:]


def fit(text, width):
    """`text` cut to `width` characters, marking the cut with "~"."""
    return text if len(text) <= width else text[:max(0, width - 1)] + "~"


def fit_left(text, width):
    """`text` cut to `width` characters from the left (paths: keep the file name)."""
    return text if len(text) <= width else "~" + text[len(text) - width + 1:]


def render(head, rows, flex=0, lead=1, width=WIDTH):
    """Aligns `rows` under `head` in at most `width` columns: the first `lead`
    columns are left-aligned text joined by two spaces, the numbers after them
    right-aligned and joined by one (a number never splits). Column `flex` (text)
    is cut with "~" when the line would be too long. Control characters in a
    cell are escaped (printable())."""
    rows = [[printable(c) for c in r] for r in rows]
    n = len(head)
    widths = [max(len(r[i]) for r in [head] + rows if i < len(r)) for i in range(n)]
    total = sum(widths) + 2 * lead + (n - lead - 1)
    if total > width:
        widths[flex] = max(3, widths[flex] - (total - width))
    out = []
    for r in [head] + rows:
        cells = []
        for i, c in enumerate(r):
            if i < lead:
                c = fit(c, widths[i])
                cells.append(c if i == len(r) - 1 else c.ljust(widths[i]))
            else:
                cells.append(c.rjust(widths[i]))
        line = "  ".join(cells[:lead])
        if len(cells) > lead:
            line += "  " + " ".join(cells[lead:])
        out.append(line.rstrip())
    return out


def _arena_cells(a, pa, dt, columns):
    row = [_limit_cell(a) if key is None else fmt(a.get(key, 0)) for _, key, fmt in columns]
    for _, key, fmt in _RATES:
        if pa is None or dt <= 0:
            row.append("-")
        else:
            row.append(fmt(max(0, a.get(key, 0) - pa.get(key, 0)) / dt))
    return row


def table(cur, prev=None, width=WIDTH):
    """The per-arena table for snapshot `cur`; rates against `prev` (per second)."""
    dt = (cur.get("time", 0) - prev.get("time", 0)) if prev else 0
    columns = _with_limit(_COLUMNS, cur.get("arenas", {}).values())
    head = ["ARENA"] + [c[0] for c in columns] + [r[0] for r in _RATES]
    rows = []
    for name, a in sorted(cur.get("arenas", {}).items()):
        pa = (prev or {}).get("arenas", {}).get(name)
        rows.append([name + ("" if a.get("in_policy", True) else "*")]
                    + _arena_cells(a, pa, dt, columns))
    return "\n".join(render(head, rows, width=width))


def memory_line(cur, width=WIDTH):
    """The process around the arenas: its resident set, what the arenas hold of it
    (their resident bytes and share), the rest, and pyarrow's pool while pyarrow
    is loaded; "" when the endpoint does not report them
    (docs/what-a-policy-governs.md)."""
    rss = cur.get("process_resident_bytes")
    if not rss:
        return ""
    arenas = sum(a.get("resident_bytes") or 0 for a in cur.get("arenas", {}).values())
    text = "process %s  arenas %s (%d%%)  outside %s" % (
        short_bytes(rss), short_bytes(arenas), min(100, round(100.0 * arenas / rss)),
        short_bytes(cur.get("outside_arenas_resident_bytes") or 0))
    if cur.get("pyarrow_allocated_bytes") is not None:
        text += "  pyarrow %s" % short_bytes(cur["pyarrow_allocated_bytes"])
    return fit(text, width)


def top_text(cur, prev, target, width=WIDTH):
    """What `top TARGET` prints for one snapshot."""
    text = header(cur, target, width) + "\n" + table(cur, prev, width)
    mem = memory_line(cur, width)
    return text + "\n" + mem if mem else text


def reload_label(cur):
    """Plain words for the reload counters: "loads 3 ok, 1 failed" (issue #11: the
    old "reloads 3/1 failed" read as a fraction)."""
    text = "loads %d ok, %d failed" % (cur.get("reloads", 0), cur.get("reload_failures", 0))
    if not cur.get("last_reload_successful", True):
        text += " (LAST RELOAD FAILED)"
    return text


def header(cur, target, width=WIDTH):
    """Who and when; then the policy, its loads and the threads (on a third line
    when they would leave the policy's path less than 24 columns)."""
    when = time.strftime("%H:%M:%S", time.localtime(cur.get("time", time.time())))
    # Everything from the target is escaped and cut: a version or pid string
    # cannot push the line past `width` or hold a "%".
    first = "datamem %s  pid %s  " % (fit(printable(cur.get("version", "?")), 16),
                                      fit(printable(cur.get("pid", "?")), 10))
    first += fit_left(printable(target), width - len(first) - len(when) - 2) + "  " + when
    tail = "%s  threads %d" % (reload_label(cur), cur.get("threads", 0))
    path = printable(cur.get("policy_path") or "-")
    room = width - len("policy ") - len(tail) - 2
    if room >= min(24, len(path)):
        return first + "\n" + "policy " + fit_left(path, room) + "  " + tail
    return "\n".join((first, "policy " + fit_left(path, width - len("policy ")),
                      fit(tail, width)))


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
    is not enough (issue 24). Group write is allowed here: an install made under
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


def sd_targets(procs):
    """Prometheus file_sd groups for discovery entries: one target per process
    serving HTTP (Prometheus cannot scrape a Unix socket), labelled with its pid
    and program, so that one scrape config covers workers that come and go."""
    groups = []
    for e in procs:
        u = urllib.parse.urlsplit(e.get("url") or "")
        if not u.hostname or not u.port:
            continue
        labels = {"pid": str(e.get("pid")), "datamem_version": str(e.get("version", ""))}
        argv0 = os.path.basename(str(e.get("argv0") or ""))
        if argv0:
            labels["program"] = argv0
        if u.path and u.path not in ("/", "/metrics"):
            labels["__metrics_path__"] = u.path
        groups.append({"targets": ["%s:%d" % (u.hostname, u.port)], "labels": labels})
    return groups


def write_sd(path, groups):
    """Writes `groups` to `path` through a temporary file renamed over it, so
    Prometheus never reads half a file. The temporary file's name is
    unpredictable and created with O_EXCL|O_NOFOLLOW (_files.write_atomic):
    issue 24, a symbolic link planted at "FILE.tmp.<pid>" made a root `ls
    --prometheus-sd` overwrite any file. Returns the text written."""
    text = json.dumps(groups, indent=2, sort_keys=True) + "\n"
    _files.write_atomic(path, text, mode=0o644)
    return text


# ---- commands --------------------------------------------------------------------------

def cmd_stats(target, as_json=False, out=sys.stdout):
    body = fetch(target, "/stats.json" if as_json else "/metrics")
    # Valid Prometheus text and JSON hold no control characters but newlines
    # and tabs; anything else a target sends is escaped, not run by the terminal.
    out.write(printable(body.decode("utf-8", "replace"), keep="\n\t"))
    return 0


def cmd_ls(as_json=False, sd_file=None, interval=5.0, once=False, out=sys.stdout):
    if sd_file:
        return cmd_prometheus_sd(sd_file, interval, once, out)
    procs = list_processes()
    if as_json:
        out.write(json.dumps(procs, indent=2) + "\n")
        return 0
    if not procs:
        out.write("no datamem process is serving stats (directory %s)\n" % stats_dir())
        return 0
    now = time.time()
    rows = [("PID", "ENDPOINT", "UP", "COMMAND")]
    for e in procs:
        up = max(0, int(now - e["started"]))
        rows.append((str(e["pid"]), printable(e["url"] or e["unix_socket"]),
                     "%dh%02dm" % (up // 3600, up // 60 % 60) if up >= 3600 else
                     "%dm%02ds" % (up // 60, up % 60),
                     printable((e["cmdline"] or e["argv0"]).replace("\n", " ")[:80])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] + "\n")
    return 0


def cmd_prometheus_sd(path, interval=5.0, once=False, out=sys.stderr):
    """Keeps `path` a Prometheus file_sd list of every datamem process serving
    HTTP on this host: rewritten (atomically) whenever the set changes, checked
    every `interval` seconds until ^C or SIGTERM; `once`: write and exit."""
    import signal
    stop = []
    if not once and threading_main():
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    last = None
    try:
        while True:
            groups = sd_targets(list_processes())
            if groups != last:
                try:
                    write_sd(path, groups)
                except OSError as e:
                    raise TargetError("cannot write %s: %s" % (path, e.strerror or e))
                out.write("%s: %d target(s)\n" % (path, len(groups)))
                out.flush()
                last = groups
            if once or stop:
                return 0
            time.sleep(interval)
            if stop:
                return 0
    except KeyboardInterrupt:
        return 0


def threading_main():
    import threading
    return threading.current_thread() is threading.main_thread()


def cmd_top(target, interval=2.0, once=False, out=sys.stdout):
    where = resolve(target)
    label = where[1]
    prev = fetch_json(where)
    if once:  # two scrapes `interval` apart: the rates need a difference
        time.sleep(interval)
        cur = fetch_json(where)
        out.write(top_text(cur, prev, label) + "\n")
        return 0
    return _loop(lambda: fetch_json(where), lambda cur, prev: top_text(cur, prev, label),
                 prev, interval, out)


def _loop(scrape, show, prev, interval, out):
    tty = out.isatty()
    try:
        while True:
            time.sleep(interval)
            cur = scrape()
            text = show(cur, prev) + "\n"
            out.write(("\x1b[H\x1b[2J" + text) if tty else (text + "\n"))
            out.flush()
            prev = cur
    except KeyboardInterrupt:
        return 0


def scrape_all(timeout=2.0):
    """{pid: snapshot or TargetError} for every process serving stats."""
    snaps = {}
    for e in list_processes():
        pid = int(e.get("pid", 0))
        if e.get("url"):
            where = ("http", _strip_endpoint(e["url"]))
        elif e.get("unix_socket"):
            where = ("unix", e["unix_socket"])
        else:
            continue
        try:
            snaps[pid] = fetch_json(where, timeout)
        except (TargetError, ValueError) as err:
            snaps[pid] = TargetError(str(err))
    return snaps


def table_all(cur, prev=None, width=WIDTH):
    """Every process in one table: per process its total and its arenas, then
    each arena summed over processes and the grand total. `cur`, `prev`:
    scrape_all() results."""
    prev = prev or {}
    head = ["PID", "ARENA"] + [c[0] for c in _ALL_COLUMNS] + [r[0] for r in _RATES]
    rows, per_arena, per_arena_prev = [], {}, {}
    grand, grand_prev, dt_all = {}, {}, []
    keys = [k for _, k, _ in _ALL_COLUMNS] + [k for _, k, _ in _RATES]

    def add(dst, a):
        for k in keys:
            dst[k] = dst.get(k, 0) + a.get(k, 0)

    ok = {pid: s for pid, s in cur.items() if not isinstance(s, Exception)}
    for pid in sorted(cur):
        snap = cur[pid]
        if isinstance(snap, Exception):
            rows.append([str(pid), fit("unreachable: %s" % snap, width - 10)])
            continue
        p = prev.get(pid) if not isinstance(prev.get(pid), Exception) else None
        dt = (snap.get("time", 0) - p.get("time", 0)) if p else 0
        if dt > 0:
            dt_all.append(dt)
        tot, tot_prev = {}, {}
        arena_rows = []
        for name, a in sorted(snap.get("arenas", {}).items()):
            pa = (p or {}).get("arenas", {}).get(name)
            add(tot, a)
            add(per_arena.setdefault(name, {}), a)
            if pa is not None:
                add(tot_prev, pa)
                add(per_arena_prev.setdefault(name, {}), pa)
            arena_rows.append(["", " " + name + ("" if a.get("in_policy", True) else "*")]
                              + _arena_cells(a, pa, dt, _ALL_COLUMNS))
        add(grand, tot)
        add(grand_prev, tot_prev)
        state = "" if snap.get("last_reload_successful", True) else " RELOAD FAILED"
        rows.append([str(pid), "all" + state] + _arena_cells(tot, tot_prev if p else None, dt,
                                                            _ALL_COLUMNS))
        rows += arena_rows
    if ok:
        dt = sum(dt_all) / len(dt_all) if dt_all else 0
        for i, name in enumerate(sorted(per_arena)):  # each arena over all processes
            rows.append(["" if i else "TOTAL", " " + name]
                        + _arena_cells(per_arena[name], per_arena_prev.get(name), dt,
                                       _ALL_COLUMNS))
        rows.append(["TOTAL", "all (%d processes)" % len(ok)]
                    + _arena_cells(grand, grand_prev if dt_all else None, dt, _ALL_COLUMNS))
    return "\n".join(render(head, rows, flex=1, lead=2, width=width))


def header_all(cur, width=WIDTH):
    when = time.strftime("%H:%M:%S")
    bad = sum(1 for s in cur.values() if isinstance(s, Exception))
    failed = sum(1 for s in cur.values()
                 if not isinstance(s, Exception) and not s.get("last_reload_successful", True))
    text = "datamem top --all  %d process(es) serving stats%s%s  %s" % (
        len(cur), ", %d unreachable" % bad if bad else "",
        ", %d with a failed reload" % failed if failed else "", when)
    return fit(text, width)


def cmd_top_all(interval=2.0, once=False, out=sys.stdout):
    prev = scrape_all()
    if not prev:
        out.write("no datamem process is serving stats (directory %s; start them with "
                  "DATAMEM_STATS_HTTP=127.0.0.1:0)\n" % stats_dir())
        return 0
    if once:
        time.sleep(interval)
        cur = scrape_all()
        out.write(header_all(cur) + "\n" + table_all(cur, prev) + "\n")
        return 0
    return _loop(scrape_all, lambda cur, prev: header_all(cur) + "\n" + table_all(cur, prev),
                 prev, interval, out)


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


def cmd_record(target, path, interval=1.0, count=0, out=sys.stderr):
    where = resolve(target)
    n = 0
    with open(path, "a") as f:
        try:
            while count <= 0 or n < count:
                if n:
                    time.sleep(interval)
                snap = fetch_json(where)
                f.write(json.dumps(snap, separators=(",", ":")) + "\n")
                f.flush()
                n += 1
        except KeyboardInterrupt:
            pass
    out.write("recorded %d snapshot(s) of %s to %s\n" % (n, printable(where[1]), path))
    return 0


def load_snapshots(path):
    snaps = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                snaps.append(json.loads(line))
    return snaps


def cmd_plot(path, out_png, out=sys.stderr):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out.write("datamem plot needs matplotlib: python3 -m pip install matplotlib\n")
        return 1
    snaps = load_snapshots(path)
    if not snaps:
        out.write("%s: no snapshots\n" % path)
        return 1
    t0 = snaps[0].get("time", 0)
    arenas = sorted({name for s in snaps for name in s.get("arenas", {})})
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for ax, key, title in ((axes[0], "resident_bytes", "resident"),
                           (axes[1], "allocated_bytes", "allocated")):
        for name in arenas:
            pts = [(s.get("time", 0) - t0, s["arenas"][name].get(key, 0) / 2**20)
                   for s in snaps if name in s.get("arenas", {})]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None,
                    label=name)
        ax.set_ylabel("%s (MiB)" % title)
        ax.set_title("per-arena %s bytes" % title)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    axes[1].set_xlabel("seconds since the first snapshot")
    s0 = snaps[0]
    fig.suptitle("datamem pid %s, %s" % (s0.get("pid", "?"), s0.get("policy_path") or "no policy"))
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    out.write("wrote %s (%d snapshots, %d arenas)\n" % (out_png, len(snaps), len(arenas)))
    return 0


# ---- argparse (wired into python -m datamem) ---------------------------------------------

COMMANDS = ("stats", "ls", "top", "record", "plot")

USAGE = """\
  stats TARGET [--json]               scrape a process: Prometheus text, or /stats.json
  ls [--json]                         processes serving stats (the discovery directory)
  ls --prometheus-sd FILE [--interval S] [--once]
                                      keep FILE a Prometheus file_sd list of them
  top TARGET [--interval S] [--once]  live per-arena table, sizes and per-second rates
  top --all [--interval S] [--once]   every process serving stats in one table, totals
  record TARGET --out F.jsonl [--interval S] [--count N]
                                      append /stats.json snapshots, one JSON line each
  plot F.jsonl --out arenas.png       per-arena resident/allocated bytes over time
  (TARGET: a pid, a URL, host:port, or a Unix socket path)
"""


def add_commands(sub):
    s = sub.add_parser("stats", help="scrape a process's stats")
    s.add_argument("target")
    s.add_argument("--json", action="store_true", help="/stats.json instead of /metrics")
    s = sub.add_parser("ls", help="list processes serving stats")
    s.add_argument("--json", action="store_true")
    s.add_argument("--prometheus-sd", metavar="FILE",
                   help="keep FILE a Prometheus file_sd target list of these processes")
    s.add_argument("--interval", type=float, default=5.0,
                   help="with --prometheus-sd: seconds between checks")
    s.add_argument("--once", action="store_true", help="with --prometheus-sd: write and exit")
    s = sub.add_parser("top", help="live per-arena table")
    s.add_argument("target", nargs="?")
    s.add_argument("--all", action="store_true", help="every process serving stats")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    s.add_argument("--once", action="store_true", help="one table (two scrapes) and exit")
    s = sub.add_parser("record", help="record /stats.json snapshots (JSON lines)")
    s.add_argument("target")
    s.add_argument("--out", required=True)
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--count", type=int, default=0, help="snapshots to take (0: until ^C)")
    s = sub.add_parser("plot", help="plot recorded snapshots to a PNG")
    s.add_argument("snapshots")
    s.add_argument("--out", default="arenas.png")


def run(a):
    try:
        if a.cmd == "stats":
            return cmd_stats(a.target, a.json)
        if a.cmd == "ls":
            return cmd_ls(a.json, a.prometheus_sd, a.interval, a.once)
        if a.cmd == "top":
            if a.all == (a.target is not None):
                sys.stderr.write("datamem: top needs a TARGET or --all (not both)\n")
                return 2
            if a.all:
                return cmd_top_all(a.interval, a.once)
            return cmd_top(a.target, a.interval, a.once)
        if a.cmd == "record":
            return cmd_record(a.target, a.out, a.interval, a.count)
        return cmd_plot(a.snapshots, a.out)
    except TargetError as e:
        sys.stderr.write("datamem: %s\n" % printable(e))
        return 1
