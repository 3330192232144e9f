"""`check POLICY`: validate a policy; exit 0 with a summary, 1 with diagnostics."""
import sys

from .._explain import check

NAMES = ("check",)


def add(sub):
    c = sub.add_parser("check", help="validate a policy")
    c.add_argument("policy", help="the policy file (YAML)")


def run(a, p):
    """The diagnostics, and ok with a summary."""
    ok, text, summary = check(a.policy)
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
    if ok:
        from .. import _shown
        print("%s: ok: %s" % (_shown(a.policy), summary))
    return 0 if ok else 1
