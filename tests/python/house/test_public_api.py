"""Every public function the docs name is called by a test, the way the docs
show it: `datamem.x(...)`, `datamem.dask.x(...)`, `datamem.ray.x(...)` (or
through a name imported from those modules), and every `python -m datamem CMD`.
A static check over README.md, docs/*.md and tests/python: a function that is
documented and that no test calls is how datamem.ray.tag_table() shipped broken.
The calls themselves live in the tests of each feature (the cluster functions in
test_cluster_tasks.py, test_engines.py and test_cluster_netns.py, which run on
real Dask and Ray clusters)."""
import ast
import glob
import os
import re

from conftest import ROOT

PKG = os.path.join(ROOT, "python", "datamem")
TESTS = os.path.join(ROOT, "tests", "python")
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

# A dotted name under datamem; "(" after it when the docs show a call.
DOC_NAME = re.compile(r"\bdatamem((?:\.[A-Za-z_]\w*)+)(\()?")
DOC_CLI = re.compile(r"\bpython3? -m datamem (-*[A-Za-z][A-Za-z-]*)")
CODE_CALL = re.compile(r"\b(datamem(?:\.[A-Za-z_]\w*)+)\s*\(")
CODE_CLI = re.compile(r"-m datamem ([A-Za-z-]+)")


