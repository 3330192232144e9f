"""`python -m datamem tune [--out FILE] [--reps N] -- CMD ...`: the policy that
measured best on the job itself.

A suggestion is a measurement, not an estimate (an estimate of "faults
avoided" promised twelve times an fft job's whole count, and the policy it
went with doubled a pandas job's faults). tune runs CMD, one child process per run, under
NumPy's default allocator (DATAMEM_CONFIG unset), the preset minimal.yaml
(shipped in the package) and the policy `suggest` makes from a profile of a
first run of CMD (that run is not measured), N times each in
interleaved order (repetition r starts at the r-th configuration, so drift in
the machine's load spreads over all of them). Per run, the same deterministic
costs as the real-job benchmark (bench/jobs/child.py):

  small faults  ru_minflt of the child (os.wait4: it and the children it waited for)
  THP faults    the change of /proc/vmstat's thp_fault_alloc around the child; that
                counter is machine-wide, so runs are sequential and another
                process's hugepage faults count too
  zeroed        small faults x page size + THP faults x 2 MiB: the bytes the kernel
                zeroed for the job
  CPU           ru_utime + ru_stime
  peak RSS      ru_maxrss
  finished      exit status 0

The pick (RULE, also in `tune --help` and docs/find-your-policy.md): a
configuration with a run that did not finish is out; so is one whose median
peak RSS is more than 2% above the default's (or, if the default did not
finish, above the lowest); of the rest, those whose median CPU time is within
3% of the lowest; of those, the one with the fewest bytes zeroed (then less CPU).

The written policy is the winner's text under a header with the table and the
command line. No policy keeps NumPy's own allocator (every policy serves arrays
from jemalloc arenas), so when the default wins, the file is minimal.yaml under
a header that says to leave DATAMEM_CONFIG unset, and tune says so on stderr.
The file is written with temp + rename (_files.write_atomic), never through a
link: a symbolic link at --out is refused.
"""
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

from .. import _ext
from .._text import printable, shell_command

PRESETS = ("minimal",)
SUGGESTED = "suggested"
DEFAULT = "default"
CPU_SLACK = 0.03   # within 3% of the lowest CPU time
RSS_SLACK = 0.02   # at most 2% above the default's peak RSS
THP_BYTES = 2 << 20
RULE = ("a configuration with a run that did not finish is out, and so is one whose median "
        "peak RSS is more than 2%% above the default's; of the rest, those within 3%% of the "
        "lowest median CPU time; of those, the fewest bytes zeroed (small faults x %d + THP "
        "faults x 2 MiB)" % resource.getpagesize())
# Variables that would put a run under another policy or profile it.
_UNSET = ("DATAMEM_CONFIG", "DATAMEM_CONFIG_TEXT", "DATAMEM_PROFILE", "DATAMEM_PROFILE_SAMPLE",
          "DATAMEM_PROFILE_STACKS", "DATAMEM_PROFILE_MAX")


class TuneError(Exception):
    """Bad input or nothing to pick: one line for the user."""


def preset(name):
    """The path of a preset shipped in the package (datamem/NAME.yaml)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, name + ".yaml")


def thp_faults():
    """/proc/vmstat's thp_fault_alloc (machine-wide), or None without it."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "thp_fault_alloc":
                    return int(v)
    except OSError:
        pass
    return None


def child_env(policy=None, extra=None):
    env = dict(os.environ)
    for k in _UNSET:
        env.pop(k, None)
    if policy:
        env["DATAMEM_CONFIG"] = os.path.abspath(policy)
    env.update(extra or {})
    return env


def run_once(cmd, policy=None, extra=None):
    """Runs cmd once (stdin and stdout /dev/null): {"finished", "status",
    "small", "thp", "zeroed", "cpu", "rss", "error"}."""
    page = resource.getpagesize()
    with tempfile.TemporaryFile() as err:
        thp0 = thp_faults()
        try:
            p = subprocess.Popen(cmd, env=child_env(policy, extra), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=err)
        except OSError as e:
            raise TuneError("cannot run %s: %s" % (printable(cmd[0]), e.strerror)) from None
        while True:
            try:
                _, status, ru = os.wait4(p.pid, 0)
                break
            except InterruptedError:
                continue
        thp1 = thp_faults()
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        err.seek(max(0, os.fstat(err.fileno()).st_size - 4096))
        tail = err.read().decode("utf-8", "replace").strip().splitlines()
    thp = None if thp0 is None or thp1 is None else max(0, thp1 - thp0)
    return {"finished": p.returncode == 0, "status": p.returncode, "small": ru.ru_minflt,
            "thp": thp, "zeroed": ru.ru_minflt * page + (thp or 0) * THP_BYTES,
            "cpu": ru.ru_utime + ru.ru_stime, "rss": ru.ru_maxrss * 1024,
            "error": printable(tail[-1]) if tail and p.returncode != 0 else ""}


