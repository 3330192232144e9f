"""Side-by-side allocator benchmark for NumPy: datamem against what users have today.

    python3 bench/run.py [--quick] [--reps N] [--only W1,W2] [--configs C1,C2]
                         [--out bench/results/NAME.json] [--plot bench/results/NAME.png]

Every (workload, configuration) runs in a fresh process (bench/workloads.py); the
order of configurations is reshuffled every repetition (and the order of
workloads too), and the table shows medians over repetitions with the ratio to
NumPy's default allocator measured in the same invocation. Needs the allocators
that bench/setup.sh installs; a configuration whose library is missing is
skipped with a note.

Numbers are wall-clock times on a shared 2-core VM: compare ratios within one run
only. Nothing here is a test; nothing asserts a time.
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The peers' libraries (bench/setup.sh installs them here); DATAMEM_BENCH_LIBDIR
# names another directory holding the same files, e.g. the Debian packages
# unpacked with `dpkg-deb -x` where installing them is not an option.
LIBDIR = os.environ.get("DATAMEM_BENCH_LIBDIR") or "/usr/lib/x86_64-linux-gnu"
JEMALLOC = os.path.join(LIBDIR, "libjemalloc.so.2")
TCMALLOC = os.path.join(LIBDIR, "libtcmalloc_minimal.so.4")
MIMALLOC = os.path.join(LIBDIR, "libmimalloc.so.2")

# name -> (environment additions, library that must exist or None)
CONFIGS = {
    "default": ({}, None),
    "glibc-tuned": ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
                                       "glibc.malloc.trim_threshold=1073741824"}, None),
    "jemalloc": ({"LD_PRELOAD": JEMALLOC}, JEMALLOC),
    "jemalloc-tuned": ({"LD_PRELOAD": JEMALLOC,
                        "MALLOC_CONF": "oversize_threshold:0,muzzy_decay_ms:-1"}, JEMALLOC),
    "tcmalloc": ({"LD_PRELOAD": TCMALLOC}, TCMALLOC),
    "mimalloc": ({"LD_PRELOAD": MIMALLOC}, MIMALLOC),
    "dm-minimal": ({"DATAMEM_CONFIG": os.path.join(ROOT, "configs/minimal.yaml")}, None),
    # a comparison policy, measured only when named (--configs): no longer shipped
    "dm-throughput": ({"DATAMEM_CONFIG": os.path.join(ROOT, "bench/policies/throughput.yaml")},
                      None),
}
ON_REQUEST = {"dm-throughput"}  # configurations left out of the default list
PEERS = ["glibc-tuned", "jemalloc", "jemalloc-tuned", "tcmalloc", "mimalloc"]
WORKLOADS = ["empty", "zeros", "touch", "temp1", "temp8", "temp64",
             "threads8", "threads64", "mixed", "gather"]
# metrics that are counts or sizes, not times: reported as values, not ratios
VALUE_METRICS = {"faults", "steady_faults", "peak_live_mb", "thp_mb", "rss_over_live"}


def add_variants(variants, known):
    """--variant NAME:VAR=VAL[;VAR=VAL] into known (DATAMEM_CONFIG relative to
    the repository); returns the names, in order."""
    names = []
    for v in variants:
        name, _, spec = v.partition(":")
        env = dict(kv.split("=", 1) for kv in spec.split(";") if kv)
        if "DATAMEM_CONFIG" in env:
            env["DATAMEM_CONFIG"] = os.path.join(ROOT, env["DATAMEM_CONFIG"])
        known[name] = (env, None)
        names.append(name)
    return names


def config_list(requested, standard, variants):
    """The configurations to run: --configs (comma-separated) or the standard
    ones, then the variants not named, NumPy's default always first."""
    configs = requested.split(",") if requested else list(standard)
    configs += [n for n in variants if n not in configs]
    if "default" not in configs:
        configs.insert(0, "default")
    return configs


def usable_configs(configs, known):
    """Drops (with a note on stderr) the configurations whose LD_PRELOAD library is
    missing; exits on an unknown one. `configs` is changed in place; returns the
    notes of what was skipped (kept in the results)."""
    skipped = []
    for c in list(configs):
        if c not in known:
            sys.exit("unknown configuration %r" % c)
        lib = known[c][1]
        if lib and not os.path.exists(lib):
            skipped.append("%s (%s missing: run bench/setup.sh)" % (c, lib))
            configs.remove(c)
    for s in skipped:
        print("skipping " + s, file=sys.stderr)
    return skipped


