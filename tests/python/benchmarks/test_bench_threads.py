"""The thread-scaling benchmark (bench/threads.py): its tiny mode runs end to end,
each datamem child really ran with datamem's handler and one arena per worker
thread, and the summary picks the best peer and judges the targets from the
medians (docs/performance.md, "Threads")."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, UNDER_ASAN

sys.path.append(ROOT)  # bench/ is a package of the repository root (`python3 -m bench.jobs`)
from bench import threads as bench  # noqa: E402

SCRIPT = os.path.join(ROOT, "bench", "threads.py")
# The children run without LD_PRELOAD (bench/run.py's child_env), so an
# ASan-built extension cannot load in them.
pytestmark = pytest.mark.skipif(UNDER_ASAN, reason="SKIP under ASan: the benchmark's "
                                "children drop LD_PRELOAD, which carries the sanitizer")


def test_quick_run_reports_every_pair_and_datamem_ran_per_worker_arenas(tmp_path):
    out = tmp_path / "threads.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--reps", "1", "--threads", "1,2",
                        "--configs", "default,dm-threads", "--seed", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "| dm-threads |" in r.stdout and "| default |" in r.stdout, r.stdout
    d = json.loads(out.read_text())
    assert d["meta"]["threads"] == [1, 2] and d["meta"]["reps"] == 1
    assert d["meta"]["gil"] == bench.gil_enabled()
    assert sorted(d["table"]) == ["default", "dm-threads"]
    for c in ("default", "dm-threads"):
        assert sorted(d["table"][c]) == ["1", "2"]
        for table in ("table", "table_cpu"):
            assert sorted(d[table][c]) == ["1", "2"]
            assert all(row["median"] > 0 for row in d[table][c].values())
            assert d[table][c]["1"]["scaling"] == 1.0
        assert all(0 < v for v in d["cpu_share"][c].values())
        assert sorted(d["faults_per_array"][c]) == ["1", "2"]
        assert all(v > 50 for v in d["maxrss_mb"][c].values())  # NumPy and its arrays
    assert d["table"]["default"]["2"]["vs_default"] == 1.0
    assert d["best_peer"] == {} and d["verdict"] == {}  # no peer was run
    assert d["meta"]["config_order"] == ["default", "dm-threads"]
    seen = sorted((s["config"], s["threads"]) for s in d["samples"])
    assert seen == [("default", 1), ("default", 2), ("dm-threads", 1), ("dm-threads", 2)]
    for s in d["samples"]:
        assert s["gil"] == bench.gil_enabled()
        assert len(s["rounds"]) == 1 and s["rounds"][0]["arrays"] > 0
        assert s["rounds"][0]["minflt"] >= 0
        if s["config"] == "dm-threads":
            assert s["handler"] == "datamem", s
            assert s["arenas"] == {"worker-%d" % k: "w%d" % k for k in range(s["threads"])}
        else:
            assert s["handler"] != "datamem" and s["arenas"] == {}, s
    # --report prints the same tables again from the file, running nothing
    rep = subprocess.run([sys.executable, SCRIPT, "--report", str(out)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    assert rep.stdout.strip() == r.stdout.strip()


def test_a_datamem_child_without_per_worker_arenas_is_refused(monkeypatch):
    # The same child under one shared arena: the parent must not count it.
    monkeypatch.setitem(bench.CONFIGS, "dm-threads",
                        ({"DATAMEM_CONFIG": os.path.join(ROOT, "configs", "minimal.yaml")}, None))
    with pytest.raises(RuntimeError, match="workers' arenas"):
        bench.run_child("dm-threads", 1, True, 120)


def test_summary_ratios_best_peer_and_verdict():
    raw = {"default": {1: [100.0, 90.0, 110.0], 2: [150.0]},
           "jemalloc": {1: [200.0], 2: [380.0]},
           "tcmalloc": {1: [250.0], 2: [400.0]},
           "dm-threads": {1: [240.0], 2: [390.0]}}
    configs = list(raw)
    table, best = bench.summarize(raw, configs, [1, 2])
    assert best == {1: "tcmalloc", 2: "tcmalloc"}
    assert table["default"][1]["median"] == 100.0
    assert table["jemalloc"][2]["scaling"] == pytest.approx(1.9)
    assert table["dm-threads"][2]["vs_default"] == pytest.approx(2.6)
    assert table["dm-threads"][2]["vs_best_peer"] == pytest.approx(0.975)
    v = bench.verdict(table, best, [1, 2])
    assert "scaling_met" not in v[1] and "throughput_met" not in v[1]
    assert v[2]["best_peer"] == "tcmalloc"
    assert v[2]["scaling_met"] is True        # 1.625 against 1.6
    assert v[2]["throughput_met"] is True     # 0.975 of the best peer
    raw["dm-threads"][2] = [370.0]             # 0.925 of it, scaling 1.54
    v = bench.verdict(*bench.summarize(raw, configs, [1, 2]), [1, 2])
    assert v[2]["throughput_met"] is False and v[2]["scaling_met"] is False


@pytest.mark.parametrize("threads", ["0,1", "1,17", "1,1", "a"])
def test_bad_thread_counts_are_refused(threads, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--threads", threads])
    assert "--threads" in capsys.readouterr().err
