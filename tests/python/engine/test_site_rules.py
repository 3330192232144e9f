"""Call-site rules: `match: {module: ...}` and `match: {function: ...}`
route an array by the code that made it: the innermost Python frame outside
NumPy, pandas, SciPy, scikit-learn and datamem (the frame a profile records).
"""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

from conftest import ROOT, UNDER_ASAN

LOADER = textwrap.dedent("""\
    import numpy as np

    def read_batch(n):
        return np.ones(n)            # np.ones is NumPy's Python code: the site is here

    class Reader:
        def read(self, n):
            return np.empty(n)

    def grow(a, n):
        a.resize(n, refcheck=False)  # NumPy's realloc: the site is not looked at
        return a
""")

POLICY = textwrap.dedent("""\
    version: 1
    default: general
    arenas:
      general: {}
      loading: {}
      readers: {}
    rules:
      - name: reader
        match: {function: "mypkg.loader.Reader.*"}
        arena: readers
      - name: small
        match: {size: {max: 512}}
        arena: general
      - name: loader
        match: {module: ["mypkg.*", "other"], thread: "Main*"}
        arena: loading
""")


def run(tmp_path, code, policy=POLICY, env=None):
    pkg = tmp_path / "mypkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "loader.py").write_text(LOADER)
    pol = tmp_path / "policy.yaml"
    pol.write_text(policy)
    e = dict(os.environ, DATAMEM_CONFIG=str(pol), PYTHONPATH=str(tmp_path))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))


def test_rules_route_by_module_and_function(tmp_path):
    code = r"""
import json, threading, numpy as np, datamem
from mypkg.loader import read_batch, Reader, grow
out = {
    "loader_big": datamem.arena_of(read_batch(1000)),
    "loader_small": datamem.arena_of(read_batch(10)),  # the earlier 'small' rule wins
    "method": datamem.arena_of(Reader().read(1000)),
    "main": datamem.arena_of(np.ones(1000)),           # __main__ matches no rule
}
t = threading.Thread(target=lambda: out.__setitem__("thread", datamem.arena_of(read_batch(1000))),
                     name="worker")
t.start(); t.join()                                     # 'loader' wants Main* threads
a = read_batch(1000)
out["grown"] = datamem.arena_of(grow(a, 100000))       # realloc: site unknown
s = datamem.stats()["rules"]
out["counts"] = {k: v["allocations"] for k, v in s.items() if k != "default"}
print(json.dumps(out))
"""
    r = run(tmp_path, code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["loader_big"] == "loading" and out["loader_small"] == "general", out
    assert out["method"] == "readers" and out["main"] == "general", out
    assert out["thread"] == "general", out
    assert out["grown"] == "general", out
    assert out["counts"]["reader"] == 1 and out["counts"]["loader"] == 2, out


def test_a_reload_recomputes_cached_sites(tmp_path):
    swapped = POLICY.replace('function: "mypkg.loader.Reader.*"', 'function: "mypkg.loader.read_*"')
    code = r"""
import json, sys, numpy as np, datamem
from mypkg.loader import read_batch, Reader
before = [datamem.arena_of(read_batch(1000)), datamem.arena_of(Reader().read(1000))]
open("swapped.yaml", "w").write(sys.argv[1])
datamem.reload("swapped.yaml")
after = [datamem.arena_of(read_batch(1000)), datamem.arena_of(Reader().read(1000))]
print(json.dumps([before, after]))
"""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "loader.py").write_text(LOADER)
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)
    e = dict(os.environ, DATAMEM_CONFIG=str(pol), PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code, swapped], env=e, capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    before, after = json.loads(r.stdout)
    assert before == ["loading", "readers"], before
    assert after == ["readers", "loading"], after


def test_without_site_rules_nothing_looks_at_frames(tmp_path):
    plain = "version: 1\ndefault: general\narenas:\n  general: {}\n"
    code = r"""
import numpy as np, datamem
from datamem import _ext
import mypkg.loader as l
print(_ext.site_rules_active(), datamem.arena_of(l.read_batch(1000)))
"""
    r = run(tmp_path, code, policy=plain)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "general"], r.stdout


