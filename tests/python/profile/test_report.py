"""Reading profiles (python/datamem/_profile/: read.py, report.py, suggest.py)
against files written byte by byte: cut short, hostile, large.

Recording real jobs is tested in test_profile.py; here every .dmprof is built
with _Dmprof, which follows the format in service/datamem_profile.h.
"""
import json
import os
import struct
import subprocess
import sys

import pytest

from conftest import skip_under_asan

T0 = 10 ** 12  # the header's t0_ns; record times are T0 + offsets
MS = 10 ** 6


def _env():
    e = dict(os.environ)
    for k in ("DATAMEM_CONFIG", "DATAMEM_PROFILE", "DATAMEM_PROFILE_SAMPLE",
              "DATAMEM_PROFILE_STACKS"):
        e.pop(k, None)
    return e


def _datamem(*args, check=True, timeout=120):
    r = subprocess.run([sys.executable, "-m", "datamem"] + [str(a) for a in args], env=_env(),
                       capture_output=True, timeout=timeout)
    r.stdout, r.stderr = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


class _Dmprof:
    """A .dmprof built record by record."""

    def __init__(self, pid=4242, header=None, raw_header=None, **fields):
        h = {"format": 1, "pid": pid, "ppid": 1, "sample_bytes": 0, "full": True,
             "stacks": False, "t0_ns": T0, "argv": ["python", "job.py"], "policy": ""}
        h.update(fields)
        if header is not None:
            h = header
        raw = raw_header if raw_header is not None else json.dumps(h).encode()
        self.b = bytearray(b"DMPROF1\nH" + struct.pack("<I", len(raw)) + raw)
        self.ids = {}

    def string(self, text):
        if text not in self.ids:
            self.ids[text] = len(self.ids) + 1
            raw = text.encode("utf-8", "surrogateescape")
            self.b += b"S" + struct.pack("<II", self.ids[text], len(raw)) + raw
        return self.ids[text]

    def site(self, function, line, file="job.py", module="__main__"):
        key = ("site", function, line, file, module)
        if key not in self.ids:
            m, fn, fi = self.string(module), self.string(function), self.string(file)
            self.ids[key] = len(self.ids) + 1
            self.b += b"C" + struct.pack("<IIIII", self.ids[key], m, fn, fi, line)
        return self.ids[key]

    def stack(self, *sites):
        """A 'K' record: call site ids, innermost first."""
        key = ("stack",) + sites
        if key not in self.ids:
            self.ids[key] = len(self.ids) + 1
            self.b += b"K" + struct.pack("<II%dI" % len(sites), self.ids[key], len(sites), *sites)
        return self.ids[key]

    def alloc(self, t, ptr, size, site=0, weight=1.0, thread="MainThread", tags="",
              rule="r", arena="default", stack=0):
        th, tg, ru, ar = (self.string(x) if x else 0 for x in (thread, tags, rule, arena))
        self.b += b"A" + struct.pack("<QQQdIIIIIIBB", T0 + t, ptr, size, weight, th, tg, ru, ar,
                                     site, stack, 11, 0)

    def free(self, t, ptr):
        self.b += b"F" + struct.pack("<QQ", T0 + t, ptr)

    def exit(self, t):
        self.b += b"X" + struct.pack("<Q", T0 + t)

    def write(self, path, cut=None):
        data = bytes(self.b if cut is None else self.b[:cut])
        with open(path, "wb") as f:
            f.write(data)
        return len(data)


def _job(pid=4242, temps=20, keep=10, **kw):
    """A small job: `temps` 8 MiB temporaries (1 ms each) and `keep` 128-byte
    arrays live to the end."""
    p = _Dmprof(pid, **kw)
    s1, s2 = p.site("__main__.make_temps", 14), p.site("__main__.keep_small", 20)
    t = 0
    for i in range(temps):
        p.alloc(t, 0x10000 + i, 8 << 20, s1)
        p.free(t + MS, 0x10000 + i)
        t += 2 * MS
    for i in range(keep):
        p.alloc(t, 0x90000 + i, 128, s2)
        t += MS
    p.exit(t + MS)
    return p


def _report(d):
    return json.loads(_datamem("report", d, "--json").stdout)


