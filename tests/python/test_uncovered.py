"""Threads not covered (issue 15): Python threads that allocate through NumPy's
default allocator reach /metrics and /stats.json, not only datamem.stats()."""
import json
import urllib.request

from conftest import run_py

CODE = r"""
import json, threading, urllib.request
import numpy as np, datamem
go, done = threading.Event(), threading.Event()
early = threading.Thread(target=lambda: (go.wait(), done.set()), name="early-bird")
early.start()                        # before datamem: NumPy's default allocator
datamem.install(POLICY)
url = datamem.serve_stats("127.0.0.1:0")
def scrape():
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    js = json.loads(urllib.request.urlopen(url.replace("/metrics", "/stats.json"),
                                       timeout=10).read())
    n = [l for l in text.splitlines() if l.startswith("datamem_threads_not_covered ")]
    return n[0].split()[1], js["threads_not_covered"]
out = {"before": scrape()}
go.set(); early.join()
t = threading.Thread(target=lambda: np.ones(10), name="late"); t.start(); t.join()
out["after"] = scrape()
print(json.dumps(out))
"""


def test_threads_not_covered_reach_the_endpoint(write_policy):
    pol = write_policy("version: 1\ndefault: general\narenas:\n  general: {}\n")
    r = run_py(CODE.replace("POLICY", repr(pol)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["before"] == ["1", ["early-bird"]], out
    assert out["after"] == ["0", []], out  # it ended; the next thread's end said so
