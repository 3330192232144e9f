"""The performance net: figures that repeat, checked against budgets in bench/budgets.json.

    python3 bench/net.py [--budgets bench/budgets.json] [--only FIGURE_PREFIX,...]
                         [--out FILE.json] [--write]

Wall time on a shared 2-core VM swings by 2x and more (docs/performance.md, "How
to read these numbers"); these figures do not: pages the kernel zeroed and
minor page faults per operation (getrusage), instructions per operation
(callgrind, counted exactly), and peak
RSS measured against a yardstick that does not move. Each is measured under
configs/minimal.yaml (the policy datamem ships), every workload in a fresh
process, from a fixed seed:

  mixed           bench/workloads.py mixed --quick: 4 KiB pages the kernel zeroed
                  per operation, run with hugepages off for the process so that
                  each fault is one page (pages_zeroed_per_op), and, run as it
                  is, peak RSS over the start's, divided by the run's peak live bytes
                  (rss_over_live; NumPy's default reads 1.02-1.45 here, by where
                  glibc's sliding mmap threshold lands, so it is not the yardstick)
  temp8, temp64   d = a*b + c; e = np.sqrt(d) - a on 8 and 64 MiB: faults per iteration
  threads8        the same loop in two threads: faults per iteration in the loops
  empty64, empty16k, smallops
                  callgrind instructions per operation (the whole process, the
                  Python loop included) of np.empty(64 B), np.empty(16 KiB) and a
                  loop of small NumPy operations, with per-tag counting off and on
                  (DATAMEM_TAG_BYTES=1): `+count` figures, and under the policy
                  with `worker_limit: 100%` added (`+limit`: the limited reserve
                  and the staleness check of the memory beside the arrays; the
                  reading itself, beside_read, comes at most every 10 ms of
                  wall time, so how many land in a phase follows the machine's
                  load: its instructions are taken out) (instr_per_op); and of
                  those, datamem's own share: the instructions inside the NEP 49
                  handler's functions, what they call included (own_instr_per_op,
                  a second callgrind run collecting only there). NumPy's default
                  handler's figures are measured alongside (`default/...`, no
                  budget: the yardstick a budget is flagged against)
  pandas          bench/jobs pandas3_etl (pandas 2: pandas_etl) at scale 0.3: peak
                  RSS as a ratio to NumPy's default in the same run
  jobs/JOB        every job of bench/jobs at scale 0.3, under the policy and under
                  NumPy's default in the same run, each child with hugepages off
                  (so each fault is one 4 KiB page the kernel zeroed, counted per
                  process): pages zeroed during the job (zeroed_ratio) and peak
                  RSS (rss_ratio), each as a ratio to the default's

A figure fails when it is worse than its budget by more than the budget's
tolerance (relative `tol` plus absolute `abs`); one better by more than that is
reported as room to tighten, and passes. Exit status 1 when any figure fails.
--write keeps, per figure, the better (lower) of its budget and this run's
figure (tolerances kept), so a regression is never written in as a budget;
it flags a budget above NumPy's default's figure where the run measured that.
Loosening a budget is a hand edit with a reason in docs/performance.md (its
"The net" section says how). About 4 minutes on 2 cores (idle); needs valgrind and
the jobs' libraries (pandas 3, pyarrow, scikit-learn, SciPy).
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import child_env  # noqa: E402  one environment discipline for every benchmark

POLICIES = {"minimal": "configs/minimal.yaml"}
PHASE_N = 20000  # operations per callgrind phase
SUFFIX = {False: "", True: "+count", "limit": "+limit"}  # a callgrind figure's mode

# One process per (policy, counting, what is collected): a warm-up, then each
# loop between two os.getppid() calls, where callgrind dumps its counts
# (--dump-before). It prints the handler NumPy allocates through.
CALLGRIND_LOOPS = r"""
import os, sys
import numpy as np
n = int(sys.argv[1])
try:
    from numpy._core.multiarray import get_handler_name
except ImportError:  # NumPy 1
    from numpy.core.multiarray import get_handler_name
print(get_handler_name(), flush=True)
u = np.uint8
a = np.arange(32.0)
def empty64(k):
    for _ in range(k):
        np.empty(64, u)
def empty16k(k):
    for _ in range(k):
        np.empty(16384, u)
def smallops(k):
    for _ in range(k):
        b = a + 1.0
        c = b * a
        c.sum()