def _one_line_error(r, *words):
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("datamem: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_report_reads_a_written_profile(tmp_path):
    _job().write(tmp_path / "4242.dmprof")
    rep = _report(tmp_path)
    sites = {s["function"]: s for s in rep["sites"]}
    temps = sites["__main__.make_temps"]
    assert temps["bytes"] == 20 * (8 << 20) and temps["median_size"] == 8 << 20
    assert temps["median_lifetime"] == pytest.approx(1e-3)
    assert sites["__main__.keep_small"]["live_at_end_bytes"] == 10 * 128
    assert rep["peak"]["bytes"] == (8 << 20)
    assert rep["warnings"] == []


# ---- a process killed -------------------------------------------------------------

def test_report_and_suggest_skip_files_cut_short(tmp_path):
    # Bug pinned: a worker killed with SIGKILL (the OOM killer's way) leaves a
    # 0-byte or truncated .dmprof, and report and suggest refused the whole
    # directory. Now such a file is skipped (or read up to its last whole
    # record) with one warning line each, and the rest is used.
    whole = _job(4242).write(tmp_path / "4242.dmprof")
    (tmp_path / "4243.dmprof").write_bytes(b"")                   # killed as its profile began
    _job(4244).write(tmp_path / "4244.dmprof", cut=11)            # inside the header
    _job(4245).write(tmp_path / "4245.dmprof", cut=whole - 30)    # inside a record
    r = _datamem("report", tmp_path, "--json")
    rep = json.loads(r.stdout)
    assert sorted(p["pid"] for p in rep["processes"]) == [4242, 4245]
    warnings = r.stderr.strip().splitlines()
    assert len(warnings) == 3, r.stderr
    assert all(w.startswith("datamem: warning: ") for w in warnings)
    assert "4243.dmprof: skipped: empty" in r.stderr
    assert "4244.dmprof: skipped: cut short" in r.stderr
    assert "4245.dmprof: cut short at byte" in r.stderr
    cut = [p for p in rep["processes"] if p["pid"] == 4245][0]
    assert cut["records"] == 20 + 9  # the last allocation record was cut
    r = _datamem("suggest", tmp_path)
    assert "- name: temporaries" in r.stdout and r.stderr.count("warning") == 3
    _datamem("report", tmp_path)  # text too


def test_report_errs_when_every_file_is_cut_short(tmp_path):
    (tmp_path / "1.dmprof").write_bytes(b"")
    (tmp_path / "2.dmprof").write_bytes(b"DMPROF")
    _one_line_error(_datamem("report", tmp_path, check=False), "no usable profile file")


def test_report_warns_of_a_profile_stopped_at_its_size_cap(tmp_path):
    # The writer's 'T' record (service/profile.c): the file reached its size cap.
    p = _job()
    p.b += b"T" + struct.pack("<QQQ", T0 + 100 * MS, 1 << 20, 30)
    p.b += b"P" + struct.pack("<QQQ", T0 + 100 * MS, 1 << 30, 30)
    p.write(tmp_path / "4242.dmprof")
    r = _datamem("report", tmp_path)
    assert "profile truncated at 1048576 bytes (cap)" in r.stderr
    assert "warning:" in r.stdout and "profile truncated at 1048576 bytes (cap)" in r.stdout


# ---- hostile files ---------------------------------------------------------------------

NESTED = b"[" * 100000 + b"]" * 100000


@pytest.mark.parametrize("raw,words", [
    (b"not json", ["header is not valid JSON"]),
    (b"[1, 2]", ["header is a JSON list, not an object"]),
    (NESTED, ["header is not valid JSON", "nested too deeply"]),
    (json.dumps({"pid": "1234", "t0_ns": T0}).encode(), ["'pid'", "a process id"]),
    (json.dumps({"pid": 7, "t0_ns": "soon"}).encode(), ["'t0_ns'", "integer of nanoseconds"]),
    (json.dumps({"pid": 7, "t0_ns": 1.5}).encode(), ["'t0_ns'"]),
    (json.dumps({"pid": 7, "t0_ns": T0, "argv": "python job.py"}).encode(),
     ["'argv'", "a list of strings"]),
    (json.dumps({"pid": 7, "t0_ns": T0, "argv": [1, 2]}).encode(), ["'argv'"]),
    (json.dumps({"pid": True}).encode(), ["'pid'"]),
    (json.dumps({"t0_ns": T0}).encode(), ["header has no 'pid'"]),
    (json.dumps({"pid": 7, "format": 2}).encode(), ["'format'"]),
    (json.dumps({"pid": 7, "full": "yes"}).encode(), ["'full'"]),
    (b'{"pid": 7, "t0_ns": NaN}', ["'t0_ns'"]),
], ids=["not-json", "list", "nested", "pid-string", "t0-string", "t0-float", "argv-string",
        "argv-ints", "pid-bool", "no-pid", "format-2", "full-string", "t0-nan"])
def test_report_and_suggest_reject_a_bad_header_in_one_line(tmp_path, raw, words):
    # Bug pinned: each of these headers ended report and suggest in a traceback.
    p = _job(raw_header=raw)
    p.write(tmp_path / "7.dmprof")
    for cmd in ("report", "suggest"):
        line = _one_line_error(_datamem(cmd, tmp_path, check=False), "7.dmprof", *words)
        assert len(line) < 300, line


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0])
def test_report_rejects_a_bad_weight_in_one_line(tmp_path, weight):
    p = _job()
    p.alloc(500 * MS, 0xdead, 4096, weight=weight)
    p.write(tmp_path / "4242.dmprof")
    for cmd in ("report", "suggest"):
        _one_line_error(_datamem(cmd, tmp_path, check=False), "4242.dmprof", "weight",
                        "finite number >= 0")