def child_env(extra):
    env = dict(os.environ)
    for k in ("DATAMEM_CONFIG", "LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES",
              "DMJE_MALLOC_CONF"):
        env.pop(k, None)
    # Set on this kind of machine for old OpenBLAS builds; they slow a current
    # NumPy. Unset both together, in the benchmark's children only.
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    env["OPENBLAS_NUM_THREADS"] = "1"  # no idle BLAS threads competing for 2 cores
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_one(workload, config, quick, timeout):
    extra, _ = CONFIGS[config]
    cmd = [sys.executable, os.path.join(HERE, "workloads.py"), workload]
    if quick:
        cmd.append("--quick")
    t0 = time.time()
    p = subprocess.run(cmd, env=child_env(extra), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError("%s/%s failed (%d): %s" % (workload, config, p.returncode,
                                                      p.stderr.strip()[-2000:]))
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(wall, 2)
    check_ran_as(config, out, "%s/%s" % (workload, config))
    return out


def check_ran_as(config, out, what):
    """Raises unless a child's report `out` (its "handler" and "preloaded", as
    bench/workloads.py gives them) shows the configuration really took: datamem's
    handler exactly for the dm-* configurations, the LD_PRELOAD library mapped."""
    want_dm = config.startswith("dm-")
    if (out["handler"] == "datamem") != want_dm:
        raise RuntimeError("%s ran with handler %r" % (what, out["handler"]))
    lib = {"jemalloc": "jemalloc", "jemalloc-tuned": "jemalloc", "tcmalloc": "tcmalloc",
           "mimalloc": "mimalloc"}.get(config)
    if lib and lib not in out["preloaded"]:
        raise RuntimeError("%s: LD_PRELOAD did not take" % what)


def flatten(out):
    m = dict(out["results"])
    if out["workload"] == "mixed":
        m["peak_rss_mb"] = out["maxrss_kb"] / 1024
        m["rss_over_start_mb"] = (out["maxrss_kb"] - out["rss0_kb"]) / 1024
        # The yardstick that does not move: NumPy's default peaks anywhere from
        # 339 to 414 MB here, by where glibc's sliding mmap threshold lands (the
        # heap's layout at start-up, e.g. the environment's size, decides it),
        # so a ratio to it flips by 20% between invocations. The run's peak
        # live bytes are exact: peak RSS over the start's, per live byte.
        m["rss_over_live"] = (out["maxrss_kb"] - out["rss0_kb"]) * 1024 / (
            out["results"]["peak_live_mb"] * 1e6)
    return m


def summarize(raw, configs, workloads):
    """medians[w][c][metric], ratios[w][c][metric] (to default)."""
    med, ratio = {}, {}
    for w in workloads:
        med[w], ratio[w] = {}, {}
        for c in configs:
            runs = raw.get(w, {}).get(c, [])
            if not runs:
                continue
            keys = runs[0].keys()
            med[w][c] = {k: statistics.median(r[k] for r in runs) for k in keys}
        base = med[w].get("default")
        for c, vals in med[w].items():
            if base:
                ratio[w][c] = {k: (v / base[k] if base.get(k) else None)
                               for k, v in vals.items() if k not in VALUE_METRICS}
    return med, ratio


def fmt(v):
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return "%.0f" % v
    if abs(v) >= 10:
        return "%.1f" % v
    return "%.2f" % v


def print_table(med, ratio, configs, file=sys.stdout):
    shown = [c for c in configs]
    w0 = 22
    print("%-*s" % (w0, "workload/metric") + "".join("%15s" % c for c in shown), file=file)
    for w, per in med.items():
        if "default" not in per:
            continue
        for k in per["default"]:
            row = "%-*s" % (w0, "%s %s" % (w, k))
            for c in shown:
                if c not in per:
                    row += "%15s" % "n/a"
                elif k in VALUE_METRICS:
                    row += "%15s" % fmt(per[c][k])
                elif c == "default":
                    row += "%15s" % fmt(per[c][k])
                else:
                    r = ratio[w][c].get(k)
                    row += "%15s" % ("-" if r is None else "%.2fx" % r)
            print(row, file=file)
    print("(default column: absolute values; others: ratio to default; faults, "
          "peak_live_mb, thp_mb, rss_over_live: absolute)", file=file)


def plot(med, ratio, configs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sys.path.insert(0, HERE)
    from report import key_order
    rows = []
    for w in sorted(ratio, key=lambda w: WORKLOADS.index(w) if w in WORKLOADS else 99):
        per = ratio[w]
        if "default" not in per:
            continue
        for k in sorted(med[w]["default"], key=key_order):
            if k in VALUE_METRICS or k in ("rss_over_start_mb",):
                continue
            rows.append(("%s %s" % (w, k), {c: per[c].get(k) for c in per}))
    shown = [c for c in configs if c != "default"]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.6))
    h = 0.8 / max(1, len(shown))
    colors = plt.get_cmap("tab10")
    for j, c in enumerate(shown):
        ys = [i + j * h for i in range(len(rows))]
        xs = [r[1].get(c) or 0 for r in rows]
        ax.barh(ys, [min(x, 100) for x in xs], height=h, label=c, color=colors(j),
                edgecolor="black" if c.startswith("dm-") else None, linewidth=0.5)
        for y, x in zip(ys, xs):
            if x > 100:  # off the scale: say by how much
                ax.text(110, y, "%.0fx %s" % (x, c), va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlim(0.01, 400)
    ax.set_yticks([i + 0.4 - h / 2 for i in range(len(rows))])
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (or peak RSS) relative to NumPy's default allocator "
                  "(log scale; < 1 is better)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs, 256 MiB gather")
    ap.add_argument("--reps", type=int, help="repetitions (default 3 quick, 5 full)")
    ap.add_argument("--only", help="comma-separated workloads (%s)" % ",".join(WORKLOADS))
    ap.add_argument("--configs", help="comma-separated configurations (%s)" % ",".join(CONFIGS))
    ap.add_argument("--out", help="write raw samples, medians and ratios as JSON")
    ap.add_argument("--plot", help="write a PNG of the ratios (needs matplotlib)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--replot", metavar="JSON", help="only redraw --plot from a result file")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VAL[;VAR=VAL]",
                    help="an extra configuration for trade-off studies, e.g. "
                         "'dm-gc:DATAMEM_CONFIG=configs/minimal.yaml;"
                         "DMJE_MALLOC_CONF=tcache_gc_incr_bytes:1048576' (names of "
                         "datamem variants start with dm-; DMJE_MALLOC_CONF reaches only "
                         "datamem's private jemalloc)")
    args = ap.parse_args()
    if args.replot:
        d = json.load(open(args.replot))
        order = [c for c in CONFIGS if c in d["meta"]["configs"]]
        order += [c for c in d["meta"]["configs"] if c not in order]
        plot(d["medians"], d["ratios"], order, args.plot)
        return
    variants = add_variants(args.variant, CONFIGS)
    reps = args.reps or (3 if args.quick else 5)
    workloads = args.only.split(",") if args.only else list(WORKLOADS)
    standard = [c for c in CONFIGS if c not in ON_REQUEST and c not in variants]
    configs = config_list(args.configs, standard, variants)
    for w in workloads:
        if w not in WORKLOADS:
            sys.exit("unknown workload %r" % w)
    skipped = usable_configs(configs, CONFIGS)

    rng = random.Random(args.seed)
    raw = {w: {c: [] for c in configs} for w in workloads}
    samples = []
    t_start = time.time()
    timeout = 300 if args.quick else 900
    for rep in range(reps):
        order_w = list(workloads)
        rng.shuffle(order_w)
        for w in order_w:
            order_c = list(configs)
            rng.shuffle(order_c)
            for c in order_c:
                out = run_one(w, c, args.quick, timeout)
                raw[w][c].append(flatten(out))
                samples.append({"rep": rep, "workload": w, "config": c, **out})
        print("repetition %d/%d done, %.0f s" % (rep + 1, reps, time.time() - t_start),
              file=sys.stderr)

    med, ratio = summarize(raw, configs, workloads)
    print_table(med, ratio, configs)
    meta = {
        "quick": args.quick, "reps": reps, "seconds": round(time.time() - t_start),
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "kernel": platform.release(),
        "configs": {c: CONFIGS[c][0] for c in configs}, "skipped": skipped,
    }
    try:
        import numpy
        meta["numpy"] = numpy.__version__
    except ImportError:
        pass
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            meta["thp"] = f.read().strip()
    except OSError:
        pass
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "medians": med, "ratios": ratio, "samples": samples},
                      f, indent=1, sort_keys=True)
        print("wrote " + args.out, file=sys.stderr)
    if args.plot:
        plot(med, ratio, configs, args.plot)
        print("wrote " + args.plot, file=sys.stderr)


if __name__ == "__main__":
    main()
