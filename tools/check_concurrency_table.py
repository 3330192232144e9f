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
- Python (python/datamem/ and its sub-packages): every module-level name bound to a mutable
  container or a lock (`{}`, `[]`, `set()`, `WeakSet()`, `Lock()`, ...) and every
  name a function rebinds with `global`.

And the fields of every shared struct. A struct or union with a name, defined
in C_DIRS (a .h file's, or a .c file's own), is shared when it is

- the type of a variable found above (a pointer to it, an array of it), unless
  the variable is thread-local; or
- the type of a field of a shared struct (embedded, an array or a pointer),
  transitively.

Types defined elsewhere (jemalloc, CPython, NumPy, policy/) are not followed. An
anonymous struct has no fields of its own here: the row of its variable or of
its field covers it. Each field of a shared struct must be named in a row whose
first cell reads

    `dm__spill_t` (runtime/spill.h) fields: `since`, `seen`

(the struct by its typedef, else `struct tag`; the file that defines it; several
rows per struct, or several structs in one cell separated by ';', are fine).

It fails, naming file and line, for a variable no row names (with its file), for
a shared struct's field no row names (the message is the row to add), and for a
row naming a variable, field or struct that is gone (or a struct no variable
reaches). Exit status 0 when the table is complete, 1 with one line per mismatch
otherwise.
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
    """[(line, name, declaration)] of the variables in C file `path` that outlive
    a call."""
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
                out.append((i + 1, m.group(1), " ".join(lines[agg_start:i + 1])))
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
                    out.append((i + 1, n, decl))
        elif re.match(r"^static\s", s) and not s.startswith("static inline"):
            decl = s
            while not decl.rstrip().endswith((";", "{")) and i + 1 < len(lines):
                i += 1
                decl += " " + lines[i].strip()
                depth += lines[i].count("{") - lines[i].count("}")
            if decl.rstrip().endswith(";"):
                for n in declarators(decl.rstrip()[:-1][len("static"):]):
                    out.append((i + 1, n, decl))
        i += 1
    return out