for f in (empty64, empty16k, smallops):
    f(2000)  # bind, learn the classes, fill the caches
    os.getppid()
    f(n)
    os.getppid()
"""
LOOPS = ["empty64", "empty16k", "smallops"]
# The NEP 49 handlers' entry points, where NumPy hands over (static symbols:
# callgrind finds them in the .so's symbol table, kept in the wheel). datamem's
# recording handlers call no other entry point, so collection toggles on and off
# once per call; a tail call (h_malloc -> dm_alloc) stays inside the toggle.
HANDLER_FUNCTIONS = {
    "datamem": ["h_malloc", "h_calloc", "h_realloc", "h_free", "dm__record_malloc",
                "dm__record_calloc", "dm__record_realloc", "dm__record_free"],
    "default_allocator": ["default_malloc", "default_calloc", "default_realloc",
                          "default_free"],
}
DEFAULT = "default"  # figures of NumPy's own handler: yardsticks, never budgets
# The tolerance a new budget gets, by the figure's last part: instruction counts
# repeat to 0.1%, faults to a few per run, peak RSS to a megabyte or two.
# datamem's own share (about 130 of a 2,200-instruction np.empty) gets its own:
# the whole op's 2% is 44 instructions, a third of the share. The share repeats
# to the instruction; 2% plus 2 fails a regression of 10 instructions per
# malloc+free pair in every figure (238 counted: limit 244.8), 5% would not.
TOLERANCES = {
    "instr_per_op": {"tol": 0.02},
    "own_instr_per_op": {"tol": 0.02, "abs": 2.0},
    "pages_zeroed_per_op": {"tol": 0.05},
    "faults_per_iter": {"abs": 0.5},
    "rss_over_live": {"tol": 0.02},
    "rss_ratio": {"abs": 0.01},
    "zeroed_ratio": {"tol": 0.05},
}


def no_hugepages():
    """In the child before exec: PR_SET_THP_DISABLE (inherited across exec), so
    every page fault is one 4 KiB page the kernel zeroed, counted per process
    (hugepage faults are counted only machine-wide, in /proc/vmstat)."""
    ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)


def run_json(cmd, env, timeout=600, hugepages=True):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                       preexec_fn=None if hugepages else no_hugepages)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode,
                                                   p.stderr.strip()[-2000:]))
    return json.loads(p.stdout.strip().splitlines()[-1])


def policy_env(policy, extra=None):
    env = {"DATAMEM_CONFIG": os.path.join(ROOT, POLICIES[policy])} if policy else {}
    env.update(extra or {})
    return child_env(env)


def under_datamem(what, policy, out):
    """out, a child's reading under policy; an error if NumPy did not allocate
    through datamem's handler there (the figure would be the default's)."""
    if out["handler"] != "datamem":
        raise RuntimeError("%s under %s ran with handler %r" % (what, policy, out["handler"]))
    return out


def workload(name, policy, hugepages=True):
    return under_datamem(name, policy, run_json(
        [sys.executable, os.path.join(HERE, "workloads.py"), name, "--quick"],
        policy_env(policy), hugepages=hugepages))


def figures_workloads(policy):
    f = {}
    m = workload("mixed", policy)
    r = m["results"]
    f["mixed/rss_over_live"] = (m["maxrss_kb"] - m["rss0_kb"]) * 1024 / (r["peak_live_mb"] * 1e6)
    # The pages the kernel zeroes, not the faults: with hugepages a fault zeroes
    # 4 KiB or 2 MiB, and a build that zeroes a quarter of the bytes can take
    # more faults (lending, bigblock.c: 58.9 against 55.9 per op, 717 MB zeroed
    # against 2,683). With hugepages off for the process each fault is one page.
    f["mixed/pages_zeroed_per_op"] = workload("mixed", policy, hugepages=False)["results"]["faults"]
    for w in ("temp8", "temp64"):
        f["%s/faults_per_iter" % w] = workload(w, policy)["results"]["faults"]
    f["threads8/faults_per_iter"] = workload("threads8", policy)["results"]["steady_faults"]
    return f


# Called by time, not per operation: the reading of the memory beside the
# arrays (runtime/beside.c), at most once per 10 ms of wall time. Under
# callgrind an operation takes ~50x its time, and more when the machine is
# busy, so the readings per phase follow the load (CI once read 1,790
# instructions for smallops+limit where an idle machine reads 1,738).
TIMED = "beside_read"


def callee_inclusive(dump, name):
    """The inclusive instructions of every call to function `name` in one
    callgrind dump (its lines): the cost line after each `calls=` line whose
    `cfn=` names it. Names are compressed: `(id) name` the first time, `(id)`
    after."""
    names, total, callee, take = {}, 0, None, False
    for line in dump:
        if line.startswith(("fn=", "cfn=", "cfi=", "cfl=", "fl=", "fi=", "fe=", "ob=", "cob=")):
            key, _, rest = line.partition("=")
            ident, _, label = rest.partition(" ")
            if ident.startswith("(") and label:
                names[(key.lstrip("c"), ident)] = label
            if key == "cfn":
                callee = names.get(("fn", ident), label or None)
        elif line.startswith("calls="):
            take = callee == name
        elif take:
            total += int(line.split()[1])
            take = False
    return total


def callgrind_totals(policy, count, own=False, n=PHASE_N):
    """Instructions per operation of each loop in LOOPS (one callgrind process):
    the whole process's, or with `own` only those inside the handler's functions
    (what they call included). policy None: NumPy's default handler. count:
    False, True (DATAMEM_TAG_BYTES=1) or "limit" (the policy with
    `worker_limit: 100%` added)."""
    expect = "datamem" if policy else "default_allocator"
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "loops.py")
        with open(script, "w") as fh:
            fh.write(CALLGRIND_LOOPS)
        env = policy_env(policy)
        env.pop("DATAMEM_TAG_BYTES", None)
        env["PYTHONHASHSEED"] = "0"  # the same dict layouts, run after run
        if count == "limit":
            limited = os.path.join(d, "limited.yaml")
            with open(os.path.join(ROOT, POLICIES[policy])) as src, open(limited, "w") as dst:
                dst.write(src.read() + "\nworker_limit: 100%\n")
            env["DATAMEM_CONFIG"] = limited
        elif count:
            env["DATAMEM_TAG_BYTES"] = "1"
        out = os.path.join(d, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", "--dump-before=os_getppid",
               "--callgrind-out-file=" + out]
        if own:
            cmd.append("--collect-atstart=no")
            cmd += ["--toggle-collect=" + f for f in HANDLER_FUNCTIONS[expect]]
        p = subprocess.run(cmd + [sys.executable, script, str(n)],
                           env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
        if p.returncode != 0:
            raise RuntimeError("callgrind failed (%d): %s" % (p.returncode, p.stderr[-2000:]))
        handler = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        if handler != expect:
            raise RuntimeError("callgrind loops under %s ran with handler %r, not %r"
                               % (policy or "NumPy's default", handler, expect))
        totals = []
        for i in range(1, 2 * len(LOOPS) + 1):
            with open("%s.%d" % (out, i)) as fh:
                dump = fh.read().splitlines()
            total = next(int(line.split()[1]) for line in dump if line.startswith("totals:"))
            if count == "limit":
                timed = callee_inclusive(dump, TIMED)
                if i == 1 and not timed:
                    # the first reserve reads at once: a dump without it means
                    # the name moved (renamed, inlined), and the readings would
                    # be counted again, by the load
                    raise RuntimeError("callgrind saw no call to %s in the +limit loops' "
                                       "start: renamed or inlined (`nm`)?" % TIMED)
                total -= timed
            totals.append(total)
    # dumps 2, 4, 6 hold the measured loops (1, 3, 5: warm-ups and start-up)
    figs = {name: totals[2 * i + 1] / n for i, name in enumerate(LOOPS)}
    if own and not all(figs.values()):
        # callgrind found no handler function (a stripped .so, a renamed one):
        # a share of 0 would read as room, and the net would watch nothing
        raise RuntimeError("callgrind saw no instructions in %s (%s): are their symbols "
                           "in the .so (`nm`)?" % (", ".join(HANDLER_FUNCTIONS[expect]), figs))
    return figs


def figures_callgrind(policy):
    """A policy's figures, counting off and on; policy None: NumPy's default
    handler's (counting is datamem's, so off only)."""
    f = {}
    for count in (False, True, "limit") if policy else (False,):
        for own in (False, True):
            metric = "own_instr_per_op" if own else "instr_per_op"
            for name, v in callgrind_totals(policy, count, own).items():
                f["%s%s/%s" % (name, SUFFIX[count], metric)] = v
    return f


def pandas_job():
    try:
        import pandas
    except ImportError:
        sys.exit("bench/net.py: pandas is needed (pip install pandas)")
    return "pandas3_etl" if int(pandas.__version__.split(".")[0]) >= 3 else "pandas_etl"


def figures_pandas(policies):
    """The pandas job's peak RSS with hugepages on (the machine's setting),
    over the default's: hugepage advice rounds blocks up to whole 2 MiB frames,
    which the jobs' figures (hugepages off, figures_jobs) cannot see."""
    job = pandas_job()
    cmd = [sys.executable, os.path.join(HERE, "jobs", "child.py"), job, "--scale", "0.3"]
    base = run_json(cmd, policy_env(None))["maxrss_mb"]
    return {p: {"pandas/rss_ratio": under_datamem(job, p, run_json(cmd, policy_env(p)))["maxrss_mb"]
                / base} for p in policies}