def suggested_policy(cmd, work):
    """Profiles one run of cmd into `work`/profile and returns the path of the
    policy `suggest` makes from it, or (None, why not)."""
    from . import read, suggest
    from .dmprof import ProfileError
    prof_dir = os.path.join(work, "profile")
    os.mkdir(prof_dir, 0o700)
    r = run_once(cmd, extra={"DATAMEM_PROFILE": prof_dir})
    if not r["finished"]:
        return None, "the profiling run exited with status %d%s" % (
            r["status"], ": " + r["error"] if r["error"] else "")
    try:
        prof = read.load(prof_dir)
    except (OSError, ProfileError) as e:
        return None, "no profile: %s" % e
    path = os.path.join(work, "suggested.yaml")
    with open(path, "w") as f:
        f.write(suggest.suggest(prof))
    return path, None


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def summarize(runs):
    """Medians of a configuration's runs (finished ones; all if none finished)."""
    done = [r for r in runs if r["finished"]] or runs
    thp = [r["thp"] for r in done if r["thp"] is not None]
    return {"runs": len(runs), "finished": sum(r["finished"] for r in runs),
            "zeroed": median([r["zeroed"] for r in done]),
            "small": median([r["small"] for r in done]),
            "thp": median(thp) if len(thp) == len(done) else None,
            "cpu": median([r["cpu"] for r in done]), "rss": median([r["rss"] for r in done]),
            "error": next((r["error"] or "exit status %d" % r["status"]
                           for r in runs if not r["finished"]), "")}


def pick(stats):
    """The winner's name under RULE, or None when no configuration finished
    every run. `stats`: {name: summarize()}, DEFAULT among them."""
    ok = {n: s for n, s in stats.items() if s["finished"] == s["runs"]}
    if not ok:
        return None
    base = ok[DEFAULT]["rss"] if DEFAULT in ok else min(s["rss"] for s in ok.values())
    pool = {n: s for n, s in ok.items()
            if n == DEFAULT or s["rss"] <= base * (1 + RSS_SLACK)}
    cpu = min(s["cpu"] for s in pool.values())
    pool = {n: s for n, s in pool.items() if s["cpu"] <= cpu * (1 + CPU_SLACK)}
    return min(pool, key=lambda n: (pool[n]["zeroed"], pool[n]["cpu"]))