def test_explain_answers_for_a_call_site(tmp_path):
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY)

    def explain(*args):
        r = subprocess.run([sys.executable, "-m", "datamem", "explain", str(pol), "--size",
                            "8KiB"] + list(args), capture_output=True, text=True, timeout=60,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = explain("--function", "mypkg.loader.read_batch", "--thread", "MainThread")
    assert out.splitlines()[-1] == "-> rule 'loader' -> arena 'loading'", out
    assert "call site mypkg.loader.read_batch (mypkg.loader) does not match function " \
           "'mypkg.loader.Reader.*'" in out
    out = explain("--module", "mypkg.loader", "--function", "mypkg.loader.Reader.read")
    assert out.splitlines()[-1] == "-> rule 'reader' -> arena 'readers'", out
    out = explain()
    assert "call site unknown" in out and out.splitlines()[-1] == "-> default arena 'general'"


def test_bad_site_globs_are_policy_errors(tmp_path):
    bad = POLICY.replace('module: ["mypkg.*", "other"]', 'module: [a, b, c, d, e]') \
                .replace('function: "mypkg.loader.Reader.*"', 'function: "mypkg[.loader"')
    pol = tmp_path / "bad.yaml"
    pol.write_text(bad)
    r = subprocess.run([sys.executable, "-m", "datamem", "check", str(pol)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0
    assert "rules[0].match.function: invalid glob" in r.stderr + r.stdout, r.stderr
    assert "rules[2].match.module: too many entries: at most 4" in r.stderr + r.stdout


def test_big_zeroed_arrays_from_a_site(tmp_path):
    """np.zeros of a reused big block through a call-site rule: zero, in the
    site's arena (the big-block path: hugepage advice, zeroing by purge)."""
    code = r"""
import json, numpy as np, datamem
import mypkg.loader as l
# A function of mypkg.loader (its globals are the module's): the call site.
exec(compile("def make2():\n    return np.zeros(64 << 20, np.uint8)\n", "mypkg/loader.py", "exec"),
     l.__dict__)
a = l.make2(); a[:] = 7; del a
b = l.make2()
print(json.dumps([datamem.arena_of(b), int(b.max()), datamem.arena_of(np.zeros(64 << 20))]))
"""
    r = run(tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["loading", 0, "general"], r.stdout


# The call-site cache kept one entry, and a reference to the code object, for every
# code object it met: a job that makes code as it runs (exec, namedtuple,
# dataclasses, code.replace) grew without bound (215 MB for 409,600 generated
# functions). It starts over at 4,096 entries; rules keep matching and a profile
# keeps naming every site right across the restarts. 100 x its size here. The
# RSS bound is datamem's share: the same loop without datamem is run beside it,
# since free-threaded 3.13t itself grows by ~40 MB here (its interned strings,
# each function's name among them, are immortal; plain CPython's stay flat).
def test_the_call_site_cache_stays_bounded_as_code_is_made(tmp_path):
    policy = ("version: 1\ndefault: general\narenas:\n  general: {}\n  gen: {}\n"
              "rules:\n  - {name: gen, match: {function: '__main__.g*7'}, arena: gen}\n")
    code = r"""
import json, os, types, numpy as np, datamem

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def f():
    return np.empty(8)

routed = "DATAMEM_CONFIG" in os.environ
wrong, start = 0, rss()
for i in range(409600):
    name = "g%d" % i
    names = {"co_name": name}
    if hasattr(f.__code__, "co_qualname"):   # 3.11+: the site's function is the qualname
        names["co_qualname"] = name
    g = types.FunctionType(f.__code__.replace(**names), globals())
    want = "gen" if name.endswith("7") else "general"
    a = g()
    if routed:
        wrong += datamem.arena_of(a) != want
    if i == 40960:
        base = rss()
print(json.dumps({"wrong": wrong, "growth": rss() - base, "total": rss() - start}))
"""
    r = run(tmp_path, code, policy=policy)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["wrong"] == 0, out
    env = {k: v for k, v in os.environ.items() if k != "DATAMEM_CONFIG"}
    c = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    assert c.returncode == 0, c.stderr
    without = json.loads(c.stdout)
    # ASan's quarantine holds freed memory: RSS says nothing there.
    if not UNDER_ASAN:
        assert out["growth"] - without["growth"] < 16 << 20, (out, without)
        assert out["total"] - without["total"] < 32 << 20, (out, without)


def test_site_rules_apply_while_a_profile_records(tmp_path):
    """The recording handlers route by call site as the plain ones do (they
    once called the runtime without the site, so a profiled job's site rules
    were silently off)."""
    code = r"""
import json, numpy as np, datamem
from mypkg.loader import read_batch, Reader
print(json.dumps([datamem.arena_of(read_batch(1000)), datamem.arena_of(Reader().read(1000)),
                  datamem.arena_of(np.ones(1000))]))
"""
    r = run(tmp_path, code, env={"DATAMEM_PROFILE": str(tmp_path / "prof"),
                                 "DATAMEM_PROFILE_SAMPLE": "full"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["loading", "readers", "general"], r.stdout