def _module_file(dotted):
    """The source of module `dotted` ("datamem", "datamem.dask", ...) or None."""
    rel = dotted.split(".")[1:]
    for path in (os.path.join(PKG, *rel) + ".py", os.path.join(PKG, *rel, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _public(dotted):
    """The functions and classes module `dotted` exports: its __all__ less
    constants (UPPER_CASE). Read from the source, so the check needs no engine."""
    tree = ast.parse(open(_module_file(dotted)).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {n for n in ast.literal_eval(node.value) if not n.isupper()}
    raise AssertionError("%s has no __all__" % dotted)


def _cli_commands():
    """The subcommands (and top-level options: --version) `python -m datamem`
    accepts, from its parsers' source."""
    names = set()
    for f in sorted(glob.glob(os.path.join(PKG, "_cli", "*.py"))):
        text = open(f).read()
        names |= set(re.findall(r'add_parser\(\s*"([a-z-]+)"', text))
        names |= set(re.findall(r'\bap\.add_argument\(\s*"(--[a-z-]+)"', text))
    return names


def documented():
    """({"datamem.x": "file:line" of its first mention} for the public
    functions the docs name, the same for `python -m datamem CMD`, and the
    problems: a call the docs show of a name that is not public)."""
    funcs, cli, problems = {}, {}, []
    commands = _cli_commands()
    for doc in DOCS:
        for lineno, line in enumerate(open(doc, encoding="utf-8"), 1):
            where = "%s:%d" % (os.path.relpath(doc, ROOT), lineno)
            for m in DOC_NAME.finditer(line):
                parts = ("datamem" + m.group(1)).split(".")
                # The longest module prefix, then the name in it: datamem.dask.Policy.
                for cut in range(len(parts) - 1, 0, -1):
                    mod = ".".join(parts[:cut])
                    if _module_file(mod):
                        break
                name = parts[cut]
                if name.startswith("_") or mod.split(".")[-1].startswith("_"):
                    continue  # private: not the public API
                if name in _public(mod):
                    funcs.setdefault(mod + "." + name, where)
                elif m.group(2) and cut == len(parts) - 1:
                    problems.append("%s: the docs call %s.%s(), which %s does not export"
                                    % (where, mod, name, mod))
            for m in DOC_CLI.finditer(line):
                cmd = m.group(1)
                if cmd in commands:
                    cli.setdefault(cmd, where)
                else:
                    problems.append("%s: `python -m datamem %s`: no such subcommand"
                                    % (where, cmd))
    return funcs, cli, problems


def _runs_cli(node):
    """A list or tuple holding "-m", "datamem": (True, the command after them
    or None where what follows is not a string constant)."""
    vals = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    for i in range(len(vals) - 1):
        if vals[i] == "-m" and vals[i + 1] == "datamem":
            nxt = vals[i + 2] if i + 2 < len(vals) else None
            return True, nxt if isinstance(nxt, str) else None
    return False, None


class _Calls(ast.NodeVisitor):
    """The dotted datamem names a module's code calls, with `import datamem.dask
    as d` and `from datamem import tag` resolved, and the `-m datamem CMD` it
    runs: a list or tuple holding "-m", "datamem", "CMD", or helper("CMD", ...)
    of a helper in the same file that runs [..., "-m", "datamem"] plus its
    arguments. Code in string literals (the scripts tests run in a fresh
    interpreter) is read too; docstrings and comments are not code."""

    def __init__(self, helpers=()):
        self.calls, self.cli, self.helpers = set(), set(), set(helpers)
        self.alias = {"datamem": "datamem"}

    def visit_Import(self, node):
        for a in node.names:
            if a.asname and a.name.split(".")[0] == "datamem":
                self.alias[a.asname] = a.name

    def visit_ImportFrom(self, node):
        if (node.module or "").split(".")[0] == "datamem":
            for a in node.names:
                self.alias[a.asname or a.name] = node.module + "." + a.name

    def _dotted(self, expr):
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in self.alias:
            return None
        return ".".join([self.alias[expr.id]] + parts[::-1])

    def visit_Call(self, node):
        name = self._dotted(node.func)
        if name:
            self.calls.add(name)
        first = node.args[0] if node.args else None
        if isinstance(node.func, ast.Name) and node.func.id in self.helpers \
                and isinstance(first, ast.Constant) and isinstance(first.value, str):
            self.cli.add(first.value)
        self.generic_visit(node)

    def visit_List(self, node):
        cmd = _runs_cli(node)[1]
        if cmd:
            self.cli.add(cmd)
        self.generic_visit(node)

    visit_Tuple = visit_List

    def visit_Expr(self, node):
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            self.generic_visit(node)  # a bare string (a docstring) runs nothing

    def visit_Constant(self, node):
        if isinstance(node.value, str) and "datamem" in node.value:
            scan_code(node.value, self)


def _cli_helpers(tree):
    """Functions whose body runs [..., "-m", "datamem"] + what they are given."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.List, ast.Tuple)) and _runs_cli(sub) == (True, None):
                    found.add(node.name)
    return found


def scan_code(text, into):
    """Adds the calls of `text` to `into`: parsed as Python (with %-format
    holes filled), else, for a script that imports datamem or a shell
    command line, by pattern."""
    try:
        tree = ast.parse(re.sub(r"%\(?\w*\)?[rsd]", "0", text))
    except SyntaxError:
        if re.search(r"^\s*(import|from) datamem", text, re.M):
            into.calls.update(m.group(1) for m in CODE_CALL.finditer(text))
        into.cli.update(CODE_CLI.findall(text))
        return
    inner = _Calls(into.helpers | _cli_helpers(tree))
    inner.visit(tree)
    into.calls |= inner.calls
    into.cli |= inner.cli


def called_by_tests():
    """(the dotted datamem names the tests call, the CLI commands they run)."""
    seen = _Calls()
    for path in sorted(glob.glob(os.path.join(TESTS, "**", "*.py"), recursive=True)):
        if os.path.basename(path) == os.path.basename(__file__):
            continue  # this file names every function without calling them
        scan_code(open(path, encoding="utf-8").read(), seen)
    return seen.calls, seen.cli


def test_every_documented_function_is_called_by_a_test():
    funcs, cli, problems = documented()
    assert not problems, "\n".join(problems)
    calls, commands = called_by_tests()
    missing = ["%s(): documented at %s" % (n, w) for n, w in sorted(funcs.items())
               if n not in calls]
    missing += ["python -m datamem %s: documented at %s" % (c, w) for c, w in sorted(cli.items())
                if c not in commands]
    assert not missing, ("documented but called by no test in tests/python (call it the way "
                         "the docs show):\n" + "\n".join(missing))


def test_the_check_sees_what_it_must():
    # The collector finds the cluster functions the docs show, and the scanner
    # tells a call from a mention; the check above is only as good as these.
    funcs, cli, _ = documented()
    for name in ("datamem.tag", "datamem.stats", "datamem.dask.Policy", "datamem.dask.tag_table",
                 "datamem.ray.runtime_env", "datamem.ray.tag_table", "datamem.ray.worker_setup"):
        assert name in funcs, name
    assert {"check", "ls", "top", "profile", "report", "reload"} <= set(cli)
    seen = _Calls()
    scan_code("import datamem.ray as r\nfrom datamem.dask import tag_table as tt\n"
              "# datamem.stats() in a comment is no call\n"
              "r.tag_table()\ntt(client)\n"
              "x = 'datamem.metrics is named here'\n"
              "run_py('import datamem\\ndatamem.refusals()')\n"
              "def cli(*a):\n    return [sys.executable, '-m', 'datamem'] + list(a)\n"
              "cli('suggest', d)\nsubprocess.run([py, '-m', 'datamem', 'plot', f])\n", seen)
    assert seen.calls == {"datamem.ray.tag_table", "datamem.dask.tag_table", "datamem.refusals"}
    assert seen.cli == {"suggest", "plot"}
