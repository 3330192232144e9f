"""bench/fault_map.py, where a job's page faults land: the map the child writes
is read into places (datamem's mappings by the mark the child put on them,
glibc's heap, big and other anonymous mappings, files), each fault address is
put in its place or counted `gone`; and a small job goes end to end, under a
policy (most faults in datamem's arenas) and under NumPy's default (none). The
job is threadpool, which needs NumPy alone (the NumPy 1.26 lane has no SciPy)
and faults in two threads besides the main one: perf follows them."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import fault_map  # noqa: E402

MAPS = """\
0 55d0a0000000-55d0a0100000 rw-p 00000000 00:00 0          [heap]
1 7f0000000000-7f0000400000 rw-p 00000000 00:00 0
0 7f0000400000-7f0040400000 rw-p 00000000 00:00 0
0 7f1000000000-7f1000010000 rw-p 00000000 00:00 0
0 7f2000000000-7f2000100000 r-xp 00000000 08:01 123        /usr/lib/libc.so.6
0 7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0          [vdso]
"""


def test_every_address_in_its_place():
    maps = fault_map.read_maps(MAPS.splitlines())
    assert [m[2] for m in maps] == ["heap", "datamem", "anon>=1G", "anon", "files", "files"]
    addrs = [0x55d0a0000000, 0x55d0a00fffff,       # heap, both ends
             0x7f0000000000, 0x7f00003fffff,       # datamem's, marked by the child
             0x7f0000400000,                       # 1 GiB, not datamem's
             0x7f1000000fff,                       # small anonymous
             0x7f2000000010, 0x7ffd00000000,       # a library, the vdso
             0x7f0040400000, 0x1000]               # unmapped at the end: gone
    assert fault_map.classify(addrs, maps) == {"datamem": 2, "heap": 2, "anon>=1G": 1, "anon": 1,
                                                "files": 2, "gone": 2}
    assert fault_map.classify([], maps) == dict.fromkeys(fault_map.PLACES, 0)


def run(tmp_path, *policy):
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fault_map.py"),
                        "--python", sys.executable, "--job", "threadpool", "--scale", "0.05",
                        "--out", str(out)] + list(policy),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.mark.skipif(shutil.which("perf") is None,
                    reason="perf is not installed here: scripts/setup.sh installs linux-perf on the "
                           "machine, the Debian roots (other Pythons, arm64) have none")
def test_a_job_end_to_end(tmp_path):
    d = run(tmp_path, "--policy", os.path.join(ROOT, "configs", "minimal.yaml"))
    assert d["handler"] == "datamem" and d["job"] == "threadpool", d
    p = d["places"]
    assert sum(p.values()) == d["faults"] and d["faults"] > d["job_faults"] > 0, d
    # the job's arrays are datamem's: their faults are there, and the rest
    # (the interpreter, its libraries) somewhere else
    assert p["datamem"] > 1000 and p["files"] > 0, d
    default = run(tmp_path)
    assert default["handler"] == "default_allocator" and default["places"]["datamem"] == 0, default
