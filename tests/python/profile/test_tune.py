"""`python -m datamem tune`: runs a job under NumPy's default, minimal.yaml and
suggest's policy, and writes the one that measured best with the table.

Each job is a short script (a few NumPy temporaries, well under a second), run
with --reps 1: these tests check what tune writes and refuses, not timings.
"""
import os
import subprocess
import sys
import textwrap

from conftest import ROOT

JOB = textwrap.dedent('''
    import numpy as np

    def work():
        s = 0.0
        for _ in range(6):
            t = np.ones(1 << 20)        # 8 MiB temporaries
            s += float((t * 2).sum())
        return s

    print(work())
''')

# Fails whenever a policy is in force: tune must never pick what did not finish.
FAILS_UNDER_A_POLICY = textwrap.dedent('''
    import os, sys
    import numpy as np
    a = np.ones(1 << 20)
    if os.environ.get("DATAMEM_CONFIG"):
        sys.exit("refusing to run under a policy")
''')

CONFIGS = ("default", "minimal", "suggested")
# a second policy, given as a file
BENCH_THROUGHPUT = os.path.join(ROOT, "bench", "policies", "throughput.yaml")


def _env():
    e = dict(os.environ)
    for k in ("DATAMEM_CONFIG", "DATAMEM_CONFIG_TEXT", "DATAMEM_PROFILE"):
        e.pop(k, None)
    return e


