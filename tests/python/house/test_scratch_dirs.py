"""The test command's tools run Python only from directories of their own.
`python -m` and `python -c` put the working directory first on sys.path, so
run from a shared one (/tmp) any file there named like a module they import
runs in its place, with the test command's privileges (root in CI).
tools/numpy_suite.py (NumPy's own suite under datamem and the default) ran its
pytest in /tmp; scripts/root-test.sh made and entered a fixed-name directory
there, which another user could have made first."""
import os
import re
import sys
import tempfile

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import numpy_suite  # noqa: E402

TINY = "dm_suite_tiny_tests"  # three tests, on PYTHONPATH: the tool's run without NumPy's


def tiny_suite(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / (TINY + ".py")).write_text(
        "def test_one():\n    pass\n\ndef test_two():\n    pass\n\ndef test_three():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(mods))
    return [TINY]


def test_a_module_planted_in_the_shared_temp_directory_never_runs(tmp_path, monkeypatch):
    targets = tiny_suite(tmp_path, monkeypatch)
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "planted-module-ran"
    # pprint: imported by pytest at start-up, not by the interpreter itself
    (shared / "pprint.py").write_text("open(%r, 'w').close()\nraise SystemExit(3)\n" % str(marker))
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    assert tempfile.gettempdir() == str(shared)
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    res = numpy_suite.run(targets, None, str(own / "default.xml"))
    assert not marker.exists()
    assert len(res) == 3 and set(res.values()) == {"passed"}, res


def test_a_run_that_writes_no_report_says_why(tmp_path):
    """pytest that stops before its session (here a usage error; in CI it was
    the planted module) writes no report: the run fails with pytest's exit
    status and stderr, where it used to fail on the missing file."""
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    with pytest.raises(SystemExit) as e:
        numpy_suite.run(["--no-such-option"], None, str(own / "default.xml"))
    msg = str(e.value)
    assert "wrote no report (exit status 4)" in msg and "--no-such-option" in msg, msg


# /tmp or a fixed name under it that a script enters or makes, or a Python
# tool's child process runs in.
FIXED_TMP = [
    re.compile(r"\bcd\s+[\"']?/tmp(?:/[A-Za-z0-9_.-]+)?/?[\"']?(?=\s|$|&|;|\))", re.M),
    re.compile(r"\bmkdir(?:\s+-\S+)*\s+[\"']?/tmp/[A-Za-z0-9_.-]+[\"']?(?=\s|$|&|;|\))", re.M),
    re.compile(r"\bcwd\s*=\s*(?:tempfile\.gettempdir\(\)|[\"']/tmp\b)"),
]


def fixed_tmp_dirs(text):
    return [m.group(0).strip() for rx in FIXED_TMP for m in rx.finditer(text)]


def test_no_script_enters_a_fixed_name_under_tmp():
    for bad in ("rm -rf /tmp/datamem-run && mkdir -p /tmp/datamem-run && cd /tmp/datamem-run\n",
                "mkdir -p /tmp/r\n", "cd /tmp && python3 -c 'import x'\n",
                "subprocess.run(cmd, cwd=tempfile.gettempdir())\n", "run(cmd, cwd='/tmp')\n"):
        assert fixed_tmp_dirs(bad), bad
    for good in ('cd "$(mktemp -d /tmp/datamem-run.XXXXXX)"\n', "r=$(mktemp -d /tmp/x.XXXXXX)\n",
                 "run(cmd, cwd=os.path.dirname(xml_path))\n", "cat > /tmp/$w\n"):
        assert not fixed_tmp_dirs(good), good
    found = []
    for top in ("scripts", ".ci", "tools", "bench", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if (f.endswith((".sh", ".py")) or top == ".ci") and path != os.path.abspath(__file__):
                    with open(path, errors="replace") as fh:
                        found += ["%s: %s" % (os.path.relpath(path, ROOT), hit)
                                  for hit in fixed_tmp_dirs(fh.read())]
    assert not found, found
