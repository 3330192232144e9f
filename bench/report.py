"""Markdown tables from a bench/run.py result file, for docs/performance.md.

    python3 bench/report.py bench/results/performance-results-halves.json
"""
import json
import sys

UNITS = {"ns": "ns/op", "us": "us/iter", "fill_ms": "ms", "peak_rss_mb": "MB",
         "rss_over_start_mb": "MB"}
LABELS = {
    "empty": "np.empty create/destroy %s (ns)",
    "zeros": "np.zeros create/destroy %s (ns)",
    "touch": "np.zeros + touch every page %s (us)",
}
ABSOLUTE = {"faults", "steady_faults", "peak_live_mb", "thp_mb", "rss_over_live"}


def label(w, k):
    if w in LABELS:
        return LABELS[w] % k.rsplit("_", 1)[0].replace("K", " KiB").replace("M", " MiB")
    name = {"temp1": "temporaries 1 MiB", "temp8": "temporaries 8 MiB",
            "temp64": "temporaries 64 MiB", "threads8": "2 threads, temporaries 8 MiB",
            "threads64": "2 threads, temporaries 64 MiB", "mixed": "mixed sizes",
            "gather": "big array"}[w]
    what = {"us": "us/iter", "faults": "minor faults/iter",
            "steady_faults": "minor faults/iter in the loops (thread starts left out)", "ns": "ns/op",
            "peak_rss_mb": "peak RSS (MB)", "rss_over_start_mb": "peak RSS over start (MB)",
            "peak_live_mb": "peak live (MB)", "fill_ms": "first-touch fill (ms)",
            "thp_mb": "AnonHugePages (MB)",
            "rss_over_live": "peak RSS over start per peak live byte"}.get(k, k)
    if w == "gather" and k == "ns":
        what = "random gather (ns/element)"
    return "%s, %s" % (name, what)


def fmt(v):
    if v is None:
        return "-"
    if abs(v) >= 100:
        return "%.0f" % v
    if abs(v) >= 10:
        return "%.1f" % v
    return "%.2f" % v


ORDER_W = ["empty", "zeros", "touch", "temp1", "temp8", "temp64", "threads8", "threads64",
           "mixed", "gather"]
ORDER_C = ["default", "glibc-tuned", "jemalloc", "jemalloc-tuned", "tcmalloc", "mimalloc",
           "dm-minimal", "dm-throughput"]
ORDER_K = ["us", "ns", "faults", "steady_faults", "peak_rss_mb", "rss_over_live", "fill_ms"]


def key_order(k):
    if k in ORDER_K:
        return (0, ORDER_K.index(k))
    num = k.split("_")[0]
    mult = {"B": 1, "K": 1 << 10, "M": 1 << 20}.get(num[-1:], 0)
    try:
        return (1, int(num[:-1]) * mult)
    except ValueError:
        return (2, k)


def main():
    d = json.load(open(sys.argv[1]))
    med, ratio = d["medians"], d["ratios"]
    configs = sorted(d["meta"]["configs"],
                     key=lambda c: ORDER_C.index(c) if c in ORDER_C else 99)
    print("| workload | " + " | ".join(configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for w in sorted(med, key=lambda w: ORDER_W.index(w) if w in ORDER_W else 99):
        per = med[w]
        if "default" not in per:
            continue
        for k in sorted(per["default"], key=key_order):
            if k in ("peak_live_mb", "rss_over_start_mb"):
                continue
            cells = []
            for c in configs:
                if c not in per:
                    cells.append("n/a")
                elif k in ABSOLUTE or c == "default":
                    cells.append(fmt(per[c][k]))
                else:
                    r = ratio[w][c].get(k)
                    cell = "-" if r is None else "%.2fx" % r
                    if c.startswith("dm-"):
                        cell = "**%s**" % cell
                    cells.append(cell)
            print("| %s | %s |" % (label(w, k), " | ".join(cells)))
    m = d["meta"]
    print()
    print("%d repetitions%s, %d s; Python %s, NumPy %s, kernel %s, THP %s" % (
        m["reps"], " (--quick)" if m["quick"] else "", m["seconds"], m["python"],
        m.get("numpy"), m["kernel"], m.get("thp")))


if __name__ == "__main__":
    main()
