"""The policy commands, `check` and `explain` (python/datamem/_cli/check.py and explain.py over
policy/): what the author of a policy sees, its summary, its errors and the
warnings about what is legal but probably not meant (printed at start-up too).
Each test fails without the check it pins."""
import os
import re
import subprocess
import sys

from conftest import ROOT, run_py

OK = "version: 1\ndefault: a\narenas: {a: {}}\n"


def cli(*args, timeout=60):
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "datamem", *args], env=e, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


# ---- a FIFO, a directory, a device as the policy -----------------------------------------

def test_check_refuses_fifo_directory_and_device_but_follows_links(fifo, tmp_path):
    r = cli("check", fifo, timeout=30)
    assert r.returncode == 1
    assert "error: not a regular file (a FIFO)" in r.stderr
    r = cli("check", str(tmp_path))
    assert r.returncode == 1 and "error: not a regular file (a directory)" in r.stderr
    r = cli("check", "/dev/zero", timeout=30)  # not read (1 MiB of zeros, then "too large")
    assert r.returncode == 1 and "error: not a regular file (a character device)" in r.stderr
    # Symbolic links are followed (no O_NOFOLLOW): the Kubernetes ConfigMap layout,
    # policy.yaml -> ..data/policy.yaml, ..data -> v1.
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "policy.yaml").write_text(OK)
    os.symlink("v1", tmp_path / "..data")
    os.symlink("..data/policy.yaml", tmp_path / "link.yaml")
    r = cli("check", str(tmp_path / "link.yaml"))
    assert r.returncode == 0, r.stderr
    r = run_py("import numpy, datamem; print(datamem.arena_of(numpy.ones(10)))",
               config=str(tmp_path / "link.yaml"))
    assert r.returncode == 0 and r.stdout.strip() == "a", r.stderr


# ---- warnings: legal but probably not meant ----------------------------------------------

SUSPICIOUS = """version: 1
default: a
arenas:
  a: {decay: {dirty: 10}}
  b: {}
rules:
  - name: big
    match: {size: {min: 4MB}}
    arena: b
  - name: etl
    match: {thread: etl-*}
    arena: b
"""


def test_check_prints_warnings_and_exits_0(write_policy):
    # The premise of the 'etl-*' warning, on this Python: pools use underscores.
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1, thread_name_prefix="etl") as ex:
        assert ex.submit(lambda: threading.current_thread().name).result() == "etl_0"

    async def in_default_executor():
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: threading.current_thread().name)
    assert re.fullmatch(r"asyncio_\d+", asyncio.run(in_default_executor()))

    p = write_policy(SUSPICIOUS)
    r = cli("check", p)
    assert r.returncode == 0, r.stderr
    assert "ok: 2 arenas, 2 rules, default 'a'" in r.stdout
    assert ("%s:4:22: warning: arenas.a.decay.dirty: 10 is read as 10 ms; write 10ms, or 10s "
            "if you meant seconds\n" % os.path.basename(p)) in r.stderr.replace(p, os.path.basename(p))
    assert "warning: rules[0].match.size.min: 4MB is 4,000,000 bytes; did you mean 4MiB?" in r.stderr
    assert ("warning: rules[1].match.thread: 'etl-*' matches no thread of "
            "ThreadPoolExecutor(thread_name_prefix='etl') (its threads are named etl_0, etl_1, "
            "...); did you mean 'etl_*'?") in r.stderr
    assert "error" not in r.stderr


def test_start_up_warns_once_and_runs_the_job(write_policy):
    p = write_policy(SUSPICIOUS)
    r = run_py("import numpy; print('job ran')", config=p)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "job ran"
    assert r.stderr.count("warning: arenas.a.decay.dirty: 10 is read as 10 ms") == 1, r.stderr
    assert r.stderr.count("4MB is 4,000,000 bytes") == 1, r.stderr
    # advice that may not apply to this job (it may name its own threads etl-1)
    # is for check and explain, not for every start
    assert "etl-*" not in r.stderr


