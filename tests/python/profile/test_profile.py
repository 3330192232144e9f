"""Allocation profiles: recording (full and sampled, DATAMEM_PROFILE and
`python -m datamem profile`, multiprocessing children), report, suggest.

Every job runs in a fresh interpreter: recording starts at interpreter start.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, untrusted_dir

JOB = textwrap.dedent('''
    import multiprocessing as mp
    import sys
    import threading

    import numpy as np
    import datamem

    KEEP = []

    def make_temps(n):
        s = 0.0
        for _ in range(n):
            t = np.ones(512 * 1024)         # line 14: 4 MiB temporaries
            s += float(t[0])
        return s

    def keep_small(n):
        for _ in range(n):
            KEEP.append(np.zeros(16))       # line 20: 128 B, live to the end

    def child():
        make_temps(20)

    if __name__ == "__main__":
        make_temps(int(sys.argv[1]))
        keep_small(int(sys.argv[2]))
        th = threading.Thread(target=make_temps, args=(10,), name="loader-1")
        th.start(); th.join()
        with datamem.tag("ingest"):
            make_temps(5)
        if len(sys.argv) > 3:
            p = mp.get_context(sys.argv[3]).Process(target=child)
            p.start(); p.join()
            assert p.exitcode == 0
''')


def _env(extra=None):
    e = dict(os.environ)
    for k in ("DATAMEM_CONFIG", "DATAMEM_PROFILE", "DATAMEM_PROFILE_SAMPLE",
              "DATAMEM_PROFILE_STACKS", "DATAMEM_PROFILE_MAX"):
        e.pop(k, None)
    e.update(extra or {})
    return e


def _run(args, env=None, timeout=180, **kw):
    r = subprocess.run(args, env=_env(env), capture_output=True, text=True, timeout=timeout,
                       **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _datamem(*args, **kw):
    return _run([sys.executable, "-m", "datamem"] + list(args), **kw)


def _report(d):
    return json.loads(_datamem("report", str(d), "--json").stdout)


def _site(report, function, line=None):
    for s in report["sites"]:
        if s["function"].endswith(function) and (line is None or s["line"] == line):
            return s
    raise AssertionError("no site %s:%s in %s" % (function, line,
                                                   [(s["function"], s["line"]) for s in report["sites"]]))


@pytest.fixture
def job(tmp_path):
    p = tmp_path / "job.py"
    p.write_text(JOB)
    return str(p)


def test_full_profile_finds_sites_lines_and_lifetimes(job, tmp_path):
    out = tmp_path / "prof"
    _run([sys.executable, job, "50", "500"],
         env={"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "full"})
    files = [n for n in os.listdir(out) if n.endswith(".dmprof")]
    assert len(files) == 1
    rep = _report(out)
    assert rep["mode"] == "full"
    temps = _site(rep, "__main__.make_temps", 14)
    small = _site(rep, "__main__.keep_small", 20)
    # 50 + 10 + 5 temporaries of 4 MiB (np.ones also makes a 0-d fill value, 8 B)
    assert temps["bytes"] >= 65 * (4 << 20) and temps["bytes"] < 65 * (4 << 20) + 4096
    assert temps["median_size"] == 4 << 20
    assert temps["median_lifetime"] < 0.1 and temps["live_at_end_bytes"] < 4096
    assert small["allocations"] == 500 and small["bytes"] == 500 * 128
    assert small["live_at_end_bytes"] == 500 * 128  # freed only at interpreter exit
    assert rep["sites_by_bytes"][0]["function"] == "__main__.make_temps"
    assert rep["sites_by_count"][0]["function"] == "__main__.keep_small"
    assert small["dtypes"] == ["float64"]
    threads = {g["name"]: g["bytes"] for g in rep["by_thread"]}
    assert threads["loader-1"] >= 10 * (4 << 20) and "MainThread" in threads
    tags = {g["name"]: g["bytes"] for g in rep["by_tag"]}
    assert tags["ingest"] >= 5 * (4 << 20)
    assert {g["name"] for g in rep["by_arena"]} == {"default"}  # the pass-through policy
    assert rep["peak"]["bytes"] >= 500 * 128 + (4 << 20)
    # full mode keeps whole stacks: the temporaries' stack ends in the module body
    text = _datamem("report", str(out)).stdout
    assert "top call sites by bytes" in text and "job.py:14" in text
    html = tmp_path / "r.html"
    _datamem("report", str(out), "--html", str(html))
    page = html.read_text()
    assert page.count("<svg") == 2 and "http" not in page.split("<body>", 1)[1].replace(
        "http://www.w3.org/2000/svg", "")


def test_sampled_estimate_is_unbiased(tmp_path):
    """Random sizes 1 KiB-1 MiB, 256 KiB mean between samples: the estimate of
    total bytes is within 10% of the truth (expected relative deviation
    sqrt(mean / total) ~ 3.5%), and of the count within 40%: a 1 KiB array is
    sampled with probability ~1/256, so the count's relative deviation is
    sqrt(sum((1 - p) / p)) / n ~ 9.7% here (15% failed one run in eight)."""
    job = tmp_path / "sizes.py"
    job.write_text(textwrap.dedent('''
        import numpy as np, sys
        rng = np.random.default_rng(7)
        sizes = (2 ** rng.uniform(10, 20, 4000)).astype(np.int64)
        for s in sizes.tolist():
            a = np.empty(s, np.uint8)
            del a
        print(int(sizes.sum()), len(sizes))
    '''))
    out = tmp_path / "prof"
    r = _run([sys.executable, str(job)],
             env={"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "256KiB"})
    truth_bytes, truth_n = map(int, r.stdout.split())
    rep = _report(out)
    assert rep["mode"] == "sampled" and rep["sample_bytes"] == 256 << 10
    site = _site(rep, "__main__.<module>")
    assert rep["records"] < truth_n / 2  # it did sample
    assert abs(site["bytes"] / truth_bytes - 1) < 0.10, (site["bytes"], truth_bytes)
    assert abs(site["allocations"] / truth_n - 1) < 0.40, (site["allocations"], truth_n)


def test_sampled_profiles_stay_small_and_unbiased_at_any_allocation_rate(tmp_path):
    """A job that allocates terabytes in a few seconds (reused 3 MiB blocks)
    with a 4 KiB sample mean would take ~10^9 samples; the sampler raises its
    mean to keep to ~10 samples a second plus ~1000 x ln(duration) (so a profile
    grows by a few MB an hour at most), and the estimate of total bytes stays
    unbiased and close."""
    job = tmp_path / "fast.py"
    job.write_text(textwrap.dedent('''
        import numpy as np, time
        total, n, end = 0, 0, time.monotonic() + 3.0
        while time.monotonic() < end:
            for s in (1 << 16, 1 << 20, 3 << 20):
                a = np.empty(s, np.uint8)
                total += s; n += 1
                del a
        print(total, n)
    '''))
    out = tmp_path / "prof"
    r = _run([sys.executable, str(job)],
             env={"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "4KiB"})
    truth_bytes, truth_n = map(int, r.stdout.split())
    rep = _report(out)
    assert truth_bytes > 4 << 30, truth_bytes  # it really allocated fast
    assert rep["records"] <= 20000, rep["records"]  # 1000 x ln(3 s / 1 ms) + 5000 + 30
    size = sum(os.path.getsize(out / f) for f in os.listdir(out) if f.endswith(".dmprof"))
    assert size < 2 << 20, size
    site = _site(rep, "__main__.<module>")
    assert abs(site["bytes"] / truth_bytes - 1) < 0.15, (site["bytes"], truth_bytes)


def test_profile_command_and_multiprocessing_children(job, tmp_path):
    out = tmp_path / "prof"
    _datamem("profile", "--out", str(out), "--full", "--", sys.executable, job, "5", "10",
             "fork")
    pids = sorted(int(n.split(".")[0]) for n in os.listdir(out) if n.endswith(".dmprof"))
    assert len(pids) == 2
    rep = _report(out)
    assert sorted(p["pid"] for p in rep["processes"]) == pids
    child = [p for p in rep["processes"] if p["ppid"] in pids][0]
    assert child["records"] >= 20  # the child's 20 temporaries, flushed at os._exit
    temps = _site(rep, "__main__.make_temps", 14)
    assert temps["bytes"] >= (5 + 10 + 5 + 20) * (4 << 20)
    # a profile directory is not overwritten
    r = subprocess.run([sys.executable, "-m", "datamem", "profile", "--out", str(out), "--",
                        sys.executable, job, "1", "1"], env=_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "already holds a profile" in r.stderr


def test_spawned_children_record_too(job, tmp_path):
    out = tmp_path / "prof"
    _run([sys.executable, job, "2", "2", "spawn"],
         env={"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "full"})
    rep = _report(out)
    assert len(rep["processes"]) >= 2  # spawn: the child and the resource tracker may record


def test_profile_under_a_policy_records_rules_and_arenas(job, tmp_path):
    out = tmp_path / "prof"
    policy = os.path.join(ROOT, "bench", "policies", "throughput.yaml")  # three arenas
    _datamem("profile", "--out", str(out), "--full", "--policy", policy, "--",
             sys.executable, job, "5", "10")
    rep = _report(out)
    temps = _site(rep, "__main__.make_temps", 14)
    assert "big" in temps["arenas"] and "huge" in temps["rules"]
    small = _site(rep, "__main__.keep_small", 20)
    assert small["arenas"] == ["small"] and small["rules"] == ["tiny"]


def test_profile_writes_its_own_passthrough_policy(tmp_path):
    # Attack pinned: an existing DIR/passthrough.yaml was used as the job's
    # policy (whoever could write DIR chose it; a policy's stats.textfile then
    # overwrites any file), and the file was written with open("w") through
    # whatever link sat at its name. The defence: the policy is always datamem's
    # own text, written as a new file and renamed over the name, never through it.
    out = tmp_path / "prof"
    out.mkdir(mode=0o700)
    evil = tmp_path / "evil.yaml"
    evil.write_text("version: 1\ndefault: evil\narenas:\n  evil: {alignment: 4096}\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    code = "import numpy as np; a = np.ones(1000)"
    for planted in (evil, victim):
        policy = out / "passthrough.yaml"
        if policy.exists():
            policy.unlink()
        policy.symlink_to(planted)
        _run([sys.executable, "-c", code], env={"DATAMEM_PROFILE": str(out),
                                                "DATAMEM_PROFILE_SAMPLE": "full"})
        assert not policy.is_symlink()
        assert "default: default" in policy.read_text()
        assert {g["name"] for g in _report(out)["by_arena"]} == {"default"}
        for name in os.listdir(out):
            os.unlink(out / name)
    assert victim.read_text() == "precious\n" and "evil" in evil.read_text()
    # A file of ours with other text is replaced, not adopted.
    (out / "passthrough.yaml").write_text(evil.read_text())
    _run([sys.executable, "-c", code], env={"DATAMEM_PROFILE": str(out),
                                            "DATAMEM_PROFILE_SAMPLE": "full"})
    assert {g["name"] for g in _report(out)["by_arena"]} == {"default"}


@pytest.mark.parametrize("how", ["another user's", "writable by others"])
def test_profile_will_not_write_its_policy_into_a_directory_of_others(tmp_path, how):
    # Attack pinned: `profile --out DIR` used an existing DIR of any owner and
    # wrote passthrough.yaml there; the owner could plant links at its names or
    # swap the policy. Without DATAMEM_CONFIG the job would run under a policy
    # from that directory, so it stops at start-up with one message instead.
    out = tmp_path / "prof"
    out.mkdir(mode=0o755)
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("SKIP: making a directory of another user needs root")
        os.chown(out, 65534, 65534)
        want = "owned by uid 65534, not by this user"
    else:
        os.chmod(out, 0o777)
        want = "writable by other users (mode 0777)"
    r = subprocess.run([sys.executable, "-m", "datamem", "profile", "--out", str(out), "--",
                        sys.executable, "-c", "print('job ran')"], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "job ran" not in r.stdout, r.stdout + r.stderr
    assert want in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(out) == []


def test_realloc_without_the_gil_has_no_site(tmp_path):
    """np.fromstring(sep=...) reallocs with the GIL released: recorded, flagged,
    no Python frame read."""
    job = tmp_path / "fs.py"
    job.write_text("import numpy as np\n"
                   "a = np.fromstring(' '.join(['1.5'] * 200000), sep=' ')\n"
                   "assert a.size == 200000\n")
    out = tmp_path / "prof"
    _run([sys.executable, str(job)],
         env={"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "full"})
    rep = _report(out)
    assert rep["realloc_records"] > 0 and rep["no_gil_records"] > 0
    assert any(s["index"] == -1 for s in rep["sites"])


def test_suggest_passes_check_and_routes_temporaries(job, tmp_path):
    out = tmp_path / "prof"
    _run([sys.executable, job, "40", "2000"], env={"DATAMEM_PROFILE": str(out)})
    policy = _datamem("suggest", str(out)).stdout
    path = tmp_path / "policy.yaml"
    path.write_text(policy)
    r = _datamem("check", str(path))
    assert "ok" in r.stdout and "warning" not in r.stderr, r.stderr
    assert "# big temporaries: sizes >= 4.0 MiB" in policy
    assert "__main__.make_temps:14 (100%)" in policy
    assert "reuse: {alignment: 4096, decay: {dirty: 30s, muzzy: 0ms}}" in policy
    ex = _datamem("explain", str(path), "--size", "4MiB").stdout
    assert "rule 'temporaries'" in ex and "arena 'reuse'" in ex
    ex = _datamem("explain", str(path), "--size", "128").stdout
    assert "arena 'reuse'" not in ex
    # and a job runs under it
    _run([sys.executable, job, "3", "3"], env={"DATAMEM_CONFIG": str(path)})


def test_suggest_keeps_long_lived_big_arrays_with_temporaries_unless_asked(tmp_path):
    job = tmp_path / "resident.py"
    job.write_text(textwrap.dedent('''
        import numpy as np
        table = np.ones(16 << 20)            # 128 MiB, lives to the end
        for _ in range(30):
            t = np.ones(1 << 20)             # 8 MiB temporaries
            t += 1
    '''))
    out = tmp_path / "prof"
    _run([sys.executable, str(job)], env={"DATAMEM_PROFILE": str(out),
                                          "DATAMEM_PROFILE_SAMPLE": "full"})
    path = tmp_path / "policy.yaml"
    path.write_text(_datamem("suggest", str(out), "--resident").stdout)
    assert "ok" in _datamem("check", str(path)).stdout
    assert "arena 'resident'" in _datamem("explain", str(path), "--size", "128MiB").stdout
    assert "arena 'reuse'" in _datamem("explain", str(path), "--size", "8MiB").stdout
    # By default they share the reuse arena (less peak RSS), and the comment says so.
    text = _datamem("suggest", str(out)).stdout
    path.write_text(text)
    assert "arena 'reuse'" in _datamem("explain", str(path), "--size", "128MiB").stdout
    assert "suggest --resident` separates them at" in text


def test_no_profile_without_the_variable():
    r = _run([sys.executable, "-c", "import numpy as np, datamem._ext as e; np.ones(10);"
              "print(repr(e.profile_info()[0]))"],
             env={"DATAMEM_CONFIG": os.path.join(ROOT, "configs", "minimal.yaml")})
    assert r.stdout.strip() == "''"


def test_bad_profile_directory_stops_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run([sys.executable, "-c", "import numpy; print('job ran')"],
                       env=_env({"DATAMEM_PROFILE": str(blocker / "sub")}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "job ran" not in r.stdout
    assert "DATAMEM_PROFILE=" in r.stderr


# ---- the writer's files --------------------------------------------------------------

MINIMAL = os.path.join(ROOT, "configs", "minimal.yaml")

# Records into DIR (argv[1]) from this process, limit argv[2] bytes (0: the default),
# after planting argv[3:] in DIR as symbolic links named after this process's file.
WRITER = textwrap.dedent('''
    import os, sys
    d, limit, victims = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    for i, v in enumerate(victims):
        name = "%d.dmprof" % os.getpid() if i == 0 else "%d-%d.dmprof" % (os.getpid(), i)
        os.symlink(v, os.path.join(d, name))
    import numpy as np, datamem
    from datamem import _ext
    print(_ext.profile_start(d, 1, True, False, "", *([limit] if limit else [])), flush=True)
    datamem.install(os.environ["POLICY"])
    n = int(os.environ.get("ARRAYS", "1000"))
    for _ in range(n):
        a = np.ones(4)
    if os.environ.get("FORK"):  # a fork child writes a file of its own
        pid = os.fork()
        if pid == 0:
            for _ in range(n):
                a = np.ones(4)
            _ext.profile_stop()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    _ext.profile_stop()
''')


def _writer(d, limit=0, victims=(), **env):
    return subprocess.run([sys.executable, "-c", WRITER, str(d), str(limit)] + list(victims),
                          env=_env(dict(env, POLICY=MINIMAL)), capture_output=True, text=True,
                          timeout=180)


def test_profile_never_writes_through_a_planted_symlink(tmp_path):
    # Attack pinned: DIR/<pid>.dmprof planted as a symbolic link to a victim file;
    # the writer opened it with O_CREAT|O_TRUNC and overwrote the victim. The
    # defence: the file is created with O_EXCL|O_NOFOLLOW and a taken name moves on.
    d = tmp_path / "prof"
    d.mkdir(mode=0o700)
    victims = [tmp_path / "victim", tmp_path / "victim2"]
    for v in victims:
        v.write_text("precious\n")
    r = _writer(d, victims=[str(v) for v in victims])
    assert r.returncode == 0, r.stderr
    for v in victims:
        assert v.read_bytes() == b"precious\n", v.read_bytes()[:40]
    path = r.stdout.strip()
    assert path.endswith("-2.dmprof") and os.path.dirname(path) == str(d), path
    with open(path, "rb") as f:
        assert f.read(8) == b"DMPROF1\n"
    assert not os.path.islink(path)


def _untrusted_dir(tmp_path, how):
    """A profile directory an attacker could write into, and the path to name it by."""
    d = tmp_path / "prof"
    return d, untrusted_dir(d, how)


_UNTRUSTED_WHY = {"another user's": "owned by uid 65534, not by this user",
                  "writable by others": "writable by other users (mode 0777)",
                  "a symbolic link": "a symbolic link, not a directory"}


@pytest.mark.parametrize("how", ["another user's", "writable by others", "a symbolic link"])
def test_profile_refuses_a_directory_it_cannot_trust(tmp_path, how):
    # Attack pinned: an existing DIR of any owner was accepted, so whoever could
    # write there could plant links or files. The writer (datamem._profile.recording.start,
    # the C side) refuses it in one line and the job runs on without a profile.
    d, target = _untrusted_dir(tmp_path, how)
    code = ("import numpy as np, datamem._profile.recording as p; "
            "print(repr(p.start(%r, 0))); np.ones(10); print('job ran')" % str(target))
    r = subprocess.run([sys.executable, "-c", code], env=_env({}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["''", "job", "ran"], r.stdout
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("datamem: profile: refusing "), r.stderr
    assert _UNTRUSTED_WHY[how] in lines[0]
    assert os.listdir(d) == []


@pytest.mark.parametrize("how", ["another user's", "writable by others", "a symbolic link"])
def test_profile_at_start_up_stops_on_a_directory_it_cannot_trust(tmp_path, how):
    # DATAMEM_PROFILE names an untrusted directory: start-up stops at the
    # job's import of NumPy with one message (exit 2), as for a bad policy, whether
    # or not DATAMEM_CONFIG is set; nothing is written there.
    d, target = _untrusted_dir(tmp_path, how)
    for extra in ({}, {"DATAMEM_CONFIG": MINIMAL}):
        env = _env(dict(extra, DATAMEM_PROFILE=str(target), DATAMEM_PROFILE_SAMPLE="full"))
        if not extra:
            env.pop("DATAMEM_CONFIG", None)
        r = subprocess.run([sys.executable, "-c", "import numpy; print('job ran')"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert "job ran" not in r.stdout
        assert "Traceback" not in r.stderr and _UNTRUSTED_WHY[how] in r.stderr, r.stderr
        assert os.listdir(d) == []


def test_profile_command_refuses_an_untrusted_out_before_running(tmp_path):
    d, target = _untrusted_dir(tmp_path, "writable by others")
    marker = tmp_path / "ran"
    r = subprocess.run([sys.executable, "-m", "datamem", "profile", "--out", str(target), "--",
                        sys.executable, "-c", "open(%r, 'w').close()" % str(marker)],
                       env=_env({}), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert _UNTRUSTED_WHY["writable by others"] in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists() and os.listdir(d) == []


def test_profile_command_max_size_bounds_each_file(tmp_path):
    # --max-size (DATAMEM_PROFILE_MAX) reaches the writer: a full profile of
    # 200,000 arrays stops at 1 MiB and report says it was cut.
    out = tmp_path / "prof"
    job = "import numpy as np\nfor i in range(200000): np.empty(3)\n"
    r = subprocess.run([sys.executable, "-m", "datamem", "profile", "--full", "--max-size",
                        "1MiB", "--out", str(out), "--", sys.executable, "-c", job],
                       env=_env({}), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    files = list(out.glob("*.dmprof"))
    assert len(files) == 1 and files[0].stat().st_size <= 1 << 20, files
    r = subprocess.run([sys.executable, "-m", "datamem", "report", str(out)], env=_env({}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "truncated" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "datamem", "profile", "--max-size", "1000",
                        "--out", str(tmp_path / "p2"), "--", sys.executable, "-c", "pass"],
                       env=_env({}), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--max-size must be at least 1048576 bytes" in r.stderr


def test_profile_stops_at_its_size_limit(tmp_path):
    # Bug pinned: --full profiles had no cap (25M small arrays: 1.9 GB in 20 s).
    # Each process's file stops at its limit with a 'T' record and one line on
    # stderr; a fork child gets a file, and a limit, of its own.
    d = tmp_path / "prof"
    limit = 1 << 20
    r = _writer(d, limit=limit, ARRAYS="100000", FORK="1")
    assert r.returncode == 0, r.stderr
    files = sorted(d.glob("*.dmprof"))
    assert len(files) == 2, files
    for f in files:
        data = f.read_bytes()
        assert limit // 2 < len(data) <= limit, (f, len(data))
        # the tail: 'T' t_ns, limit, records; then a last 'P'
        t = data[-50:]
        assert t[0:1] == b"T" and t[25:26] == b"P", t
        assert int.from_bytes(t[9:17], "little") == limit
        assert int.from_bytes(t[17:25], "little") > 1000  # records written before the stop
    assert r.stderr.count("reached its size limit") == 2, r.stderr
    # nothing else from datamem (3.12+ may add its DeprecationWarning for a fork in a
    # process with threads: the profile's flusher is one)
    assert len([l for l in r.stderr.splitlines() if "datamem" in l]) == 2, r.stderr


def test_profile_limit_below_one_mib_is_refused():
    r = subprocess.run([sys.executable, "-c", "from datamem import _ext\n"
                        "_ext.profile_start('/nonexistent', 1, True, False, '', 1000)"],
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "profile size limit must be at least 1048576 bytes" in r.stderr


def test_a_refused_second_start_leaves_the_running_profile_alone(tmp_path):
    """profile_start while a profile records raises, and changes nothing first:
    it once set the running profile's mode (here: full instead of sampled)
    before the writer refused it."""
    code = textwrap.dedent("""\
        import numpy as np
        from datamem import _ext
        _ext.profile_start(%r, 1 << 30, False, False, "")
        try:
            _ext.profile_start(%r, 1, True, True, "")
        except RuntimeError as e:
            print(e)
        keep = [np.ones(100) for _ in range(2000)]
        print(_ext.profile_info()[1])
        _ext.profile_stop()
    """) % (str(tmp_path / "a"), str(tmp_path / "b"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=_env({"DATAMEM_CONFIG": os.path.join(ROOT, "configs", "minimal.yaml")}))
    assert r.returncode == 0, r.stderr
    refused, samples = r.stdout.split("\n")[:2]
    assert refused == "datamem: already recording a profile", r.stdout
    # sampled (a small array about once in 16, pyext/record.c), not every one of the
    # 6,000 allocations (each np.ones also makes two 0-d arrays) as in full mode
    assert int(samples) < 1000, r.stdout
    assert not (tmp_path / "b").exists()


SPILL_JOB = textwrap.dedent('''
    import json, sys
    import numpy as np
    import datamem

    def load_features():                   # long-lived: 4 x 32 MiB to the end
        return [np.ones(4 << 20) for _ in range(4)]

    def burst():                           # 12 x 8 MiB held together, freed at once
        parts = [np.ones(1 << 20) for _ in range(12)]
        return float(sum(p.sum() for p in parts)), [datamem.arena_of(p) for p in parts]

    feats = load_features() if "features" in sys.argv else []
    total, where = burst()
    print(json.dumps({"features": [datamem.arena_of(f) for f in feats], "burst": where,
                      "sum": total + sum(float(f.sum()) for f in feats),
                      "failure": datamem.last_failure()}))
''')


def _suggest_spilling(tmp_path, job, memory, args=()):
    """Profiles the script `job` run with `args` (every allocation), then has
    suggest write a policy for `memory` that spills to tmp_path/spill (made
    once, 0700): (its text, the directory)."""
    spill = tmp_path / "spill"
    if not spill.exists():
        spill.mkdir(mode=0o700)
    out = tmp_path / ("prof-" + "-".join(list(args) + [memory]))
    _run([sys.executable, str(job)] + list(args),
         env={"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "full"})
    return _datamem("suggest", str(out), "--memory", memory, "--spill-dir", str(spill)).stdout, spill


def test_suggest_memory_spills_what_does_not_fit(tmp_path):
    """`suggest --memory`: a job whose peak passes the memory gets a spill arena;
    a rule for the call site that held the peak when one does, else worker_limit
    with worker_spill; the job then runs under it with those arrays on disk."""
    job = tmp_path / "spill_job.py"
    job.write_text(SPILL_JOB)
    spill = tmp_path / "spill"
    path = tmp_path / "policy.yaml"

    def suggest(args, memory):
        text, _ = _suggest_spilling(tmp_path, job, memory, args)
        path.write_text(text)
        assert "ok" in _datamem("check", str(path)).stdout
        return text, text.splitlines()

    # Peak 224 MiB, 128 of it long-lived from load_features; 70% of 183 MiB is 128.1.
    text, lines = suggest(["features"], "183MiB")
    assert "  #      mkdir -m 700 -p %s" % spill in lines, text
    assert ('  spill: {alignment: 64, decay: {dirty: 1s}, backing: {dir: "%s", max: 256MiB, '
            'resident_max: 8MiB}}' % spill) in lines, text
    assert "  - name: spill" in lines and "worker_limit: 70%" not in lines, text
    out = json.loads(_run([sys.executable, str(job), "features"],
                          env={"DATAMEM_CONFIG": str(path)}).stdout)
    assert out["features"] == ["spill"] * 4 and "spill" not in out["burst"], out
    assert out["sum"] == float(12 << 20) + float(16 << 20) and out["failure"] is None, out

    # Peak 96 MiB of temporaries from one site: no rule for them; whatever passes
    # 70% of 100 MiB spills (DATAMEM_MEMORY_LIMIT stands in for the cgroup's).
    text, lines = suggest([], "100MiB")
    assert lines[-2:] == ["worker_limit: 70%", "worker_spill: spill"], text
    assert "  - name: spill" not in lines, text
    out = json.loads(_run([sys.executable, str(job)],
                          env={"DATAMEM_CONFIG": str(path),
                               "DATAMEM_MEMORY_LIMIT": "100MiB"}).stdout)
    assert "spill" in out["burst"] and out["burst"][0] != "spill", out
    assert out["sum"] == float(12 << 20) and out["failure"] is None, out

    # 0.8 MiB of arrays past 70% of 136 MiB, but the array that crosses the limit is
    # 8 MiB and goes to disk whole, and the runtime counts what the process holds
    # beside its arrays (its peak RSS less the arrays): max is twice 0.8 + 8 MiB
    # + that, at least (it was twice 0.8: a 2 MiB file, and that array's
    # allocation failed with MemoryError).
    text, lines = suggest([], "136MiB")
    held = re.search(r"^  #    max: twice the bytes past the limit and the largest array "
                     r"\(([\d.]+) MiB\);$", text, re.M)
    assert held and float(held.group(1)) >= 8.8, text
    disk = re.search(r"max: (\d+)MiB, resident_max: 8MiB}}", text)
    assert disk and int(disk.group(1)) >= 2 * float(held.group(1)), text
    out = json.loads(_run([sys.executable, str(job)],
                          env={"DATAMEM_CONFIG": str(path),
                               "DATAMEM_MEMORY_LIMIT": "136MiB"}).stdout)
    assert out["burst"][-1] == "spill" and out["burst"][0] != "spill", out
    assert out["sum"] == float(12 << 20) and out["failure"] is None, out

    # It fits: no spill arena, and the estimate says so.
    text, lines = suggest([], "16GiB")
    assert "spill:" not in text and "worker_limit" not in text, text
    assert any(l.startswith("#   --memory 16.0 GiB: the peak of live arrays, 96.0 MiB at ")
               and l.endswith("is within 70% of it: nothing to spill") for l in lines), text

    for bad, says in ((["--memory", "0"], "at least 1 byte"),
                      (["--memory", "16G"], "bad size"),
                      (["--memory", "1GiB", "--spill-dir", "rel/dir"], "not an absolute path")):
        r = subprocess.run([sys.executable, "-m", "datamem", "suggest", str(tmp_path)] + bad,
                           env=_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr, (bad, r.stderr)


# Bug pinned: `suggest --memory 280MiB` wrote `backing.max: 64MiB` (twice
# the 24 MiB past the limit) for a rule whose call site held 72 MiB at the peak, all
# of which the rule sends to disk: the job, fine without a policy, died of MemoryError.
SPILL_PEAK_JOB = textwrap.dedent('''
    import numpy as np
    KEEP = []

    def load():
        for _ in range(9):
            KEEP.append(np.ones(1 << 20))    # 9 x 8 MiB, live to the end

    def burst():
        ts = [np.ones(1 << 20) for _ in range(22)]   # 176 MiB at once
        return sum(float(t[0]) for t in ts)

    load()
    print(burst() + sum(float(k[0]) for k in KEEP))
''')


# Bug pinned: a rule's backing.max was twice what its call site held at
# the peak of all live arrays (24 MiB here), but the site reached 200 MiB a second
# earlier, all of which the rule sends to disk: the job died of MemoryError. The
# suggestion is now replayed from the profile: the rule's own highest, at any time.
SPILL_EARLY_JOB = textwrap.dedent('''
    import time
    import numpy as np
    KEEP = []

    def load():
        KEEP.extend(np.ones(1 << 20) for _ in range(25))   # 25 x 8 MiB
        time.sleep(1.2)                                      # long-lived
        del KEEP[3:]                                         # 3 stay, to the end

    def burst():
        ts = [np.ones(1 << 20) for _ in range(30)]   # 240 MiB of temporaries at once
        return sum(float(t[0]) for t in ts)

    load()
    print(burst() + sum(float(k[0]) for k in KEEP))
''')


@pytest.mark.parametrize("job_text, memory, held, most, disk_max, result", [
    (SPILL_PEAK_JOB, "320MiB", "__main__.load (72.0 MiB)", "72.0 MiB", "256MiB", 31.0),
    # peak 264 MiB, limit 240.8
    (SPILL_EARLY_JOB, "344MiB", "__main__.load.<locals>.<genexpr> (24.0 MiB)", "200.0 MiB",
     "512MiB", 33.0)], ids=["peak", "early"])
def test_suggest_memory_backing_max_holds_what_its_rule_spills(tmp_path, job_text, memory, held,
                                                               most, disk_max, result):
    job = tmp_path / "job.py"
    job.write_text(job_text)
    text, spill = _suggest_spilling(tmp_path, job, memory)
    lines = text.splitlines()
    assert "  # what held the peak: %s;" % held in lines, text
    assert ("  #    max: twice the most its rule's arrays hold at once in the profile (%s);"
            % most) in lines, text
    assert ('  spill: {alignment: 64, decay: {dirty: 1s}, backing: {dir: "%s", max: %s, '
            'resident_max: 16MiB}}' % (spill, disk_max)) in lines, text
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    r = _run([sys.executable, str(job)], env={"DATAMEM_CONFIG": str(path)})
    assert float(r.stdout) == result, r.stdout


def test_suggest_memory_never_spills_a_scripts_top_level(tmp_path):
    """Bug pinned: a module-level script got a spill rule matching
    `__main__.<module>`, which every array it makes matches: the whole job spilled.
    A comprehension at the top level (`__main__.<listcomp>`) is no site either."""
    job = tmp_path / "flat.py"
    job.write_text(textwrap.dedent('''
        import numpy as np
        KEEP = []
        for _ in range(9):
            KEEP.append(np.ones(1 << 20))               # 72 MiB, live to the end
        ts = [np.ones(1 << 20) for _ in range(22)]   # 176 MiB of temporaries
        s = sum(float(t[0]) for t in ts + KEEP)
        del ts
        print(s)
    '''))
    text, spill = _suggest_spilling(tmp_path, job, "280MiB")
    assert "match: {function:" not in text and "  - name: spill" not in text, text
    assert text.splitlines()[-2:] == ["worker_limit: 70%", "worker_spill: spill"], text


def test_suggest_names_only_arenas_it_has_and_promises_no_fault_counts(tmp_path):
    """Bugs pinned: a job with no big temporaries got a comment saying its
    long-lived arrays "share the reuse arena", an arena the policy did not have; and
    every policy with temporaries promised "up to N minor page faults avoided" (12x
    an fft job's whole count; a pandas job's faults doubled): suggest now points to
    `datamem tune`, which measures them."""
    job = tmp_path / "keep.py"
    job.write_text(textwrap.dedent('''
        import numpy as np
        def load():
            return [np.ones(1 << 20) for _ in range(3)]
        KEEP = load()
    '''))
    out = tmp_path / "prof"
    _run([sys.executable, str(job)], env={"DATAMEM_PROFILE": str(out),
                                          "DATAMEM_PROFILE_SAMPLE": "full"})
    text = _datamem("suggest", str(out)).stdout
    assert "reuse:" not in text and "share the reuse arena" not in text, text
    assert "stay in the default arena (this policy has no reuse arena)" in text, text

    out2 = tmp_path / "prof2"
    temps = tmp_path / "temps.py"
    temps.write_text("import numpy as np\nfor _ in range(10):\n    t = np.ones(1 << 20)\n")
    # the job's argv goes into a comment: a line break in it must not end the comment
    _run([sys.executable, str(temps), "x\nrules: []"], env={"DATAMEM_PROFILE": str(out2),
                                                           "DATAMEM_PROFILE_SAMPLE": "full"})
    text = _datamem("suggest", str(out2)).stdout
    assert "faults avoided" not in text and "minor page faults" not in text, text
    assert "is measured, not estimated: python -m datamem tune --out policy.yaml -- " in text, text
    assert text.split("tune --out policy.yaml -- ")[1].split("\n")[0].endswith(
        "%s 'x\\x0arules: []'" % temps), text
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert "ok: " in _datamem("check", str(path)).stdout
    assert "rule 'temporaries'" in _datamem("explain", str(path), "--size", "8MiB").stdout


# ---- commands printed for a shell -------------------------------------------------
#
# Attack pinned: `suggest --spill-dir DIR` printed `mkdir -m 700 -p DIR` unquoted in
# the policy's comment, for the user to paste: `W/my spill` made `W/my` and
# `W/spill`, `W/s;touch W/PWNED` and `W/$(touch W/PWNED2)` ran `touch`. Every
# command the CLI prints for a shell quotes what it names (_text.shell_command).

SHELL_NAMES = ("my spill", "s;touch {W}/PWNED", "$(touch {W}/PWNED2)")
# a DIR that would end a YAML value and add keys, were it not a quoted string
YAML_NAMES = ('a", max: 1MiB}, x: {dir: "b', "c #d", "e}, evil: {f", "g\\h", "i'j",
              "k: l", "\u00fc\U0001f600")
PROFILE_DIR = "prof 'a';b $(c) `d` \"e\""


@pytest.fixture(scope="module")
def spill_profile(tmp_path_factory):
    """A full profile of SPILL_JOB's "features" run, recorded by `profile --out`
    into a directory with quotes, `;`, `$(...)` and backquotes in its name: (its
    path, the job's path, profile's stderr)."""
    base = tmp_path_factory.mktemp("spill-profile")
    job = base / "spill_job.py"
    job.write_text(SPILL_JOB)
    out = base / PROFILE_DIR
    r = _datamem("profile", "--out", str(out), "--full", "--", sys.executable, str(job),
                 "features")
    return str(out), str(job), r.stderr


def _suggested(prof, spill_dir):
    return _datamem("suggest", prof, "--memory", "160MiB", "--spill-dir", spill_dir).stdout


def _command_after(text, marker):
    """The command that starts at `marker` on the one line of `text` holding it,
    to the end of that line."""
    lines = [l for l in text.splitlines() if marker in l]
    assert len(lines) == 1, (marker, text)
    return lines[0][lines[0].index(marker):]


def test_suggest_spill_dir_command_makes_exactly_that_directory(spill_profile, tmp_path):
    """The printed mkdir, run by bash, makes the one directory named, whatever its
    name holds, and runs nothing else; the policy then spills there."""
    prof, job, _ = spill_profile
    for i, name in enumerate(SHELL_NAMES):
        w = tmp_path / ("w%d" % i)
        w.mkdir()
        d = os.path.join(str(w), name.format(W=w))
        text = _suggested(prof, d)
        cmd = _command_after(text, "mkdir ")
        r = subprocess.run(["bash", "-c", cmd], cwd=str(w), capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, (cmd, r.stderr)
        made = {os.path.join(top, n) for top, dirs, files in os.walk(str(w)) for n in dirs + files}
        want = set()
        p = d
        while p != str(w):
            want.add(p)
            p = os.path.dirname(p)
        assert made == want, (cmd, sorted(made - want), sorted(want - made))
        assert os.path.isdir(d) and (os.stat(d).st_mode & 0o777) == 0o700, cmd
        assert not (w / "PWNED").exists() and not (w / "PWNED2").exists(), cmd
        policy = tmp_path / ("policy%d.yaml" % i)
        policy.write_text(text)
        out = json.loads(_run([sys.executable, job, "features"],
                              env={"DATAMEM_CONFIG": str(policy)}).stdout)
        assert out["features"] == ["spill"] * 4 and out["failure"] is None, (d, out)


def test_suggest_names_any_spill_dir_as_one_yaml_string(spill_profile, tmp_path):
    """A DIR with quotes, `}`, `#`, `: ` or characters past U+FFFF is the arena's
    backing.dir, exactly, and adds no key (explain --table names the directory)."""
    prof, _, _ = spill_profile
    for i, name in enumerate(YAML_NAMES):
        d = os.path.join(str(tmp_path), "y%d" % i, name)
        os.makedirs(d, mode=0o700)
        policy = tmp_path / ("policy%d.yaml" % i)
        policy.write_text(_suggested(prof, d))
        r = subprocess.run([sys.executable, "-m", "datamem", "explain", str(policy), "--table"],
                           env=_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "", (name, r.stderr)
        assert "backed by a file in %s (max 268435456)" % d in r.stdout, (name, r.stdout)


def test_every_printed_shell_command_splits_into_its_words(spill_profile, tmp_path):
    """Each command the CLI prints for a shell, its names hostile, reads back
    through shlex.split as the words meant: profile's `report` hint, report's
    `profile` hint for an empty directory, suggest's own command line and its
    mkdir."""
    prof, _, stderr = spill_profile
    import shlex
    words = ["python", "-m", "datamem"]
    assert shlex.split(_command_after(stderr, "python -m datamem report")) == \
        words + ["report", prof], stderr
    empty = tmp_path / PROFILE_DIR
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "datamem", "report", str(empty)], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert shlex.split(_command_after(r.stderr, "python -m datamem profile")) == \
        words + ["profile", "--out", str(empty), "--", "python", "job.py"], r.stderr
    d = os.path.join(str(tmp_path), SHELL_NAMES[2])
    text = _suggested(prof, d)
    assert shlex.split(_command_after(text, "python -m datamem suggest")) == \
        words + ["suggest", prof], text
    assert shlex.split(_command_after(text, "mkdir ")) == ["mkdir", "-m", "700", "-p", d], text
    # a line break in a name is escaped, not printed: the command stays one line
    nl = tmp_path / "a\nb"
    nl.mkdir()
    r = subprocess.run([sys.executable, "-m", "datamem", "report", str(nl)], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert shlex.split(_command_after(r.stderr, "python -m datamem profile")) == \
        words + ["profile", "--out", str(nl).replace("\n", "\\x0a"), "--", "python",
                 "job.py"], r.stderr


# Pool workers: `with Pool()` ends with terminate(), SIGTERM to
# every worker, and no atexit runs; a worker may also leave by _exit. Every
# worker's file used to be empty ("skipped: empty"): its records sat in the
# writer's buffer. Now the header is written at once, a flusher thread writes what
# is buffered every second, and SIGTERM (at its default action) flushes first.
POOL_JOB = textwrap.dedent('''
    import json
    import multiprocessing as mp
    import os
    import sys
    import time

    import numpy as np

    ARRAYS = 4

    def init(barrier):
        barrier.wait(60)  # every worker runs (and records) before the first task

    def task(i):
        keep = []
        for _ in range(ARRAYS):
            keep.append(np.empty(3001))  # TASK: 24008 B each
        return os.getpid(), len(keep)

    def exit_hard():
        """Allocates, waits (bounded) for the flusher to write it, then leaves by
        posix._exit, which neither atexit nor datamem's os._exit wrapper sees."""
        import posix
        from datamem import _ext
        path = _ext.profile_info()[0]
        base = os.path.getsize(path)
        keep = []
        for _ in range(ARRAYS):
            keep.append(np.empty(3001))  # HARD
        deadline = time.monotonic() + 10  # 59 bytes an 'A' record
        while os.path.getsize(path) < base + 59 * ARRAYS and time.monotonic() < deadline:
            time.sleep(0.01)
        posix._exit(0 if keep else 1)

    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[1])
        with ctx.Pool(3, initializer=init, initargs=(ctx.Barrier(3),)) as pool:
            workers = sorted(w.pid for w in pool._pool)
            done = pool.map(task, range(12), chunksize=1)
        p = ctx.Process(target=exit_hard)
        p.start(); p.join()
        print(json.dumps({"workers": workers, "done": done, "hard": p.pid,
                          "hard_exit": p.exitcode}))
