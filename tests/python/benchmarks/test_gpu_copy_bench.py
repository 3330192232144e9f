"""bench/gpu_copy.py: says so and exits 0 without a CUDA runtime, and runs end to
end against a stand-in runtime (host memory as the device), so the benchmark
keeps working on machines without a GPU, where CI runs."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, UNDER_ASAN

BENCH = os.path.join(ROOT, "bench", "gpu_copy.py")
MiB = 1 << 20

# The runtime calls the benchmark makes, with host memory standing in for the
# GPU's; cudaPointerGetAttributes says "host" (pinned) for registered ranges.
STAND_IN = r"""
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
static struct { char *p; size_t n; } regs[4096];
static int nregs;
int cudaHostRegister(void *p, size_t n, unsigned int flags) {
    if (nregs < 4096) { regs[nregs].p = p; regs[nregs].n = n; nregs++; }
    return 0;
}
int cudaHostUnregister(void *p) { return 0; }
const char *cudaGetErrorString(int e) { return e ? "stand-in error" : "no error"; }
int cudaGetLastError(void) { return 0; }
int cudaGetDeviceCount(int *n) { *n = 1; return 0; }
int cudaSetDevice(int d) { return 0; }
int cudaFree(void *p) { free(p); return 0; }
int cudaMalloc(void **p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaMallocHost(void **p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaFreeHost(void *p) { free(p); return 0; }
int cudaMemcpy(void *d, const void *s, size_t n, int k) { memcpy(d, s, n); return 0; }
int cudaMemcpyAsync(void *d, const void *s, size_t n, int k, void *st) {
    memcpy(d, s, n); return 0; }
int cudaStreamCreateWithFlags(void **s, unsigned f) { *s = (void *)1; return 0; }
int cudaStreamSynchronize(void *s) { return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
int cudaDriverGetVersion(int *v) { *v = 13000; return 0; }
int cudaDeviceGetAttribute(int *v, int a, int d) { *v = 0; return 0; }
int cudaPointerGetAttributes(int *attrs, const char *p) {
    memset(attrs, 0, 8 * sizeof(int));
    for (int i = 0; i < nregs; i++)
        if (regs[i].p <= p && p < regs[i].p + regs[i].n) attrs[0] = 1;
    return 0;
}
"""


def bench(*args, env=None):
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    e.pop("DATAMEM_CUDART", None)
    e.update(env or {})
    return subprocess.run([sys.executable, BENCH, *args], env=e, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_without_a_cuda_runtime_it_says_so_and_exits_0():
    r = bench("--cudart", "/nonexistent/libcudart.so")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_copy: no CUDA runtime"), r.stdout


def test_every_allocator_is_measured_with_a_stand_in_runtime(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("SKIP: no C compiler to build the CUDA stand-in")
    src = tmp_path / "cudart.c"
    src.write_text(STAND_IN)
    lib = tmp_path / "libcudart.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    out = tmp_path / "gpu_copy.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = bench("--cudart", str(lib), "--sizes", "1M,4M", "--rounds", "1", "--first-rounds", "1",
              "--out", str(out), env={"TMPDIR": str(scratch)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(scratch.iterdir()) == []  # its policy's directory goes with it (80 were left in /tmp)
    doc = json.loads(out.read_text())
    modes = ["numpy", "plain", "lock", "pinned", "mallochost"]
    assert sorted(doc["copies"]) == sorted(modes)
    for m in modes:
        for n in (MiB, 4 * MiB):
            cell = doc["copies"][m][str(n)]
            for op in ("h2d", "d2h", "h2d_async", "d2h_async", "h2d_async_enqueue"):
                assert cell[op]["gbps"] > 0 and cell[op]["samples"] >= 3, (m, n, op, cell[op])
            f = doc["first_alloc"][m][str(n)]
            assert f["first_s"] > 0 and f["again_s"] > 0, (m, n, f)
    assert doc["verified"] == {m: True for m in modes}
    where = {k: v["where"] for k, v in doc["placement"].items()}
    assert where["numpy/1048576"] == "default_allocator", where
    assert where["plain/1048576"] == "datamem:plain" and where["lock/4194304"] == "datamem:locked"
    assert where["pinned/4194304"] == "datamem:gpu", where
    # Every pinned array lies in memory registered with the runtime, and only those do.
    for k, v in doc["placement"].items():
        want = "pinned" if k.startswith("pinned/") else "pageable"
        assert v["start"] == want and v["end"] == want, (k, v)
    stats = doc["arena_stats"]
    assert stats["gpu"]["pinned_bytes"] >= 5 * MiB and stats["gpu"]["placement_errors"] == 0
    if not UNDER_ASAN:  # ASan makes mlock a no-op
        assert stats["locked"]["locked_bytes"] >= 5 * MiB, stats
    assert "mallochost" in r.stdout and "GB/s" in r.stdout
