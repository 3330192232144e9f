"""Real jobs under each allocator: datamem's policies against what users have today.

    python3 -m bench.jobs [--quick] [--reps N] [--only J1,J2] [--configs C1,C2]
                          [--variant NAME:VAR=VAL;...] [--out bench/results/NAME.json]
                          [--plot bench/results/NAME.png] [--shares]

run from the repository root. The discipline of bench/run.py, on whole jobs
(the other modules of this package, one per job): every (job, configuration)
runs in a fresh process (child.py), the order of jobs and of configurations is
reshuffled every repetition, and the table shows medians with ratios to NumPy's
default allocator measured in the same invocation. Each child checks that it ran
with the handler, the preloaded library and the policy it was meant to, and
every configuration must produce the same checksum as the default (to 1e-6
relative): an allocator must not change results.

Reported per job: wall time and CPU time of the job itself (imports excluded),
peak RSS of the process (ru_maxrss, interpreter and libraries included), minor
faults during the job, and with datamem each arena's dirty and retained bytes
at the end. The children run with OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE unset and
one BLAS/OpenMP thread, identically for every configuration.

--shares adds one untimed run of every (job, configuration) with a sampler
(child.py --peak) and a table of what each job's peak RSS is made of: the part
datamem's arenas held (what a policy can act on), pyarrow's pool, the rest
(docs/what-a-policy-governs.md). `--reps 0 --shares` runs only that.

Nothing here is a test; nothing asserts a time. Needs bench/setup.sh (pandas,
scikit-learn, SciPy and the peer allocators).
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

# one definition of the peers and of the command line's configurations
from bench.run import CONFIGS as RUN_CONFIGS, add_variants, child_env, config_list, usable_configs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CONFIGS = dict(RUN_CONFIGS)
CONFIGS["dm-demo"] = ({"DATAMEM_CONFIG": os.path.join(ROOT, "configs/demo.yaml")}, None)
DEFAULT_CONFIGS = ["default", "glibc-tuned", "jemalloc", "jemalloc-tuned", "tcmalloc", "mimalloc",
                   "dm-minimal", "dm-demo"]
PEERS = ["glibc-tuned", "jemalloc", "jemalloc-tuned", "tcmalloc", "mimalloc"]
JOBS = ["pandas_etl", "pandas3_etl", "pandas3_arrow", "sklearn_pipeline", "scipy_cg", "fft_image",
        "stencil_big", "threadpool"]
RATIO_METRICS = ["wall_s", "cpu_s", "user_s", "wall_best_s", "maxrss_mb"]
# This VM's system time is bimodal for the same job and configuration (0.1 s or
# 0.6-1.2 s for pandas_etl, almost all of it the kernel zeroing fresh pages,
# clear_page_erms): a median of wall time can land in either mode. User time and
# the best wall time of N runs swing far less (on short jobs user time spreads too);
# the tables report both next to the median (docs/performance.md, "How to read these numbers").
LIBS = {"jemalloc": "jemalloc", "jemalloc-tuned": "jemalloc", "tcmalloc": "tcmalloc",
        "mimalloc": "mimalloc"}


def run_one(job, config, scale, timeout, peak=False):
    extra, _ = CONFIGS[config]
    cmd = [sys.executable, os.path.join(HERE, "child.py"), job, "--scale", str(scale)]
    cmd += ["--peak"] if peak else []
    p = subprocess.run(cmd, env=child_env(extra), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError("%s/%s failed (%d): %s" % (job, config, p.returncode,
                                                      p.stderr.strip()[-2000:]))
    out = json.loads(p.stdout.strip().splitlines()[-1])
    want_dm = config.startswith("dm-")
    if (out["handler"] == "datamem") != want_dm:
        raise RuntimeError("%s/%s ran with handler %r" % (job, config, out["handler"]))
    want_policy = extra.get("DATAMEM_CONFIG")
    if want_dm and (not out["policy"] or
                    os.path.realpath(out["policy"]) != os.path.realpath(want_policy)):
        raise RuntimeError("%s/%s ran under policy %r" % (job, config, out["policy"]))
    lib = LIBS.get(config)
    if lib and lib not in out["preloaded"]:
        raise RuntimeError("%s/%s: LD_PRELOAD did not take" % (job, config))
    if not lib and out["preloaded"]:
        raise RuntimeError("%s/%s: unexpected allocator %s" % (job, config, out["preloaded"]))
    return out


def metrics(out):
    m = {k: out[k] for k in ("wall_s", "cpu_s", "user_s", "sys_s", "maxrss_mb", "faults",
                             "thp_mb")}
    m.update(out.get("extra") or {})
    if out.get("arenas"):
        m["dm_dirty_mb"] = sum(a["dirty_bytes"] for n, a in out["arenas"].items()
                               if not n.startswith("_")) / 1e6
        m["dm_retained_mb"] = sum(a["retained_bytes"] for n, a in out["arenas"].items()
                                  if not n.startswith("_")) / 1e6
    return m


def summarize(raw):
    med, ratio = {}, {}
    for job, per in raw.items():
        med[job], ratio[job] = {}, {}
        for c, runs in per.items():
            if runs:
                keys = set().union(*(r.keys() for r in runs))
                med[job][c] = {k: statistics.median(r[k] for r in runs if k in r) for k in keys}
                med[job][c]["wall_best_s"] = min(r["wall_s"] for r in runs)
        base = med[job].get("default")
        for c, vals in med[job].items():
            if base:
                ratio[job][c] = {k: vals[k] / base[k] for k in RATIO_METRICS
                                 if base.get(k) and k in vals}
    return med, ratio


def check_checksums(samples):
    """Every configuration's checksum matches the default's for that job."""
    ref = {}
    for s in samples:
        if s["config"] == "default":
            ref.setdefault(s["job"], s["checksum"])
    bad = []
    for s in samples:
        r = ref.get(s["job"])
        if r is not None and abs(s["checksum"] - r) > 1e-6 * max(1.0, abs(r)):
            bad.append("%s/%s: %r != %r" % (s["job"], s["config"], s["checksum"], r))
    return bad


def print_table(med, ratio, configs, file=sys.stdout):
    print("%-26s" % "job/metric" + "".join("%15s" % c for c in configs), file=file)
    for job in med:
        if "default" not in med[job]:
            continue
        for k in ["wall_s", "wall_best_s", "cpu_s", "user_s", "sys_s", "maxrss_mb", "faults",
                  "thp_mb", "thp_live_mb", "dm_dirty_mb", "dm_retained_mb"]:
            if not any(k in med[job].get(c, {}) for c in configs):
                continue
            row = "%-26s" % ("%s %s" % (job, k))
            for c in configs:
                v = med[job].get(c, {}).get(k)
                if v is None:
                    row += "%15s" % "-"
                elif k in RATIO_METRICS and c != "default":
                    row += "%15s" % ("%.3fx" % ratio[job][c][k])
                else:
                    row += "%15s" % ("%.4g" % v)
            print(row, file=file)
    print("(default column and sys/faults/THP/dm_* rows: absolute; wall (median and best), "
          "CPU, user and peak RSS of other columns: ratio to default)", file=file)


def ratio_table(med, ratio, configs, keys, head, base_fmt):
    """A markdown table: per job, the default's two `keys` (absolute, `base_fmt`)
    and every other configuration's two ratios to them."""
    lines = ["| job | default: %s | " % head +
             " | ".join(c for c in configs if c != "default") + " |",
             "|---|---|" + "---|" * (len(configs) - 1)]
    for job in med:
        d = med[job].get("default")
        if not d or any(k not in d for k in keys):
            continue
        cells = []
        for c in configs:
            if c == "default":
                continue
            r = ratio[job].get(c) or {}
            cells.append("%.2fx / %.2fx" % tuple(r[k] for k in keys)
                         if all(k in r for k in keys) else "-")
        lines.append("| %s | %s | %s |" % (job, base_fmt % tuple(d[k] for k in keys),
                                          " | ".join(cells)))
    return "\n".join(lines)