@pytest.mark.parametrize("record,words", [
    (b"Z" + bytes(16), ["bad record type 0x5a"]),
    (b"S" + struct.pack("<II", 99, 1 << 30), ["a string of 1073741824 bytes"]),
    (b"K" + struct.pack("<II", 1, 1 << 30), ["a stack of 1073741824 frames"]),
    (b"H" + struct.pack("<I", 2) + b"{}", ["a second header"]),
])
def test_report_rejects_a_bad_record_in_one_line(tmp_path, record, words):
    p = _job()
    p.b += record
    p.write(tmp_path / "4242.dmprof")
    _one_line_error(_datamem("report", tmp_path, check=False), "4242.dmprof", *words)


def test_report_html_of_a_job_that_made_no_array(tmp_path):
    # Bug pinned: `report --html` on a profile without allocation records raised
    # ValueError (the max of nothing) in the scatter plot.
    _Dmprof().write(tmp_path / "4242.dmprof")
    out = tmp_path / "r.html"
    _datamem("report", tmp_path, "--html", out)
    assert "No arrays were recorded" in out.read_text()
    assert "records" in _datamem("report", tmp_path).stdout
    assert "version: 1" in _datamem("suggest", tmp_path).stdout


# Attack: `report --html FILE` wrote with open("w"): a symbolic link planted at
# FILE (in /tmp, say) made a root user's report overwrite any file. The page is
# written to a temporary file and renamed over the link.
def test_report_html_never_writes_through_a_planted_link(tmp_path):
    _Dmprof().write(tmp_path / "4242.dmprof")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "r.html"
    out.symlink_to(victim)
    _datamem("report", tmp_path, "--html", out)
    assert victim.read_text() == "precious\n"
    assert not out.is_symlink() and "No arrays were recorded" in out.read_text()


# ---- names from the profiled job -----------------------------------------------------

# A call site whose function name ends the YAML comment it is copied into and
# adds a rule of its own, first in the list, sending every array to `general`.
INJECT = "f\n  - name: evil\n    match: {size: {min: 0}}\n    arena: general\n  #"