def _tune(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "datamem", "tune"] + list(args), env=_env(),
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def _table(text):
    """{config: [finished, zeroed MB, small, THP, CPU s, RSS MB]} from the header."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("#   config "))
    rows = {}
    for l in lines[start + 1:]:
        if not l.startswith("#   "):
            break
        cells = l[4:].split()
        rows[cells[0]] = cells[1:]
    return rows


def test_tune_writes_a_policy_that_checks_with_the_table_of_every_config(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "policy.yaml"
    r = _tune("--out", str(out), "--reps", "1", "--", sys.executable, str(job))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = _table(text)
    assert list(rows) == list(CONFIGS), text
    for name, cells in rows.items():
        assert cells[0] == "1/1", (name, text)
        assert float(cells[1]) > 0 and int(cells[2]) > 0 and float(cells[5]) > 0, (name, text)
    assert text.startswith("# Measured by: python -m datamem tune --out %s --reps 1 -- %s %s\n"
                           % (out, sys.executable, job)), text
    assert "# Pick: a configuration with a run that did not finish is out" in text
    # tune's own header, up to the line that names the winner (what follows is the
    # winning policy itself: suggest's header quotes its own command line, paths and all)
    lines = text.splitlines()
    end = next(i for i, l in enumerate(lines)
               if l.startswith(("# Measured best:", "# datamem anyway")))
    long = [l for l in lines[1:end + 1] if len(l) > 100]
    assert not long, long
    c = subprocess.run([sys.executable, "-m", "datamem", "check", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert c.returncode == 0 and "ok" in c.stdout, c.stdout + c.stderr
    # The winner is the row with the fewest bytes zeroed among those the rule keeps;
    # the header names it and the policy that follows is its own.
    said = [l for l in text.splitlines()
            if l.startswith("# Measured best: ") or l.startswith("# NumPy's default allocator")]
    assert len(said) == 1, text
    if said[0].startswith("# NumPy's default"):
        assert "default: main" in text
    else:
        winner = said[0][len("# Measured best: "):].split()[0]
        assert winner in CONFIGS[1:], text
        if winner == "suggested":
            assert "# Suggested by: python -m datamem suggest" in text


def test_tune_never_picks_a_configuration_whose_run_failed(tmp_path):
    job = tmp_path / "picky.py"
    job.write_text(FAILS_UNDER_A_POLICY)
    out = tmp_path / "policy.yaml"
    r = _tune("--out", str(out), "--reps", "1", "--candidates", "minimal",
              str(BENCH_THROUGHPUT), "--", sys.executable, str(job))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = _table(text)
    assert rows["default"][0] == "1/1" and rows["minimal"][0] == "0/1", text
    assert rows["throughput.yaml"][0] == "0/1", text
    assert "# minimal: out, a run did not finish (refusing to run under a policy)" in text
    assert "# NumPy's default allocator measured best: run this job with DATAMEM_CONFIG" \
        in text, text
    assert "leave DATAMEM_CONFIG unset" in r.stderr, r.stderr


def test_tune_refuses_a_symbolic_link_at_out(tmp_path):
    """Attack pinned: --out planted as a link to a file of the user's (here
    victim.txt) must neither be written through nor replaced; tune refuses
    before it runs anything."""
    job = tmp_path / "job.py"
    marker = tmp_path / "ran"
    job.write_text("open(%r, 'w').close()\n" % str(marker))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "policy.yaml"
    link.symlink_to(victim)
    r = _tune("--out", str(link), "--reps", "1", "--candidates", "minimal", "--",
              sys.executable, str(job))
    assert r.returncode == 1 and "a symbolic link" in r.stderr, r.stderr
    assert os.path.islink(link) and victim.read_text() == "keep me\n"
    assert not marker.exists()


def test_tune_says_what_is_wrong_with_its_arguments(tmp_path):
    r = _tune("--reps", "1")
    assert r.returncode == 2 and "no command to run" in r.stderr, r.stderr
    r = _tune("--reps", "0", "--", sys.executable, "-c", "pass")
    assert r.returncode == 1 and "--reps must be at least 1" in r.stderr, r.stderr
    r = _tune("--reps", "1", "--candidates", str(tmp_path / "nope.yaml"), "--",
              sys.executable, "-c", "pass")
    assert r.returncode == 1 and "neither a name (minimal, suggested) nor a policy file" \
        in r.stderr, r.stderr
    # throughput.yaml no longer ships (docs/performance.md, "throughput.yaml"): the
    # name is refused, not measured as something else
    r = _tune("--reps", "1", "--candidates", "throughput", "--", sys.executable, "-c", "pass")
    assert r.returncode == 1 and "throughput: neither a name" in r.stderr, r.stderr


def _s(cpu, rss, zeroed, finished=1, runs=1):
    return {"runs": runs, "finished": finished, "zeroed": zeroed, "small": zeroed // 4096,
            "thp": 0, "cpu": cpu, "rss": rss, "error": ""}


def test_tune_pick_follows_its_stated_rule():
    """The rule tune --help and docs/find-your-policy.md state: a run that did not
    finish is out; so is peak RSS > 2% above the default's; of the rest, CPU within
    3% of the lowest; of those, the fewest bytes zeroed."""
    from datamem._profile.tune import pick
    base = _s(1.00, 100e6, 900e6)
    # fewest zeroed wins among the fast, lean ones
    assert pick({"default": base, "a": _s(1.00, 101e6, 300e6),
                 "b": _s(0.99, 100e6, 400e6)}) == "a"
    # 2.5% more peak RSS than the default: out, however few bytes it zeroes
    assert pick({"default": base, "a": _s(0.90, 102.5e6, 100e6),
                 "b": _s(1.00, 101.9e6, 500e6)}) == "b"
    # 4% slower than the fastest: out
    assert pick({"default": base, "a": _s(1.04, 100e6, 100e6),
                 "b": _s(1.00, 100e6, 500e6)}) == "b"
    # a failed run: out, and with nothing else the default stays
    assert pick({"default": base, "a": _s(0.5, 50e6, 1e6, finished=0)}) == "default"
    # the default failed: the RSS bound is the lowest finished peak
    assert pick({"default": _s(1.0, 100e6, 1e6, finished=2, runs=3),
                 "a": _s(1.0, 104e6, 1e6), "b": _s(1.0, 100e6, 5e6)}) == "b"
    assert pick({"default": _s(1.0, 1e6, 1e6, finished=0)}) is None


def test_tune_keeps_a_candidates_name_inside_its_comment(tmp_path):
    """Attack pinned: a policy file named with a line break ("x\\nworker_limit: 1MiB")
    would put a line of its choosing into the written policy's header as YAML."""
    job = tmp_path / "job.py"
    job.write_text("import numpy as np\nnp.ones(1 << 20)\n")
    cand = tmp_path / "x\nworker_limit: 1MiB\n#.yaml"
    cand.write_text("version: 1\ndefault: main\narenas:\n  main: {alignment: 64}\n")
    out = tmp_path / "policy.yaml"
    r = _tune("--out", str(out), "--reps", "1", "--candidates", str(cand), "--",
              sys.executable, str(job))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "\nworker_limit" not in text and "x\\x0aworker_limit: 1MiB\\x0a#.yaml" in text, text
    c = subprocess.run([sys.executable, "-m", "datamem", "check", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert c.returncode == 0 and "worker_limit" not in c.stdout, c.stdout + c.stderr
