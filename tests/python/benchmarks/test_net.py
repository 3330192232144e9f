"""bench/net.py, the performance net: its verdicts against bench/budgets.json
(a figure past its tolerance fails, one inside passes, one better is room to
tighten, one without a budget fails), a budget for every figure it
measures, --write's rule (a budget only ever moves down), and, where valgrind
is, that datamem's own share of an op is measured. The full measuring runs as
its own stage of scripts/test.sh."""
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from conftest import ROOT, UNDER_ASAN

sys.path.insert(0, os.path.join(ROOT, "bench"))
import net  # noqa: E402

BUDGETS = {"a/instr_per_op": {"value": 1000.0, "tol": 0.02},
           "a/faults_per_iter": {"value": 0.0, "abs": 0.5}}


def test_a_figure_past_its_tolerance_fails_and_one_inside_passes():
    fails, lines = net.check({"a/instr_per_op": 1019.0, "a/faults_per_iter": 0.4}, BUDGETS)
    assert fails == [], lines
    fails, lines = net.check({"a/instr_per_op": 1019.0, "a/faults_per_iter": 0.6}, BUDGETS)
    assert fails == ["a/faults_per_iter"], lines
    fails, lines = net.check({"a/instr_per_op": 1021.0, "a/faults_per_iter": 0.0}, BUDGETS)
    assert fails == ["a/instr_per_op"], lines


def test_a_better_figure_passes_as_room_and_an_unbudgeted_one_fails():
    fails, lines = net.check({"a/instr_per_op": 900.0}, BUDGETS)
    assert fails == [] and lines[0].startswith("room"), lines
    fails, lines = net.check({"b/instr_per_op": 1.0}, BUDGETS)
    assert fails == ["b/instr_per_op"] and "no budget" in lines[0], lines


def test_the_checked_in_budgets_cover_every_figure_the_net_measures():
    with open(os.path.join(ROOT, "bench", "budgets.json")) as f:
        budgets = json.load(f)["budgets"]
    assert sorted(budgets) == net.figure_names()
    for k, b in budgets.items():
        assert b["value"] >= 0 and (b.get("tol", 0) > 0 or b.get("abs", 0) > 0), (k, b)


def test_the_command_exits_1_on_a_regression(tmp_path):
    with open(os.path.join(ROOT, "bench", "budgets.json")) as f:
        budgets = json.load(f)["budgets"]
    worse = {k: b["value"] * 1.5 + 1 for k, b in budgets.items()}
    figs = tmp_path / "figs.json"
    figs.write_text(json.dumps(worse))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "net.py"), "--figures",
                        str(figs)], capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "figures past their budget" in p.stdout
    same = {k: b["value"] for k, b in budgets.items()}
    figs.write_text(json.dumps(same))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "net.py"), "--figures",
                        str(figs)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_write_keeps_the_better_of_the_budget_and_the_figure():
    # A worse figure never becomes the budget (the net's own regression would be
    # written in as the next build's allowance); a better one tightens it.
    budgets = {"p/empty64/own_instr_per_op": {"value": 134.0, "tol": 0.05, "abs": 2.0},
               "p/empty64/instr_per_op": {"value": 2194.0, "tol": 0.02}}
    figs = {"p/empty64/own_instr_per_op": 144.0, "p/empty64/instr_per_op": 2190.5,
            "p/smallops/own_instr_per_op": 538.0}
    lines = net.write_budgets(figs, budgets)
    assert budgets["p/empty64/own_instr_per_op"] == {"value": 134.0, "tol": 0.05, "abs": 2.0}
    assert budgets["p/empty64/instr_per_op"] == {"value": 2190.5, "tol": 0.02}
    # a figure new to the file gets its metric's tolerance
    assert budgets["p/smallops/own_instr_per_op"] == dict(net.TOLERANCES["own_instr_per_op"],
                                                          value=538.0)
    assert any(line.startswith("kept p/empty64/own_instr_per_op") for line in lines), lines
    assert any(line.startswith("down p/empty64/instr_per_op") for line in lines), lines