@pytest.mark.parametrize("brk", ["\n", "\r", "\x85", "\u2028", "\u2029"])
def test_suggest_keeps_call_site_names_inside_comments(tmp_path, brk):
    # Attack pinned: suggest copied call-site names into YAML comments as they
    # were; a qualname with a line break (libyaml also breaks lines at NEL, LS
    # and PS) injected a rule that shadowed all the others.
    p = _Dmprof()
    evil = p.site(INJECT.replace("\n", brk), 3)
    t = 0
    for i in range(10):
        p.alloc(t, 0x1000 + i, 8 << 20, evil)
        p.free(t + MS, 0x1000 + i)
        p.alloc(t, 0x9000 + i, 64, evil)
        t += 2 * MS
    p.exit(t)
    p.write(tmp_path / "4242.dmprof")
    policy = _datamem("suggest", tmp_path).stdout
    path = tmp_path / "policy.yaml"
    path.write_bytes(policy.encode("utf-8"))
    assert "ok: 3 arenas, 2 rules" in _datamem("check", path).stdout
    table = _datamem("explain", path, "--table").stdout
    listed = table.split("rules:")[1].split("view")[0].strip().splitlines()
    rules = [l.split()[1].rstrip(":") for l in listed]
    assert rules == ["temporaries", "tiny"], table
    assert "evil" not in table
    assert "\\x" in policy or "\\u" in policy  # the name is there, escaped


def test_report_escapes_control_characters_from_the_job(tmp_path):
    # Attack pinned: report printed paths, thread names and call sites as they
    # were: escape sequences reached the terminal and newlines forged lines.
    p = _Dmprof(argv=["python", "\x1b]2;owned\x07job.py"])
    s = p.site("\x1b[2J\x1b[31mred\nforged line", 1, file="/tmp/\x1b[1mx.py")
    p.alloc(0, 0x1000, 4096, s, thread="t\x1b[5m\r", tags="<script>x</script>\u202e")
    p.free(MS, 0x1000)
    p.exit(2 * MS)
    p.write(tmp_path / "4242.dmprof")
    text = _datamem("report", tmp_path).stdout
    assert not any(c in text for c in "\x1b\x07\r\u202e")
    assert "forged line" in text and not any(l.startswith("forged") for l in text.splitlines())
    assert "\\x1b[31mred\\x0aforged line" in text
    html = tmp_path / "r.html"
    _datamem("report", tmp_path, "--html", html)
    page = html.read_text()
    assert "\x1b" not in page and "<script>" not in page and "&lt;script&gt;" in page
    rep = json.loads(_datamem("report", tmp_path, "--json").stdout)  # JSON keeps them, escaped
    assert rep["by_thread"][0]["name"] == "t\x1b[5m\r"


# ---- large profiles --------------------------------------------------------------------

GEN = r'''
import json, struct, sys
import numpy as np
A = np.dtype([("k", "u1"), ("t", "<u8"), ("ptr", "<u8"), ("size", "<u8"), ("w", "<f8"),
              ("th", "<u4"), ("tg", "<u4"), ("ru", "<u4"), ("ar", "<u4"), ("site", "<u4"),
              ("stack", "<u4"), ("dt", "u1"), ("fl", "u1")])
F = np.dtype([("k", "u1"), ("t", "<u8"), ("ptr", "<u8")])
path, n = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(1)
with open(path, "wb") as f:
    h = json.dumps({"pid": 99, "t0_ns": 1000, "full": True}).encode()
    f.write(b"DMPROF1\nH" + struct.pack("<I", len(h)) + h)
    for i, s in enumerate([b"MainThread", b"mod", b"fn", b"job.py", b"default"], 1):
        f.write(b"S" + struct.pack("<II", i, len(s)) + s)
    for sid in range(1, 201):
        f.write(b"C" + struct.pack("<IIIII", sid, 2, 3, 4, sid))
    ev = np.zeros(2 * 65536, np.dtype((np.void, 59)))
    for start in range(0, n, 65536):
        m = min(65536, n - start)
        i = start + np.arange(m)
        a = np.zeros(m, A)
        a["k"], a["t"], a["ptr"] = ord("A"), 1000 + i * 1000, 4096 * (i % 50000 + 1)
        a["site"] = rng.integers(1, 201, m)  # a few sizes per line, as in real jobs
        a["size"] = np.where(rng.random(m) < 0.01, 8 << 20, 8 * a["site"] * (1 + i % 3))
        a["w"], a["th"], a["ar"], a["dt"] = 1.0, 1, 5, 11
        fr = np.zeros(m, F)
        fr["k"], fr["t"], fr["ptr"] = ord("F"), a["t"] + 500, a["ptr"]
        out = bytearray()
        ab, fb = a.tobytes(), fr.tobytes()
        for j in range(m):
            out += ab[59 * j:59 * j + 59]
            out += fb[17 * j:17 * j + 17]
        f.write(out)
'''


