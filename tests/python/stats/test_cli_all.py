"""Many processes, one view: `top` at 80 columns, `top --all`,
`ls --prometheus-sd` and `reload --all`, against real processes."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

from conftest import CONFIGS, ROOT, job_died

from datamem._cli import stats as stats_cli
from datamem._stats import tables

DEMO = os.path.join(CONFIGS, "demo.yaml")

# Serves stats, makes arrays of known sizes, prints its pid and URL, then answers
# "stats" on stdin with datamem.stats() (JSON) until stdin closes.
JOB = r"""
import json, os, sys, numpy as np, datamem
keep = [np.ones(1 << 20) for _ in range(int(sys.argv[1]))]   # 8 MiB each: arena "big"
small = [np.ones(10) for _ in range(100)]
print(json.dumps({"pid": os.getpid(), "url": datamem.stats_url()}), flush=True)
for line in sys.stdin:
    print(json.dumps(datamem.stats()), flush=True)
"""


def cli(*args, env=None, timeout=60):
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "datamem"] + [str(a) for a in args], env=e,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


class Job:
    def __init__(self, disc, config=DEMO, big=1, token=""):
        e = dict(os.environ)
        e.update({"DATAMEM_CONFIG": config, "DATAMEM_STATS_HTTP": "127.0.0.1:0",
                  "DATAMEM_STATS_DIR": str(disc)})
        self.p = subprocess.Popen([sys.executable, "-c", JOB, str(big), token], env=e, cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(job_died(self.p))
        info = json.loads(line)
        self.pid, self.url = info["pid"], info["url"]

    def stats(self):
        self.p.stdin.write("stats\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def stop(self):
        if self.p.stderr.closed:  # stopped already
            return ""
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        err = self.p.stderr.read()
        self.p.stdout.close()
        self.p.stderr.close()
        return err


@contextlib.contextmanager
def jobs(*specs):
    started = []
    try:
        for kw in specs:
            started.append(Job(**kw))
        yield started
    finally:
        for j in started:
            j.stop()


def long_policy(tmp_path, extra=""):
    """A policy in a deep directory with arena names longer than a table cell."""
    d = tmp_path / ("a-directory-with-a-long-name-" * 3) / "policies"
    d.mkdir(parents=True)
    p = d / "policy.yaml"
    p.write_text("version: 1\ndefault: general-purpose-arena-for-everything\narenas:\n"
                 "  general-purpose-arena-for-everything: {}\n"
                 "  big: {alignment: 4096}\n"
                 "rules:\n  - name: huge\n    match: {size: {min: 4MiB}}\n    arena: big\n"
                 + extra)
    return p


# ---- top at 80 columns ------------------------------------------------------------------

def _worst_snapshot(t):
    big = 1023.9 * 2 ** 40  # the widest size cell: "1023.9TiB"
    arena = {k: big for k in ("allocated_bytes", "active_bytes", "resident_bytes",
                              "dirty_bytes", "hugepage_bytes", "mapped_bytes")}
    arena.update(allocations=999_999_999_999 * t, failures=999_999_999 * t, in_policy=False)
    return {"time": t, "pid": 4194304, "version": "10.20.30", "reloads": 123456,
            "reload_failures": 7890, "last_reload_successful": False, "threads": 100000,
            "policy_path": "/very/" + "long/" * 30 + "policy.yaml",
            "arenas": {"an-arena-name-much-longer-than-any-column-allows": arena, "b": arena}}


def test_top_rendering_fits_80_columns_at_worst():
    prev, cur = _worst_snapshot(1.0), _worst_snapshot(2.0)
    text = tables.header(cur, "http://127.0.0.1:65535" + "/x" * 40) + "\n" + \
        tables.table(cur, prev)
    lines = text.splitlines()
    assert all(len(l) <= 80 for l in lines), "\n".join("%3d %s" % (len(l), l) for l in lines)
    # Too much for one line: the policy's path gets a line of its own.
    assert lines[1].startswith("policy ~") and lines[1].endswith("/long/policy.yaml")
    assert lines[2] == "loads 123456 ok, 7890 failed (LAST RELOAD FAILED)  threads 100000"
    row = next(l for l in lines if l.startswith("an-arena"))
    assert "1023.9TiB" in row and row.split()[-2] == "1000.0G"  # numbers are never cut
    assert row.split()[0].endswith("~")                 # the name is, visibly


def test_top_of_a_real_process_fits_80_columns(tmp_path):
    disc = tmp_path / "discovery"
    pol = long_policy(tmp_path)
    with jobs(dict(disc=disc, config=str(pol), big=3)) as (j,):
        r = cli("top", j.pid, "--once", "--interval", "0.2",
                env={"DATAMEM_STATS_DIR": str(disc)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(l) <= 80 for l in lines), "\n".join("%3d %s" % (len(l), l) for l in lines)
    assert "loads 1 ok, 0 failed" in lines[1] and "1/0" not in r.stdout
    assert lines[2].split() == ["ARENA", "ALLOCATED", "ACTIVE", "RESIDENT", "DIRTY", "HUGE",
                                "ALLOC/s", "FAIL/s"]
    big = next(l for l in lines if l.startswith("big "))
    assert big.split()[1] == "24.0MiB"                  # 3 x 8 MiB


# ---- top --all ----------------------------------------------------------------------------

def test_top_all_one_table_per_process_per_arena_and_totals(tmp_path):
    disc = tmp_path / "discovery"
    env = {"DATAMEM_STATS_DIR": str(disc)}
    with jobs(dict(disc=disc, big=1), dict(disc=disc, big=2),
              dict(disc=disc, big=4)) as js:
        r = cli("top", "--all", "--once", "--interval", "0.2", env=env)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(len(l) <= 80 for l in lines), "\n".join("%3d %s" % (len(l), l) for l in lines)
        assert "3 process(es)" in lines[0]
        assert lines[1].split()[:4] == ["PID", "ARENA", "ALLOCATED", "RESIDENT"]
        for j, n in zip(js, (1, 2, 4)):
            i = next(k for k, l in enumerate(lines) if l.split()[:1] == [str(j.pid)])
            assert lines[i].split()[1] == "all"
            big = next(l for l in lines[i + 1:] if l.split()[0] == "big")
            assert big.split()[1] == "%.1fMiB" % (8.0 * n)
        # Each arena summed over the processes, then everything.
        t = next(k for k, l in enumerate(lines) if l.startswith("TOTAL"))
        assert lines[t].split()[:3] == ["TOTAL", "big", "56.0MiB"]   # 8 + 16 + 32
        assert lines[-1].startswith("TOTAL") and "all (3 processes)" in lines[-1]
        # Without a TARGET or --all, top says what it needs.
        r = cli("top", env=env)
        assert r.returncode == 2 and "TARGET or --all" in r.stderr


def test_top_all_with_nothing_serving(tmp_path):
    r = cli("top", "--all", "--once", env={"DATAMEM_STATS_DIR": str(tmp_path / "none")})
    assert r.returncode == 0 and "no datamem process is serving stats" in r.stdout


# ---- ls --prometheus-sd ------------------------------------------------------------------------

def _read_sd(path, want, timeout=20.0):
    """The file_sd groups once their pids are `want` (a set)."""
    deadline = time.monotonic() + timeout
    groups = None
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                groups = json.load(f)
            if {g["labels"]["pid"] for g in groups} == {str(p) for p in want}:
                return groups
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError("file_sd never listed %s: %s" % (sorted(want), groups))


def test_prometheus_sd_follows_processes_that_come_and_go(tmp_path):
    disc = tmp_path / "discovery"
    sd = tmp_path / "targets.json"
    e = dict(os.environ, DATAMEM_STATS_DIR=str(disc))
    e.pop("DATAMEM_CONFIG", None)
    with jobs(dict(disc=disc), dict(disc=disc)) as (a, b):
        w = subprocess.Popen([sys.executable, "-m", "datamem", "ls", "--prometheus-sd", str(sd),
                              "--interval", "0.1"], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            groups = _read_sd(sd, {a.pid, b.pid})
            by_pid = {g["labels"]["pid"]: g for g in groups}
            for j in (a, b):
                g = by_pid[str(j.pid)]
                assert g["targets"] == [j.url.split("//")[1].split("/")[0]]
                assert g["labels"]["program"].startswith("python")
            b.stop()                                    # a worker goes ...
            _read_sd(sd, {a.pid})
            with jobs(dict(disc=disc)) as (c,):         # ... another comes
                _read_sd(sd, {a.pid, c.pid})
        finally:
            w.send_signal(signal.SIGTERM)
            out, err = w.communicate(timeout=30)
        assert w.returncode == 0, err
        # Checked once the writer is gone: while it runs, a rewrite's temporary
        # file exists for a moment before its rename.
        assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]
        assert "%s: 2 target(s)" % sd in out.splitlines()[0]


def test_prometheus_sd_once(tmp_path):
    disc = tmp_path / "discovery"
    sd = tmp_path / "t.json"
    with jobs(dict(disc=disc)) as (a,):
        r = cli("ls", "--prometheus-sd", sd, "--once", env={"DATAMEM_STATS_DIR": str(disc)})
        assert r.returncode == 0, r.stderr
        groups = json.loads(sd.read_text())
        assert [g["labels"]["pid"] for g in groups] == [str(a.pid)]


# ---- reload --all -----------------------------------------------------------------------------

def test_reload_all_signals_every_process_that_opted_in(tmp_path):
    disc = tmp_path / "discovery"
    token = "dm-reload-all-" + uuid.uuid4().hex   # only this test's processes
    sig = long_policy(tmp_path, "reload: {signal: true}\n")
    nosig = tmp_path / "nosig.yaml"
    nosig.write_text("version: 1\ndefault: general\narenas:\n  general: {}\n")
    with jobs(dict(disc=disc, config=str(sig), token=token),
              dict(disc=disc, config=str(sig), token=token),
              dict(disc=disc, config=str(nosig), token=token)) as (a, b, c):
        sig.write_text(sig.read_text().replace("min: 4MiB", "min: 1MiB"))
        r = cli("reload", "--all", "--match", token)
        # c has not opted in: it is named, not signalled (SIGHUP would end it), and
        # the exit status says not everything was reloaded.
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "sent SIGHUP to 2 process(es)" in r.stdout
        assert str(a.pid) in r.stdout and str(b.pid) in r.stdout
        assert "process %d does not handle SIGHUP" % c.pid in r.stderr
        for j in (a, b):
            deadline = time.monotonic() + 20
            while j.stats()["reloads"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert j.stats()["reloads"] == 2
        assert c.p.poll() is None and c.stats()["reloads"] == 1
    r = cli("reload", "--all", "--match", token)
    assert r.returncode == 1 and "no process of this user has datamem loaded" in r.stderr
    r = cli("reload")
    assert r.returncode == 2 and "PID or --all" in r.stderr


def test_top_shows_limits_in_80_columns():
    """An arena with a limit shows its live bytes as a share of it."""
    prev, cur = _worst_snapshot(1.0), _worst_snapshot(2.0)
    for snap in (prev, cur):
        arenas = snap["arenas"]
        arenas["b"] = dict(arenas["b"], limit_bytes=8 << 30, live_bytes=6 << 30)
    lines = tables.table(cur, prev).splitlines()
    assert all(len(l) <= 80 for l in lines), "\n".join(lines)
    head = lines[0].split()
    assert "LIMIT" in head and "ACTIVE" not in head, head
    col = head.index("LIMIT")
    rows = {l.split()[0].rstrip("*"): l.split() for l in lines[1:]}
    assert rows["b"][col] == "75%", rows["b"]
    other = next(r for n, r in rows.items() if n != "b")
    assert other[col] == "-", other
    # No limit anywhere: the usual columns.
    assert "LIMIT" not in tables.table(_worst_snapshot(2.0), _worst_snapshot(1.0))


def test_top_shows_spill_arenas_in_80_columns():
    """A file-backed arena's bytes on disk and in memory, with their bounds, in a
    table under the arena table; arenas without `backing` have no row there."""
    prev, cur = _worst_snapshot(1.0), _worst_snapshot(2.0)
    big = 1023.9 * 2 ** 40
    for snap in (prev, cur):
        snap["arenas"]["b"] = dict(snap["arenas"]["b"], backed=True, backing_disk_bytes=big,
                                   backing_max=big, backing_resident_bytes=big,
                                   backing_resident_max=None, backing_paged_out_bytes=big,
                                   backing_full=999_999_999)
    lines = tables.top_text(cur, prev, "x").splitlines()
    assert all(len(l) <= 80 for l in lines), "\n".join(lines)
    at = next(i for i, l in enumerate(lines) if l.startswith("SPILL ARENA"))
    assert lines[at].split() == ["SPILL", "ARENA", "ON", "DISK", "DISK", "MAX", "RESIDENT", "RES",
                                 "MAX", "PAGED", "OUT", "REFUSED"], lines[at]
    assert lines[at + 1].split() == ["b*", "1023.9TiB", "1023.9TiB", "1023.9TiB", "-",
                                     "1023.9TiB", "999999999"], lines[at + 1]
    assert at + 2 == len(lines)  # one spill arena: one row
    # `top --all`: a row per process and spill arena.
    text = stats_cli.top_all_text({41: cur, 42: cur}, {41: prev, 42: prev})
    lines = text.splitlines()
    assert all(len(l) <= 80 for l in lines), text
    at = next(i for i, l in enumerate(lines) if l.startswith("PID") and "SPILL ARENA" in l)
    assert [l.split()[:2] for l in lines[at + 1:]] == [["41", "b*"], ["42", "b*"]], text
    # No file-backed arena: no spill table.
    assert "SPILL" not in tables.top_text(_worst_snapshot(2.0), _worst_snapshot(1.0), "x")


def _subparsers(ap):
    import argparse
    for act in ap._actions:
        if isinstance(act, argparse._SubParsersAction):
            return act.choices
    return {}


def test_every_command_and_option_has_help():
    """`python -m datamem` alone, `check -h`, `explain --dtype/--tag` and
    `record --out` each print help (they once printed none). Walks the CLI's
    own parser: every subcommand has a help line, every option and argument of
    each has a help text, and `-h` exits 0 for each."""
    from datamem import _cli
    ap = _cli.parser()[0]
    subs = _subparsers(ap)
    assert {"check", "explain", "reload", "stats", "ls", "top", "record", "plot",
            "profile", "report", "suggest"} <= set(subs), sorted(subs)
    listed = {c.dest: c.help for c in
              next(a for a in ap._actions if a.choices is subs)._choices_actions}
    missing = []
    for name, p in subs.items():
        if not (listed.get(name) or "").strip():
            missing.append(name)
        for act in p._actions:
            if act.dest == "help":
                continue
            if not (act.help or "").strip():
                missing.append("%s %s" % (name, "/".join(act.option_strings) or act.dest))
    assert not missing, "no help text: %s" % ", ".join(missing)
    for name in subs:
        r = cli(name, "-h")
        assert r.returncode == 0, (name, r.stderr)
        assert "usage:" in r.stdout, (name, r.stdout)
    r = cli()
    assert r.returncode == 2, r
    for name in subs:  # the whole help, each command named, not only "cmd is required"
        assert name in r.stderr, (name, r.stderr)
    assert "validate a policy" in r.stderr, r.stderr
