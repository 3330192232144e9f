"""Runs NumPy's own test suite twice -- under NumPy's default allocator and under
datamem with configs/everything.yaml -- and compares the outcome of every test.

The only differences allowed are listed in EXPECTED_DIFFERENCES: tests that
assert that a new thread uses NumPy's default handler (datamem deliberately
covers new threads). Any other difference fails the run.

Usage: python3 tools/numpy_suite.py [--full] [--policy P]
  default: a fixed large slice (the modules that allocate the most, ~2 min each);
  --full:  the whole suite minus tests marked slow (~5 min each on 2 cores).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLICE = [
    "numpy._core.tests.test_multiarray", "numpy._core.tests.test_mem_policy",
    "numpy._core.tests.test_ufunc", "numpy._core.tests.test_numeric",
    "numpy._core.tests.test_regression", "numpy._core.tests.test_item_selection",
    "numpy._core.tests.test_shape_base", "numpy._core.tests.test_nditer",
    "numpy._core.tests.test_dtype", "numpy.lib.tests.test_io",
]

# test name -> why it differs under datamem (junit gives no module for --pyargs)
EXPECTED_DIFFERENCES = {
    "test_thread_locality":
        "a new threading.Thread asserts it sees 'default_allocator'; datamem covers new "
        "threads on purpose (docs/design.md)",
}


def outcomes(xml_path):
    res = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tid = "%s::%s" % (case.get("classname", ""), case.get("name", ""))
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = child.tag
        res[tid] = kind
    return res


def run(targets, policy, xml_path):
    """pytest on targets, its report written to xml_path. It runs in the
    directory that holds xml_path, which must be the caller's own (a
    TemporaryDirectory): `python -m` puts its working directory first on
    sys.path, so in a shared one (/tmp) any file named like a module pytest
    or NumPy imports would run in its place."""
    env = dict(os.environ)
    env.pop("DATAMEM_CONFIG", None)
    if policy:
        env["DATAMEM_CONFIG"] = policy
    cmd = [sys.executable, "-m", "pytest", "--pyargs", *targets, "-q", "-p", "no:cacheprovider",
           "-m", "not slow", "-W", "error::pytest.PytestUnhandledThreadExceptionWarning",
           "--junitxml", xml_path]
    r = subprocess.run(cmd, env=env, cwd=os.path.dirname(os.path.abspath(xml_path)),
                       capture_output=True, text=True)
    tail = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
    print("  %s: %s" % ("datamem" if policy else "default", " ".join(tail)), flush=True)
    if not os.path.exists(xml_path):
        raise SystemExit("FAIL: pytest wrote no report (exit status %d); its stderr ends:\n%s"
                         % (r.returncode, "\n".join(r.stderr.strip().splitlines()[-20:])))
    return outcomes(xml_path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--policy", default=os.path.join(ROOT, "configs", "everything.yaml"))
    a = ap.parse_args()
    targets = ["numpy"] if a.full else SLICE
    with tempfile.TemporaryDirectory() as d:
        print("NumPy's test suite (%s), default allocator vs datamem:" %
              ("full" if a.full else "slice of %d modules" % len(targets)), flush=True)
        base = run(targets, None, os.path.join(d, "default.xml"))
        dm = run(targets, a.policy, os.path.join(d, "datamem.xml"))
    if len(base) < 1000:
        print("FAIL: only %d tests ran" % len(base))
        return 1
    diffs = sorted(t for t in set(base) | set(dm) if base.get(t) != dm.get(t))
    unexpected = [t for t in diffs if t.split("::")[-1] not in EXPECTED_DIFFERENCES]
    for t in diffs:
        print("  %-8s %-8s %s" % (base.get(t), dm.get(t), t))
    for k, why in EXPECTED_DIFFERENCES.items():
        print("  expected difference (numpy/_core/tests/test_mem_policy.py): %s: %s" % (k, why))
    print("%d tests compared, %d differ, %d unexpected" % (len(base), len(diffs), len(unexpected)))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
