"""Scraping a TARGET's stats endpoint (HTTP or a Unix socket), bounded in size
and time, and checking that /stats.json has the shape `top` reads.

A TARGET is a pid (looked up in the discovery directory), a URL
(http://127.0.0.1:PORT, with or without /metrics), host:port, or the path of
a Unix socket.
"""
import http.client
import json
import os
import socket
import stat
import time
import urllib.parse

from .. import _files
from .discovery import TargetError, _is_number, list_processes, registered, stats_dir
from .tables import _ARENA_NUMBERS, _PROCESS_NUMBERS

_ENDPOINTS = ("/metrics", "/stats.json")


# The most a reply from a target may hold (`top`, `stats`, `record`): /metrics of
# a process with every arena and rule is well under 1 MiB; an endless or huge
# reply is refused, not held (an unbounded read once grew the client to 3 GB).
MAX_REPLY = 16 << 20


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
            if not os.path.exists("/proc/%d" % pid):
                raise TargetError("no process %d (see `python -m datamem ls` for those "
                                  "serving stats)" % pid)
            raise TargetError(
                "process %d is not serving datamem stats (no live entry %s/%d.json): start "
                "the job with DATAMEM_STATS_HTTP=127.0.0.1:0 in its environment, or give its "
                "policy `stats: {http: \"127.0.0.1:0\"}` (or `stats: {unix_socket: "
                "/run/user/UID/{pid}.sock}`; a running job picks that up on reload); "
                "`python -m datamem ls` lists the processes serving stats"
                % (pid, stats_dir(), pid))
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
