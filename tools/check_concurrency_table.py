"""Checks docs/design.md's concurrency table against the sources.

    python3 tools/check_concurrency_table.py [ROOT]

The table is the one after the marker line
`<!-- concurrency: checked by tools/check_concurrency_table.py -->`: one row per
piece of shared mutable state, its first cell naming the file and, in
backticks, each variable of that row. The check finds every variable that
outlives a call:

- C (runtime/, service/, pyext/, tests and fuzz drivers left out): every
  declaration at file scope, and every `static` one inside a function, unless it
  cannot change (`const` on the variable itself, not only on what it points to);
- Python (python/datamem/): every module-level name bound to a mutable
  container or a lock (`{}`, `[]`, `set()`, `WeakSet()`, `Lock()`, ...) and every
  name a function rebinds with `global`.

It fails, naming file and line, for a variable no row names (with its file), and
for a row naming a variable its file does not have. Exit status 0 when the table
is complete, 1 with one line per mismatch otherwise.
"""
import ast
import os
import re
import sys

C_DIRS = ("runtime", "service", "pyext")
PY_DIR = os.path.join("python", "datamem")
MARKER = "<!-- concurrency: checked by tools/check_concurrency_table.py -->"
SKIP_WORDS = ("typedef", "extern", "return", "#", "}", "{", "/*", "*", "//", "else", "case")
MUTABLE_CALLS = {"dict", "list", "set", "WeakSet", "WeakValueDictionary", "Lock", "RLock",
                 "Event", "Condition", "Semaphore", "local", "deque"}


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def split_top(s, sep=","):
    """s split at `sep` outside (), [] and {}."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def declarators(decl):
    """The names a C declaration (no trailing ';') declares that can change."""
    decl = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", decl)
    decl = re.sub(r"_Atomic\s*\(([^()]*)\)", r"_Atomic \1", decl)
    decl = re.sub(r"\[[^\]]*\]", "[]", decl)  # array sizes may hold ( )
    parts = split_top(decl)
    first = parts[0].split("=", 1)[0]
    m = re.match(r"^\s*((?:\w+\s+|\*\s*)*?)((?:\*\s*(?:(?:const|_Atomic|volatile)\s*)*)*)(\w+)"
                 r"\s*(\[[^\]]*\]\s*)*$",
                 first)
    if not m:
        return []
    base = m.group(1)
    names = []
    for i, p in enumerate(parts):
        p = p.split("=", 1)[0].strip()
        if "(" in p:  # a function
            return []
        dm = re.match(r"^((?:\w+\s+)*?)((?:\*\s*(?:(?:const|_Atomic|volatile)\s*)*)*)(\w+)"
                      r"\s*(\[[^\]]*\]\s*)*$", p)
        if not dm:
            continue
        ptr = dm.group(2) if i else m.group(2)
        typ = base if i == 0 else base
        if ptr:
            const = re.search(r"const\s*$", ptr) is not None
        else:
            const = re.search(r"\bconst\b", typ) is not None
        if not const:
            names.append(dm.group(3))
    return names


def c_variables(path):
    """[(line, name)] of the variables in C file `path` that outlive a call."""
    text = strip_comments(open(path).read())
    out = []
    lines = text.split("\n")
    depth = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        s = line.strip()
        start_depth = depth
        depth += line.count("{") - line.count("}")
        if not s or s.startswith("#"):
            i += 1
            continue
        # `static struct {...} name = {...};` at file scope: the name follows the brace
        if start_depth == 1 and s.startswith("}") and depth == 0:
            m = re.match(r"^\}\s*(\w+)\s*(\[[^\]]*\])?\s*(=.*)?;", s)
            if m and agg_start is not None:
                out.append((i + 1, m.group(1)))
            i += 1
            continue
        if start_depth == 0:
            agg_start = None
            if re.match(r"^(static\s+)?(struct|union)\s*\w*\s*\{\s*$", s) and "typedef" not in s:
                agg_start = i
                i += 1
                continue
            head = re.sub(r"\[[^\]]*\]", "[]", s.split("=", 1)[0]).replace("_Atomic(", "")
            if s.startswith(SKIP_WORDS) or "(" in head:
                i += 1
                continue
            decl = s
            while not decl.rstrip().endswith((";", "{", ")")) and i + 1 < len(lines):
                i += 1
                decl += " " + lines[i].strip()
                depth += lines[i].count("{") - lines[i].count("}")
            decl = decl.rstrip()
            if decl.endswith("{") and "=" in decl:  # an initialised aggregate: `x[] = {`
                decl = decl.split("=", 1)[0] + ";"
            if decl.endswith(";") and not re.match(r"^(static\s+)?(inline|struct\s+\w+\s*;)", decl):
                for n in declarators(decl[:-1].replace("static ", "", 1)):
                    out.append((i + 1, n))
        elif re.match(r"^static\s", s) and not s.startswith("static inline"):
            decl = s
            while not decl.rstrip().endswith((";", "{")) and i + 1 < len(lines):
                i += 1
                decl += " " + lines[i].strip()
                depth += lines[i].count("{") - lines[i].count("}")
            if decl.rstrip().endswith(";"):
                for n in declarators(decl.rstrip()[:-1][len("static"):]):
                    out.append((i + 1, n))
        i += 1
    return out


def py_variables(path):
    tree = ast.parse(open(path).read())
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp,
                                         ast.ListComp, ast.SetComp))
            if isinstance(value, ast.Call):
                f = value.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                mutable = name in MUTABLE_CALLS
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if mutable and not (len(targets) == 1 and isinstance(targets[0], ast.Name)
                                and targets[0].id == "__all__"):
                out += [(node.lineno, t.id) for t in targets if isinstance(t, ast.Name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out += [(node.lineno, n) for n in node.names]
    seen, uniq = set(), []
    for line, name in out:
        if name not in seen:
            seen.add(name)
            uniq.append((line, name))
    return uniq


def table_rows(doc):
    """{file: {names}} from the table after MARKER, and the line of each row."""
    lines = open(doc).read().split("\n")
    try:
        start = lines.index(MARKER)
    except ValueError:
        return None
    rows = {}
    for j in range(start + 1, len(lines)):
        ln = lines[j]
        if not ln.startswith("|"):
            if rows:
                break
            continue
        cell = ln.split("|")[1]
        # `file`: names, ...; `other file`: names: each name belongs to the file before it
        parts = re.split(r"`?((?:runtime|service|pyext|python/datamem)/[\w/]+\.(?:c|py))`?", cell)
        for f, text in zip(parts[1::2], parts[2::2]):
            names = re.findall(r"`([A-Za-z_]\w*)`", text)
            rows.setdefault(f, {}).update({n: j + 1 for n in names})
    return rows


def main(root):
    rows = table_rows(os.path.join(root, "docs", "design.md"))
    if rows is None:
        print("docs/design.md: no line %s" % MARKER)
        return 1
    problems = []
    found = {}
    for d in C_DIRS:
        for f in sorted(os.listdir(os.path.join(root, d))):
            if not f.endswith(".c") or f.endswith("_test.c") or "fuzz" in f:
                continue
            rel = "%s/%s" % (d, f)
            found[rel] = c_variables(os.path.join(root, rel))
    for f in sorted(os.listdir(os.path.join(root, PY_DIR))):
        if f.endswith(".py"):
            rel = "python/datamem/%s" % f
            found[rel] = py_variables(os.path.join(root, rel))
    for rel, variables in sorted(found.items()):
        named = rows.get(rel, {})
        for line, name in variables:
            if name not in named:
                problems.append("%s:%d: `%s` is shared mutable state the concurrency table in "
                                "docs/design.md does not name" % (rel, line, name))
        have = {n for _, n in variables}
        for name, row in sorted(named.items()):
            if name not in have:
                problems.append("docs/design.md:%d: `%s` is not a variable of %s"
                                % (row, name, rel))
    for rel in sorted(set(rows) - set(found)):
        problems.append("docs/design.md: the concurrency table names %s, which does not exist"
                        % rel)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
