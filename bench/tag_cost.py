"""What counting bytes per tag costs in time: np.empty of 64 B and 16 KiB inside
`datamem.tag("task")`, side by side in one run.

    python3 bench/tag_cost.py [--python NAME=PYTHON ...] [--rounds 9] [--batches 15]
                              [--ops 50000] [--out F.json]

For each interpreter (default: this one; several `--python` to put two builds side
by side) and each configuration: NumPy's default handler, configs/minimal.yaml,
and configs/minimal.yaml with counting on (DATAMEM_TAG_BYTES=1, as the Dask plugin
turns it on). Every (interpreter, configuration) runs in a fresh process per round,
rounds interleaved. A process warms up, then times --batches batches of --ops
operations of each loop, the loops alternating, and keeps each loop's fastest batch
(the one the machine disturbed least). The table is the median over the rounds of
those, in ns per np.empty + free, and as ratios: to NumPy's default in the same
run, and counting on to counting off (what counting per tag costs in time). On a
shared VM time is noisy: the fastest batch and the median over rounds are what
repeat; read the ratios, not the nanoseconds.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run import child_env  # noqa: E402  one environment discipline for every benchmark

LOOPS = ("empty64", "empty16k")
POLICY = os.path.join(ROOT, "configs", "minimal.yaml")
CONFIGS = {  # name: the environment a child gets
    "default": {},
    "minimal": {"DATAMEM_CONFIG": POLICY},
    "minimal+count": {"DATAMEM_CONFIG": POLICY, "DATAMEM_TAG_BYTES": "1"},
}

CHILD = r"""
import contextlib, json, os, sys, time
import numpy as np
batches, ops = int(sys.argv[1]), int(sys.argv[2])
if os.environ.get("DATAMEM_CONFIG"):
    import datamem
    scope = datamem.tag("task")
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:
        from numpy.core.multiarray import get_handler_name
    assert get_handler_name() == "datamem", get_handler_name()
else:
    scope = contextlib.nullcontext()
def empties(size, k, empty=np.empty, u=np.uint8):
    for _ in range(k):
        empty(size, u)
sizes = {"empty64": 64, "empty16k": 16384}
best = dict.fromkeys(sizes, float("inf"))
clock = time.perf_counter_ns
with scope:
    for size in sizes.values():
        empties(size, ops)  # bind, learn the classes, fill the caches
    for _ in range(batches):
        for name, size in sizes.items():
            t = clock()
            empties(size, ops)
            best[name] = min(best[name], (clock() - t) / ops)
if os.environ.get("DATAMEM_TAG_BYTES"):
    tags = datamem.stats()["tags"]
    assert tags["task"]["peak"] > 0, tags  # counted, under its tag
print(json.dumps(best))
"""


def run_child(python, config, batches, ops):
    p = subprocess.run([python, "-c", CHILD, str(batches), str(ops)],
                       env=child_env(CONFIGS[config]), capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    if p.returncode != 0:
        raise RuntimeError("%s under %s failed (%d): %s" % (python, config, p.returncode,
                                                            p.stderr.strip()[-2000:]))
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[], metavar="NAME=PYTHON",
                    help="an interpreter with datamem installed (repeat to compare builds)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=15, help="timed batches per loop and process")
    ap.add_argument("--ops", type=int, default=50000, help="operations per batch")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()
    pythons = [p.split("=", 1) for p in a.python] or [["this", sys.executable]]
    runs = {}
    for r in range(a.rounds):
        for name, py in pythons:
            for config in CONFIGS:
                if config == "default" and name != pythons[0][0]:
                    continue  # NumPy's own handler: the same in every build
                for loop, ns in run_child(py, config, a.batches, a.ops).items():
                    runs.setdefault((name, config, loop), []).append(ns)
        print("round %d of %d" % (r + 1, a.rounds), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = pythons[0][0]
    rows = []
    print("| build | configuration | loop | ns per op (median of %d) | x default | "
          "counting on / off |" % a.rounds)
    print("|---|---|---|---|---|---|")
    for name, _ in pythons:
        for config in CONFIGS:
            for loop in LOOPS:
                k = (name, config, loop)
                if k not in med:
                    continue
                ratio = med[k] / med[(base, "default", loop)]
                onoff = (med[k] / med[(name, "minimal", loop)]
                         if config == "minimal+count" else None)
                rows.append({"build": name, "config": config, "loop": loop, "ns": med[k],
                             "runs": runs[k], "x_default": ratio, "count_on_off": onoff})
                print("| %s | %s | %s | %.1f | %.3f | %s |"
                      % (name, config, loop, med[k], ratio,
                         "%.3f" % onoff if onoff else ""))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"batches": a.batches, "ops": a.ops, "rounds": a.rounds, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
