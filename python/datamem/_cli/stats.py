"""Client side of datamem's stats endpoint: find processes, scrape them, show a
live table, record snapshots and plot them. Used by `python -m datamem stats |
ls | top | record | plot`; imports nothing heavy (matplotlib only for plot).

A TARGET is a pid (looked up in the discovery directory), a URL
(http://127.0.0.1:PORT, with or without /metrics), host:port, or the path of
a Unix socket.

This module is the command glue (cmd_*, add, run); the work lives in
  _stats/discovery.py  the discovery directory: list_processes, registered
  _stats/client.py     scraping a TARGET: resolve, fetch, fetch_json, scrape_all
  _stats/tables.py     what `top` prints: table, top_text, header, table_all
  _stats/sd.py         `ls --prometheus-sd`: sd_targets, write_sd
  _stats/reload.py     `reload`: not_ours, datamem_pids, reload_pid, reload_all
  _stats/record.py     `record` and `plot`
"""
import json
import sys
import time

from .._stats.client import fetch, fetch_json, resolve, scrape_all
from .._stats.discovery import TargetError, list_processes, stats_dir
from .._stats.record import cmd_plot, cmd_record
from .._stats.sd import cmd_prometheus_sd
from .._stats.tables import header_all, spill_table, table, table_all, top_text
from .._text import printable


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


def cmd_top_all(interval=2.0, once=False, out=sys.stdout):
    prev = scrape_all()
    if not prev:
        out.write("no datamem process is serving stats (directory %s; start them with "
                  "DATAMEM_STATS_HTTP=127.0.0.1:0)\n" % stats_dir())
        return 0
    if once:
        time.sleep(interval)
        cur = scrape_all()
        out.write(top_all_text(cur, prev) + "\n")
        return 0
    return _loop(scrape_all, top_all_text, prev, interval, out)


def top_all_text(cur, prev):
    """What `top --all` prints for one round of scrapes."""
    ok = {pid: s for pid, s in cur.items() if not isinstance(s, Exception)}
    parts = [header_all(cur), table_all(cur, prev), spill_table(ok)]
    return "\n".join(p for p in parts if p)


# ---- the command protocol (_cli/__init__.py) ---------------------------------------------

NAMES = ("stats", "ls", "top", "record", "plot")

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


TARGET_HELP = "a pid, a URL, host:port, or a Unix socket path"


def add(sub):
    s = sub.add_parser("stats", help="scrape a process's stats")
    s.add_argument("target", help=TARGET_HELP)
    s.add_argument("--json", action="store_true", help="/stats.json instead of /metrics")
    s = sub.add_parser("ls", help="list processes serving stats")
    s.add_argument("--json", action="store_true", help="print JSON for tools")
    s.add_argument("--prometheus-sd", metavar="FILE",
                   help="keep FILE a Prometheus file_sd target list of these processes")
    s.add_argument("--interval", type=float, default=5.0,
                   help="with --prometheus-sd: seconds between checks")
    s.add_argument("--once", action="store_true", help="with --prometheus-sd: write and exit")
    s = sub.add_parser("top", help="live per-arena table")
    s.add_argument("target", nargs="?", help=TARGET_HELP + " (or --all)")
    s.add_argument("--all", action="store_true", help="every process serving stats")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    s.add_argument("--once", action="store_true", help="one table (two scrapes) and exit")
    s = sub.add_parser("record", help="record /stats.json snapshots (JSON lines)")
    s.add_argument("target", help=TARGET_HELP)
    s.add_argument("--out", required=True, metavar="F.jsonl",
                   help="the file the snapshots are appended to, one JSON line each")
    s.add_argument("--interval", type=float, default=1.0,
                   help="seconds between snapshots (default 1)")
    s.add_argument("--count", type=int, default=0, help="snapshots to take (0: until ^C)")
    s = sub.add_parser("plot", help="plot recorded snapshots to a PNG")
    s.add_argument("snapshots", help="a file record --out wrote")
    s.add_argument("--out", default="arenas.png",
                   help="the PNG to write (default arenas.png)")


def run(a, p):
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
    except OSError as e:  # an output file the rules refuse (record, plot), or cannot write
        sys.stderr.write("datamem: %s\n" % printable(str(e)))
        return 1
