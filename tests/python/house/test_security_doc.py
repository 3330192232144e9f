"""docs/security.md's tables name the tests that pin each threat: every test
they name must exist, so the tables cannot drift from the suite. Its audit
table lists every place in the shipped code (C in policy/ runtime/ service/
pyext/, Python in python/datamem/) that creates, opens for writing, renames,
chmods, binds or deletes a path: a scan of the sources finds every such call,
and each must be listed (by file and function, so line numbers may move), and
every listed place must still make one."""
import ast
import glob
import os
import re

from conftest import ROOT

C_DIRS = ("policy", "runtime", "service", "pyext")
PY_DIR = os.path.join("python", "datamem")

# System calls that make, change or remove a name (open/openat/fopen count only
# when they write); and the project's own wrappers of them, so a new caller of
# a wrapper is a new place too.
C_CALLS = ("creat", "mkstemp", "mkostemp", "mkdtemp", "rename", "renameat", "renameat2",
           "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "bind",
           "unlink", "unlinkat", "remove", "rmdir", "mkdir", "mkdirat", "symlink", "symlinkat",
           "link", "linkat", "truncate", "ftruncate", "mkfifo", "mknod", "dm__files_create",
           "dm__files_write_atomic", "dm__files_dir_open_owned", "dm__sock_listen",
           "dm__sock_remove")
C_OPEN = ("open", "openat", "fopen")
PY_MODULE_CALLS = {
    "os": {"replace", "rename", "renames", "remove", "unlink", "rmdir", "removedirs", "mkdir",
           "makedirs", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "symlink",
           "link", "truncate", "mkfifo", "mknod"},
    "shutil": {"copy", "copy2", "copyfile", "copytree", "move", "rmtree", "chown"},
    "tempfile": {"mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory",
                 "TemporaryFile"},
    "_files": {"write_atomic", "write_if_changed", "open_append"},
}
PY_NAMES = {"write_atomic", "write_if_changed", "open_append", "mkdtemp", "mkstemp"}
PY_METHODS = {"bind", "savefig", "write_text", "write_bytes", "touch", "unlink", "symlink_to"}


def _doc():
    with open(os.path.join(ROOT, "docs", "security.md"), encoding="utf-8") as f:
        return f.read()


def _rows(section):
    table = _doc().split(section, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[1:]]


def _test_file(name):
    """tests/python/<component>/NAME: a test file named by its base name."""
    found = glob.glob(os.path.join(ROOT, "tests", "python", "**", name), recursive=True)
    assert len(found) == 1, (name, found)
    return found[0]


def _missing_tests(cells):
    missing, named = [], 0
    for cell in cells:
        current = None
        for ref in re.findall(r"`([^`]+)`", cell):
            if ref.startswith("::") and current and current.endswith(".c"):
                ref = current + ref  # `c_test.c::a`, `::b`: b in the same C file
            m = re.fullmatch(r"(test_\w+\.py)?::(\w+)(\[.*\])?|(test_\w+\.py)|(//\S+)"
                             r"|(\w+_test)\.c::(\w+)", ref)
            assert m, "cannot read the test reference %r" % ref
            if m.group(6):
                current = m.group(6) + ".c"
            if m.group(1) or m.group(2):
                current = m.group(1) or current
                path, name = _test_file(current), m.group(2)
                with open(path, encoding="utf-8") as f:
                    found = re.search(r"^def %s\(" % name, f.read(), re.M)
            elif m.group(5):  # a Bazel target
                pkg, target = m.group(5)[2:].split(":")
                with open(os.path.join(ROOT, pkg, "BUILD"), encoding="utf-8") as f:
                    found = '"%s"' % target in f.read()
                name = m.group(5)
            elif m.group(6):  # a C test function, in the module that has that test
                name = m.group(7)
                found = False
                for d in C_DIRS:
                    path = os.path.join(ROOT, d, m.group(6) + ".c")
                    if os.path.exists(path):
                        with open(path, encoding="utf-8") as f:
                            found = bool(re.search(r"^static void %s\(" % name, f.read(), re.M))
            else:
                continue
            named += 1
            if not found:
                missing.append(name)
    return named, missing


def test_every_test_the_threat_table_names_exists():
    named, missing = _missing_tests(
        [r[-1] for r in _rows("## Threats and the tests that pin them")])
    assert named > 30, named
    assert not missing, missing


# ---- the audit: every place that writes a path -----------------------------------------


