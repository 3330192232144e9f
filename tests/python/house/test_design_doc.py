"""docs/design.md against the tree: its picture of the layers matches the #include
lines (tools/check_design_picture.py), and its "Where to change what" table names
files and tests that exist. Both drifted before: the picture left out
service/profile.c, export.h and pyext's direct use of jemalloc and policy.h. Its
concurrency table names every shared variable (tools/check_concurrency_table.py)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

CHECK = os.path.join(ROOT, "tools", "check_design_picture.py")


def check(root, tool=CHECK):
    return subprocess.run([sys.executable, tool, str(root)], capture_output=True, text=True,
                          timeout=60)


def copy_tree(tmp_path):
    for layer in ("policy", "runtime", "service", "pyext"):
        shutil.copytree(os.path.join(ROOT, layer), tmp_path / layer)
    (tmp_path / "docs").mkdir()
    shutil.copy(os.path.join(ROOT, "docs", "design.md"), tmp_path / "docs" / "design.md")
    return tmp_path


@pytest.mark.parametrize("tool", ["check_design_picture.py", "check_concurrency_table.py"])
def test_the_picture_and_the_concurrency_table_match_the_sources(tool):
    r = check(ROOT, os.path.join(ROOT, "tools", tool))
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_include_the_picture_lacks_fails_the_check(tmp_path):
    root = copy_tree(tmp_path)
    with open(root / "runtime" / "os.c", "a") as f:
        f.write('#include "service/export.h"\n')  # the engine calling up
    r = check(root)
    assert r.returncode == 1, r.stdout
    assert "runtime/os.c:" in r.stdout and "service/export.h" in r.stdout, r.stdout


def test_an_arrow_no_file_follows_or_one_pointing_up_fails_the_check(tmp_path):
    root = copy_tree(tmp_path)
    arrow = "     |        -> runtime/datamem.h"
    replace_in(root / "docs" / "design.md", (arrow + "\n", arrow + ", pyext/x.h, libnuma\n"))
    r = check(root)
    assert r.returncode == 1, r.stdout
    assert "service/ includes pyext/x.h; none of its files does" in r.stdout, r.stdout
    assert "service/ -> pyext/x.h points up or sideways" in r.stdout, r.stdout
    assert "service/ includes libnuma" in r.stdout, r.stdout


def test_a_header_the_picture_does_not_name_fails_the_check(tmp_path):
    root = copy_tree(tmp_path)
    (root / "service" / "newthing.h").write_text("/* new */\n")
    r = check(root)
    assert r.returncode == 1, r.stdout
    assert "does not name service/newthing.h" in r.stdout, r.stdout


def test_every_file_and_test_the_change_table_names_exists():
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    rows = [l for l in table.splitlines() if l.startswith("| ") and "---" not in l][1:]
    assert [r.split("|")[1].strip() for r in rows] == [
        "a policy key", "a metric", "an OS call", "a CLI command", "a benchmark job"]
    missing, named = [], 0
    for ref in re.findall(r"`([^`]+)`", table):
        target = re.fullmatch(r"//(\w+):(\w+)", ref)
        if target:  # a Bazel target: named in its package's BUILD
            with open(os.path.join(ROOT, target.group(1), "BUILD"), encoding="utf-8") as f:
                ok = '"%s"' % target.group(2) in f.read()
        elif re.fullmatch(r"(tests/python/(\w+/)?test_\w+\.py)::(\w+)", ref):
            path, name = ref.split("::")
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                ok = re.search(r"^def %s\(" % name, f.read(), re.M) is not None
        elif re.fullmatch(r"[\w.-]+(/[\w.-]+)+/?", ref) and "NAME" not in ref:
            ok = os.path.exists(os.path.join(ROOT, ref))
        else:
            continue  # a symbol, a command line
        named += 1
        if not ok:
            missing.append(ref)
    assert named > 30, named
    assert not missing, missing


# ---- the concurrency table (tools/check_concurrency_table.py) ------------------------

CONCURRENCY = os.path.join(ROOT, "tools", "check_concurrency_table.py")


def check_concurrency(root):
    return check(root, CONCURRENCY)


def copy_sources(tmp_path):
    shutil.copytree(os.path.join(ROOT, "python", "datamem"), tmp_path / "python" / "datamem")
    return copy_tree(tmp_path)


def replace_in(path, *pairs):
    """Each (old, new) of `pairs` in the file at `path`, in order; each old
    text must be there (an edit that finds nothing tests nothing)."""
    text = path.read_text()
    for old, new in pairs:
        assert old in text, (str(path), old)
        text = text.replace(old, new)
    path.write_text(text)


def test_a_new_static_or_module_global_fails_the_concurrency_check(tmp_path):
    root = copy_sources(tmp_path)
    with open(root / "pyext" / "site.c", "a") as f:
        f.write("static int cache_hits, *last_seen;\nstatic const char *const fixed = \"x\";\n"
                "int dm__site_count(void) {\n    static unsigned calls;\n    return ++calls;\n}\n")
    with open(root / "python" / "datamem" / "_text.py", "a") as f:
        f.write("\n_seen = set()\n\n\ndef _reset():\n    global _limit\n    _limit = 0\n")
    r = check_concurrency(root)
    assert r.returncode == 1, r.stdout
    for name in ("pyext/site.c:", "`cache_hits`", "`last_seen`", "`calls`",
                 "python/datamem/_text.py:", "`_seen`", "`_limit`"):
        assert name in r.stdout, (name, r.stdout)
    assert "`fixed`" not in r.stdout  # a const pointer to const cannot change


def test_a_row_for_a_variable_that_is_gone_fails_the_concurrency_check(tmp_path):
    root = copy_sources(tmp_path)
    replace_in(root / "pyext" / "site.c",
               ("static PyObject *name_key;", "static PyObject *key_name;"),
               ("name_key", "key_name"))
    r = check_concurrency(root)
    assert r.returncode == 1, r.stdout
    assert "`name_key` is not a variable of pyext/site.c" in r.stdout, r.stdout
    assert "`key_name` is shared mutable state" in r.stdout, r.stdout


# The fields of shared structs: a struct that a variable reaches (here `all`, the
# spill arenas, in runtime/spill.c) has a row for each field, so a field added to
# one (the pager's `since` and `seen`, a fork's `fork_fd` went unchecked before)
# fails until its row says what guards it.
def test_a_new_field_of_a_shared_struct_fails_the_concurrency_check(tmp_path):
    root = copy_sources(tmp_path)
    replace_in(root / "runtime" / "spill.h",
               ("    int fork_fd; ", "    _Atomic uint64_t pass_at;\n"
                "    struct dm__spill_log *log;\n    int fork_fd; "),
               ("typedef struct dm__spill {",
                "struct dm__spill_log {\n    int fd, nlines;\n};\n\ntypedef struct dm__spill {"))
    r = check_concurrency(root)
    assert r.returncode == 1, r.stdout
    lines = r.stdout.splitlines()
    want = ("field `pass_at` of `dm__spill_t` is shared (the type of `all` in runtime/spill.c) "
            "and has no row in docs/design.md's concurrency table: add `pass_at` to a row "
            "whose first cell reads \"`dm__spill_t` (runtime/spill.h) fields: `pass_at`, ...\" "
            "and say what guards it")
    assert any(ln.startswith("runtime/spill.h:") and ln.endswith(want) for ln in lines), r.stdout
    # a struct reached through a pointer field is shared too, field by field
    for field in ("fd", "nlines"):
        assert ("field `%s` of `struct dm__spill_log` is shared (reached through "
                "`dm__spill_t.log`)" % field) in r.stdout, r.stdout
    assert "`fork_fd`" not in r.stdout  # its row is there
    assert len(lines) == 4, r.stdout  # pass_at, log, fd, nlines

    # the rows the messages ask for make it pass
    replace_in(root / "docs" / "design.md", (
        "| `dm__spill_t` (runtime/spill.h) fields: `dirfd`, `dir` |",
        "| `dm__spill_t` (runtime/spill.h) fields: `pass_at`, `log`; `struct dm__spill_log` "
        "(runtime/spill.h) fields: `fd`, `nlines` | under `pass_mu` | |\n"
        "| `dm__spill_t` (runtime/spill.h) fields: `dirfd`, `dir` |"))
    r = check_concurrency(root)
    assert r.returncode == 0, r.stdout


def test_a_row_for_a_field_or_struct_that_is_gone_fails_the_concurrency_check(tmp_path):
    root = copy_sources(tmp_path)
    replace_in(root / "runtime" / "tally.h", ("    int8_t idle; ", "    int8_t idle_list; "))
    replace_in(root / "docs" / "design.md", ("| `cfg_t` (service/export.c) fields:",
                                             "| `cfg_t` (service/http.c) fields:"))
    r = check_concurrency(root)
    assert r.returncode == 1, r.stdout
    assert "`idle` is not a field of `dm__tally_row_t` (runtime/tally.h)" in r.stdout, r.stdout
    assert "field `idle_list` of `dm__tally_row_t` is shared" in r.stdout, r.stdout
    assert "`cfg_t` (service/http.c) is not a struct there that a variable reaches" in r.stdout
    assert "field `http` of `cfg_t` is shared (the type of `policy_cfg` in service/export.c)" \
        in r.stdout, r.stdout


def test_a_thread_local_struct_needs_no_field_rows(tmp_path):
    # a struct only a thread-local variable has is that thread's alone
    root = copy_sources(tmp_path)
    with open(root / "runtime" / "alloc.c", "a") as f:
        f.write("typedef struct scratch { int n; } scratch_t;\n"
                "static _Thread_local scratch_t scratch;\n")
    replace_in(root / "docs" / "design.md", (
        "| `runtime/alloc.c`: `foreign_frees`;",
        "| `runtime/alloc.c`: `scratch` | thread-local | |\n| `runtime/alloc.c`: `foreign_frees`;"))
    r = check_concurrency(root)
    assert r.returncode == 0, r.stdout
