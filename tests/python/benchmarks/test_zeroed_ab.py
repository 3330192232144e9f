"""bench/zeroed_ab.py, the bytes the kernel zeroes for one workload, builds side by
side: a tiny run goes end to end, each build's child ran under the handler its
policy names, and the bytes zeroed are the faults counted as pages."""
import json
import os
import subprocess
import sys

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "bench", "zeroed_ab.py")


def test_two_builds_side_by_side(tmp_path):
    out = tmp_path / "z.json"
    minimal = os.path.join(ROOT, "configs", "minimal.yaml")
    r = subprocess.run([sys.executable, SCRIPT, "--build", "default=" + sys.executable,
                        "--build", "minimal=%s,%s" % (sys.executable, minimal), "--reps", "2",
                        "--out", str(out), "--", "temp8", "--quick"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert d["workload"] == ["temp8", "--quick"]
    assert sorted(d["samples"]) == ["default", "minimal"]
    for name, samples in d["samples"].items():
        assert len(samples) == 2, samples
        for s in samples:
            assert (s["handler"] == "datamem") == (name == "minimal"), s
            assert s["small"] > 0 and s["thp"] >= 0 and s["rss_mb"] > 0, s
            assert abs(s["zeroed_mb"] - (s["small"] * 4096 + s["thp"] * (2 << 20)) / 1e6) < 1e-6
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table[1:]] == ["| default", "| minimal"], table