def job_names():
    """Every job of bench/jobs (each needs its libraries: pandas 3, pyarrow,
    scikit-learn, SciPy; a missing one fails the net, it is not skipped)."""
    jobs = os.path.join(HERE, "jobs")
    if jobs not in sys.path:
        sys.path.insert(0, jobs)
    from child import JOBS
    return list(JOBS)


JOB_REPS = 3  # per job and configuration, interleaved; the medians are compared


def figures_jobs(policies):
    """Per job, pages zeroed during the job (imports excluded) and peak RSS
    under each policy, as ratios to NumPy's default's, medians of JOB_REPS runs
    interleaved. Hugepages are off in each child: every fault is one 4 KiB
    page, counted per process, so a run's count is its own whatever else the
    machine runs; what still varies is the job's (threads, Arrow's pool)."""
    out = {p: {} for p in policies}
    for job in job_names():
        cmd = [sys.executable, os.path.join(HERE, "jobs", "child.py"), job, "--scale", "0.3"]
        runs = {c: [] for c in [None] + policies}
        for _ in range(JOB_REPS):
            for c in runs:
                r = run_json(cmd, policy_env(c), hugepages=False)
                runs[c].append(under_datamem(job, c, r) if c else r)
        med = {c: {k: statistics.median(r[k] for r in rs) for k in ("faults", "maxrss_mb")}
               for c, rs in runs.items()}
        for p in policies:
            out[p]["jobs/%s/zeroed_ratio" % job] = med[p]["faults"] / med[None]["faults"]
            out[p]["jobs/%s/rss_ratio" % job] = med[p]["maxrss_mb"] / med[None]["maxrss_mb"]
    return out


