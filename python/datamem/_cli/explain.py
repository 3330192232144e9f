"""`explain POLICY --size N ...` (or --table): which rule and arena serve an
allocation, why each earlier rule did not match, and what the policy's
worker_limit comes to here now."""
import sys

from .. import _ext
from .._explain import check, explain
from .common import parse_dtype, parse_size

NAMES = ("explain",)


def add(sub):
    e = sub.add_parser("explain", help="which rule and arena serve an allocation, and what "
                                       "the policy's worker_limit comes to here now")
    e.add_argument("policy", help="the policy file (YAML)")
    e.add_argument("--size", type=parse_size, help="allocation size (required unless --table)")
    e.add_argument("--dtype", type=parse_dtype, default="unknown",
                   help="the array's dtype, as match.dtype names it (float64, int32, ...; "
                        "default: unknown)")
    e.add_argument("--thread", default="MainThread",
                   help="the allocating thread's name (match.thread; default MainThread)")
    e.add_argument("--tag", action="append", default=[],
                   help="a tag in force (match.tag, tag_limits); repeat for several")
    e.add_argument("--table", action="store_true", help="print the compiled table")
    e.add_argument("--module", help="the call site's module (match.module)")
    e.add_argument("--function", help="the call site's qualified function, module.qualname "
                   "(match.function)")


def run(a, p):
    """check's diagnostics first, then the explanation."""
    if a.size is None and not a.table:  # explaining size 0 by default misled
        p.error("the following arguments are required: --size (or --table for the whole table)")
    ok, text, _ = check(a.policy)  # the same diagnostics as check, warnings included
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
    if not ok:
        return 1
    try:
        sys.stdout.write(explain(a.policy, a.size or 0, a.dtype, a.thread, a.tag, a.table,
                                 a.module, a.function))
    except _ext.PolicyError as err:
        sys.stderr.write(str(err) + "\n")
        return 1
    return 0
