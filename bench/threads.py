"""Allocation throughput of T NumPy threads at once, datamem against the peers.

    python3 bench/threads.py [--threads 1,2,4,8,16] [--reps N] [--configs C1,C2]
                             [--quick] [--seed S] [--out bench/results/NAME.json]
    PYTHON_GIL=0 .venv-ft/bin/python bench/threads.py ...    # free-threaded 3.13t

T threads, named worker-0 .. worker-(T-1), each run the same allocation-heavy
loop on arrays of their own: small temporaries (64 float64), temporaries of
16 KiB, 64 KiB, 256 KiB and 1 MiB (d = a*b + c; e = sqrt(d) - a), and every
BIG_EVERY iterations a 64 MiB np.empty with one byte written per page. Every
thread does the same work whatever T is (weak scaling); the child runs rounds
of it that all threads start together at a barrier, times each by the wall
clock from the first worker's start to the last worker's end, after one
warm-up round, and reports the median round's arrays per second (all threads).

As bench/run.py does: every (configuration, T) runs in a fresh process, the
order of the pairs is reshuffled every repetition, the tables show medians over
repetitions, and each child checks it ran with the handler, the LD_PRELOAD
library and (for dm-threads) the arena per worker it was meant to, and with the
GIL as the parent's interpreter has it (PYTHON_GIL=0 reaches every child). The
peers are bench/run.py's. dm-threads is datamem under
bench/policies/threads-per-arena.yaml: worker-N allocates from arena wN (N < 16).

Reported per configuration and T: throughput, scaling (throughput at T over the
same configuration's at T=1), the ratio to NumPy's default and to the best peer
(highest throughput at that T, among bench/run.py's PEERS). The times are
wall-clock on whatever machine runs it: on a shared VM compare within one run.
"""
import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # bench/ is a package of the repository root, as for bench.jobs
from bench.run import (CONFIGS as RUN_CONFIGS, PEERS, check_ran_as,  # noqa: E402
                       child_env, usable_configs)  # one definition of the peers

POLICY = os.path.join(HERE, "policies", "threads-per-arena.yaml")
CONFIGS = dict(RUN_CONFIGS)
CONFIGS["dm-threads"] = ({"DATAMEM_CONFIG": POLICY}, None)
DEFAULT_CONFIGS = ["default", "glibc-tuned", "jemalloc", "tcmalloc", "mimalloc", "dm-threads"]
MAX_WORKERS = 16  # the policy's rules name worker-0 .. worker-15

KiB, MiB = 1 << 10, 1 << 20
SMALL_N = 64                                   # float64 elements: 512 B
MEDIUM_BYTES = [16 * KiB, 64 * KiB, 256 * KiB, MiB]
BIG_BYTES = 64 * MiB
BIG_EVERY = 32                                 # iterations per 64 MiB array
SMALL_OPS = 8                                  # d = a*b + c on the small arrays
ARRAYS_PER_ITER = 2 * SMALL_OPS + 4 * len(MEDIUM_BYTES)
PAGE = os.sysconf("SC_PAGESIZE")


