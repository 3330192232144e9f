"""Memory profilers (memray, tracemalloc) on a job under a policy and without.

memray hooks libc's allocation symbols (malloc ... mmap, munmap) in every
loaded library, datamem's extension included, and counts what each returns.
Under NumPy's default it sees each array as one malloc. Under a policy, once
the extension finds its own malloc hooked, it shows each array to the hook as
a malloc of the array's size (a shadow, never touched) and makes its own
mappings (reservations, extents, jemalloc's metadata) with syscall(2), which no
hook sees (pyext/shadow.c, docs/operations.md, "Profilers"). Before, memray
counted the arenas' extents: 632 MB for an fft job whose peak is 343 MB, and
datamem's start as the job's. tracemalloc sees every array, as NumPy reports
each one to it.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import CONFIGS, ROOT, UNDER_ASAN, UNDER_TSAN

memray = pytest.importorskip("memray", reason="SKIP: memray is not installed "
                             "(requirements-dev.txt installs it)")

pytestmark = pytest.mark.skipif(
    UNDER_ASAN or UNDER_TSAN,
    reason="SKIP under sanitizers: their interceptors and memray's hooks both "
           "wrap malloc and mmap, and shadow memory is mapped under memray's eyes")

# A policy of three arenas, one of them for blocks of 4 MiB and more that keeps
# freed pages 30 s (the benchmarks' comparison policy, once shipped).
THROUGHPUT = os.path.join(ROOT, "bench", "policies", "throughput.yaml")
POLICY = {"minimal.yaml": os.path.join(CONFIGS, "minimal.yaml"),
          "throughput.yaml": THROUGHPUT,
          "dtype.yaml": os.path.join(CONFIGS, "dtype.yaml")}

# A user's fft job: a 2048x2048 image, a few round trips. Its arrays are
# 32-64 MiB, served by throughput.yaml's `big` arena.
FFT_JOB = r"""
import numpy as np
rng = np.random.default_rng(0)
img = rng.standard_normal((2048, 2048))
for _ in range(3):
    f = np.fft.fft2(img)
    img = np.fft.ifft2(f * 0.5).real
"""

# A job that only starts: NumPy, datamem when a policy is set, one small array.
START_JOB = r"""
import numpy as np
a = np.ones(10)
"""

# memray started by the job after `import numpy` (as pytest-memray and
# memray.Tracker do): the extension finds the hook at the first allocation
# after it. Small and big arrays, four threads, a resize (NumPy's realloc), a
# fork whose child frees arrays that have shadows; at the end it writes what it
# holds in arrays, which memray must count as leaked.
LATER_JOB = r"""
import json, os, sys, threading
import numpy as np, memray
before = [np.ones(1000 + i) for i in range(100)]   # made before tracking: never shown
with memray.Tracker(sys.argv[1]):
    small = [np.empty(1024 * (1 + i % 3)) for i in range(2000)]   # 8-24 KiB, 32 MiB
    def work(k):
        for i in range(200):
            a = np.ones(4096 + k) * i   # temporaries freed at once
            b = np.empty(3 * 2**20)     # 24 MiB, big arrays
            del a, b
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    img = np.random.default_rng(0).standard_normal((1024, 1024))
    for _ in range(3):
        img = np.fft.ifft2(np.fft.fft2(img) * 0.5).real
    grown = np.ones(1000)
    grown.resize(200000, refcheck=False)                # realloc: 8 KB -> 1.6 MB
    pid = os.fork()
    if pid == 0:
        del small
        os._exit(0)
    os.waitpid(pid, 0)
    del small
    kept = [img, grown] + [np.empty(2**20) for _ in range(4)]   # 8 MiB each
    with open(sys.argv[2], "w") as out:
        # img is the real part of a complex array: its memory is the base's
        json.dump({"kept": sum((a if a.base is None else a.base).nbytes for a in kept)}, out)
