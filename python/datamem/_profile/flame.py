"""`report --folded OUT` and `report --flamegraph OUT.html`: the profile's
bytes (and allocation counts) by whole Python stack.

folded() writes the folded-stack text that flamegraph.pl, inferno, speedscope
and py-spy read: one line per stack, frames outermost first joined by ';', a
space, then the stack's estimated bytes (or allocations) as an integer.
html() draws both flame graphs as inline SVG: the page loads nothing (no
script, no style sheet, no font from elsewhere) and every name from the
profile (function, file) is escaped, since the profiled job chose them.

Stacks are recorded with `profile --stacks` (the default with --full);
without them each record's stack is its call site alone.
"""
import html as _html

from .read import is_library
from .._text import printable


def frame_name(p, i):
    """One frame as the folded format has it: 'module.qualname (file:line)',
    control characters escaped and no ';' (the format's frame separator)."""
    mod, fn, fi, line = p.sites[i]
    return printable("%s (%s:%d)" % (fn, fi, line)).replace(";", ",")


def _stacks(p, column):
    """(frames outermost first, value) for every stack with a value, by value."""
    out = []
    for k, frames in enumerate(p.stacks):
        v = float(p.stack_sums[k + 1, column]) if k + 1 < len(p.stack_sums) else 0.0
        if v > 0:
            out.append((tuple(reversed(frames)), v))
    if len(p.stack_sums) and p.stack_sums[0, column] > 0:  # no stack at all (not expected)
        out.append(((), float(p.stack_sums[0, column])))
    out.sort(key=lambda x: -x[1])
    return out


def folded(p, by="bytes"):
    col = 1 if by == "bytes" else 0
    lines = []
    for frames, v in _stacks(p, col):
        names = [frame_name(p, f) for f in frames] or ["(no Python frame)"]
        n = int(round(v))
        if n > 0:
            lines.append("%s %d" % (";".join(names), n))
    return "\n".join(lines) + ("\n" if lines else "")


def _tree(p, column):
    """A nested dict: {frame: [value, children]} from the root."""
    root = [0.0, {}]
    for frames, v in _stacks(p, column):
        node = root
        node[0] += v
        for f in frames or (-1,):
            node = node[1].setdefault(f, [0.0, {}])
            node[0] += v
    return root


def _svg(p, column, unit, width=1200, row=17):
    from .report import fmt_count
    from .._text import human_bytes
    root = _tree(p, column)
    total = root[0]
    if total <= 0:
        return "<p>Nothing was recorded.</p>"
    fmt = human_bytes if unit == "bytes" else (lambda v: fmt_count(v) + " allocations")
    rects = []
    depth_max = [0]

    def walk(node, x, depth):
        depth_max[0] = max(depth_max[0], depth)
        for f, child in sorted(node[1].items(), key=lambda kv: -kv[1][0]):
            w = child[0] / total * width
            if w >= 0.3:
                name = frame_name(p, f) if f >= 0 else "(no Python frame)"
                lib = f >= 0 and is_library(p.sites[f])
                rects.append((x, depth, w, name, child[0], lib))
                walk(child, x, depth + 1)
            x += w
    walk(root, 0.0, 0)
    height = (depth_max[0] + 1) * row + 4
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="monospace" font-size="11">' % (width, height)]
    for x, depth, w, name, v, lib in rects:
        y = depth * row
        tip = _html.escape("%s: %s (%.1f%%)%s" % (name, fmt(v), 100 * v / total,
                                                   " [library]" if lib else ""), quote=True)
        colour = "#c9c9d6" if lib else "#f2a65a"
        out.append('<g><title>%s</title><rect x="%.1f" y="%d" width="%.1f" height="%d" '
                   'fill="%s" stroke="#fff"/>' % (tip, x, y, w, row - 1, colour))
        chars = int(w // 7)
        if chars >= 4:
            text = name if len(name) <= chars else name[:chars - 2] + ".."
            out.append('<text x="%.1f" y="%d">%s</text>'
                       % (x + 3, y + row - 5, _html.escape(text, quote=True)))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def html(p):
    src = _html.escape(printable(p.directory), quote=True)
    mode = "full" if p.full else "sampled (estimates)"
    return """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>datamem flame graph</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<style>body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}svg{display:block}</style>
</head><body>
<h1>datamem flame graph</h1>
<p>%s, %s. Each bar is a Python frame, its callers above it, its width its share;
outermost frames at the top. Grey: library frames (site-packages, the standard
library, frozen importlib, numpy, pandas, scipy, sklearn, datamem); orange: your code.
Hover a bar for its figures.</p>
<h2>Bytes allocated, by stack</h2>
%s
<h2>Allocations, by stack</h2>
%s
</body></html>
""" % (src, mode, _svg(p, 1, "bytes"), _svg(p, 0, "count"))