def markdown(med, ratio, configs):
    """The results table of docs/performance.md: time and peak RSS ratios per job."""
    return ratio_table(med, ratio, configs, ("wall_s", "maxrss_mb"),
                       "wall s, peak RSS MB", "%.2f, %.0f")


def markdown_steady(med, ratio, configs):
    """User time and best-of-N wall time ratios: the columns that do not swing with
    the VM's page-zeroing cost."""
    return ratio_table(med, ratio, configs, ("user_s", "wall_best_s"),
                       "user s, best wall s", "%.2f, %.2f")


def markdown_shares(samples):
    """What each job's peak RSS is made of (--shares runs): the sampled peak,
    ru_maxrss, and at the sampled peak the arenas' resident bytes, their share,
    pyarrow's pool and the rest."""
    lines = ["| job | config | peak RSS MB (sampled / ru_maxrss) | datamem's arenas MB | "
             "arenas' share | pyarrow MB | other MB |", "|---|---|---|---|---|---|---|"]
    for smp in samples:
        p = smp["peak"]
        arenas, arrow = p["arenas_mb"], p["pyarrow_mb"]
        other = p["rss_mb"] - (arenas or 0) - (arrow or 0)
        lines.append("| %s | %s | %.0f / %.0f | %s | %s | %s | %.0f |" % (
            smp["job"], smp["config"], p["rss_mb"], smp["maxrss_mb"],
            "-" if arenas is None else "%.0f" % arenas,
            "-" if arenas is None else "%.0f%%" % (100 * min(arenas, p["rss_mb"]) / p["rss_mb"]),
            "-" if arrow is None else "%.0f" % arrow, max(0, other)))
    return "\n".join(lines)


