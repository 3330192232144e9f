"""Checks docs/design.md's picture of the layers against the #include lines.

    python3 tools/check_design_picture.py [ROOT]

The picture is the fenced block after the marker line
`<!-- layers: checked by tools/check_design_picture.py -->`. In it, a line that
starts with ` policy/`, ` runtime/`, ` service/` or ` pyext/` opens that layer's
part; in a layer's part, lines whose text (after an optional `|`) starts with `->`
list what the layer's files include from outside the layer: headers of another
layer as `layer/file.h`, libraries by name (jemalloc, libnuma, libyaml, Python,
NumPy); text in parentheses is a comment. The check fails, naming file and line,
when

- a layer includes something its arrows do not list, or its arrows list something
  none of its files includes;
- an arrow points up or sideways (layers run policy -> runtime -> service -> pyext:
  nothing below calls up);
- a header of a layer (`*.h`, `*.def`) is not named in that layer's part.

Tests (`*_test.c`, `test_*.h`) and fuzz drivers are left out: they may include `testing/`.
Exit status 0 when the picture matches, 1 with one line per mismatch otherwise.
"""
import os
import re
import sys

LAYERS = ["policy", "runtime", "service", "pyext"]  # in the direction data flows
MARKER = "<!-- layers: checked by tools/check_design_picture.py -->"
# Headers outside the project, by the name the picture uses for their library.
LIBRARIES = {
    "jemalloc/jemalloc.h": "jemalloc",
    "numa.h": "libnuma",
    "numaif.h": "libnuma",
    "yaml.h": "libyaml",
    "Python.h": "Python",
    "frameobject.h": "Python",
    "dm_build_info.h": "Python",  # generated from the interpreter (@local_python)
}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def is_test(name):
    return (name.endswith("_test.c") or name.endswith("_fuzz.c") or name == "fuzz_driver.c"
            or name.startswith("test_"))  # test-only headers (runtime/test_policy.h)


def library_of(header):
    if header.startswith("numpy/"):
        return "NumPy"
    return LIBRARIES.get(header)


def includes(root, layer):
    """{what: (file, line)} for every include of `layer`'s sources that leaves it."""
    found, errors = {}, []
    d = os.path.join(root, layer)
    for name in sorted(os.listdir(d)):
        if not name.endswith((".c", ".h", ".def")) or is_test(name):
            continue
        path = os.path.join(layer, name)
        with open(os.path.join(root, path), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                quote, header = m.groups()
                lib = library_of(header)
                top = header.split("/", 1)[0] if "/" in header else None
                if lib:
                    what = lib
                elif quote == '"' and top in LAYERS:
                    if top == layer:
                        continue
                    what = header
                elif quote == "<":
                    continue  # the C library and the system
                else:
                    errors.append("%s:%d: #include \"%s\": neither a layer's header nor a "
                                  "library tools/check_design_picture.py knows" % (path, n, header))
                    continue
                found.setdefault(what, (path, n))
    return found, errors


def picture(text):
    """{layer: (arrows {what: line}, text of its part)} from the marked block."""
    lines = text.splitlines()
    try:
        start = lines.index(MARKER)
    except ValueError:
        raise SystemExit("docs/design.md: no line %r before the picture" % MARKER)
    i = start + 1
    while i < len(lines) and not lines[i].startswith("```"):
        i += 1
    parts, layer = {}, None
    for n in range(i + 1, len(lines)):
        line = lines[n]
        if line.startswith("```"):
            break
        m = re.match(r"^ (%s)/(\s|$)" % "|".join(LAYERS), line)
        if m:
            layer = m.group(1)
            parts[layer] = ({}, [])
        elif re.match(r"^ \S", line):
            layer = None  # python/datamem, the policy file: no C includes
        if layer is None:
            continue
        arrows, body = parts[layer]
        body.append(line)
        rest = line.strip()
        if rest.startswith("|"):
            rest = rest[1:].strip()
        if rest.startswith("->"):
            listed = re.sub(r"\([^)]*\)", " ", rest[2:])
            for token in re.split(r"[\s,;]+", listed):
                if token:
                    arrows[token] = n + 1
    return {k: (a, "\n".join(b)) for k, (a, b) in parts.items()}


def check(root):
    doc = os.path.join(root, "docs", "design.md")
    with open(doc, encoding="utf-8") as f:
        parts = picture(f.read())
    errors = []
    for li, layer in enumerate(LAYERS):
        if layer not in parts:
            errors.append("docs/design.md: the picture has no line starting ' %s/'" % layer)
            continue
        arrows, body = parts[layer]
        found, errs = includes(root, layer)
        errors += errs
        for what, (path, n) in sorted(found.items()):
            if what not in arrows:
                errors.append("%s:%d: includes %s, which the picture's arrows from %s/ do not "
                              "list (docs/design.md)" % (path, n, what, layer))
        for what, n in sorted(arrows.items()):
            if what not in found:
                errors.append("docs/design.md:%d: the picture says %s/ includes %s; none of "
                              "its files does" % (n, layer, what))
            top = what.split("/", 1)[0] if "/" in what else None
            if top in LAYERS and LAYERS.index(top) >= li:
                errors.append("docs/design.md:%d: %s/ -> %s points up or sideways (layers "
                              "run %s)" % (n, layer, what, " -> ".join(LAYERS)))
        for name in sorted(os.listdir(os.path.join(root, layer))):
            if name.endswith((".h", ".def")) and not is_test(name) and not re.search(
                    r"(?<![\w./])%s(?![\w])" % re.escape(name), body):
                errors.append("docs/design.md: the picture's %s/ part does not name %s/%s"
                              % (layer, layer, name))
    return errors


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print("docs/design.md's picture does not match the includes (%d); update one or "
              "the other" % len(errors))
        return 1
    print("docs/design.md's picture matches the includes of %s" % ", ".join(
        l + "/" for l in LAYERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