def figure_names():
    """Every figure a full run measures (bench/budgets.json holds one budget each)."""
    per = ["mixed/pages_zeroed_per_op", "mixed/rss_over_live", "temp8/faults_per_iter",
           "temp64/faults_per_iter", "threads8/faults_per_iter", "pandas/rss_ratio"]
    per += ["%s%s/%s" % (loop, c, m) for loop in LOOPS for c in SUFFIX.values()
            for m in ("instr_per_op", "own_instr_per_op")]
    per += ["jobs/%s/%s" % (j, m) for j in job_names() for m in ("zeroed_ratio", "rss_ratio")]
    return sorted("%s/%s" % (p, f) for p in POLICIES for f in per)


def measure(only):
    want = lambda key: not only or any(key.startswith(o) for o in only)  # noqa: E731
    figs = {}
    for p in POLICIES:
        if want(p + "/mixed") or want(p + "/temp") or want(p + "/threads"):
            figs.update({"%s/%s" % (p, k): v for k, v in figures_workloads(p).items()})
        if any(want("%s/%s" % (p, loop)) for loop in LOOPS):
            figs.update({"%s/%s" % (p, k): v for k, v in figures_callgrind(p).items()})
    if any(want("%s/%s" % (p, loop)) for p in POLICIES for loop in LOOPS):
        dflt = {"%s/%s" % (DEFAULT, k): v for k, v in figures_callgrind(None).items()}
    else:
        dflt = {}
    if any(want(p + "/pandas") for p in POLICIES):
        for p, fs in figures_pandas(list(POLICIES)).items():
            figs.update({"%s/%s" % (p, k): v for k, v in fs.items()})
    if any(want(p + "/jobs") for p in POLICIES):
        for p, fs in figures_jobs([p for p in POLICIES if want(p + "/jobs")]).items():
            figs.update({"%s/%s" % (p, k): v for k, v in fs.items()})
    figs = {k: v for k, v in figs.items() if want(k)}
    figs.update(dflt)
    return figs