"""

MiB = 1 << 20


def env_for(config):
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    if config:
        e["DATAMEM_CONFIG"] = config
    return e


def memray_run(tmp_path, name, job, config):
    """Runs `job` under `memray run`; returns memray's peak in bytes."""
    script = tmp_path / f"{name}.py"
    script.write_text(job)
    capture = tmp_path / f"{name}.bin"
    r = subprocess.run([sys.executable, "-m", "memray", "run", "-q", "-o", str(capture),
                        str(script)],
                       env=env_for(config), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return memray.FileReader(str(capture)).metadata.peak_memory


# dtype.yaml: with dtype hooks on, the handler's check of its dtype and of a
# profiler's hook share one word (pyext/handler.c, h_hooked).
@pytest.mark.parametrize("config", ["minimal.yaml", "throughput.yaml", "dtype.yaml"])
def test_memray_peak_is_the_same_with_and_without_a_policy(tmp_path, config):
    plain = memray_run(tmp_path, "fft_plain", FFT_JOB, None)
    policy = memray_run(tmp_path, "fft_policy", FFT_JOB, POLICY[config])
    # Measured: 325.9 MiB under either policy, 325.8 MiB without a policy.
    # Counting the arenas' extents it read 632 MB under throughput.yaml.
    assert plain > 3 * 32 * MiB, plain  # the arrays are in it
    assert abs(policy - plain) <= 0.02 * plain, (
        f"memray's peak under {config} {policy / MiB:.1f} MiB, without a policy "
        f"{plain / MiB:.1f} MiB")


@pytest.mark.parametrize("config", ["minimal.yaml", "throughput.yaml"])
def test_memray_does_not_count_datamem_starting(tmp_path, config):
    # Reservations (1 GiB segments), extents and jemalloc's metadata are not
    # the job's: measured 6.4-7.4 MiB under either policy against 6.3 MiB without
    # a policy (a pymalloc arena is 1 MiB); counting them it read 26.3 MiB.
    plain = memray_run(tmp_path, "start_plain", START_JOB, None)
    policy = memray_run(tmp_path, "start_policy", START_JOB, POLICY[config])
    assert policy <= plain + 2 * MiB, (
        f"memray's peak of a job that only starts: {policy / MiB:.1f} MiB under "
        f"{config}, {plain / MiB:.1f} MiB without a policy")


def test_memray_started_after_numpy_sees_arrays_as_without_a_policy(tmp_path):
    script = tmp_path / "later.py"
    script.write_text(LATER_JOB)
    seen = {}
    for name, config in (("plain", None), ("policy", THROUGHPUT)):
        capture, result = tmp_path / f"{name}.bin", tmp_path / f"{name}.json"
        r = subprocess.run([sys.executable, str(script), str(capture), str(result)],
                           env=env_for(config), capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        reader = memray.FileReader(str(capture))
        leaked = sum(a.size for a in reader.get_leaked_allocation_records(merge_threads=True))
        seen[name] = (reader.metadata.peak_memory, leaked, json.loads(result.read_text())["kept"])
    (plain_peak, plain_leaked, kept), (peak, leaked, _) = seen["plain"], seen["policy"]
    # The arrays alive at the end are memray's leaks, every shadow of a freed
    # array (threads, realloc, a fork's child) was given back.
    assert kept <= leaked <= kept + 4 * MiB, (leaked, kept)
    assert abs(leaked - plain_leaked) <= 2 * MiB, (leaked, plain_leaked)
    assert abs(peak - plain_peak) <= 0.03 * plain_peak, (
        f"memray's peak under throughput.yaml {peak / MiB:.1f} MiB, without a policy "
        f"{plain_peak / MiB:.1f} MiB")


def fil_peak(tmp_path, name, job, config):
    """Runs `job` under Fil (filprofiler: malloc and mmap interposed with
    LD_PRELOAD); returns its peak in MiB, as its report states it."""
    script = tmp_path / f"{name}.py"
    script.write_text(job)
    out = tmp_path / f"{name}-fil"
    r = subprocess.run([sys.executable, "-m", "filprofiler", "-o", str(out), "--no-browser",
                        "run", str(script)],
                       env=env_for(config), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (svg,) = out.glob("*/peak-memory.svg")
    m = re.search(r"Peak Tracked Memory Usage \(([0-9.]+) MiB\)", svg.read_text())
    assert m, svg
    return float(m.group(1))


def test_fil_peak_is_the_same_with_and_without_a_policy(tmp_path):
    # Fil interposes malloc for the whole process (LD_PRELOAD): its library is
    # named among the profilers datamem shows arrays to (pyext/shadow.c).
    # Measured: 321.2 MiB under throughput.yaml, 321.3 without a policy; the
    # arenas' extents counted instead, it read 589.2 MiB.
    pytest.importorskip("filprofiler", reason="SKIP: filprofiler is not installed "
                        "(requirements-dev.txt installs it where it has a wheel)")
    plain = fil_peak(tmp_path, "fft_plain", FFT_JOB, None)
    policy = fil_peak(tmp_path, "fft_policy", FFT_JOB, THROUGHPUT)
    assert plain > 3 * 32, plain  # MiB: the arrays are in it
    assert abs(policy - plain) <= 0.02 * plain, (policy, plain)


TRACEMALLOC_JOB = r"""
import json, sys, tracemalloc
import numpy as np
tracemalloc.start()
rng = np.random.default_rng(0)
img = rng.standard_normal((2048, 2048))
for _ in range(3):
    f = np.fft.fft2(img)
    img = np.fft.ifft2(f * 0.5).real
print(json.dumps(tracemalloc.get_traced_memory()[1]))
"""


def test_tracemalloc_peaks_agree():
    # NumPy reports each array to tracemalloc (PyTraceMalloc_Track) whichever
    # handler made it, and datamem maps nothing through the Python allocators.
    peaks = {}
    for name, config in (("plain", None), ("policy", THROUGHPUT)):
        r = subprocess.run([sys.executable, "-c", TRACEMALLOC_JOB], env=env_for(config),
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        peaks[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert peaks["plain"] > 3 * 64 * MiB, peaks  # the arrays are in it
    assert abs(peaks["policy"] - peaks["plain"]) <= 0.05 * peaks["plain"], peaks
