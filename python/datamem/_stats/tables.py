"""Terminal tables of stats snapshots (`top`, `top --all`): byte and rate
formats, column fitting, the per-arena table, the memory line and headers.
Pure functions of parsed /stats.json snapshots; no I/O.
"""
import time

from .._text import human_bytes, printable, short_bytes

# ---- formatting ------------------------------------------------------------------------

WIDTH = 80  # every line `top` prints fits a classic terminal


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
# A file-backed (spill) arena's figures, in a table of their own under the arena
# table (spill_table): only arenas with `backing` have them.
_SPILL_COLUMNS = [  # header, key, formatter ("-" for null: no bound)
    ("ON DISK", "backing_disk_bytes", short_bytes),
    ("DISK MAX", "backing_max", short_bytes),
    ("RESIDENT", "backing_resident_bytes", short_bytes),
    ("RES MAX", "backing_resident_max", short_bytes),
    ("PAGED OUT", "backing_paged_out_bytes", short_bytes),
    ("REFUSED", "backing_full", lambda n: "%d" % n),
]
# Numbers read from each arena of a snapshot (checked by fetch_json).
_ARENA_NUMBERS = ([c[1] for c in _COLUMNS + _RATES + _SPILL_COLUMNS]
                  + ["limit_bytes", "live_bytes"])
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


def _spill_cells(a):
    return [("-" if a.get(key) is None else fmt(a[key])) for _, key, fmt in _SPILL_COLUMNS]


def spill_table(snaps, width=WIDTH):
    """The file-backed (spill) arenas of `snaps` ({label: snapshot}; label None
    for `top TARGET`, a pid for `top --all`): per arena its bytes on disk (the
    bytes spilled), its pages in memory, their bounds, what the pager dropped and
    the reservations refused (a full disk or `backing.max`). "" when no arena is
    file-backed."""
    rows = []
    for label, snap in sorted(snaps.items(), key=lambda kv: str(kv[0])):
        for name, a in sorted(snap.get("arenas", {}).items()):
            if a.get("backed"):
                row = [name + ("" if a.get("in_policy", True) else "*")] + _spill_cells(a)
                rows.append(row if label is None else [str(label)] + row)
    if not rows:
        return ""
    lead = 1 if None in snaps else 2
    head = (["SPILL ARENA"] if lead == 1 else ["PID", "SPILL ARENA"]) + \
        [c[0] for c in _SPILL_COLUMNS]
    return "\n".join(render(head, rows, flex=lead - 1, lead=lead, width=width))


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


def budget_is_shared(tag_bytes):
    """Whether the worker limit of stats' `tag_bytes` is a share of a cgroup's
    limit, and so one budget for every process in that cgroup (its `beside`
    counts what the others hold)."""
    return (tag_bytes.get("worker_limit_source") or "").startswith("cgroup")


def budget_line(cur, width=WIDTH):
    """The worker limit (`worker_limit`): where it comes from, what counts
    against it (the arrays, and what is held beside them: with a share of a
    cgroup's limit, by every process in the group), the share used, the
    allocations past it that worker_spill served and those that failed; "" when no worker limit is set (docs/spill-and-limits.md, "What
    `worker_limit` counts")."""
    tb = cur.get("tag_bytes") or {}
    limit = tb.get("worker_limit")
    if not limit or limit >= 2 ** 64 - 1:
        return ""
    source = printable(tb.get("worker_limit_source") or "?")
    live, beside = tb.get("live") or 0, tb.get("worker_beside") or 0
    group = budget_is_shared(tb)
    text = "budget %s %s%s  arrays %s  beside %s  %d%%" % (
        short_bytes(limit), source, " group" if group else "", short_bytes(live),
        short_bytes(beside), round(100.0 * (live + beside) / limit))
    said_no, spilled = tb.get("worker_refused") or 0, tb.get("worker_spilled") or 0
    if said_no:
        text += "\n  past it: %d spilled (worker_spill), %d MemoryError" % (
            spilled, max(said_no - spilled, 0))
    return "\n".join(fit(line, width) for line in text.split("\n"))


def top_text(cur, prev, target, width=WIDTH):
    """What `top TARGET` prints for one snapshot."""
    parts = [header(cur, target, width), table(cur, prev, width),
             spill_table({None: cur}, width), memory_line(cur, width), budget_line(cur, width)]
    return "\n".join(p for p in parts if p)


def reload_label(cur):
    """Plain words for the reload counters: "loads 3 ok, 1 failed" (the
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