def default_figure(key, figs):
    """NumPy's default handler's figure for a budget's key where this run measured
    it (None where not): a ratio is to the default by its definition."""
    policy, rest = key.split("/", 1)
    if policy == DEFAULT:
        return None
    if rest.endswith("_ratio"):
        return 1.0
    loop, metric = rest.split("/", 1)
    return figs.get("%s/%s/%s" % (DEFAULT, loop.split("+")[0], metric))


def write_budgets(figs, budgets):
    """Folds a run's figures into the budgets, in place: per figure the better
    (lower) of its budget and the figure, so that a regression never becomes a
    budget (loosening one is a hand edit, with its reason in docs/performance.md);
    a new figure gets TOLERANCES' tolerance. Returns the lines to print: what
    moved, what was kept, and every budget above NumPy's default's figure."""
    lines = []
    for k in sorted(figs):
        if k.startswith(DEFAULT + "/"):
            continue
        v = round(figs[k], 4)
        b = budgets.get(k)
        if b is None:
            b = budgets[k] = dict(TOLERANCES[k.rsplit("/", 1)[1]])
            b["value"] = v
            lines.append("new  %-40s %12.4f" % (k, v))
        elif v < b["value"]:
            lines.append("down %-40s %12.4f  from %12.4f" % (k, v, b["value"]))
            b["value"] = v
        elif v > b["value"]:
            lines.append("kept %-40s %12.4f  (this run %.4f is worse)" % (k, b["value"], v))
        d = default_figure(k, figs)
        if d is not None and b["value"] > d:
            lines.append("ABOVE NumPy's default: %s budget %.4f, the default's %.4f"
                         % (k, b["value"], d))
    return lines


def check(figs, budgets):
    """Returns (failures, lines): each figure against its budget."""
    failures, lines = [], []
    for key in sorted(set(figs) | set(budgets)):
        b = budgets.get(key)
        if key not in figs or key.startswith(DEFAULT + "/"):
            continue  # not measured in this run (--only), or a yardstick
        v = figs[key]
        if b is None:
            failures.append(key)
            lines.append("FAIL %-40s %12.4f  no budget in the file" % (key, v))
            continue
        limit = b["value"] * (1 + b.get("tol", 0.0)) + b.get("abs", 0.0)
        floor = b["value"] * (1 - b.get("tol", 0.0)) - b.get("abs", 0.0)
        if v > limit:
            failures.append(key)
            verdict = "FAIL"
        elif v < floor:
            verdict = "room"  # better than the budget by more than its tolerance
        else:
            verdict = "ok"
        lines.append("%-4s %-40s %12.4f  budget %12.4f  limit %12.4f" % (verdict, key, v,
                                                                          b["value"], limit))
    return failures, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default=os.path.join(HERE, "budgets.json"))
    ap.add_argument("--only", help="comma-separated figure prefixes, e.g. minimal/mixed")
    ap.add_argument("--out", help="write the measured figures as JSON")
    ap.add_argument("--figures", help="check figures from this JSON file instead of measuring")
    ap.add_argument("--write", action="store_true",
                    help="lower each budget to its measured figure where that is better "
                    "(a worse figure never raises one; tolerances kept)")
    args = ap.parse_args()
    only = args.only.split(",") if args.only else None
    if args.figures:
        with open(args.figures) as fh:
            figs = json.load(fh)
    else:
        figs = measure(only)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(figs, fh, indent=1, sort_keys=True)
    with open(args.budgets) as fh:
        doc = json.load(fh)
    budgets = doc["budgets"]
    if args.write:
        lines = write_budgets(figs, budgets)
        # a fresh file beside it (O_EXCL), then one rename: never half a file
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.budgets)),
                                   prefix=".budgets.", suffix=".json")
        try:
            os.chmod(tmp, os.stat(args.budgets).st_mode & 0o777)  # mkstemp's is 0600
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True)
                fh.write("\n")
            os.replace(tmp, args.budgets)
        except BaseException:
            os.unlink(tmp)
            raise
        print("\n".join(lines))
        print("wrote %s: each budget the better of its value and this run's figure"
              % args.budgets)
        return 0
    failures, lines = check(figs, budgets)
    print("\n".join(lines))
    if failures:
        print("\nnet: %d of %d figures past their budget: %s" % (len(failures), len(lines),
                                                                 ", ".join(failures)))
        print("(a budget is loosened only in a commit that says why in docs/performance.md)")
        return 1
    print("\nnet: %d figures within their budgets" % len(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