def _max_rss_kib(args, out=os.devnull):
    """The peak RSS (KiB) of a command run with stdout to `out`."""
    code = ("import resource, subprocess, sys\n"
            "with open(sys.argv[1], 'w') as f:\n"
            "    subprocess.run(sys.argv[2:], stdout=f, check=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", code, str(out)] + args, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


@skip_under_asan  # every malloc of the process goes through ASan's quarantine
def test_report_memory_does_not_grow_with_the_profile(tmp_path):
    # Bug pinned: report read every record into Python lists, ~9x the file in
    # memory (a 200 MB profile: 1.7 GB). It streams now: its memory grows with
    # the call sites and the arrays live at once, not the records (this 80 MB
    # profile: ~20 MB above the interpreter with NumPy; 720 MB before).
    n = 1050000
    d = tmp_path / "prof"
    d.mkdir()
    subprocess.run([sys.executable, "-c", GEN, str(d / "99.dmprof"), str(n)], check=True,
                   timeout=300)
    size = os.path.getsize(d / "99.dmprof")
    assert size > 75e6
    base = _max_rss_kib([sys.executable, "-c", "import numpy, datamem._profile.report, datamem._ext, "
                                               "datamem._cli"])
    out = tmp_path / "report.json"
    used = _max_rss_kib([sys.executable, "-m", "datamem", "report", str(d), "--json"], out) - base
    assert used * 1024 < size / 2, (used, size)
    rep = json.loads(out.read_text())
    assert rep["records"] == n and len(rep["sites"]) == 200
    os.unlink(d / "99.dmprof")


# The reader is a parser of files written by other processes (and, at worst, by
# someone else): fuzzed like the policy parser. Mutated profiles (bytes flipped,
# cut, inserted, records repeated) must give a Profile or a ProfileError, and a
# Profile must render as text, HTML, JSON and a suggested policy, never raise
# anything else.
_FUZZ_BASE = bytes(_job(temps=6, keep=4).b)


@pytest.fixture(scope="module")
def _reader():
    from datamem._profile import read, report, suggest
    from datamem._profile.dmprof import ProfileError
    return read, report, suggest, ProfileError


def _mutate(data, ops):
    b = bytearray(data)
    for kind, pos, value in ops:
        pos %= max(len(b), 1)
        if kind == 0 and b:
            b[pos] = value
        elif kind == 1:
            del b[pos:]
        elif kind == 2:
            b[pos:pos] = bytes([value]) * (1 + value % 9)
        elif kind == 3 and b:
            b[pos:pos] = b[pos:pos + 1 + value]
    return bytes(b)


def test_reader_fuzz_gives_a_profile_or_one_error(tmp_path, _reader):
    from hypothesis import HealthCheck, given, settings, strategies as st
    read, report, suggest, ProfileError = _reader
    op = st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255))

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(op, min_size=1, max_size=6))
    def check(ops):
        d = tmp_path / "fz"
        d.mkdir(exist_ok=True)
        (d / "4242.dmprof").write_bytes(_mutate(_FUZZ_BASE, ops))
        try:
            p = read.load(str(d))
        except ProfileError as e:
            assert "\n" not in str(e).strip(), str(e)
            return
        s = report.summarize(p, top=5)
        report.text(s)
        report.html(p, s)
        report.to_json(s)
        suggest.suggest(p)

    check()