def minflt():
    """Minor page faults of the whole process so far (they repeat to the page, where
    times do not)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gil_enabled():
    return getattr(sys, "_is_gil_enabled", lambda: True)()


# ---- the child: one configuration, T threads ---------------------------------

def worker_body(seed):
    """The loop of one thread on arrays of its own: body(k) runs k iterations
    (k a multiple of BIG_EVERY) and returns how many arrays it made."""
    import numpy as np
    rng = np.random.default_rng(seed)
    sa, sb, sc = (rng.random(SMALL_N) for _ in range(3))
    medium = [tuple(rng.random(n // 8) + 1.0 for _ in range(3)) for n in MEDIUM_BYTES]
    step = PAGE // 8

    def body(k):
        made = 0
        for i in range(k):
            for _ in range(SMALL_OPS):
                d = sa * sb + sc
            for a, b, c in medium:
                d = a * b + c
                e = np.sqrt(d) - a
            del d, e
            made += ARRAYS_PER_ITER
            if i % BIG_EVERY == 0:
                x = np.empty(BIG_BYTES // 8)
                x[::step] = 1.0  # one write per page: the pages' first touch, or reuse
                del x
                made += 1
        return made
    return body


def child(nthreads, iters, rounds):
    """Runs `rounds` + 1 barrier-synchronised rounds (the first is warm-up) of
    `iters` iterations in each of `nthreads` threads; returns the report."""
    import numpy as np
    from bench.workloads import handler_name, preloaded
    dm = handler_name() == "datamem"
    start = threading.Barrier(nthreads + 1)
    end = threading.Barrier(nthreads + 1)
    made = [0] * nthreads
    # Each worker stamps its own start and end: the main thread, one more runnable
    # thread than there are cores at T=2 here, can wake from the start barrier
    # tens of milliseconds after the workers did, and a round timed by it read up
    # to twice the real throughput (3.13t runs of 333 thousand arrays/s where the
    # workers' own stamps give half that).
    began = [0.0] * nthreads
    ended = [0.0] * nthreads
    arenas, errors = {}, []

    def work(k):
        try:
            body = worker_body(k)
            if dm:
                import datamem
                arenas[threading.current_thread().name] = datamem.arena_of(np.empty(2048))
            for _ in range(rounds + 1):
                start.wait()
                began[k] = time.perf_counter()
                made[k] = body(iters)
                ended[k] = time.perf_counter()
                end.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 -- reported by the parent
            errors.append(repr(e))
            start.abort()
            end.abort()

    ts = [threading.Thread(target=work, args=(k,), name="worker-%d" % k)
          for k in range(nthreads)]
    for t in ts:
        t.start()
    samples = []
    try:
        for _ in range(rounds + 1):
            c0, f0 = time.process_time(), minflt()  # before the workers can start
            start.wait()
            end.wait()
            samples.append({"wall_s": max(ended) - min(began), "cpu_s": time.process_time() - c0,
                            "minflt": minflt() - f0, "arrays": sum(made)})
    except threading.BrokenBarrierError:
        pass
    for t in ts:
        t.join()
    if errors:
        raise SystemExit("worker failed: " + "; ".join(errors))
    measured = samples[1:]
    return {
        "threads": nthreads, "handler": handler_name(), "preloaded": preloaded(),
        "gil": gil_enabled(), "arenas": arenas, "rounds": measured,
        "arrays_per_s": statistics.median(s["arrays"] / s["wall_s"] for s in measured),
        "arrays_per_cpu_s": statistics.median(s["arrays"] / s["cpu_s"] for s in measured),
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


# ---- the parent ------------------------------------------------------------------

def run_child(config, nthreads, quick, timeout):
    extra, _ = CONFIGS[config]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(nthreads)]
    if quick:
        cmd.append("--quick")
    p = subprocess.run(cmd, env=child_env(extra), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    what = "%s/T=%d" % (config, nthreads)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (what, p.returncode, p.stderr.strip()[-2000:]))
    out = json.loads(p.stdout.strip().splitlines()[-1])
    check_ran_as(config, out, what)
    if out["gil"] != gil_enabled():
        raise RuntimeError("%s ran with the GIL %s, this interpreter has it %s" % (
            what, "on" if out["gil"] else "off", "on" if gil_enabled() else "off"))
    if config == "dm-threads":
        want = {"worker-%d" % k: "w%d" % k for k in range(nthreads)}
        if out["arenas"] != want:
            raise RuntimeError("%s: workers' arenas %r, not %r" % (what, out["arenas"], want))
    return out


def summarize(raw, configs, threads):
    """raw[config][T] = [one measure per repetition] -> per (config, T): the
    median, scaling (over the same configuration's at T=1), ratio to the
    default and to the best peer (the peer with the highest median at T)."""
    med = {c: {t: statistics.median(raw[c][t]) for t in threads if raw[c].get(t)}
           for c in configs}
    best = {}
    for t in threads:
        peers = [(med[c][t], c) for c in configs if c in PEERS and t in med[c]]
        if peers:
            best[t] = max(peers)[1]
    table = {}
    for c in configs:
        table[c] = {}
        for t, v in med[c].items():
            base1 = med[c].get(1)
            table[c][t] = {
                "median": v, "scaling": v / base1 if base1 else None,
                "vs_default": v / med["default"][t] if t in med.get("default", {}) else None,
                "vs_best_peer": v / med[best[t]][t] if t in best else None}
    return table, best


def cpu_share(sample):
    """Process CPU time over wall time in the child's median round: under 1.0 per
    thread, the machine did not give the threads a core each."""
    return statistics.median(r["cpu_s"] / r["wall_s"] for r in sample["rounds"])


def summaries(samples, configs, threads):
    """Everything the tables show, from the children's reports: by wall clock (the
    targets' measure) and per CPU-second (what the allocator costs, whatever CPU
    the machine gave the child), each child's CPU share, the verdict."""
    def raw(key):
        r = {c: {t: [] for t in threads} for c in configs}
        for s in samples:
            if s["threads"] in r.get(s["config"], {}):
                r[s["config"]][s["threads"]].append(key(s))
        return r
    wall, best = summarize(raw(lambda s: s["arrays_per_s"]), configs, threads)
    cpu, best_cpu = summarize(raw(lambda s: s["arrays_per_cpu_s"]), configs, threads)
    def medians(key):
        return {c: {t: statistics.median(v) for t, v in per.items() if v}
                for c, per in raw(key).items()}
    return {"table": wall, "best_peer": best, "verdict": verdict(wall, best, threads),
            "table_cpu": cpu, "best_peer_cpu": best_cpu, "cpu_share": medians(cpu_share),
            "faults_per_array": medians(lambda s: statistics.median(
                r["minflt"] / r["arrays"] for r in s["rounds"])),
            "maxrss_mb": medians(lambda s: s["maxrss_kb"] / 1024)}


