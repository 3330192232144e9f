"""`record` (append /stats.json snapshots to a JSON-lines file) and `plot`
(per-arena bytes over time, with matplotlib).
"""
import io
import json
import sys
import time

from .._files import open_append, write_atomic
from .client import fetch_json, resolve
from .._text import printable

def cmd_record(target, path, interval=1.0, count=0, out=sys.stderr):
    where = resolve(target)
    n = 0
    with open_append(path) as f:  # the file rules: owned directory, no link followed
        try:
            while count <= 0 or n < count:
                if n:
                    time.sleep(interval)
                snap = fetch_json(where)
                f.write((json.dumps(snap, separators=(",", ":")) + "\n").encode())
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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    write_atomic(out_png, png.getvalue(), mode=0o644)  # temp file + rename, owned directory
    out.write("wrote %s (%d snapshots, %d arenas)\n" % (out_png, len(snaps), len(arenas)))
    return 0