@pytest.mark.parametrize("name", ['mod.load*', 'mod.load"]', "mod.l\u00f6ad", "mod." + "x" * 60])
def test_suggest_memory_names_only_plain_call_sites_in_a_rule(tmp_path, name):
    # A call-site name goes into a spill rule's `function` glob only when it is a
    # plain dotted identifier: a glob character would match other functions, a
    # quote or bracket would end the YAML string, a longer name passes the
    # schema's 63 bytes. Such a site is never chosen: worker_limit spills instead.
    p = _Dmprof()
    sites = {"plain": p.site("mod.features", 3), "odd": p.site(name, 5)}
    for k, (which, n) in enumerate((("plain", 4), ("odd", 4))):
        for i in range(n):  # 4 x 64 MiB each, live to the end
            p.alloc(k * 10 * MS + i * MS, 0x100000 * (k * 10 + i + 1), 64 << 20, sites[which])
    p.exit(5000 * MS)
    p.write(tmp_path / "4242.dmprof")
    spill = tmp_path / "spill"
    for memory, want in (("400MiB", "plain"), ("200MiB", None)):
        # 512 MiB at the peak: past 70% of 400 MiB by 232 MiB (the plain site's 256
        # cover it); past 70% of 200 MiB by 372 MiB (the plain site alone does not)
        policy = _datamem("suggest", tmp_path, "--memory", memory, "--spill-dir", spill).stdout
        path = tmp_path / "policy.yaml"
        path.write_text(policy)
        assert "ok: " in _datamem("check", path).stdout
        table = _datamem("explain", path, "--table").stdout
        rules = [l.split()[1].rstrip(":") for l in
                 table.split("rules:")[1].split("view")[0].strip().splitlines()]
        lines = policy.splitlines()
        assert 'backing: {dir: "%s", max: ' % spill in policy, policy
        if want:
            assert rules[0] == "spill", table
            assert '    match: {function: ["mod.features"], size: {min: 4MiB}}' in lines, policy
            assert "worker_limit: 70%" not in lines and "# worker_limit: 70%" in lines, policy
            ex = _datamem("explain", path, "--size", "64MiB", "--function", "mod.features").stdout
            assert "arena 'spill'" in ex, ex
        else:
            assert "spill" not in rules, table
            assert lines[-2:] == ["worker_limit: 70%", "worker_spill: spill"], policy
        assert name not in "\n".join(l for l in lines if not l.lstrip().startswith("#"))


# ---- estimates from a sampled profile ----------------------------------------------

# Bug pinned (a sampled report counted 107 allocations against 865):
# sampling by bytes alone gives an 8-byte array one chance in 65,536 at 512 KiB,
# so a job's many small arrays were almost never sampled and the estimated count
# was the big arrays' alone (about 2,000 against 10,000 for this job). Each allocation
# now also counts mean/16 bytes, and its weight says so.
def test_report_sampled_count_estimates_small_arrays(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("import numpy as np\n"
                   "for _ in range(2000):\n"
                   "    np.empty(64 * 1024, np.uint8)\n"
                   "small = [np.empty(1, np.uint8) for _ in range(8000)]\n")
    counts = []
    for i in range(3):  # each run is a fresh random sample
        d = tmp_path / ("p%d" % i)
        _datamem("profile", "--out", d, "--", sys.executable, job)
        s = json.loads(_datamem("report", d, "--json").stdout)
        full = {h["label"]: h["allocations"] for h in s["size_histogram"]}
        counts.append((s["allocations"], full.get("0 B - 1 KiB", 0.0), s["bytes"]))
    # the truth: 10,000 arrays (and NumPy's own few), 8,000 of them tiny; 125 MiB
    for total, tiny, nbytes in counts:
        assert 10000 * 0.8 <= total <= 10000 * 1.25, counts
        assert 8000 * 0.8 <= tiny <= 8000 * 1.25, counts
        assert 2000 * 65536 * 0.8 <= nbytes <= 2000 * 65536 * 1.25, counts


# ---- stacks: the user's frames, flame graphs ------------------------------------------

# Bug pinned: with --stacks the report still named each site by the innermost
# frame outside numpy/pandas/scipy/sklearn, so arrays made through a library
# layer were charged to it (joblib's NotMemorizedFunc.__call__, importlib's
# _bootstrap), never to the user's line that called it.
def test_report_names_the_users_frame_behind_library_frames(tmp_path):
    lib = tmp_path / "lib" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "layer.py").write_text("def call(fn, *a):\n    return fn(*a)\n")
    (lib / "tables.py").write_text("import numpy as np\nTABLE = np.ones(1 << 17)\n")
    (tmp_path / "usercode.py").write_text(
        "import importlib\nimport numpy as np\nimport layer\n"
        "def run():\n    for i in range(50):\n        layer.call(np.ones, 1 << 16)\n"
        "def load():\n    return importlib.import_module('tables')\n")
    job = tmp_path / "job.py"
    job.write_text("import sys\nsys.path[:0] = [sys.argv[1], sys.argv[2]]\nimport usercode\n"
                   "usercode.run()\nusercode.load()\n")
    d = tmp_path / "prof"
    _datamem("profile", "--out", d, "--full", "--", sys.executable, job, lib, tmp_path)
    s = json.loads(_datamem("report", d, "--json").stdout)
    by_fn = {x["function"]: x for x in s["sites"]}
    assert "layer.call" not in by_fn and "tables.<module>" not in by_fn, sorted(by_fn)
    assert by_fn["usercode.run"]["bytes"] >= 50 * (1 << 19), by_fn["usercode.run"]
    assert by_fn["usercode.load"]["bytes"] >= 1 << 20, by_fn["usercode.load"]
    frames = by_fn["usercode.run"]["stacks"][0]["frames"]
    assert [(f["function"], f["library"]) for f in frames][:3] == [
        ("__main__.<module>", False), ("usercode.run", False), ("layer.call", True)], frames
    load = [(f["function"], f["library"]) for f in by_fn["usercode.load"]["stacks"][0]["frames"]]
    assert ("importlib.import_module", True) in load and ("tables.<module>", True) in load, load
    assert any(fn.startswith("importlib._bootstrap.") and lib for fn, lib in load), load
    out = _datamem("report", d).stdout
    assert "stacks of the top call sites" in out and "[lib] layer.call" in out, out
    assert "more library frames" in out, out  # importlib's run is folded
    # sampled without --stacks, only the recorded site is known: the report says
    # how to see the user's frames
    d2 = tmp_path / "prof2"
    _datamem("profile", "--out", d2, "--sample", "64KiB", "--", sys.executable, job, lib,
             tmp_path)
    out = _datamem("report", d2).stdout
    assert "layer.call" in out and "record with `profile --stacks`" in out, out


