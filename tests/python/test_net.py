"""bench/net.py, the performance net: its verdicts against bench/budgets.json
(a figure past its tolerance fails, one inside passes, one better is room to
tighten, one without a budget fails), and a budget for every figure it
measures. The measuring itself runs as its own stage of scripts/test.sh."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
