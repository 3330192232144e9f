"""`tune [--out FILE] [--reps N] [--candidates NAME|FILE ...] -- CMD`: run CMD
under NumPy's default, the preset minimal.yaml and suggest's policy; write the
one that measured best (_profile/tune.py)."""
import sys

from .._profile import tune
from .common import add_job, job

NAMES = ("tune",)


def add(sub):
    tp = sub.add_parser(
        "tune", help="measure NumPy's default, minimal.yaml and suggest's policy on a command; "
        "write the best", description="Runs CMD (a child process per run, interleaved, --reps "
        "each) with DATAMEM_CONFIG unset, under minimal.yaml and the policy "
        "suggest makes from a profile of one first run; measures each run's small and THP "
        "faults, bytes zeroed, CPU time and peak RSS, and writes the policy that measured "
        "best with the table in its header. Pick: %s. When NumPy's default wins, the file is "
        "minimal.yaml under a header saying to leave DATAMEM_CONFIG unset." % tune.RULE)
    tp.add_argument("--out", metavar="FILE", help="write the policy here (temp + rename; a "
                    "symbolic link is refused); default: stdout")
    tp.add_argument("--reps", type=int, default=3, help="runs per configuration (default 3)")
    tp.add_argument("--candidates", nargs="+", metavar="NAME|FILE",
                    help="what to measure against the default: minimal, suggested or policy "
                    "files (default: minimal suggested)")
    add_job(tp)


def run(a, tp):
    """Measure, pick, write."""
    cmd = job(a, tp)
    argv = ["python", "-m", "datamem", "tune"] + (["--out", a.out] if a.out else []) + [
        "--reps", str(a.reps)] + (["--candidates"] + a.candidates if a.candidates else []) + [
        "--"] + cmd
    try:
        text, _ = tune.tune(cmd, a.out, a.reps, a.candidates or tune.PRESETS + (
            tune.SUGGESTED,), argv)
    except tune.TuneError as e:
        sys.stderr.write("datamem: tune: %s\n" % e)
        return 1
    if text is not None:
        sys.stdout.write(text)
    return 0
