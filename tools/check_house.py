"""House rules a newcomer can rely on: no source file outside the tests is over
800 lines, no function in one is over 80, and a C internal shared across files
is named after the file that defines it (shared/STYLE.md, "Names": dm__<file>_*,
as jemalloc's decay.c defines decay_*).

    python3 tools/check_house.py [ROOT]

Sources: the C files (*.c, *.h) of policy/, runtime/, service/, pyext/ and
testing/, and the Python files of python/ and tools/. Tests (*_test.c,
test_*.h, *_fuzz.c, fuzz_driver.c, tests/) and generated files are left out:
a test may be as long as the cases it lists. A C function's lines run from the
line that names it to its closing brace; a Python function's are
end_lineno - lineno + 1 (decorators not counted). A file or function that grows
past them is split along its seams. A C file's non-static functions and
variables named dm__* start with dm__<its name>_ (yaml_tree.c: dm__yaml_tree_*). Exit status 0 when the house holds, 1 with
one line per offender ("path:line: what") otherwise.
"""
import ast
import os
import re
import sys

FILE_MAX = 800
FUNCTION_MAX = 80
C_DIRS = ["policy", "runtime", "service", "pyext", "testing"]
PY_DIRS = ["python", "tools"]

# A C function definition as this codebase writes them: the name and its opening
# parenthesis at the start of a line (after its return type and qualifiers), the
# body's closing brace alone in column 0.
C_FUNCTION = re.compile(r"^(?!static_assert)[A-Za-z_][\w \t\*]*?\b([A-Za-z_]\w*)\s*\(")
C_ATTRIBUTE = re.compile(r"^__attribute__\(\(.*?\)\)\s*")  # constructor, destructor
C_NOT_FUNCTION = re.compile(r"^(typedef|struct|union|enum|return|if|for|while|switch|#)\b")


def is_test(path):
    name = os.path.basename(path)
    return (name.endswith("_test.c") or name.endswith("_fuzz.c") or name == "fuzz_driver.c"
            or name.startswith("test_") or os.sep + "tests" + os.sep in os.sep + path)


def c_functions(text):
    """[(name, first line, lines)] for each function defined in C `text`."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        head = C_ATTRIBUTE.sub("", lines[i])
        m = C_FUNCTION.match(head)
        if not m or C_NOT_FUNCTION.match(head):
            i += 1
            continue
        # The header may wrap; the definition's body opens with '{' before any ';'.
        j = i
        while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
            j += 1
        if j == len(lines) or "{" not in lines[j] or (j > i and lines[j].lstrip().startswith("#")):
            i = j + 1
            continue
        if lines[j].rstrip().endswith("}") and lines[j].count("{") == lines[j].count("}"):
            out.append((m.group(1), i + 1, j - i + 1))  # a one-line body
            i = j + 1
            continue
        k = j + 1
        while k < len(lines) and lines[k].rstrip() != "}" and not lines[k].startswith("};"):
            k += 1
        if k < len(lines) and lines[k].rstrip() == "}":
            out.append((m.group(1), i + 1, k - i + 1))
        i = k + 1
    return out


# A definition at file scope of a dm__ name that is not static: a function (its
# parenthesis) or a variable (its initialiser, array bounds or semicolon).
C_INTERNAL = re.compile(r"^(?!static\b|extern\b|typedef\b)[A-Za-z_][\w \t\*]*?\b(dm__\w+)\s*[\(\[=;]",
                        re.M)


def misnamed(path, name=None):
    """["name:line: what", ...] for each cross-file internal of C file `path`
    whose name does not start with dm__<file stem>_."""
    name = name or path
    stem = os.path.basename(path)[:-2]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in C_INTERNAL.finditer(text):
        if not m.group(1).startswith("dm__%s_" % stem):
            out.append("%s:%d: %s is shared across files: name it dm__%s_*"
                       % (name, text.count("\n", 0, m.start()) + 1, m.group(1), stem))
    return out


def py_functions(text, path):
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def too_long(path, name=None):
    """["name:line: what", ...] for the file and each function over its bound."""
    name = name or path
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    n = len(text.splitlines())
    if n > FILE_MAX:
        out.append("%s: %d lines (at most %d)" % (name, n, FILE_MAX))
    funcs = py_functions(text, path) if path.endswith(".py") else c_functions(text)
    for fname, line, length in funcs:
        if length > FUNCTION_MAX:
            out.append("%s:%d: %s() is %d lines (at most %d)"
                       % (name, line, fname, length, FUNCTION_MAX))
    return out


def sources(root):
    for top, exts in [(d, (".c", ".h")) for d in C_DIRS] + [(d, (".py",)) for d in PY_DIRS]:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "bazel-")))
            for f in sorted(filenames):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                if f.endswith(exts) and not is_test(rel):
                    yield path, rel


def check(root):
    out = []
    for path, rel in sources(root):
        out += too_long(path, rel)
        if path.endswith(".c"):
            out += misnamed(path, rel)
    return out


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = check(root)
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