def test_explain_prints_the_warnings_too(write_policy):
    p = write_policy(SUSPICIOUS)
    r = cli("explain", p, "--size", "64", "--thread", "etl_0")
    assert r.returncode == 0, r.stderr
    assert "did you mean 'etl_*'?" in r.stderr
    assert "rule 'etl': thread 'etl_0' does not match 'etl-*'" in r.stdout


# ---- tabs, repeated causes ---------------------------------------------------------------

def test_tab_indentation_is_named(write_policy):
    p = write_policy("version: 1\ndefault: a\narenas:\n\ta: {}\n")
    r = cli("check", p)
    assert r.returncode == 1
    assert r.stderr.startswith(
        "%s:4:1: error: tabs are not allowed for indentation in YAML; use spaces\n" % p), r.stderr
    assert "cannot start any token" not in r.stderr


def test_many_aliases_one_diagnostic(write_policy):
    p = write_policy(OK + "x: &a 1\nrules: [%s]\n" % ", ".join(["*a"] * 81))
    r = cli("check", p)
    assert r.returncode == 1
    assert r.stderr.count("error:") == 1, r.stderr
    assert "anchors and aliases are not allowed in a policy (and 81 more like this)" in r.stderr


# ---- plurals -----------------------------------------------------------------------------

def test_check_summary_singular(write_policy):
    p = write_policy(OK + "rules: [{name: r, arena: a, match: {dtype: float32}}]\n")
    r = cli("check", p)
    assert r.returncode == 0 and r.stdout.strip() == "%s: ok: 1 arena, 1 rule, default 'a'" % p


# ---- explain's arguments -----------------------------------------------------------------

def test_explain_needs_size_unless_table(write_policy):
    p = write_policy(OK)
    r = cli("explain", p)
    assert r.returncode == 2
    assert "error: the following arguments are required: --size" in r.stderr
    r = cli("explain", p, "--table")
    assert r.returncode == 0 and "1 arena, 0 rules" in r.stdout, r.stderr
    r = cli("explain", p, "--size", "0")
    assert r.returncode == 0 and "-> default arena 'a'" in r.stdout, r.stderr


def test_explain_sizes_take_the_policys_grammar(write_policy):
    """--size reads sizes as a policy does: a fraction that comes to whole bytes
    (1.5MiB) is a size; one that does not (1.1KiB) is an error, never rounded."""
    p = write_policy("version: 1\ndefault: a\narenas: {a: {}, big: {}}\n"
                     "rules:\n  - {name: big, match: {size: {min: 1536KiB}}, arena: big}\n")
    r = cli("explain", p, "--size", "1.5MiB")
    assert r.returncode == 0 and "arena 'big'" in r.stdout, r.stdout + r.stderr
    r = cli("explain", p, "--size", "1.25MiB")
    assert r.returncode == 0 and "-> default arena 'a'" in r.stdout, r.stdout + r.stderr
    r = cli("explain", p, "--size", "1.1KiB")
    assert r.returncode == 2 and "not a whole number of bytes" in r.stderr, r.stderr


def test_explain_unknown_dtype_lists_the_accepted_ones(write_policy):
    r = cli("explain", write_policy(OK), "--size", "1MiB", "--dtype", "float33")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "argument --dtype: unknown dtype 'float33'; accepted dtypes are unknown, bool, " \
        in r.stderr
    assert "float32, float64" in r.stderr


