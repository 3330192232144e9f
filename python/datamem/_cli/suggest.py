"""`suggest DIR [--resident] [--memory 16GiB [--spill-dir DIR]]`: a policy for
the profiled job, with its numbers; with --memory, a spill arena if its peak
does not fit."""
import sys

from .._profile import suggest, suggest_spill
from .common import load_profile, memory_size, spill_dir

NAMES = ("suggest",)


def add(sub):
    sg = sub.add_parser("suggest", help="propose a policy from an allocation profile")
    sg.add_argument("dir", help="the profile directory (profile --out)")
    sg.add_argument("--resident", action="store_true",
                    help="give long-lived big arrays an arena of their own (faster random "
                         "access on hugepages, more peak RSS)")
    sg.add_argument("--memory", type=memory_size, metavar="SIZE",
                    help="the memory the job will have (16GiB): if its peak does not fit, "
                         "spill to disk what does not")
    sg.add_argument("--spill-dir", type=spill_dir, default=suggest_spill.DEFAULT_DIR,
                    metavar="DIR", help="with --memory: where spilled arrays go (default "
                    "%(default)s; yours, on local disk)")


def run(a, p):
    prof = load_profile(a.dir, user_sites=False)
    if prof is None:
        return 1
    sys.stdout.write(suggest.suggest(prof, resident_arena=a.resident, memory=a.memory,
                                     spill_dir=a.spill_dir))
    return 0