''')


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_pool_workers_keep_their_records_past_terminate_and_exit(tmp_path, method):
    job = tmp_path / "pooljob.py"
    job.write_text(POOL_JOB)
    out = tmp_path / "prof"
    r = _datamem("profile", "--out", str(out), "--full", "--", sys.executable, str(job),
                 method)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["hard_exit"] == 0
    made = {}
    for pid, n in res["done"]:
        made[pid] = made.get(pid, 0) + n
    rr = subprocess.run([sys.executable, "-m", "datamem", "report", str(out), "--json"],
                        env=_env(), capture_output=True, text=True, timeout=120)
    assert rr.returncode == 0, rr.stderr
    assert "skipped" not in rr.stderr, rr.stderr
    rep = json.loads(rr.stdout)
    procs = {p["pid"]: p for p in rep["processes"]}
    # every worker has a readable file, terminated or not (__main__ under fork,
    # __mp_main__ under spawn and forkserver)
    assert set(res["workers"]) <= set(procs), (res["workers"], sorted(procs))
    for pid, n in made.items():  # and holds every array it made
        assert procs[pid]["records"] >= n, (pid, n, procs[pid])
    assert procs[res["hard"]]["records"] >= 4, procs.get(res["hard"])
    lines = POOL_JOB.splitlines()
    line = {k: 1 + next(i for i, t in enumerate(lines) if t.endswith("# " + k) or
                        "# %s:" % k in t) for k in ("TASK", "HARD")}
    site = _site(rep, "main__.task", line["TASK"])
    assert site["bytes"] == 12 * 4 * 24008, site
    hard = _site(rep, "main__.exit_hard", line["HARD"])
    assert hard["bytes"] == 4 * 24008, hard


def test_sigterm_flushes_a_profile_started_while_the_process_serves(tmp_path):
    """The stats export and the profile writer share one SIGTERM handler
    (service/term.h). Each used to install its own, and the writer's went only
    over the default action: in a job that served stats before it started
    recording, SIGTERM removed the socket but never flushed the profile."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    pol = tmp_path / "p.yaml"
    pol.write_text("version: 1\ndefault: a\narenas: {a: {}}\n"
                   "stats:\n  unix_socket: %s/{pid}.sock\n" % run)
    out = tmp_path / "prof"
    code = ("import os, signal, numpy as np, datamem\n"
            "from datamem._profile import recording\n"
            "assert os.path.exists(%r %% os.getpid())\n"     # serving: its handler is in
            "recording.start(%r, sample=0)\n"
            "keep = [np.empty(5003) for _ in range(7)]\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "raise SystemExit('SIGTERM did not end the process')\n"
            % (str(run / "%d.sock"), str(out)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=_env({"DATAMEM_CONFIG": str(pol)}))
    assert r.returncode == -15, (r.returncode, r.stderr)
    assert list(run.iterdir()) == []                        # the socket went
    [proc] = _report(out)["processes"]
    assert proc["records"] >= 7, proc


def test_sigterm_flushes_then_dies_of_sigterm(tmp_path):
    # The SIGTERM handler the writer installs must not change how the process
    # ends: the parent still sees it killed by SIGTERM, and its arrays are there.
    out = tmp_path / "prof"
    code = ("import os, signal, numpy as np\n"
            "keep = [np.empty(5003) for _ in range(7)]\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "raise SystemExit('SIGTERM did not end the process')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=_env({"DATAMEM_PROFILE": str(out),
                                            "DATAMEM_PROFILE_SAMPLE": "full"}))
    assert r.returncode == -15, (r.returncode, r.stderr)
    rep = _report(out)
    [proc] = rep["processes"]
    assert proc["records"] >= 7, proc
    # CPython 3.12 and later inline the comprehension (PEP 709): its site is <module>
    site = _site(rep, "<listcomp>" if sys.version_info < (3, 12) else "<module>", 2)
    assert site["bytes"] == 7 * 5003 * 8, site


def test_sigterm_that_lands_inside_the_writer_still_flushes(tmp_path):
    # Bug pinned: a process that allocates in a loop spends much of its time
    # inside the writer, holding its lock; a SIGTERM that interrupted it there
    # waited for a lock its own thread held, and died with a second of records
    # unwritten and no exit mark. Now the handler writes the whole records
    # buffered before the one it interrupted, then the exit mark.
    import signal
    import time
    code = "import numpy as np\nwhile True:\n    np.empty(8)\n"
    for i in range(12):  # the old handler missed about one in two
        out = tmp_path / ("p%d" % i)
        p = subprocess.Popen([sys.executable, "-c", code], env=_env(
            {"DATAMEM_PROFILE": str(out), "DATAMEM_PROFILE_SAMPLE": "full"}))
        try:
            deadline = time.monotonic() + 60
            files = []
            while time.monotonic() < deadline:  # recording: a first full buffer written
                files = list(out.glob("*.dmprof")) if out.exists() else []
                if files and files[0].stat().st_size >= 1 << 20:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("no 1 MiB profile in 60 s: %s" % files)
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == -signal.SIGTERM
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        data = files[0].read_bytes()
        # the file ends with the handler's 'X' (9 bytes) and 'P' (25 bytes)
        assert (data[-34], data[-25]) == (ord("X"), ord("P")), (i, len(data), data[-40:])
        assert _report(out)["processes"][0]["records"] > 1000
