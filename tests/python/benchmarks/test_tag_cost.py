"""The tag-counting time benchmark (bench/tag_cost.py): a tiny run goes end to
end, every configuration's children ran as named (datamem's handler under a
policy, the tag counted with DATAMEM_TAG_BYTES=1: each child asserts both), and
the table's ratios are computed from the same run's figures."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, UNDER_ASAN

SCRIPT = os.path.join(ROOT, "bench", "tag_cost.py")
pytestmark = pytest.mark.skipif(UNDER_ASAN, reason="SKIP under ASan: the benchmark's "
                                "children drop LD_PRELOAD, which carries the sanitizer")


def test_tiny_run_reports_every_configuration_and_the_counting_ratio(tmp_path):
    out = tmp_path / "tag_cost.json"
    r = subprocess.run([sys.executable, SCRIPT, "--rounds", "2", "--batches", "2", "--ops", "2000",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert (d["rounds"], d["batches"], d["ops"]) == (2, 2, 2000)
    rows = {(row["config"], row["loop"]): row for row in d["rows"]}
    assert sorted(rows) == sorted((c, loop) for c in ("default", "minimal", "minimal+count")
                                  for loop in ("empty64", "empty16k"))
    for (config, loop), row in rows.items():
        assert len(row["runs"]) == 2 and all(ns > 0 for ns in row["runs"])
        assert row["x_default"] == pytest.approx(row["ns"] / rows[("default", loop)]["ns"])
        if config == "minimal+count":
            assert row["count_on_off"] == pytest.approx(row["ns"] / rows[("minimal", loop)]["ns"])
        else:
            assert row["count_on_off"] is None
    assert "| this | minimal+count | empty64 |" in r.stdout, r.stdout
