"""House rules a newcomer can rely on (issue 27): no Python file under
python/datamem/ is over 800 lines and no function in one over 80 (a
function's lines: end_lineno - lineno + 1, decorators not counted). A module
that grows past them is split along its seams, as _stats_cli.py and
_profile.py were."""
import ast
import glob
import os

from conftest import ROOT

FILE_MAX = 800
FUNCTION_MAX = 80


def sources():
    paths = sorted(glob.glob(os.path.join(ROOT, "python", "datamem", "*.py")))
    assert paths, "no Python sources under %s/python/datamem" % ROOT
    return paths


def too_long(path):
    """["file:line: what", ...] for the file and each function over its bound."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    name = os.path.relpath(path, ROOT)
    out = []
    lines = len(text.splitlines())
    if lines > FILE_MAX:
        out.append("%s: %d lines (at most %d)" % (name, lines, FILE_MAX))
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > FUNCTION_MAX:
                out.append("%s:%d: %s() is %d lines (at most %d)"
                           % (name, node.lineno, node.name, n, FUNCTION_MAX))
    return out


def test_python_files_and_functions_are_short():
    bad = [line for path in sources() for line in too_long(path)]
    assert not bad, "split these along their seams:\n" + "\n".join(bad)


def test_the_check_sees_a_long_file_and_a_long_function(tmp_path):
    body = "\n".join("    x = %d" % i for i in range(FUNCTION_MAX))
    long_function = tmp_path / "f.py"
    long_function.write_text("def f():\n%s\n" % body)
    assert [l.split(": ", 1)[1] for l in too_long(str(long_function))] == \
        ["f() is %d lines (at most %d)" % (FUNCTION_MAX + 1, FUNCTION_MAX)]
    long_file = tmp_path / "g.py"
    long_file.write_text("x = 1\n" * (FILE_MAX + 1))
    assert len(too_long(str(long_file))) == 1
    ok = tmp_path / "h.py"
    ok.write_text("def f():\n%s\n" % "\n".join(body.splitlines()[1:]) + "x = 1\n" * 700)
    assert too_long(str(ok)) == []
