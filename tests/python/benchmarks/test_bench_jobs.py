"""The real-job benchmark's summary (`python3 -m bench.jobs`, bench/jobs/__main__.py):
the columns that do not swing with the VM's page-zeroing cost (user time, best-of-N
wall time) sit next to the medians (docs/performance.md, "How to read these numbers")."""
import os
import sys

from conftest import ROOT

sys.path.append(ROOT)  # bench/ is a package of the repository root (`python3 -m bench.jobs`)
from bench.jobs import __main__ as jobs  # noqa: E402


def run(wall, user, rss=100.0):
    return {"wall_s": wall, "cpu_s": wall, "user_s": user, "sys_s": wall - user,
            "maxrss_mb": rss, "faults": 10, "thp_mb": 0}


def test_best_wall_and_user_time_are_ratios_to_the_default():
    raw = {"job": {"default": [run(2.0, 1.0), run(1.0, 0.9), run(3.0, 1.1)],
                   "dm-x": [run(1.1, 1.0), run(4.0, 1.0), run(4.5, 1.2)]}}
    med, ratio = jobs.summarize(raw)
    assert med["job"]["default"]["wall_best_s"] == 1.0
    assert med["job"]["dm-x"]["wall_best_s"] == 1.1
    assert abs(ratio["job"]["dm-x"]["wall_best_s"] - 1.1) < 1e-12
    assert abs(ratio["job"]["dm-x"]["wall_s"] - 2.0) < 1e-12   # the median: 4.0 / 2.0
    assert abs(ratio["job"]["dm-x"]["user_s"] - 1.0) < 1e-12
    table = jobs.markdown_steady(med, ratio, ["default", "dm-x"])
    assert "| job | 1.00, 1.00 | 1.00x / 1.10x |" in table


def test_samples_without_user_time_leave_the_steady_table_out():
    raw = {"job": {"default": [{"wall_s": 1.0, "maxrss_mb": 1.0}],
                   "dm-x": [{"wall_s": 1.0, "maxrss_mb": 1.0}]}}
    med, ratio = jobs.summarize(raw)
    assert jobs.markdown_steady(med, ratio, ["default", "dm-x"]).count("\n") == 1


def test_shares_table_splits_the_peak_into_arenas_pyarrow_and_other():
    smp = [{"job": "j", "config": "dm-x", "maxrss_mb": 1030.0,
            "peak": {"rss_mb": 1000.0, "arenas_mb": 600.0, "pyarrow_mb": 100.0}},
           {"job": "j", "config": "default", "maxrss_mb": 990.0,
            "peak": {"rss_mb": 980.0, "arenas_mb": None, "pyarrow_mb": None}}]
    lines = jobs.markdown_shares(smp).splitlines()
    assert lines[2] == "| j | dm-x | 1000 / 1030 | 600 | 60% | 100 | 300 |"
    assert lines[3] == "| j | default | 980 / 990 | - | - | - | 980 |"


def test_child_peak_sampler_sees_the_arenas_hold_a_numpy_job():
    # stencil_big at 0.1: a 100 MiB grid and its temporaries, all NumPy's.
    import json
    import subprocess
    child = os.path.join(ROOT, "bench", "jobs", "child.py")
    env = dict(os.environ, DATAMEM_CONFIG=os.path.join(ROOT, "configs", "minimal.yaml"))
    r = subprocess.run([sys.executable, child, "stencil_big", "--scale", "0.1", "--peak"],
                       env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    p = out["peak"]
    assert p["rss_mb"] <= out["maxrss_mb"] * 1.02, out  # sampled: at most the true peak
    assert p["rss_mb"] >= 200, out                       # the grid and two temporaries
    assert p["arenas_mb"] >= 0.8 * p["rss_mb"], out      # most of it in datamem's arenas
    assert p["pyarrow_mb"] is None, out
    r = subprocess.run([sys.executable, child, "stencil_big", "--scale", "0.1"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert json.loads(r.stdout.strip().splitlines()[-1])["peak"] is None  # off unless asked


def test_variants_and_the_configuration_list_are_one_definition_for_both_benchmarks():
    """--variant NAME:VAR=VAL;VAR=VAL adds a configuration (its policy path
    made absolute) to bench/run.py's and bench/jobs' lists alike; --configs
    picks, the variants follow, NumPy's default always comes first."""
    from bench import run
    known = {}
    names = run.add_variants(["dm-a:DATAMEM_CONFIG=configs/minimal.yaml;DMJE_MALLOC_CONF=x:1",
                              "dm-b:"], known)
    assert names == ["dm-a", "dm-b"]
    assert known["dm-a"] == ({"DATAMEM_CONFIG": os.path.join(ROOT, "configs/minimal.yaml"),
                              "DMJE_MALLOC_CONF": "x:1"}, None)
    assert known["dm-b"] == ({}, None)
    assert run.config_list(None, ["default", "tcmalloc"], names) == \
        ["default", "tcmalloc", "dm-a", "dm-b"]
    assert run.config_list("tcmalloc,dm-b", ["default"], names) == \
        ["default", "tcmalloc", "dm-b", "dm-a"]
    assert jobs.add_variants is run.add_variants and jobs.config_list is run.config_list
