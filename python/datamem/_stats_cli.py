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
    is cut with "~" when the line would be too long."""
    rows = [[str(c) for c in r] for r in rows]
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
    first = "datamem %s  pid %s  %%s  %s" % (cur.get("version", "?"), cur.get("pid", "?"), when)
    first = first % fit_left(str(target), width - len(first) + 2)
    tail = "%s  threads %d" % (reload_label(cur), cur.get("threads", 0))
    path = cur.get("policy_path") or "-"
    room = width - len("policy ") - len(tail) - 2
    if room >= min(24, len(path)):
        return first + "\n" + "policy " + fit_left(path, room) + "  " + tail
    return "\n".join((first, "policy " + fit_left(path, width - len("policy ")),
                      fit(tail, width)))


# ---- every process on the host -------------------------------------------------------------

def _cmdline(pid):
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()


def datamem_pids(match=None):
    """Pids of this user's processes that have datamem loaded (its extension's
    libdatamem_tls.so is in /proc/PID/maps), whether or not they serve stats;
    never this process. `match`: only those whose command line contains it."""
    me, uid = os.getpid(), os.getuid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if uid != 0 and os.stat("/proc/" + name).st_uid != uid:
                continue
            with open("/proc/%s/maps" % name) as f:
                if "/libdatamem_tls.so" not in f.read():
                    continue
            if match is None or match in _cmdline(int(name)):
                out.append(int(name))
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
    Prometheus never reads half a file. Returns the text written."""
    text = json.dumps(groups, indent=2, sort_keys=True) + "\n"
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return text


# ---- commands --------------------------------------------------------------------------

def cmd_stats(target, as_json=False, out=sys.stdout):
    body = fetch(target, "/stats.json" if as_json else "/metrics")
    out.write(body.decode("utf-8", "replace"))
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
        up = int(now - e.get("started", now))
        rows.append((str(e.get("pid")), e.get("url") or e.get("unix_socket") or "-",
                     "%dh%02dm" % (up // 3600, up // 60 % 60) if up >= 3600 else
                     "%dm%02ds" % (up // 60, up % 60),
                     (e.get("cmdline") or e.get("argv0") or "").replace("\n", " ")[:80]))
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
                write_sd(path, groups)
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
        out.write(header(cur, label) + "\n" + table(cur, prev) + "\n")
        return 0
    return _loop(lambda: fetch_json(where),
                 lambda cur, prev: header(cur, label) + "\n" + table(cur, prev),
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


def reload_all(match=None, out=sys.stdout, err=sys.stderr):
    """SIGHUP to every datamem process of this user that asked for it
    (`reload: {signal: true}`); the others are named and left alone (SIGHUP would
    end them). Exit status 0 only if every datamem process found was signalled."""
    import signal
    pids = datamem_pids(match)
    if not pids:
        err.write("datamem: no process of this user has datamem loaded%s\n" %
                  (" with %r in its command line" % match if match else ""))
        return 1
    sent, skipped = [], []
    for pid in pids:
        try:
            if catches_sighup(pid):
                os.kill(pid, signal.SIGHUP)
                sent.append(pid)
            else:
                skipped.append(pid)
        except (OSError, ValueError):
            continue  # exited meanwhile
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
        sys.stderr.write("datamem: %s\n" % e)
        return 1