# A policy's tables (rules, arenas) are refused past their size at the offending
# line, saying the bound; 100 times their size is over the 1 MiB file bound and is
# refused for that before parsing (docs/reliability.md, "Tables that fill").
def test_too_many_rules_or_arenas_are_refused_at_their_line(write_policy):
    rules = "".join("  - {name: r%d, arena: a, match: {size: {min: %d}}}\n" % (i, i)
                    for i in range(1025))
    r = cli("check", write_policy(OK + "rules:\n" + rules))
    assert r.returncode == 1 and ":5:3: error: rules: too many rules: 1025 (at most 1024)" \
        in r.stderr, r.stderr
    arenas = "".join("  a%d: {}\n" % i for i in range(65))
    r = cli("check", write_policy("version: 1\ndefault: a0\narenas:\n" + arenas))
    assert r.returncode == 1 and ":68:3: error: arenas: too many arenas: at most 64" \
        in r.stderr, r.stderr
    rules = "".join("  - {name: r%d, arena: a}\n" % i for i in range(102400))
    r = cli("check", write_policy(OK + "rules:\n" + rules))
    assert r.returncode == 1 and "larger than 1048576 bytes" in r.stderr, r.stderr


def test_the_references_example_passes_check_without_a_warning(tmp_path):
    """docs/policy-reference.md's Example, as a user copies it, is a policy
    `check` accepts with nothing to say: its `thread: ["loader-*"]` drew the
    pool-glob warning (ThreadPoolExecutor names threads loader_0, ...)."""
    with open(os.path.join(ROOT, "docs", "policy-reference.md"), encoding="utf-8") as f:
        doc = f.read()
    example = re.search(r"## Example\n\n```yaml\n(.*?)```", doc, re.S).group(1)
    pol = tmp_path / "example.yaml"
    pol.write_text(example)
    r = cli("check", str(pol))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("%s: ok: " % pol), r.stdout


def test_check_quotes_the_source_line_under_every_diagnostic(tmp_path):
    """Before, only the first diagnostic got its source line. `check` (the user
    named the file) quotes each one's line with its caret; a job's own report
    keeps to one (test_activation.py, docs/security.md)."""
    pol = tmp_path / "policy.yaml"
    pol.write_text("version: 1\ndefault: a\narenas:\n  a:\n    hugepages: yes\n"
                   "    limt: 1GiB\n")
    r = cli("check", pol)
    assert r.returncode == 1, r
    lines = r.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if ":5:16: error:" in line)
    second = next(i for i, line in enumerate(lines) if ":6:5: error:" in line)
    assert "invalid value 'yes' (did you mean 'on'?)" in lines[first], r.stderr
    assert lines[first + 1:first + 3] == ["    hugepages: yes", " " * 15 + "^"], r.stderr
    assert "unknown key 'limt' (did you mean 'limit'?)" in lines[second], r.stderr
    assert lines[second + 1:second + 3] == ["    limt: 1GiB", "    ^"], r.stderr


def test_datamem_quiet_silences_warnings_never_errors(tmp_path):
    """A way to silence the start-up warnings: DATAMEM_QUIET=1 drops a
    policy's warnings; a bad policy's errors are printed all the same, and a
    value other than 0 or 1 is reported, not taken as either."""
    warn = os.path.join(ROOT, "tests", "policies", "warn", "decimal_size.yaml")
    code = "import numpy, datamem; print(datamem.arena_of(numpy.ones(10)))"
    loud = run_py(code, config=warn)
    assert loud.returncode == 0 and "warning: arenas.general.decay.budget" in loud.stderr, loud
    quiet = run_py(code, config=warn, env={"DATAMEM_QUIET": "1"})
    assert quiet.returncode == 0 and quiet.stdout.strip() == "general", quiet
    assert quiet.stderr == "", quiet.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: a\narenas:\n  a: {hugepages: yes}\n")
    r = run_py(code, config=str(bad), env={"DATAMEM_QUIET": "1"})
    assert r.returncode != 0, r
    assert "error: arenas.a.hugepages: invalid value 'yes'" in r.stderr, r.stderr
    r = run_py(code, config=warn, env={"DATAMEM_QUIET": "yes"})
    assert "DATAMEM_QUIET='yes': use 1 (no warnings) or 0" in r.stderr, r.stderr
    assert "warning: arenas.general.decay.budget" in r.stderr, r.stderr
