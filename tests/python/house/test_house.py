"""House rules a newcomer can rely on, checked by
tools/check_house.py: no source file outside the tests is over 800 lines and
no function in one over 80, in C (policy/, runtime/, service/, pyext/,
testing/) as in Python (python/, tools/). A file that grows past them is split
along its seams."""
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_house  # noqa: E402

FILE_MAX = check_house.FILE_MAX
FUNCTION_MAX = check_house.FUNCTION_MAX


def test_sources_are_short():
    bad = check_house.check(ROOT)
    assert not bad, "split these along their seams:\n" + "\n".join(bad)


def test_the_check_covers_every_layer():
    seen = {rel.split(os.sep)[0] for _, rel in check_house.sources(ROOT)}
    assert {"policy", "runtime", "service", "pyext", "python", "tools"} <= seen, seen
    # The engine's own file is checked; its tests are not.
    rels = {rel for _, rel in check_house.sources(ROOT)}
    assert "runtime/arena.c" in rels and "runtime/runtime_test.c" not in rels


def test_the_check_sees_a_long_python_file_and_function(tmp_path):
    body = "\n".join("    x = %d" % i for i in range(FUNCTION_MAX))
    long_function = tmp_path / "f.py"
    long_function.write_text("def f():\n%s\n" % body)
    assert [l.split(": ", 1)[1] for l in check_house.too_long(str(long_function))] == \
        ["f() is %d lines (at most %d)" % (FUNCTION_MAX + 1, FUNCTION_MAX)]
    long_file = tmp_path / "g.py"
    long_file.write_text("x = 1\n" * (FILE_MAX + 1))
    assert len(check_house.too_long(str(long_file))) == 1
    ok = tmp_path / "h.py"
    ok.write_text("def f():\n%s\n" % "\n".join(body.splitlines()[1:]) + "x = 1\n" * 700)
    assert check_house.too_long(str(ok)) == []


def test_the_check_sees_long_c_functions_in_the_shapes_we_write(tmp_path):
    body = "\n".join("    x += %d;" % i for i in range(FUNCTION_MAX - 2))
    shapes = {
        "plain": "static int f(int x) {\n%s\n    return x;\n}\n",
        "wrapped": "static int f(int x,\n             int y) {\n%s\n    return x + y;\n}\n",
        "constructor": "__attribute__((constructor)) static void f(void) {\n"
                       "    int x = 0;\n%s\n}\n",
    }
    for shape, text in shapes.items():
        src = tmp_path / ("%s.c" % shape)
        src.write_text("#include <stdio.h>\nstruct s { int a; };\nint g(int);\n"
                       + text % body + "int h(void) { return 0; }\n")
        bad = check_house.too_long(str(src))
        assert len(bad) == 1 and ": f() is " in bad[0], (shape, bad)
    short = tmp_path / "short.c"
    short.write_text("static int f(int x) {\n%s\n}\n" % "\n".join(body.splitlines()[1:]))
    assert check_house.too_long(str(short)) == []


def test_the_command_line_names_each_offender(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "big.c").write_text("int x;\n" * (FILE_MAX + 1))
    (tmp_path / "runtime" / "big_test.c").write_text("int x;\n" * (FILE_MAX + 1))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_house.py"),
                        str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "runtime/big.c: %d lines (at most %d)\n" % (
        FILE_MAX + 1, FILE_MAX), r


def test_the_check_sees_a_shared_internal_named_after_another_file(tmp_path):
    src = tmp_path / "units.c"
    src.write_text("/* units.c */\n"
                   "#include \"policy/internal.h\"\n"
                   "static int dm__helper(void) { return 0; }\n"      # a static: any name
                   "int dm__units_size(const char *s) { return s != 0; }\n"
                   "const char *const dm__units_words[] = {\"a\"};\n"
                   "extern int dm__text_quote(void);\n"               # a declaration
                   "int dm__name_valid(const char *s) {\n    return s != 0;\n}\n"
                   "const int dm__policy_schema[] = {1};\n")
    assert check_house.misnamed(str(src), "units.c") == [
        "units.c:7: dm__name_valid is shared across files: name it dm__units_*",
        "units.c:10: dm__policy_schema is shared across files: name it dm__units_*"]


def _imports(path):
    """The modules a Python file imports, absolute (datamem._cli.stats) or relative
    to its package, resolved against python/datamem's layout."""
    import ast
    rel = os.path.relpath(path, os.path.join(ROOT, "python"))
    package = os.path.dirname(rel).replace(os.sep, ".")
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module) if p)
            out |= {mod} | {mod + "." + a.name for a in node.names}
    return out


def test_the_library_never_imports_its_command_line():
    pkg = os.path.join(ROOT, "python", "datamem")
    library = [os.path.join(d, f) for d, _, fs in os.walk(pkg) for f in fs
               if f.endswith(".py") and os.sep + "_cli" not in d and f != "__main__.py"]
    assert len(library) > 20, library
    bad = {os.path.relpath(p, ROOT): sorted(m for m in _imports(p) if m.startswith("datamem._cli"))
           for p in library}
    assert not {p: m for p, m in bad.items() if m}, bad
    # the scan sees an import of the CLI where there is one
    assert "datamem._cli" in _imports(os.path.join(pkg, "__main__.py"))
    assert "datamem._stats.reload" in _imports(os.path.join(pkg, "_cli", "reload.py"))
