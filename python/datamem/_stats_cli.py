"""Client side of datamem's stats endpoint: find processes, scrape them, show a
live table, record snapshots and plot them. Used by `python -m datamem stats |
ls | top | record | plot`; imports nothing heavy (matplotlib only for plot).

A TARGET is a pid (looked up in the discovery directory), a URL
(http://127.0.0.1:PORT, with or without /metrics), host:port, or the path of
a Unix socket.
"""
import http.client
import json
import os
import socket
import stat
import sys
import time
import urllib.parse

_ENDPOINTS = ("/metrics", "/stats.json")


# ---- discovery -----------------------------------------------------------------

def stats_dir():
    """Where serving processes announce themselves ($DATAMEM_STATS_DIR or
    /tmp/datamem-<uid>); the C runtime uses the same rule."""
    return os.environ.get("DATAMEM_STATS_DIR") or "/tmp/datamem-%d" % os.getuid()


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
    start = _proc_start_time(int(entry.get("pid", 0)))
    return start is not None and start <= float(entry.get("started", 0)) + 2


def list_processes(prune=True):
    """Discovery entries of live processes, oldest first; files of dead ones are
    removed when `prune` (pool workers killed by SIGTERM cannot clean up)."""
    d = stats_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(".json") or not name[:-5].isdigit():
            continue
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue
        if _alive(entry):
            out.append(entry)
        elif prune:
            try:
                os.unlink(path)
            except OSError:
                pass
    return sorted(out, key=lambda e: (e.get("started", 0), e.get("pid", 0)))


# ---- scraping ----------------------------------------------------------------------

class TargetError(Exception):
    pass


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
        try:
            with open(os.path.join(stats_dir(), "%d.json" % pid)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            raise TargetError("process %d is not serving datamem stats (no %s/%d.json; see "
                              "`python -m datamem ls`)" % (pid, stats_dir(), pid))
        if entry.get("url"):
            return "http", _strip_endpoint(entry["url"])
        if entry.get("unix_socket"):
            return "unix", entry["unix_socket"]
        raise TargetError("process %d lists no endpoint" % pid)
    if t.startswith(("http://", "https://")):
        return "http", _strip_endpoint(t)
    try:
        if stat.S_ISSOCK(os.stat(t).st_mode):
            return "unix", t
    except OSError:
        pass
    if ":" in t and "/" not in t:
        return "http", "http://" + t
    raise TargetError("%r is not a pid, a URL, host:port or a Unix socket" % t)


def fetch(target, path="/metrics", timeout=5.0):
    """GETs `path` from TARGET; returns the body (bytes). Raises TargetError."""
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
            body = r.read()
        finally:
            conn.close()
    except OSError as e:
        raise TargetError("cannot reach %s: %s" % (where, e))
    if r.status != 200:
        raise TargetError("%s%s: HTTP %d" % (where, path, r.status))
    return body


def fetch_json(target, timeout=5.0):
    return json.loads(fetch(target, "/stats.json", timeout))


# ---- formatting ------------------------------------------------------------------------

def human_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024
    return "%.1f TiB" % n


def human_rate(n):
    n = float(n)
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return ("%.0f" % n) if unit == "" else ("%.1f%s" % (n, unit))
        n /= 1000
    return "%.1fG" % n


_COLUMNS = [  # header, key, formatter
    ("ALLOCATED", "allocated_bytes", human_bytes),
    ("ACTIVE", "active_bytes", human_bytes),
    ("RESIDENT", "resident_bytes", human_bytes),
    ("MAPPED", "mapped_bytes", human_bytes),
    ("RETAINED", "retained_bytes", human_bytes),
    ("DIRTY", "dirty_bytes", human_bytes),
    ("HUGE", "hugepage_bytes", human_bytes),
]
_RATES = [  # header, counter key, formatter
    ("ALLOC/s", "allocations", human_rate),
    ("FREE/s", "frees", human_rate),
    ("REQ/s", "bytes_requested", lambda v: human_bytes(v) + "/s"),
    ("FAIL/s", "failures", human_rate),
]


def table(cur, prev=None):
    """The per-arena table for snapshot `cur`; rates against `prev` (per second)."""
    dt = (cur.get("time", 0) - prev.get("time", 0)) if prev else 0
    head = ["ARENA"] + [c[0] for c in _COLUMNS] + [r[0] for r in _RATES]
    rows = []
    for name, a in sorted(cur.get("arenas", {}).items()):
        row = [name + ("" if a.get("in_policy", True) else "*")]
        row += [fmt(a.get(key, 0)) for _, key, fmt in _COLUMNS]
        pa = (prev or {}).get("arenas", {}).get(name)
        for _, key, fmt in _RATES:
            if pa is None or dt <= 0:
                row.append("-")
            else:
                row.append(fmt(max(0, a.get(key, 0) - pa.get(key, 0)) / dt))
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in [head] + rows]
    return "\n".join(lines)


def header(cur, target):
    when = time.strftime("%H:%M:%S", time.localtime(cur.get("time", time.time())))
    ok = "ok" if cur.get("last_reload_successful", True) else "LAST RELOAD FAILED"
    return ("datamem %s  pid %s  %s  policy %s (%s)  reloads %d/%d failed  threads %d  %s" % (
        cur.get("version", "?"), cur.get("pid", "?"), target, cur.get("policy_path") or "-",
        ok, cur.get("reloads", 0), cur.get("reload_failures", 0), cur.get("threads", 0), when))


# ---- commands --------------------------------------------------------------------------

def cmd_stats(target, as_json=False, out=sys.stdout):
    body = fetch(target, "/stats.json" if as_json else "/metrics")
    out.write(body.decode("utf-8", "replace"))
    return 0


def cmd_ls(as_json=False, out=sys.stdout):
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
        up = int(now - e.get("started", now))
        rows.append((str(e.get("pid")), e.get("url") or e.get("unix_socket") or "-",
                     "%dh%02dm" % (up // 3600, up // 60 % 60) if up >= 3600 else
                     "%dm%02ds" % (up // 60, up % 60),
                     (e.get("cmdline") or e.get("argv0") or "").replace("\n", " ")[:80]))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] + "\n")
    return 0


def cmd_top(target, interval=2.0, once=False, out=sys.stdout):
    where = resolve(target)
    label = where[1]
    prev = fetch_json(where)
    if once:  # two scrapes `interval` apart: the rates need a difference
        time.sleep(interval)
        cur = fetch_json(where)
        out.write(header(cur, label) + "\n" + table(cur, prev) + "\n")
        return 0
    tty = out.isatty()
    try:
        while True:
            time.sleep(interval)
            cur = fetch_json(where)
            text = header(cur, label) + "\n" + table(cur, prev) + "\n"
            out.write(("\x1b[H\x1b[2J" + text) if tty else (text + "\n"))
            out.flush()
            prev = cur
    except KeyboardInterrupt:
        return 0


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
    out.write("recorded %d snapshot(s) of %s to %s\n" % (n, where[1], path))
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
  top TARGET [--interval S] [--once]  live per-arena table, sizes and per-second rates
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
    s = sub.add_parser("top", help="live per-arena table")
    s.add_argument("target")
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
            return cmd_ls(a.json)
        if a.cmd == "top":
            return cmd_top(a.target, a.interval, a.once)
        if a.cmd == "record":
            return cmd_record(a.target, a.out, a.interval, a.count)
        return cmd_plot(a.snapshots, a.out)
    except TargetError as e:
        sys.stderr.write("datamem: %s\n" % e)
        return 1
