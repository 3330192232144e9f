"""`python -m datamem report DIR`: what a recorded profile says.

summarize(profile) computes everything once, as plain data (what --json
prints); text() and html() render it. Sampled profiles are estimates: every
count and byte figure is a sum of the records' weights (see read.py), so
"allocations" and "bytes" are estimates of all allocations, not of the samples.

Medians are by bytes (half of a site's bytes were in arrays at most this big,
or freed at most this soon): what matters for placement is where the bytes
are, not the many tiny arrays (a 0-d fill value) a line also makes.

Lifetime classes: short (freed within SHORT seconds: the temporaries of an
expression or a loop iteration), long (LONG seconds or more, or still live when
the process ended), medium in between.

Names in a profile (paths, thread names, call sites, tags, argv) come from the
profiled job: printable() shows their control characters as escapes in text
(a terminal would obey them), and html() escapes them too.
"""
import html as _html
import json
import math

import numpy as np

from .._text import human_bytes, printable
from .dmprof import LIFE_EDGES, LONG, SHORT, SIZE_EDGES
from .read import SITE_COLUMNS, is_library

# C0 and C1 controls (ESC, CR, NEL...), DEL, the line and paragraph separators
# (line breaks to YAML), bidirectional overrides, and lone surrogates (bytes that
# were not UTF-8: they cannot be written to a UTF-8 stream).
def fmt_size_edge(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return "%d %s" % (n // k, unit)
    return "%d B" % n


def fmt_time(s):
    if s != s:  # nan
        return "-"
    if s < 1e-3:
        return "%.0f us" % (s * 1e6)
    if s < 1:
        return "%.1f ms" % (s * 1e3)
    return "%.2f s" % s


def fmt_count(n):
    return "{:,}".format(int(round(n)))


def _group(sums, names):
    """Rows (allocations, bytes) per label -> [{name, allocations, bytes}] by bytes."""
    out = []
    for i in np.argsort(-sums[:, 1], kind="stable"):
        if sums[i, 0] > 0:
            out.append({"name": names[i], "allocations": float(sums[i, 0]),
                        "bytes": float(sums[i, 1])})
    return out


def _site_rows(p):
    """Rows of p.site_sums in site order, the unknown site (row 0) last."""
    return list(range(1, len(p.site_sums))) + [0]


def _site_dicts(p):
    """One dict per call site that allocated, in site order (unknown last)."""
    c = {name: i for i, name in enumerate(SITE_COLUMNS)}
    stacks = _site_stacks(p)
    sites = []
    for r in _site_rows(p):
        row = p.site_sums[r]
        if row[c["allocations"]] <= 0:
            continue
        i = r - 1
        site = p.sites[i] if i >= 0 else ("?", "?", "?", 0)
        sites.append({
            "site": p.site_label(i),
            "module": site[0], "function": site[1], "file": site[2], "line": site[3],
            "allocations": float(row[c["allocations"]]), "bytes": float(row[c["bytes"]]),
            "records": int(row[c["records"]]),
            "median_size": p.median_size.median(r),
            "max_size": float(row[c["max_size"]]),
            "median_lifetime": p.median_life.median(r),
            "short_bytes": float(row[c["short_bytes"]]),
            "long_bytes": float(row[c["long_bytes"]]),
            "live_at_end_bytes": float(row[c["live_at_end_bytes"]]),
            "threads": p.site_set("thread", i),
            "dtypes": p.site_set("dtype", i),
            "arenas": p.site_set("arena", i),
            "rules": p.site_set("rule", i),
            "stacks": stacks.get(i, []),
            "library": i >= 0 and is_library(site),
            "index": i,
        })
    return sites


STACKS_PER_SITE = 3  # stacks shown under each of the top call sites


def _site_stacks(p):
    """Per site index: its STACKS_PER_SITE stacks with most bytes, each
    {allocations, bytes, frames: [{name, function, file, line, library}]},
    frames outermost first (the site is the innermost frame of the user's code
    in them: Profile.user_sites)."""
    by_site = {}
    for k, frames in enumerate(p.stacks):
        if not frames or k + 1 >= len(p.stack_sums) or p.stack_sums[k + 1, 0] <= 0:
            continue  # no Python frame (realloc without the GIL), or nothing allocated
        by_site.setdefault(p.stack_site[k], []).append(k)
    out = {}
    for site, ks in by_site.items():
        ks.sort(key=lambda k: -p.stack_sums[k + 1, 1])
        out[site] = [{
            "allocations": float(p.stack_sums[k + 1, 0]),
            "bytes": float(p.stack_sums[k + 1, 1]),
            "frames": [{"name": p.site_label(f), "function": p.sites[f][1],
                        "file": p.sites[f][2], "line": p.sites[f][3],
                        "library": is_library(p.sites[f])}
                       for f in reversed(p.stacks[k])],
        } for k in ks[:STACKS_PER_SITE]]
    return out


def _size_histogram(p):
    size_hist = []
    for k, (lo, hi) in enumerate(zip(SIZE_EDGES, SIZE_EDGES[1:] + [float("inf")])):
        w, b, n = p.size_hist[k]
        if n:
            size_hist.append({"min": lo, "max": hi if hi != float("inf") else None,
                              "label": "%s - %s" % (fmt_size_edge(lo), fmt_size_edge(hi))
                              if hi != float("inf") else ">= %s" % fmt_size_edge(lo),
                              "allocations": float(w), "bytes": float(b),
                              "median_lifetime": p.median_life_size.median(k)})
    return size_hist


def _lifetime_histogram(p):
    life_hist = []
    for k, (lo, hi) in enumerate(zip(LIFE_EDGES, LIFE_EDGES[1:] + [float("inf")])):
        w, b, n = p.life_hist[k]
        if n:
            life_hist.append({"min": lo, "max": hi if hi != float("inf") else None,
                              "label": "%s - %s" % (fmt_time(lo), fmt_time(hi))
                              if hi != float("inf") else ">= %s" % fmt_time(lo),
                              "allocations": float(w), "bytes": float(b)})
    if p.live_end_hist[2]:
        life_hist.append({"min": None, "max": None, "label": "live at exit",
                          "allocations": float(p.live_end_hist[0]),
                          "bytes": float(p.live_end_hist[1])})
    return life_hist


def _peak(p, top):
    """The peak of live bytes, and the `top` call sites that held most of it."""
    pk = p.peak
    peak_sites = []
    rows = _site_rows(p)
    sb = pk["site_bytes"][rows]
    for j in np.argsort(-sb, kind="stable")[:top]:
        if sb[j] > 0:
            r = rows[j]
            peak_sites.append({"bytes": float(sb[j]),
                               "allocations": float(pk["site_allocations"][r]),
                               "name": p.site_label(r - 1)})
    return {"bytes": float(pk["bytes"]), "time": float(pk["time"]), "sites": peak_sites}


def summarize(p, top=10):
    T = p.totals
    sites = _site_dicts(p)
    by_bytes = sorted(sites, key=lambda s: -s["bytes"])
    by_count = sorted(sites, key=lambda s: -s["allocations"])
    size_hist = _size_histogram(p)
    life_hist = _lifetime_histogram(p)
    peak = _peak(p, top)

    return {
        "directory": p.directory,
        "mode": "full" if p.full else "sampled",
        "sample_bytes": p.sample_bytes,
        "records": len(p),
        "processes": [{k: q[k] for k in ("pid", "ppid", "argv", "file", "file_bytes", "records",
                                          "policy", "start", "end", "max_rss",
                                          "unmatched_frees", "limit")} for q in p.processes],
        "warnings": list(p.warnings),
        "stacks": all(q["stacks"] for q in p.processes),
        "duration": p.end,
        "allocations": T["allocations"],
        "bytes": T["bytes"],
        "short_bytes": T["short_bytes"],
        "long_bytes": T["long_bytes"],
        "live_at_end_bytes": T["live_at_end_bytes"],
        "no_gil_records": int(T["no_gil_records"]),
        "realloc_records": int(T["realloc_records"]),
        "peak": peak,
        "max_rss": max([q["max_rss"] for q in p.processes] + [0]),
        "sites_by_bytes": by_bytes[:top],
        "sites_by_count": by_count[:top],
        "sites": by_bytes,
        "size_histogram": size_hist,
        "lifetime_histogram": life_hist,
        "by_thread": _group(p.groups["thread"], p.labels["thread"]),
        "by_tag": _group(p.groups["tags"], [t or "(no tag)" for t in p.labels["tags"]]),
        "by_arena": _group(p.groups["arena"], p.labels["arena"]),
        "by_rule": _group(p.groups["rule"], p.labels["rule"]),
        "by_dtype": _group(p.groups["dtype"], p.dtype_names),
        "thresholds": {"short": SHORT, "long": LONG},
    }


# ---- text -----------------------------------------------------------------------

def _table(rows, head):
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    out = []
    for r in [head] + rows:
        cells = []
        for i, c in enumerate(r):
            c = str(c)
            cells.append(c.ljust(widths[i]) if i == len(r) - 1 else c.rjust(widths[i]))
        out.append("  " + "  ".join(cells).rstrip())
    return out


def text(s):
    est = "" if s["mode"] == "full" else " (estimated)"
    lines = ["datamem profile: %s" % printable(s["directory"])]
    if s["mode"] == "full":
        lines.append("mode: full (every allocation; %s records)" % fmt_count(s["records"]))
    else:
        lines.append("mode: sampled, one sample per %s allocated on average (%s samples); "
                     "counts and bytes are unbiased estimates"
                     % (human_bytes(s["sample_bytes"]), fmt_count(s["records"])))
    for q in s["processes"]:
        if q.get("limit"):
            lines.append("warning: %s: profile truncated at %d bytes (cap) after %s records"
                         % (printable(q["file"]), q["limit"]["bytes"],
                            fmt_count(q["limit"]["records"])))
        lines.append("process %d (parent %s): %s  [%s records, %.2f s, max RSS %s]"
                     % (q["pid"], q["ppid"], printable(" ".join(q["argv"])[:100]),
                        fmt_count(q["records"]),
                        q["end"] - q["start"], human_bytes(q["max_rss"])))
    tb = s["bytes"] or 1.0
    lines.append("")
    lines.append("allocated%s: %s in %s allocations over %.2f s"
                 % (est, human_bytes(s["bytes"]), fmt_count(s["allocations"]), s["duration"]))
    lines.append("  short-lived (< %s): %s (%.0f%%); long-lived (>= %s or live at exit): %s "
                 "(%.0f%%); live at exit: %s"
                 % (fmt_time(s["thresholds"]["short"]), human_bytes(s["short_bytes"]),
                    100 * s["short_bytes"] / tb, fmt_time(s["thresholds"]["long"]),
                    human_bytes(s["long_bytes"]), 100 * s["long_bytes"] / tb,
                    human_bytes(s["live_at_end_bytes"])))
    lines.append("peak live NumPy bytes%s: %s at %.3f s (max RSS of any process: %s)"
                 % (est, human_bytes(s["peak"]["bytes"]), s["peak"]["time"], human_bytes(s["max_rss"])))
    if s["no_gil_records"]:
        lines.append("  %d records without the GIL (NumPy's realloc in fromfile/fromstring): "
                     "no call site" % s["no_gil_records"])

    def site_rows(lst):
        return [[human_bytes(x["bytes"]), "%.0f%%" % (100 * x["bytes"] / tb),
                 fmt_count(x["allocations"]), human_bytes(x["median_size"]),
                 fmt_time(x["median_lifetime"]), printable(x["site"])] for x in lst]
    head = ["bytes", "%", "count", "median size", "median life", "call site"]
    lines += ["", "top call sites by bytes:"] + _table(site_rows(s["sites_by_bytes"]), head)
    lines += ["", "top call sites by count:"] + _table(site_rows(s["sites_by_count"]), head)
    lines += _stack_lines(s["sites_by_bytes"][:STACKS_SITES], tb)
    if not s["stacks"] and any(x["library"] for x in s["sites_by_bytes"]):
        lines += ["", "note: some call sites are library frames (site-packages, the standard "
                  "library); record with `profile --stacks` to see the frames of your code "
                  "behind them"]
    lines += ["", "sizes:"] + _table(
        [[h["label"], fmt_count(h["allocations"]), human_bytes(h["bytes"]),
          "%.0f%%" % (100 * h["bytes"] / tb), fmt_time(h["median_lifetime"])]
         for h in s["size_histogram"]], ["size", "count", "bytes", "%", "median life"])
    lines += ["", "lifetimes:"] + _table(
        [[h["label"], fmt_count(h["allocations"]), human_bytes(h["bytes"]),
          "%.0f%%" % (100 * h["bytes"] / tb)] for h in s["lifetime_histogram"]],
        ["lifetime", "count", "bytes", "%"])
    pk = s["peak"]["bytes"] or 1.0
    lines += ["", "what made up the peak (%s):" % human_bytes(s["peak"]["bytes"])] + _table(
        [[human_bytes(x["bytes"]), "%.0f%%" % (100 * x["bytes"] / pk), fmt_count(x["allocations"]),
          printable(x["name"])] for x in s["peak"]["sites"]],
        ["bytes", "%", "live arrays", "call site"])
    for title, key in (("by thread", "by_thread"), ("by tag", "by_tag"),
                       ("by arena", "by_arena"), ("by rule", "by_rule"),
                       ("by dtype", "by_dtype")):
        lines += ["", title + ":"] + _table(
            [[human_bytes(g["bytes"]), "%.0f%%" % (100 * g["bytes"] / tb),
              fmt_count(g["allocations"]), printable(g["name"])] for g in s[key][:10]],
            ["bytes", "%", "count", key[3:]])
    return "\n".join(lines) + "\n"


STACKS_SITES = 5  # call sites whose stacks text() shows
LIBRARY_RUN = 2   # text() folds a run of more library frames than this into one line


def _stack_lines(sites, tb):
    """The stacks of the top call sites, outermost frame first; a run of
    library frames longer than LIBRARY_RUN is folded into one line."""
    if not any(len(x["stacks"]) > 1 or len(x["stacks"]) == 1 and len(x["stacks"][0]["frames"]) > 1
               for x in sites):
        return []  # recorded without --stacks: each stack is its site alone
    lines = ["", "stacks of the top call sites (outermost first; [lib]: site-packages, "
             "the standard library, frozen importlib, numpy/pandas/scipy/sklearn/datamem):"]
    for x in sites:
        lines.append("  %s" % printable(x["site"]))
        for st in x["stacks"]:
            lines.append("    %s (%.0f%%) in %s allocation%s:"
                         % (human_bytes(st["bytes"]), 100 * st["bytes"] / tb,
                            fmt_count(st["allocations"]),
                            "" if fmt_count(st["allocations"]) == "1" else "s"))
            fr = st["frames"]
            i = 0
            while i < len(fr):
                j = i
                while j < len(fr) and fr[j]["library"]:
                    j += 1
                if j - i > LIBRARY_RUN:
                    lines.append("      [lib] %s ... %d more library frame%s ... %s"
                                 % (printable(fr[i]["name"]), j - i - 2,
                                    "" if j - i == 3 else "s", printable(fr[j - 1]["name"])))
                    i = j
                    continue
                f = fr[i]
                lines.append("      %s%s" % ("[lib] " if f["library"] else "", printable(f["name"])))
                i += 1
    return lines


# ---- html -----------------------------------------------------------------------

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#17becf"]


def _scatter_svg(p, sites, width=760, height=380):
    """Size x lifetime, one dot per record (at most 4000, chosen at random),
    coloured by call site; live-at-exit blocks on the right edge."""
    pad_l, pad_b, pad_t, pad_r = 70, 40, 10, 20
    if p.sample is None or not len(p.sample[0]):
        return ""
    _prio, life, size, site = p.sample
    life = np.maximum(life, 1e-6)
    size = np.maximum(size, 1)
    lx0, lx1 = -6.0, max(1.0, math.ceil(math.log10(life.max() + 1e-9)))
    ly0, ly1 = 0.0, max(3.0, math.ceil(math.log2(size.max() + 1)))
    W, H = width - pad_l - pad_r, height - pad_t - pad_b

    def x(v):
        return pad_l + (np.log10(v) - lx0) / (lx1 - lx0) * W

    def y(v):
        return pad_t + H - (np.log2(v) - ly0) / (ly1 - ly0) * H
    colour = {s["index"]: PALETTE[i % len(PALETTE)] for i, s in enumerate(sites[:8])}
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" role="img" '
           'aria-label="size by lifetime">' % (width, height),
           '<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#999"/>'
           % (pad_l, pad_t, W, H)]
    for e in range(int(lx0), int(lx1) + 1):
        xx = pad_l + (e - lx0) / (lx1 - lx0) * W
        out.append('<text x="%.1f" y="%d" font-size="10" text-anchor="middle">%s</text>'
                   % (xx, height - pad_b + 14, _html.escape(fmt_time(10.0 ** e))))
    for e in range(int(ly0), int(ly1) + 1, 4):
        yy = pad_t + H - (e - ly0) / (ly1 - ly0) * H
        out.append('<text x="%d" y="%.1f" font-size="10" text-anchor="end">%s</text>'
                   % (pad_l - 4, yy + 3, _html.escape(human_bytes(2 ** e))))
    out.append('<text x="%d" y="%d" font-size="11" text-anchor="middle">lifetime '
               '(live at exit: to the end of the process)</text>' % (pad_l + W // 2, height - 4))
    for i in range(len(life)):
        c = colour.get(int(site[i]), "#bbb")
        out.append('<circle cx="%.1f" cy="%.1f" r="2.2" fill="%s" fill-opacity="0.6"/>'
                   % (x(life[i]), y(size[i]), c))
    out.append("</svg>")
    return "\n".join(out)


def _live_svg(p, sites, width=760, height=300):
    """Live bytes over time, stacked by call site (top 8, the rest grey): a
    second pass over the profile (Profile.live_layers)."""
    pad_l, pad_b, pad_t, pad_r = 70, 30, 10, 20
    W, H = width - pad_l - pad_r, height - pad_t - pad_b
    if len(p) == 0:
        return ""
    end = max(p.end, 1e-6)
    grid = np.linspace(0, end, 300)
    top_sites = sites[:8]
    vals = p.live_layers([s["index"] for s in top_sites], grid)
    layers = [(vals[i], s) for i, s in enumerate(top_sites)] + [(vals[len(top_sites)], None)]
    total = np.sum([l for l, _ in layers], axis=0)
    top = max(float(total.max()), 1.0)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" role="img" '
           'aria-label="live bytes over time">' % (width, height),
           '<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#999"/>'
           % (pad_l, pad_t, W, H)]
    base = np.zeros_like(grid)
    for i, (l, s) in enumerate(layers):
        lo, hi = base, base + l
        pts = ["%.1f,%.1f" % (pad_l + t / end * W, pad_t + H - v / top * H)
               for t, v in zip(grid, hi)]
        pts += ["%.1f,%.1f" % (pad_l + t / end * W, pad_t + H - v / top * H)
                for t, v in zip(grid[::-1], lo[::-1])]
        out.append('<polygon points="%s" fill="%s" fill-opacity="0.8"><title>%s</title></polygon>'
                   % (" ".join(pts), PALETTE[i % len(PALETTE)] if s else "#bbb",
                      _html.escape(printable(s["site"]) if s else "other sites")))
        base = hi
    out.append('<text x="%d" y="%d" font-size="10" text-anchor="end">%s</text>'
               % (pad_l - 4, pad_t + 8, _html.escape(human_bytes(top))))
    out.append('<text x="%d" y="%d" font-size="10" text-anchor="end">0</text>'
               % (pad_l - 4, pad_t + H))
    out.append('<text x="%d" y="%d" font-size="10" text-anchor="end">%.2f s</text>'
               % (pad_l + W, height - 12, end))
    out.append("</svg>")
    return "\n".join(out)


def html(p, s):
    def esc(text):
        return _html.escape(printable(text))
    tb = s["bytes"] or 1.0
    legend = "".join('<li><span style="background:%s"></span>%s</li>'
                     % (PALETTE[i % len(PALETTE)], esc(x["site"]))
                     for i, x in enumerate(s["sites"][:8]))
    rows = "".join("<tr><td>%s</td><td>%.0f%%</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td></tr>"
                   % (esc(human_bytes(x["bytes"])), 100 * x["bytes"] / tb,
                      esc(fmt_count(x["allocations"])), esc(human_bytes(x["median_size"])),
                      esc(fmt_time(x["median_lifetime"])), esc(x["site"]))
                   for x in s["sites"][:30])
    return """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>datamem profile</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;max-width:60em;color:#222}
table{border-collapse:collapse}td,th{padding:2px 8px;text-align:right}
td:last-child,th:last-child{text-align:left}tr:nth-child(even){background:#f4f4f4}
ul.legend{list-style:none;padding:0}ul.legend span{display:inline-block;width:12px;height:12px;margin-right:6px}
pre{background:#f8f8f8;padding:1em;overflow:auto}
</style></head><body>
<h1>datamem allocation profile</h1>
<p>%s</p>
%s<h2>Size by lifetime</h2>%s
<ul class="legend">%s</ul>
<h2>Live bytes over time, by call site</h2>%s
<h2>Call sites</h2>
<table><tr><th>bytes</th><th>%%</th><th>count</th><th>median size</th><th>median life</th><th>call site</th></tr>%s</table>
<h2>Summary</h2><pre>%s</pre>
</body></html>
""" % (esc(s["directory"]),
       "" if len(p) else "<p><strong>No arrays were recorded.</strong></p>",
       _scatter_svg(p, s["sites"]), legend, _live_svg(p, s["sites"]), rows,
       _html.escape(text(s)))  # text() already shows control characters as escapes


def _clean(v):
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return None if v != v or v in (float("inf"), float("-inf")) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


def to_json(s):
    """JSON for tools: unknown numbers (a median of nothing) are null."""
    return json.dumps(_clean(s), indent=1, allow_nan=False)