def _c_call_text(text, start):
    """The call's argument text, from its "(" to the matching ")"."""
    depth, i = 0, start
    while i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
        i += 1
    return text[start:]


def _c_places(rel):
    """(file, function) of every call that changes a name, in one C file."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', lambda m: '"' + "s" * (len(m.group()) - 2) + '"'
                  if "\n" not in m.group() else m.group(), text)
    places, func = set(), None
    offset = 0
    for line in text.splitlines(keepends=True):
        m = re.match(r"[A-Za-z_][\w \*]*?\b(\w+)\(", line)
        if m and not line.startswith(("#", "typedef", "struct", "static const", "enum")):
            func = m.group(1)
        for call in re.finditer(r"\b(\w+)\s*\(", line):
            name = call.group(1)
            if func is None or (name not in C_CALLS and name not in C_OPEN):
                continue
            if call.start() == 0 or line[:call.start()].strip() in ("int", "bool", "void"):
                continue  # the definition itself
            if name in C_OPEN:
                args = _c_call_text(text, offset + call.end() - 1)
                writes = re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", args) or \
                    (name == "fopen" and re.search(r'"[^"]*[wa+][^"]*"\s*\)$', args))
                if not writes:
                    continue
            places.add((rel, func))
        offset += len(line)
    return places


def _py_places(rel):
    """(file, function) of every call that changes a name, in one Python file."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    places = set()

    def writes(call):
        fn = call.func
        if isinstance(fn, ast.Attribute):
            base = fn.value.id if isinstance(fn.value, ast.Name) else None
            if base in PY_MODULE_CALLS:
                if fn.attr in PY_MODULE_CALLS[base]:
                    return True
                if base == "os" and fn.attr == "open":
                    return re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", ast.dump(call.args[1]))
                if base == "_files" and fn.attr == "owned_dir":
                    return any(k.arg == "create" for k in call.keywords)
                return False
            return fn.attr in PY_METHODS
        if isinstance(fn, ast.Name):
            if fn.id in PY_NAMES:
                return True
            if fn.id == "owned_dir":
                return any(k.arg == "create" for k in call.keywords)
            if fn.id == "open":
                mode = call.args[1] if len(call.args) > 1 else next(
                    (k.value for k in call.keywords if k.arg == "mode"), None)
                return isinstance(mode, ast.Constant) and re.search(r"[wax+]", str(mode.value))
        return False

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call) and writes(child):
                places.add((rel, func or "<module>"))
            visit(child, name)

    visit(tree, None)
    return places


def _scan():
    found = set()
    for d in C_DIRS:
        for name in sorted(os.listdir(os.path.join(ROOT, d))):
            if name.endswith(".c") and not re.search(r"_test\.c$|fuzz|gen_reference", name):
                found |= _c_places(os.path.join(d, name))
    for path in sorted(glob.glob(os.path.join(ROOT, PY_DIR, "**", "*.py"), recursive=True)):
        found |= _py_places(os.path.relpath(path, ROOT))
    return found


def _listed():
    listed = set()
    for row in _rows("## Every place that writes a path"):
        refs = re.findall(r"`([^`]+)`", row[0])
        assert refs and "/" in refs[0], "a row must begin with `file`: %r" % row[0]
        for func in refs[1:]:
            listed.add((refs[0], func))
    return listed


def test_the_scan_finds_the_places_it_is_meant_to():
    found = _scan()
    for place in [("service/sock.c", "bind_private"), ("service/files.c", "dm__files_create"),
                  ("service/textfile.c", "textfile_write"), ("policy/trust.c", "lookup"),
                  ("python/datamem/_files.py", "write_atomic"),
                  ("python/datamem/_stats/record.py", "cmd_plot")]:
        assert place in found, (place, sorted(found))
    # a read-only open is not a place that writes
    assert ("runtime/os.c", "read_small") not in found and \
        not any(f == "python/datamem/_stats/reload.py" for f, _ in found), sorted(found)


def test_every_place_that_writes_a_path_is_in_the_audit():
    found, listed = _scan(), _listed()
    assert not found - listed, "not in docs/security.md's audit table: %s" % sorted(found - listed)
    assert not listed - found, "in the audit table but no longer writing: %s" % sorted(
        listed - found)


def test_every_test_the_audit_names_exists():
    named, missing = _missing_tests([r[-1] for r in _rows("## Every place that writes a path")])
    assert named > 15, named
    assert not missing, missing