def plot(med, ratio, configs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    jobs = [j for j in JOBS if j in ratio and "default" in ratio[j]]
    shown = [c for c in configs if c != "default"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.55 * len(jobs) * len(shown) / 4 + 2),
                             sharey=True)
    colors = plt.get_cmap("tab10")
    h = 0.8 / max(1, len(shown))
    for ax, metric, label in ((axes[0], "wall_s", "wall time"),
                              (axes[1], "maxrss_mb", "peak RSS")):
        for j, c in enumerate(shown):
            ys = [i + j * h for i in range(len(jobs))]
            xs = [ratio[job].get(c, {}).get(metric, 0) for job in jobs]
            ax.barh(ys, xs, height=h, label=c, color=colors(j),
                    edgecolor="black" if c.startswith("dm-") else None, linewidth=0.5)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("%s relative to NumPy's default (< 1 is better)" % label)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0.4, 1.6)
    axes[0].set_yticks([i + 0.4 - h / 2 for i in range(len(jobs))])
    axes[0].set_yticklabels(jobs, fontsize=9)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(prog="python3 -m bench.jobs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="jobs at 0.4 scale, 2 repetitions")
    ap.add_argument("--reps", type=int, help="repetitions (default 2 quick, 3 full)")
    ap.add_argument("--scale", type=float, help="job size factor (default 1, 0.4 quick)")
    ap.add_argument("--only", help="comma-separated jobs (%s)" % ",".join(JOBS))
    ap.add_argument("--configs", help="comma-separated configurations (%s)" % ",".join(CONFIGS))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VAL[;VAR=VAL]",
                    help="an extra configuration, as in bench/run.py (names of datamem "
                         "variants start with dm-)")
    ap.add_argument("--out", help="write raw samples, medians and ratios as JSON")
    ap.add_argument("--plot", help="write a PNG of the ratios (needs matplotlib)")
    ap.add_argument("--replot", metavar="JSON", help="only redraw --plot (and print the "
                    "markdown table) from a result file")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--shares", action="store_true", help="also one untimed run of each with "
                    "a sampler: what the peak RSS is made of (arenas, pyarrow, other)")
    args = ap.parse_args()
    if args.replot:
        d = json.load(open(args.replot))
        configs = d["meta"]["config_order"]
        raw = {}
        for smp in d["samples"]:  # recomputed, so older files get the newer columns
            raw.setdefault(smp["job"], {}).setdefault(smp["config"], []).append(metrics(smp))
        med, ratio = summarize(raw)
        print(markdown(med, ratio, configs))
        print()
        print(markdown_steady(med, ratio, configs))
        if args.plot:
            plot(med, ratio, configs, args.plot)
        return
    variants = add_variants(args.variant, CONFIGS)
    reps = args.reps if args.reps is not None else (2 if args.quick else 3)
    scale = args.scale or (0.4 if args.quick else 1.0)
    jobs = args.only.split(",") if args.only else list(JOBS)
    configs = config_list(args.configs, DEFAULT_CONFIGS, variants)
    for j in jobs:
        if j not in JOBS:
            sys.exit("unknown job %r" % j)
    skipped = usable_configs(configs, CONFIGS)

    rng = random.Random(args.seed)
    raw = {j: {c: [] for c in configs} for j in jobs}
    samples = []
    t_start = time.time()
    for rep in range(reps):
        order_j = list(jobs)
        rng.shuffle(order_j)
        for j in order_j:
            order_c = list(configs)
            rng.shuffle(order_c)
            for c in order_c:
                out = run_one(j, c, scale, 600)
                raw[j][c].append(metrics(out))
                samples.append({"rep": rep, "config": c, **out})
        print("repetition %d/%d done, %.0f s, load %.2f" % (rep + 1, reps, time.time() - t_start,
                                                             os.getloadavg()[0]), file=sys.stderr)
    shares = [{"config": c, **run_one(j, c, scale, 600, peak=True)}
              for j in (jobs if args.shares else []) for c in configs]
    bad = check_checksums(samples + shares)
    med, ratio = summarize(raw)
    if samples:
        print_table(med, ratio, configs)
        print()
        print(markdown(med, ratio, configs))
        print()
        print(markdown_steady(med, ratio, configs))
    if shares:
        print()
        print(markdown_shares(shares))
    meta = {
        "quick": args.quick, "reps": reps, "scale": scale, "seconds": round(time.time() - t_start),
        "python": platform.python_version(), "cpus": os.cpu_count(), "kernel": platform.release(),
        "configs": {c: CONFIGS[c][0] for c in configs}, "config_order": configs,
        "skipped": skipped, "checksum_mismatches": bad, "load_end": os.getloadavg(),
    }
    try:
        import numpy
        meta["numpy"] = numpy.__version__
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            meta["thp"] = f.read().strip()
    except (ImportError, OSError):
        pass
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "medians": med, "ratios": ratio, "samples": samples,
                       "shares": shares}, f, indent=1, sort_keys=True)
        print("wrote " + args.out, file=sys.stderr)
    if args.plot:
        plot(med, ratio, configs, args.plot)
        print("wrote " + args.plot, file=sys.stderr)
    if bad:
        sys.exit("checksums differ from the default's:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