def verdict(table, best, threads, dm="dm-threads"):
    """The targets: datamem's scaling >= the best peer's at every T, and its
    throughput at T=2 within 5% of the best peer's."""
    out = {}
    for t in threads:
        if dm not in table or t not in table[dm] or t not in best:
            continue
        d, p = table[dm][t], table[best[t]][t]
        v = {"best_peer": best[t], "dm_scaling": d["scaling"], "peer_scaling": p["scaling"],
             "dm_vs_best_peer": d["vs_best_peer"]}
        if t != 1 and d["scaling"] is not None and p["scaling"] is not None:
            v["scaling_met"] = d["scaling"] >= p["scaling"]
        if t == 2:
            v["throughput_met"] = d["vs_best_peer"] >= 0.95
        out[t] = v
    return out


def markdown(res, configs, threads):
    """The two tables (wall clock, per CPU-second) and the verdict, as markdown."""
    def f(x, fmt):
        return "-" if x is None else fmt % x

    def one(table, best, head, cell):
        lines = ["| configuration | " + " | ".join("T=%d: %s" % (t, head) for t in threads) + " |",
                 "|---|" + "---|" * len(threads)]
        for c in configs:
            cells = [cell(c, t, table[c][t]) if t in table.get(c, {}) else "n/a"
                     for t in threads]
            lines.append("| %s | %s |" % (c, " | ".join(cells)))
        lines.append("\nbest peer: " + ", ".join(
            "T=%d %s" % (t, best[t]) for t in threads if t in best))
        return lines
    out = one(res["table"], res["best_peer"], "k arrays/s, scaling, vs default, vs best peer",
              lambda c, t, r: "%s, %s, %s, %s" % (
                  f(r["median"] / 1e3, "%.1f"), f(r["scaling"], "%.2f"),
                  f(r["vs_default"], "%.2fx"), f(r["vs_best_peer"], "%.2fx")))
    out += ["", "Per CPU-second (process CPU time), the CPU the child got (CPU/wall), minor "
            "faults per array and peak RSS:", ""]
    out += one(res["table_cpu"], res["best_peer_cpu"],
               "k arrays/CPU-s, vs best peer, CPU/wall, faults/array, MB",
               lambda c, t, r: "%s, %s, %s, %s, %s" % (
                   f(r["median"] / 1e3, "%.1f"), f(r["vs_best_peer"], "%.2fx"),
                   f(res["cpu_share"][c].get(t), "%.2f"),
                   f(res["faults_per_array"][c].get(t), "%.2f"),
                   f(res["maxrss_mb"][c].get(t), "%.0f")))
    out.append("")
    for t, v in res["verdict"].items():
        out.append("T=%d: %s" % (t, json.dumps(v, sort_keys=True)))
    return "\n".join(out)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, "
                    "1 first for the scaling column (default 1,2; at most %d)" % MAX_WORKERS)
    ap.add_argument("--reps", type=int, help="repetitions (default 5; 1 with --quick)")
    ap.add_argument("--configs", help="comma-separated configurations (default %s; any of %s)"
                    % (",".join(DEFAULT_CONFIGS), ",".join(CONFIGS)))
    ap.add_argument("--quick", action="store_true", help="short rounds (a smoke test)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", help="write samples, medians, the tables and the verdict as JSON")
    ap.add_argument("--report", metavar="JSON", help="only print the tables of a result file")
    args = ap.parse_args(argv)
    try:
        args.threads = [int(x) for x in args.threads.split(",")]
    except ValueError:
        ap.error("--threads: comma-separated integers, e.g. 1,2,4")
    if any(t < 1 or t > MAX_WORKERS for t in args.threads) or len(set(args.threads)) != len(args.threads):
        ap.error("--threads: distinct counts from 1 to %d (the policy has %d worker arenas)"
                 % (MAX_WORKERS, MAX_WORKERS))
    if args.reps is not None and args.reps < 1:
        ap.error("--reps: at least 1")
    args.reps = args.reps or (1 if args.quick else 5)
    args.configs = args.configs.split(",") if args.configs else list(DEFAULT_CONFIGS)
    if "default" not in args.configs:
        args.configs.insert(0, "default")
    return args