def match_brace(text, i):
    """The index of the brace closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def member_names(member):
    """The field names one member declaration (no trailing ';') declares."""
    member = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", member)
    member = re.sub(r"_Alignas\s*\([^()]*\)", "", member)
    if "{" in member:  # a nested aggregate: the names after its body
        member = member[member.rindex("}") + 1:]
    fp = re.search(r"\(\s*\*\s*(?:_Atomic\s*|const\s*)*(\w+)\s*\)\s*\(", member)
    if fp:  # a function pointer
        return [fp.group(1)]
    member = re.sub(r"\[[^\]]*\]", "", member)
    names = []
    for part in split_top(member):
        m = re.search(r"(\w+)\s*$", part.split(":")[0])  # a bit-field's width after ':'
        if m:
            names.append(m.group(1))
    return names


def c_structs(root):
    """The structs and unions with a name defined in C_DIRS (tests and fuzz
    drivers left out): {(file, name): (line, [(field, line, member text)])}, and
    the names each file sees them by: {file: {alias: (file, name)}}, where an
    alias is `struct tag` or a typedef name; a header's are seen by every file,
    a .c file's by itself only. A struct is named by its typedef when it has one,
    else `struct tag`."""
    structs, seen_in, forward = {}, {}, []
    for d in C_DIRS:
        for f in sorted(os.listdir(os.path.join(root, d))):
            if (not f.endswith((".c", ".h")) or f.endswith("_test.c")
                    or f.startswith("test_") or "fuzz" in f):
                continue
            rel = "%s/%s" % (d, f)
            text = strip_comments(open(os.path.join(root, rel)).read())
            names = seen_in.setdefault(rel, {})
            for m in re.finditer(r"\btypedef\s+(?:struct|union)\s+(\w+)\s+(\w+)\s*;", text):
                forward.append((rel, m.group(1), m.group(2)))
            for m in re.finditer(r"\b(typedef\s+)?(struct|union)\s+(\w+)?\s*\{", text):
                b = m.end() - 1
                e = match_brace(text, b)
                tag = m.group(3)
                tdef = None
                if m.group(1):
                    t = re.search(r"(\w+)\s*$", text[e + 1:text.find(";", e)])
                    tdef = t.group(1) if t else None
                if not tag and not tdef:
                    continue  # anonymous: its fields are its variable's or its field's
                name = tdef or "struct " + tag
                fields, depth, start = [], 0, b + 1
                for j in range(b + 1, e + 1):
                    ch = text[j]
                    if ch == "{":
                        depth += 1
                    elif ch == "}":
                        depth -= 1
                    if (ch == ";" and depth == 0) or j == e:
                        member = text[start:j]
                        line = text.count("\n", 0, start + len(member) - len(member.lstrip())) + 1
                        for n in member_names(member.strip()) if member.strip() else []:
                            fields.append((n, line, member.strip()))
                        start = j + 1
                structs[(rel, name)] = (text.count("\n", 0, m.start()) + 1, fields)
                for a in ("struct " + tag if tag else None, tdef):
                    if a:
                        names[a] = (rel, name)
    # `typedef struct tag name;` apart from the definition (dm_ctx_t): the struct
    # is named by that typedef, and seen by it where the typedef is seen
    for rel, tag, tdef in forward:
        keys = sorted((k[0] != rel, k[0]) for k in structs if k[1] == "struct " + tag)
        if not keys or (len(keys) > 1 and keys[0][0] and keys[1][0]):
            continue  # not defined, or defined by more than one file: ambiguous
        key = (keys[0][1], "struct " + tag)
        new = (key[0], tdef)
        structs[new] = structs.pop(key)
        for names in seen_in.values():
            for a, k in list(names.items()):
                if k == key:
                    names[a] = new
        seen_in[rel][tdef] = new
    # `typedef name other;` of a struct's name (tally.c's tally_tag_t): one more alias
    for rel in sorted(seen_in):
        text = strip_comments(open(os.path.join(root, rel)).read())
        for m in re.finditer(r"\btypedef\s+(?:const\s+)?(\w+)\s+(\w+)\s*;", text):
            k = struct_refs(m.group(1), rel, seen_in)
            if k:
                seen_in[rel][m.group(2)] = k[0]
    return structs, seen_in


def struct_refs(text, rel, seen_in):
    """The structs a declaration in file `rel` names in its type (not in a
    function pointer's parameters)."""
    text = re.sub(r"\(\s*\*[^()]*\)\s*\(.*", "", text, flags=re.S)
    words = ["struct " + t for t in re.findall(r"\b(?:struct|union)\s+(\w+)", text)]
    words += re.findall(r"\b(\w+)\b", text)
    out = []
    for w in words:
        k = seen_in.get(rel, {}).get(w) or next(
            (names[w] for f, names in sorted(seen_in.items()) if f.endswith(".h") and w in names),
            None)
        if k and k not in out:
            out.append(k)
    return out


def shared_structs(found, structs, seen_in):
    """{(file, struct): why} of the structs other threads can reach: the type of
    a variable the check finds (thread-local ones left out), and, transitively,
    the type of a field of one (embedded, an array or a pointer)."""
    why, todo = {}, []
    for rel, variables in sorted(found.items()):
        for _, name, decl in variables:
            if re.search(r"\b(_Thread_local|__thread|thread_local)\b", decl):
                continue
            for k in struct_refs(decl, rel, seen_in):
                if k not in why:
                    why[k] = "the type of `%s` in %s" % (name, rel)
                    todo.append(k)
    while todo:
        k = todo.pop(0)
        for field, _, member in structs[k][1]:
            for u in struct_refs(member, k[0], seen_in):
                if u not in why:
                    why[u] = "reached through `%s.%s`" % (k[1], field)
                    todo.append(u)
    return why


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
    return [(line, name, "") for line, name in uniq]


STRUCT_ROW = re.compile(r"`((?:struct )?\w+)` \(((?:runtime|service|pyext)/[\w/]+\.[ch])\) "
                        r"fields:([^;]*)")


def table_rows(doc):
    """({file: {name: line}}, {(file, struct): {field: line}}) from the table
    after MARKER."""
    lines = open(doc).read().split("\n")
    try:
        start = lines.index(MARKER)
    except ValueError:
        return None, None
    rows, field_rows = {}, {}
    for j in range(start + 1, len(lines)):
        ln = lines[j]
        if not ln.startswith("|"):
            if rows or field_rows:
                break
            continue
        cell = ln.split("|")[1]
        # `struct` (file) fields: `a`, `b`; `other` (file) fields: `c`
        if " fields:" in cell:
            for m in STRUCT_ROW.finditer(cell):
                names = re.findall(r"`([A-Za-z_]\w*)`", m.group(3))
                field_rows.setdefault((m.group(2), m.group(1)), {}).update(
                    {n: j + 1 for n in names})
            continue
        # `file`: names, ...; `other file`: names: each name belongs to the file before it
        parts = re.split(r"`?((?:runtime|service|pyext|python/datamem)/[\w/]+\.(?:c|py))`?", cell)
        for f, text in zip(parts[1::2], parts[2::2]):
            names = re.findall(r"`([A-Za-z_]\w*)`", text)
            rows.setdefault(f, {}).update({n: j + 1 for n in names})
    return rows, field_rows


def main(root):
    rows, field_rows = table_rows(os.path.join(root, "docs", "design.md"))
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
    for dirpath, dirs, files in sorted(os.walk(os.path.join(root, PY_DIR))):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                found[rel] = py_variables(os.path.join(root, rel))
    for rel, variables in sorted(found.items()):
        named = rows.get(rel, {})
        for line, name, _ in variables:
            if name not in named:
                problems.append("%s:%d: `%s` is shared mutable state the concurrency table in "
                                "docs/design.md does not name" % (rel, line, name))
        have = {n for _, n, _ in variables}
        for name, row in sorted(named.items()):
            if name not in have:
                problems.append("docs/design.md:%d: `%s` is not a variable of %s"
                                % (row, name, rel))
    for rel in sorted(set(rows) - set(found)):
        problems.append("docs/design.md: the concurrency table names %s, which does not exist"
                        % rel)
    structs, seen_in = c_structs(root)
    shared = shared_structs(found, structs, seen_in)
    for key, why in sorted(shared.items()):
        rel, name = key
        named = field_rows.get(key, {})
        for field, line, _ in structs[key][1]:
            if field not in named:
                problems.append(
                    "%s:%d: field `%s` of `%s` is shared (%s) and has no row in docs/design.md's "
                    "concurrency table: add `%s` to a row whose first cell reads "
                    "\"`%s` (%s) fields: `%s`, ...\" and say what guards it"
                    % (rel, line, field, name, why, field, name, rel, field))
        have = {f for f, _, _ in structs[key][1]}
        for field, row in sorted(named.items()):
            if field not in have:
                problems.append("docs/design.md:%d: `%s` is not a field of `%s` (%s)"
                                % (row, field, name, rel))
    for key in sorted(set(field_rows) - set(shared)):
        row = min(field_rows[key].values()) if field_rows[key] else 0
        problems.append("docs/design.md:%d: `%s` (%s) is not a struct there that a variable "
                        "reaches (%s)" % (row, key[1], key[0], "defined there, but shared by "
                                          "none" if key in structs else "no such struct"))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
