"""Property test: `explain` (the compiled table) agrees with a straightforward
reference evaluation of random policies and allocations; and the CLI."""
import fnmatch
import subprocess
import sys

from hypothesis import HealthCheck, given, settings, strategies as st

import datamem
from conftest import ROOT

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint64", "float16",
          "float32", "float64", "complex64", "complex128", "object", "str"]
KINDS = {
    "int": ["int8", "int16", "int32", "int64"],
    "uint": ["uint8", "uint16", "uint32", "uint64"],
    "float": ["float16", "float32", "float64", "longdouble"],
    "complex": ["complex64", "complex128", "clongdouble"],
}
KINDS["integer"] = KINDS["int"] + KINDS["uint"]
GLOBS = ["w-*", "loader-?", "main*", "[ab]x*"]
THREADS = ["w-1", "loader-3", "loader-33", "mainthread", "ax9", "other"]
TAGS = ["x", "y", "z"]
SIZES = [0, 1, 63, 64, 4095, 4096, 4097, 1 << 20, (1 << 20) + 1, 8 << 20, 1 << 30]

rule_st = st.fixed_dictionaries({
    "min": st.one_of(st.none(), st.sampled_from(SIZES)),
    "max": st.one_of(st.none(), st.sampled_from(SIZES)),
    "dtype": st.lists(st.sampled_from(DTYPES + list(KINDS)), max_size=3, unique=True),
    "thread": st.lists(st.sampled_from(GLOBS), max_size=2, unique=True),
    "tag": st.lists(st.sampled_from(TAGS), max_size=2, unique=True),
    "arena": st.integers(0, 3),
}).filter(lambda r: r["min"] is None or r["max"] is None or r["min"] <= r["max"])

case_st = st.fixed_dictionaries({
    "rules": st.lists(rule_st, max_size=6),
    "default": st.integers(0, 3),
    "size": st.sampled_from(SIZES),
    "dtype": st.sampled_from(DTYPES + ["unknown"]),
    "thread": st.sampled_from(THREADS),
    "tags": st.lists(st.sampled_from(TAGS), max_size=3, unique=True),
})


def policy_yaml(case):
    lines = ["version: 1", "default: a%d" % case["default"], "arenas:"]
    lines += ["  a%d: {alignment: 64}" % i for i in range(4)]
    if case["rules"]:
        lines.append("rules:")
    for i, r in enumerate(case["rules"]):
        match = []
        size = []
        if r["min"] is not None:
            size.append("min: %d" % r["min"])
        if r["max"] is not None:
            size.append("max: %d" % r["max"])
        if size:
            match.append("size: {%s}" % ", ".join(size))
        for key in ("dtype", "thread", "tag"):
            if r[key]:
                match.append("%s: [%s]" % (key, ", ".join("'%s'" % v for v in r[key])))
        lines.append("  - {name: r%d, match: {%s}, arena: a%d}" % (i, ", ".join(match), r["arena"]))
    return "\n".join(lines) + "\n"


def reference(case):
    """First matching rule wins; else the default."""
    for i, r in enumerate(case["rules"]):
        if r["min"] is not None and case["size"] < r["min"]:
            continue
        if r["max"] is not None and case["size"] > r["max"]:
            continue
        if r["dtype"]:
            allowed = set()
            for d in r["dtype"]:
                allowed.update(KINDS.get(d, [d]))
            if case["dtype"] == "unknown" or case["dtype"] not in allowed:
                continue
        if r["thread"] and not any(fnmatch.fnmatchcase(case["thread"], g) for g in r["thread"]):
            continue
        if not set(r["tag"]) <= set(case["tags"]):
            continue
        return "-> rule 'r%d' -> arena 'a%d'" % (i, r["arena"])
    return "-> default arena 'a%d'" % case["default"]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=case_st)
def test_explain_matches_reference(case, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(policy_yaml(case))
    ok, diags, _ = datamem.check(str(path))
    assert ok, diags
    out = datamem.explain(str(path), case["size"], case["dtype"], case["thread"], case["tags"])
    assert out.strip().splitlines()[-1] == reference(case), (policy_yaml(case), case, out)


def test_cli_check_and_explain(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "datamem"] + list(args),
                              capture_output=True, text=True, cwd=ROOT)
    r = cli("check", "configs/demo.yaml")
    assert r.returncode == 0 and "ok: 5 arenas, 4 rules" in r.stdout, r
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault: g\narenas:\n  g: {alignment: 48}\n")
    r = cli("check", str(bad))
    assert r.returncode == 1
    assert str(bad) + ":4:18: error: arenas.g.alignment: 48 is not a power of two" in r.stderr, r.stderr
    r = cli("explain", "configs/demo.yaml", "--size", "8MiB", "--dtype", "float32",
            "--thread", "loader-3", "--tag", "ingest")
    assert r.returncode == 0 and r.stdout.strip() == "-> rule 'huge' -> arena 'big'", r
    r = cli("explain", "configs/demo.yaml", "--size", "100000")
    assert "rule 'tiny': size 100000 is above max 4096" in r.stdout
    assert r.stdout.strip().endswith("-> default arena 'general'")
    r = cli("explain", "configs/demo.yaml", "--table")
    assert "view without context: 3 intervals" in r.stdout
