"""`reload PID` or `reload --all [--match TEXT]`: ask a running job (or every
datamem process of this user that handles SIGHUP) to reload its policy."""
from .._stats import reload

NAMES = ("reload",)


def add(sub):
    r = sub.add_parser("reload", help="ask a running process to reload its policy (SIGHUP)")
    r.add_argument("pid", type=int, nargs="?", help="the process to reload")
    r.add_argument("--all", action="store_true",
                   help="every datamem process of this user that handles SIGHUP")
    r.add_argument("--match", metavar="TEXT",
                   help="with --all: only processes whose command line contains TEXT")


def run(a, p):
    if a.all == (a.pid is not None):
        p.error("reload needs a PID or --all (not both)")
    # reload_pid refuses processes that are not this user's datamem ones
    return reload.reload_all(a.match) if a.all else reload.reload_pid(a.pid)