def loadavg():
    try:
        return os.getloadavg()
    except OSError:
        return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        quick = "--quick" in argv
        out = child(int(argv[1]), BIG_EVERY if quick else 8 * BIG_EVERY, 1 if quick else 3)
        print(json.dumps(out))
        return
    args = parse_args(argv)
    if args.report:
        d = json.load(open(args.report))
        m = d["meta"]
        order = m.get("config_order") or [c for c in CONFIGS if c in m["configs"]]
        print(markdown(summaries(d["samples"], order, m["threads"]), order, m["threads"]))
        return
    skipped = usable_configs(args.configs, CONFIGS)
    rng = random.Random(args.seed)
    samples = []
    meta = {"loadavg_start": loadavg()}
    t_start = time.time()
    for rep in range(args.reps):
        pairs = [(c, t) for c in args.configs for t in args.threads]
        rng.shuffle(pairs)
        for c, t in pairs:
            samples.append({"rep": rep, "config": c, **run_child(c, t, args.quick, 600)})
        print("repetition %d/%d done, %.0f s" % (rep + 1, args.reps, time.time() - t_start),
              file=sys.stderr)
    res = summaries(samples, args.configs, args.threads)
    print(markdown(res, args.configs, args.threads))
    meta.update({
        "quick": args.quick, "reps": args.reps, "threads": args.threads,
        "seconds": round(time.time() - t_start), "loadavg_end": loadavg(),
        "python": platform.python_version(), "gil": gil_enabled(),
        "executable": sys.executable, "cpus": os.cpu_count(), "kernel": platform.release(),
        "configs": {c: CONFIGS[c][0] for c in args.configs}, "config_order": args.configs,
        "skipped": skipped, "loop": {"small_elements": SMALL_N, "medium_bytes": MEDIUM_BYTES,
                 "big_bytes": BIG_BYTES, "big_every": BIG_EVERY,
                 "arrays_per_iteration": ARRAYS_PER_ITER},
    })
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "samples": samples, **res}, f, indent=1, sort_keys=True)
        print("wrote " + args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
