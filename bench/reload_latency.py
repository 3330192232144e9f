"""Latency from replacing the policy file to the new rules being in force.

The job watches its policy (reload: {watch: true, debounce: D}); this script
replaces the file (write to a temp file + rename, as editors and config tools do)
and polls, from the same process, until a new array lands in the arena the new
policy names. Reports p50/p99 over N replacements for each debounce setting.
Usage: python3 bench/reload_latency.py [N]
"""
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import datamem

TEXT = """version: 1
default: {d}
arenas:
  a: {{alignment: 64}}
  b: {{alignment: 64}}
rules:  # never match in this benchmark; they keep both arenas in use
  - {{name: over-2g, match: {{size: {{min: 2GiB}}}}, arena: a}}
  - {{name: over-1g, match: {{size: {{min: 1GiB}}}}, arena: b}}
reload: {{watch: true, debounce: {debounce}}}
"""


def measure(n, debounce):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "policy.yaml")
        with open(path, "w") as f:
            f.write(TEXT.format(d="a", debounce=debounce))
        datamem.install(path)
        lat = []
        for i in range(n):
            want = "b" if i % 2 == 0 else "a"
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(TEXT.format(d=want, debounce=debounce))
            t0 = time.perf_counter()
            os.replace(tmp, path)
            while datamem.arena_of(np.empty(100)) != want:
                if time.perf_counter() - t0 > 5:
                    raise SystemExit("no reload within 5 s")
                time.sleep(0.0002)
            lat.append(time.perf_counter() - t0)
        with open(path, "w") as f:  # stop watching before the directory goes away
            f.write(TEXT.format(d="a", debounce=debounce).replace("watch: true", "watch: false"))
        datamem.reload()
        datamem.uninstall()
    lat.sort()
    return statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))], lat[-1]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    print("%-10s %10s %10s %10s" % ("debounce", "p50 ms", "p99 ms", "max ms"))
    for debounce in ("0ms", "10ms", "50ms"):
        p50, p99, mx = measure(n, debounce)
        print("%-10s %10.2f %10.2f %10.2f" % (debounce, p50 * 1e3, p99 * 1e3, mx * 1e3))


if __name__ == "__main__":
    main()
