"""`profile [--out DIR] [--sample BYTES | --full] [--stacks] [--policy P] -- CMD`:
run CMD recording an allocation profile of every process it starts
(DIR/<pid>.dmprof; DATAMEM_PROFILE=DIR)."""
import os
import sys

from .. import _ext, _text
from .._explain import check
from .._profile import recording
from .common import add_job, job, parse_size

NAMES = ("profile",)


def add(sub):
    pr = sub.add_parser("profile", help="run a command recording an allocation profile")
    pr.add_argument("--out", metavar="DIR", help="where the profile goes (default: "
                    "./datamem-profile-PID; must hold no .dmprof files)")
    pr.add_argument("--sample", type=parse_size, default=None, metavar="BYTES",
                    help="mean bytes between samples (default 512KiB)")
    pr.add_argument("--full", action="store_true", help="record every allocation (short jobs)")
    pr.add_argument("--stacks", action="store_true", default=None,
                    help="record whole Python stacks (default: with --full)")
    pr.add_argument("--policy", help="run under this policy (default: one pass-through arena)")
    pr.add_argument("--max-size", type=parse_size, default=None, metavar="BYTES",
                    help="each process's profile stops at this size (default 256MiB, "
                         "DATAMEM_PROFILE_MAX)")
    add_job(pr)


def run(a, pr):
    cmd = job(a, pr)
    if a.full and a.sample is not None:
        pr.error("--full and --sample exclude each other")
    out = a.out or "datamem-profile-%d" % os.getpid()
    from .._files import UnsafeError, owned_dir
    try:  # the job's start-up checks it too; here it fails before the job runs
        os.close(owned_dir(out, create=True))
    except (OSError, UnsafeError) as e:
        pr.error("--out %s: %s" % (out, getattr(e, "strerror", None) or e))
    if any(n.endswith(".dmprof") for n in os.listdir(out)):
        pr.error("%s already holds a profile (.dmprof files); give another --out" % out)
    if a.max_size is not None and 0 < a.max_size < _ext.PROFILE_MAX_BYTES_MIN:
        pr.error("--max-size must be at least %d bytes" % _ext.PROFILE_MAX_BYTES_MIN)
    if a.policy:
        ok, text, _ = check(a.policy)
        if not ok:
            sys.stderr.write(text)
            return 2
    sample = 0 if a.full else (a.sample or recording.DEFAULT_SAMPLE)
    rc = recording.run(cmd, out, sample, a.stacks, a.policy, a.max_size)
    files = [n for n in os.listdir(out) if n.endswith(".dmprof")] if os.path.isdir(out) else []
    size = sum(os.path.getsize(os.path.join(out, n)) for n in files)
    sys.stderr.write("datamem: profile of %d process%s in %s (%.1f MB); %s\n"
                     % (len(files), "" if len(files) == 1 else "es", _text.printable(out),
                        size / 1e6, _text.shell_command("python", "-m", "datamem", "report",
                                                        out)))
    return rc