def _stacked_profile(d, inner="job.inner"):
    p = _Dmprof(stacks=True)
    outer = p.site("job.outer", 1)
    lib = p.site("layer.call", 7, file="/usr/lib/python3/site-packages/layer.py", module="layer")
    mine = p.site(inner, 2)
    k = p.stack(mine, lib, outer)
    p.alloc(1 * MS, 0x1000, 4096, site=lib, stack=k)
    p.alloc(2 * MS, 0x2000, 4096, site=lib, stack=k)
    p.alloc(3 * MS, 0x3000, 100, site=outer, stack=p.stack(outer))
    p.exit(4 * MS)
    p.write(d / "4242.dmprof")


def test_report_folded_stacks(tmp_path):
    _stacked_profile(tmp_path)
    _datamem("report", tmp_path, "--folded", tmp_path / "b.folded")
    _datamem("report", tmp_path, "--folded", tmp_path / "n.folded", "--by", "count")
    stack = ("job.outer (job.py:1);layer.call (/usr/lib/python3/site-packages/layer.py:7);"
             "job.inner (job.py:2)")
    assert (tmp_path / "b.folded").read_text() == stack + " 8192\njob.outer (job.py:1) 100\n"
    assert (tmp_path / "n.folded").read_text() == stack + " 2\njob.outer (job.py:1) 1\n"


# Attack: function and file names come from the profiled job; a function named
# <script>... in a flame graph page must be text, not markup that runs.
def test_report_flamegraph_escapes_names_and_loads_nothing(tmp_path):
    evil = '<script>alert(1)</script><img src=x onerror="alert(2)">'
    _stacked_profile(tmp_path, inner=evil)
    out = tmp_path / "f.html"
    _datamem("report", tmp_path, "--flamegraph", out)
    page = out.read_text()
    assert "<script" not in page.lower() and "<img" not in page.lower(), page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<svg") == 2  # bytes, then allocations
    assert "8.0 KiB" in page and "2 allocations" in page
    for outside in ("src=", "href=", "<link", "@import", "url("):
        assert outside not in page.replace("&lt;img src=x", ""), outside


# Attack: a symbolic link planted where the graph goes (in /tmp, say) would
# point a root user's report at any file: the report refuses it.
@pytest.mark.parametrize("opt", ["--flamegraph", "--folded"])
def test_report_flame_outputs_refuse_a_planted_link(tmp_path, opt):
    _stacked_profile(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.symlink_to(victim)
    r = _datamem("report", tmp_path, opt, out, check=False)
    assert r.returncode == 1 and "symbolic link" in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert victim.read_text() == "precious\n" and out.is_symlink()