def table(stats, order):
    """The measured table, one line per configuration (plain text)."""
    rows = [("config", "finished", "zeroed MB", "small faults", "THP faults", "CPU s",
             "peak RSS MB")]
    for n in order:
        s = stats[n]
        rows.append((n, "%d/%d" % (s["finished"], s["runs"]), "%.1f" % (s["zeroed"] / 1e6),
                     "%d" % s["small"], "n/a" if s["thp"] is None else "%d" % s["thp"],
                     "%.2f" % s["cpu"], "%.1f" % (s["rss"] / 1e6)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def header(argv, reps, stats, order, winner, notes):
    lines = ["# Measured by: " + shell_command(*argv),
             "# %d run%s per configuration, interleaved; medians of the finished runs. zeroed:"
             % (reps, "" if reps == 1 else "s"),
             "# bytes the kernel zeroed (small faults x %d + THP faults x 2 MiB; THP from"
             % resource.getpagesize(),
             "# /proc/vmstat, machine-wide)."]
    lines += ["#   " + line for line in table(stats, order)]
    lines += textwrap.wrap("Pick: " + RULE + ".", 84, initial_indent="# ",
                           subsequent_indent="# ")
    for n in notes:
        lines += textwrap.wrap(printable(n), 84, initial_indent="# ", subsequent_indent="#   ")
    if winner == DEFAULT:
        lines += ["# NumPy's default allocator measured best: run this job with DATAMEM_CONFIG "
                  "unset.",
                  "# No policy keeps NumPy's allocator (every policy serves arrays from jemalloc",
                  "# arenas); what follows is minimal.yaml (its row above), for when the job needs",
                  "# datamem anyway (stats, tags, limits)."]
    else:
        lines += ["# Measured best: %s (what follows)." % winner]
        if winner == SUGGESTED:
            lines += ["# (suggest's own header names the profile tune recorded of one run, in a",
                      "# temporary directory removed since.)"]
    return lines


def _candidates(cmd, candidates, work, policies, notes, log):
    """Adds {name: policy path} for each candidate to `policies` (the suggested
    one from a profile of one run in `work`), each checked; notes why one is not."""
    for c in candidates:
        if c in PRESETS:
            policies[c] = preset(c)
        elif c == SUGGESTED:
            log.write("datamem: tune: profiling one run for suggest's policy\n")
            path, why = suggested_policy(cmd, work)
            if path is None:
                notes.append("suggested: not measured (%s)" % why)
                log.write("datamem: tune: suggest's policy not measured: %s\n" % printable(why))
            else:
                policies[c] = path
        else:  # a policy file of the user's
            # escaped: the name goes into the header's comments and the log
            name = printable(os.path.basename(c))
            if name in policies or name in PRESETS + (SUGGESTED,):
                raise TuneError("--candidates: two configurations named %s" % printable(name))
            if not os.path.isfile(c):
                raise TuneError("--candidates: %s: neither a name (%s) nor a policy file"
                                % (printable(c), ", ".join(PRESETS + (SUGGESTED,))))
            policies[name] = c
    for name, path in policies.items():
        if path is None:
            continue
        ok, text, _ = _ext.check(path)
        if not ok:
            raise TuneError("%s: not a valid policy:\n%s" % (name, text.rstrip()))


def _measure(cmd, policies, order, reps, log):
    """Runs cmd reps times under each configuration, repetition r starting at
    the r-th: {name: [run_once()]}."""
    runs = {n: [] for n in order}
    for r in range(reps):
        for i in range(len(order)):
            name = order[(r + i) % len(order)]
            res = run_once(cmd, policies[name])
            runs[name].append(res)
            log.write("datamem: tune: run %d/%d %-12s %s\n"
                      % (r + 1, reps, name, "cpu %.2f s, %d small faults" % (
                          res["cpu"], res["small"]) if res["finished"] else
                         "did not finish: " + (res["error"] or "exit status %d"
                                               % res["status"])))
    return runs


def tune(cmd, out=None, reps=3, candidates=(PRESETS + (SUGGESTED,)), argv=None, log=sys.stderr):
    """Runs the measurements and writes the policy (to `out`, else returns its
    text for stdout). Returns (text or None, winner)."""
    from .._files import write_atomic
    if reps < 1:
        raise TuneError("--reps must be at least 1")
    if out is not None:  # before minutes of runs, not after
        refuse_link(out)
        from .._files import UnsafeError, owned_dir
        try:
            os.close(owned_dir(os.path.dirname(out) or "."))
        except (OSError, UnsafeError) as e:
            raise TuneError("--out %s: %s" % (printable(out),
                                              getattr(e, "strerror", None) or e)) from None
    work = tempfile.mkdtemp(prefix="datamem-tune-")
    try:
        policies, notes = {DEFAULT: None}, []
        _candidates(cmd, candidates, work, policies, notes, log)
        order = list(policies)
        runs = _measure(cmd, policies, order, reps, log)
        stats = {n: summarize(runs[n]) for n in order}
        for n in order:
            if stats[n]["finished"] < stats[n]["runs"]:
                notes.append("%s: out, a run did not finish (%s)" % (n, stats[n]["error"]))
        winner = pick(stats)
        for line in table(stats, order):
            log.write("datamem: tune: %s\n" % line)
        if winner is None:
            raise TuneError("no configuration finished every run; nothing written")
        body_path = policies[winner] or preset("minimal")
        with open(body_path) as f:
            body = f.read()
        body += "" if body.endswith("\n") else "\n"
        text = "\n".join(header(argv or ["python", "-m", "datamem", "tune", "--"] + list(cmd),
                                reps, stats, order, winner, notes)) + "\n\n" + body
        if winner == DEFAULT:
            log.write("datamem: tune: NumPy's default allocator measured best: leave "
                      "DATAMEM_CONFIG unset for this job%s\n"
                      % (" (%s holds minimal.yaml and the table)" % printable(out)
                         if out else ""))
        else:
            log.write("datamem: tune: measured best: %s%s\n"
                      % (winner, " -> " + printable(out) if out else ""))
        if out is None:
            return text, winner
        refuse_link(out)
        try:
            write_atomic(out, text, mode=0o644)
        except OSError as e:
            raise TuneError("--out %s: %s" % (printable(out),
                                              getattr(e, "strerror", None) or e)) from None
        return None, winner
    finally:
        shutil.rmtree(work, ignore_errors=True)


def refuse_link(out):
    """--out must not be a symbolic link (tune replaces files, never writes
    through a link, and refuses rather than replace the link itself)."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as e:
        raise TuneError("--out %s: %s" % (printable(out), e.strerror)) from None
    if stat.S_ISLNK(st.st_mode):
        raise TuneError("--out %s: a symbolic link; give a plain file's path" % printable(out))
    if not stat.S_ISREG(st.st_mode):
        raise TuneError("--out %s: not a regular file" % printable(out))