def test_write_flags_a_budget_above_numpys_default():
    budgets = {"p/empty64+count/own_instr_per_op": {"value": 140.0, "tol": 0.05, "abs": 2.0},
               "p/empty16k/own_instr_per_op": {"value": 138.0, "tol": 0.05, "abs": 2.0},
               "p/pandas/rss_ratio": {"value": 1.04, "abs": 0.01}}
    figs = {"p/empty64+count/own_instr_per_op": 141.0, "p/empty16k/own_instr_per_op": 138.0,
            "p/pandas/rss_ratio": 0.99, "default/empty64/own_instr_per_op": 36.0,
            "default/empty16k/own_instr_per_op": 310.0}
    lines = net.write_budgets(figs, budgets)
    above = [line for line in lines if line.startswith("ABOVE")]
    assert len(above) == 1 and "p/empty64+count/own_instr_per_op" in above[0], lines
    assert not any(k.startswith("default/") for k in budgets)  # yardsticks only
    # the default's figures are no budgets: check() neither fails nor lists them
    fails, lines = net.check(figs, budgets)
    assert fails == [] and not any("default/" in line for line in lines), lines


def test_the_command_writes_no_regression_into_the_budgets(tmp_path):
    with open(os.path.join(ROOT, "bench", "budgets.json")) as f:
        doc = json.load(f)
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o644)
    budgets = doc["budgets"]
    worse, better = "minimal/empty64/instr_per_op", "minimal/mixed/pages_zeroed_per_op"
    figs = tmp_path / "figs.json"
    figs.write_text(json.dumps({worse: budgets[worse]["value"] * 2 + 10,
                                better: budgets[better]["value"] / 2}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "net.py"), "--figures",
                        str(figs), "--budgets", str(path), "--write"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    after = json.loads(path.read_text())["budgets"]
    assert after[worse] == budgets[worse], (after[worse], budgets[worse])
    assert after[better]["value"] == round(budgets[better]["value"] / 2, 4)
    assert {k: v for k, v in after.items() if k != better} == \
        {k: v for k, v in budgets.items() if k != better}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["budgets.json", "figs.json"]  # no temp left


def skip_if_stripped():
    import datamem._ext as ext
    syms = subprocess.run(["nm", ext.__file__], capture_output=True, text=True).stdout
    if " h_malloc" not in syms:
        pytest.skip("SKIP: the installed extension is stripped (a manylinux wheel); "
                    "the net stage measures the Bazel-built wheel, which keeps its symbols")


# A callgrind dump's calls, with names compressed as callgrind writes them.
DUMP = """fn=(1) h_malloc
0 40
cfn=(2) beside_read
calls=1 0
0 900
cfn=(3) dm_alloc
calls=2 0
0 70
fn=(4) dm__tally_charge_from
0 12
cfn=(2)
calls=1 0
0 850
totals: 1872
""".splitlines()


def test_the_timed_reading_is_taken_out_of_the_limit_figures():
    # beside_read runs once per 10 ms of wall time, so how many readings land
    # in a phase follows the machine's load (CI read smallops+limit 3% over an
    # idle machine's figure); what every call to it cost is taken out.
    assert net.callee_inclusive(DUMP, "beside_read") == 900 + 850
    assert net.callee_inclusive(DUMP, "dm_alloc") == 70
    assert net.callee_inclusive(DUMP, "h_malloc") == 0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.skipif(UNDER_ASAN, reason="SKIP under ASan: valgrind cannot run an ASan build (the net measures the plain wheel; scripts/test.sh runs it in its own stage)")
def test_the_limit_figures_see_the_timed_reading():
    # Measured for real: the first reserve reads at once, so the start's dump
    # must show beside_read (callgrind_totals raises otherwise), and the loops'
    # figures are what is left without the readings.
    skip_if_stripped()
    limited = net.callgrind_totals("minimal", "limit", own=True, n=2000)
    counted = net.callgrind_totals("minimal", True, own=True, n=2000)
    for loop in net.LOOPS:
        assert counted[loop] < limited[loop] < 3 * counted[loop], (loop, limited, counted)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.skipif(UNDER_ASAN, reason="SKIP under ASan: valgrind cannot run an ASan build (the net measures the plain wheel; scripts/test.sh runs it in its own stage)")
def test_datamems_own_share_of_an_op_is_measured():
    # callgrind collects only inside the handler's functions: if it cannot see
    # them (a stripped .so, a renamed function), the share reads 0 and a
    # regression in datamem's own path would pass the net unseen.
    skip_if_stripped()
    with open(os.path.join(ROOT, "bench", "budgets.json")) as f:
        budgets = json.load(f)["budgets"]
    own = net.callgrind_totals("minimal", False, own=True, n=2000)
    assert sorted(own) == sorted(net.LOOPS)
    for loop, v in own.items():
        whole = budgets["minimal/%s/instr_per_op" % loop]["value"]
        assert 20 < v < whole / 4, (loop, v, whole)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.skipif(UNDER_ASAN, reason="SKIP under ASan: valgrind cannot run an ASan build (the net measures the plain wheel; scripts/test.sh runs it in its own stage)")
def test_a_share_callgrind_cannot_see_is_an_error(monkeypatch):
    # A stripped _ext.so (no h_malloc in its symbol table) reads a share of 0,
    # which would pass every budget as room: the net refuses to measure it.
    monkeypatch.setitem(net.HANDLER_FUNCTIONS, "datamem", ["dm_no_such_function"])
    with pytest.raises(RuntimeError, match="saw no instructions in dm_no_such_function"):
        net.callgrind_totals("minimal", False, own=True, n=200)


def test_the_job_figures_are_ratios_of_medians_to_the_default_in_the_same_run(monkeypatch):
    """Per job: pages zeroed (minor faults with hugepages off) and peak RSS, the
    median of the policy's runs over the median of the default's, the runs
    interleaved, every child with hugepages off; a policy run NumPy did not
    allocate through fails rather than compares."""
    calls = []
    faults = {None: iter([100, 300, 200]), "p": iter([90, 500, 110])}  # medians 200, 110

    def run_json(cmd, env, timeout=600, hugepages=True):
        policy = "p" if "DATAMEM_CONFIG" in env else None
        calls.append((cmd[2], policy, hugepages))
        return {"faults": next(faults[policy]), "maxrss_mb": 100.0 if policy is None else 103.0,
                "handler": "datamem" if policy else "default_allocator"}

    monkeypatch.setattr(net, "run_json", run_json)
    monkeypatch.setattr(net, "job_names", lambda: ["scipy_cg"])
    monkeypatch.setitem(net.POLICIES, "p", "configs/minimal.yaml")
    figs = net.figures_jobs(["p"])
    assert figs == {"p": {"jobs/scipy_cg/zeroed_ratio": 110 / 200,
                          "jobs/scipy_cg/rss_ratio": 1.03}}, figs
    assert [c[1] for c in calls] == [None, "p"] * net.JOB_REPS, calls
    assert all(c[0] == "scipy_cg" and c[2] is False for c in calls), calls
    monkeypatch.setattr(net, "run_json", lambda *a, **k: {"faults": 1, "maxrss_mb": 1.0,
                                                          "handler": "default_allocator"})
    with pytest.raises(RuntimeError, match="ran with handler"):
        net.figures_jobs(["p"])


def test_every_job_of_bench_jobs_has_its_figures():
    """A job module added to bench/jobs is a job of child.py's JOBS, so the net
    measures it, and the checked-in budgets hold both of its figures."""
    jobs_dir = os.path.join(ROOT, "bench", "jobs")
    modules = {f[:-3] for f in os.listdir(jobs_dir)
               if f.endswith(".py") and f not in ("child.py", "__init__.py", "__main__.py")}
    jobs = net.job_names()
    child = sys.modules["child"]
    assert modules <= set(jobs), modules - set(jobs)
    assert {child.MODULE.get(j, j) for j in jobs} == modules, jobs
    with open(os.path.join(ROOT, "bench", "budgets.json")) as f:
        budgets = json.load(f)["budgets"]
    names = net.figure_names()
    for job in jobs:
        for m in ("zeroed_ratio", "rss_ratio"):
            key = "minimal/jobs/%s/%s" % (job, m)
            assert key in names, key
            assert key in budgets, key
    assert net.job_names() == jobs and sys.path.count(jobs_dir) == 1, sys.path


def test_the_pandas_figure_fails_a_run_not_under_datamem(monkeypatch):
    monkeypatch.setattr(net, "pandas_job", lambda: "pandas3_etl")
    monkeypatch.setattr(net, "run_json", lambda *a, **k: {"maxrss_mb": 1.0,
                                                          "handler": "default_allocator"})
    with pytest.raises(RuntimeError, match="ran with handler"):
        net.figures_pandas(["minimal"])
