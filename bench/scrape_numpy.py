"""NumPy allocation throughput under a 10 Hz /metrics scraper vs none, in one run
(docs/monitoring.md, "Stats and scraping").

    python3 bench/scrape_numpy.py [--rounds 10] [--phase 1.0]

A job (DATAMEM_CONFIG=configs/demo.yaml, DATAMEM_STATS_HTTP=127.0.0.1:0) creates
and drops arrays of mixed sizes (64 B to 8 MiB, every demo arena) in phases
agreed by wall clock; this process scrapes the job's /metrics at 10 Hz during
every other phase. Phases alternate so drift affects both alike; the ratio of
median ops/s (with / without) is printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = r"""
import json, sys, time
import numpy as np, datamem
t0, phase, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
sizes = [8, 64, 1000, 10_000, 100_000, 1 << 20]   # elements of float64
print(json.dumps({"url": datamem.stats_url()}), flush=True)
while time.time() < t0:
    time.sleep(0.001)
rates = []
for p in range(n):
    end = t0 + (p + 1) * phase
    ops = 0
    start = time.time()
    while time.time() < end:
        for s in sizes:
            a = np.empty(s)
            del a
        ops += len(sizes)
    rates.append(ops / (time.time() - start))
print(json.dumps({"rates": rates}), flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--phase", type=float, default=1.0)
    a = ap.parse_args()
    n = 2 * a.rounds
    t0 = time.time() + 3.0  # after the job's start-up
    env = dict(os.environ, DATAMEM_CONFIG=os.path.join(ROOT, "configs", "demo.yaml"),
               DATAMEM_STATS_HTTP="127.0.0.1:0")
    p = subprocess.Popen([sys.executable, "-c", JOB, str(t0), str(a.phase), str(n)], env=env,
                         stdout=subprocess.PIPE, text=True)
    url = json.loads(p.stdout.readline())["url"]
    scrapes, lat = 0, []
    for k in range(n):
        start, end = t0 + k * a.phase, t0 + (k + 1) * a.phase
        while time.time() < start:
            time.sleep(0.001)
        if k % 2 == 1:  # scraped phases
            nxt = start + 0.05
            while nxt < end - 0.01:
                while time.time() < nxt:
                    time.sleep(0.001)
                t = time.perf_counter()
                urllib.request.urlopen(url, timeout=5).read()
                lat.append(time.perf_counter() - t)
                scrapes += 1
                nxt += 0.1
    rates = json.loads(p.stdout.readline())["rates"]
    p.wait()
    off = rates[0::2]
    on = rates[1::2]
    print("np.empty create+drop, 6 sizes 64 B-8 MiB, %d x %.1f s phases each way" % (a.rounds, a.phase))
    print("without scraper: median %.0f k ops/s (min %.0f, max %.0f)" % (
        statistics.median(off) / 1e3, min(off) / 1e3, max(off) / 1e3))
    print("with 10 Hz:      median %.0f k ops/s (min %.0f, max %.0f), %d scrapes, median %.2f ms" % (
        statistics.median(on) / 1e3, min(on) / 1e3, max(on) / 1e3, scrapes,
        statistics.median(lat) * 1e3))
    print("ratio with/without: %.3f" % (statistics.median(on) / statistics.median(off)))


if __name__ == "__main__":
    main()
