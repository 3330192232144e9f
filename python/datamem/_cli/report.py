"""`report DIR [--html OUT] [--json] [--flamegraph OUT] [--folded OUT [--by count]]`:
top call sites (your frames) and their stacks, sizes, lifetimes, peak, threads,
tags; flame graphs."""
import sys

from .._files import write_atomic, write_new_file
from .._profile import flame, report
from .common import load_profile

NAMES = ("report",)


def add(sub):
    rp = sub.add_parser("report", help="summarize an allocation profile")
    rp.add_argument("dir", help="the profile directory (profile --out)")
    rp.add_argument("--html", metavar="OUT", help="write one self-contained HTML page")
    rp.add_argument("--json", action="store_true", help="print JSON for tools")
    rp.add_argument("--flamegraph", metavar="OUT", help="write flame graphs of bytes and of "
                    "allocations by stack as one self-contained HTML page")
    rp.add_argument("--folded", metavar="OUT", help="write the stacks in folded-stack text "
                    "(flamegraph.pl, inferno, speedscope)")
    rp.add_argument("--by", choices=("bytes", "count"), default="bytes",
                    help="what --folded counts (default bytes)")
    rp.add_argument("--top", type=int, default=10, help="call sites listed (default 10)")


def run(a, p):
    prof = load_profile(a.dir, user_sites=True)
    if prof is None:
        return 1
    s = report.summarize(prof, top=a.top)
    if a.html:
        try:  # temp file + rename in a directory of this user's: never through a link
            write_atomic(a.html, report.html(prof, s), mode=0o644)
        except OSError as e:
            sys.stderr.write("datamem: --html: %s\n" % e)
            return 1
    for opt, path, make in (("--folded", a.folded, lambda: flame.folded(prof, a.by)),
                            ("--flamegraph", a.flamegraph, lambda: flame.html(prof))):
        if path:
            try:
                write_new_file(path, make(), mode=0o644)
            except OSError as e:
                sys.stderr.write("datamem: %s: %s\n" % (opt, e))
                return 1
    if a.json:
        sys.stdout.write(report.to_json(s) + "\n")
    elif not (a.html or a.folded or a.flamegraph):
        sys.stdout.write(report.text(s))
    return 0
