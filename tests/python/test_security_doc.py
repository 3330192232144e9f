"""docs/security.md's threat table names the tests that pin each threat: every
test it names must exist, so the table cannot drift from the suite."""
import os
import re

from conftest import ROOT


def _table_cells():
    with open(os.path.join(ROOT, "docs", "security.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Threats and the tests that pin them", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [row.rsplit("|", 2)[-2] for row in rows[1:]]  # the "test" column


def test_every_test_the_threat_table_names_exists():
    missing, named = [], 0
    for cell in _table_cells():
        current = None
        for ref in re.findall(r"`([^`]+)`", cell):
            m = re.fullmatch(r"(test_\w+\.py)?::(\w+)(\[.*\])?|(test_\w+\.py)|(//\S+)"
                             r"|(\w+_test)\.c::(\w+)", ref)
            assert m, "cannot read the test reference %r" % ref
            if m.group(1) or m.group(2):
                current = m.group(1) or current
                path, name = os.path.join(ROOT, "tests", "python", current), m.group(2)
                with open(path, encoding="utf-8") as f:
                    found = re.search(r"^def %s\(" % name, f.read(), re.M)
            elif m.group(5):  # a Bazel target
                pkg, target = m.group(5)[2:].split(":")
                with open(os.path.join(ROOT, pkg, "BUILD"), encoding="utf-8") as f:
                    found = '"%s"' % target in f.read()
                name = m.group(5)
            elif m.group(6):  # a C test function
                path = os.path.join(ROOT, "runtime", m.group(6) + ".c")
                name = m.group(7)
                with open(path, encoding="utf-8") as f:
                    found = re.search(r"^static void %s\(" % name, f.read(), re.M)
            else:
                continue
            named += 1
            if not found:
                missing.append(name)
    assert named > 30, named
    assert not missing, missing
