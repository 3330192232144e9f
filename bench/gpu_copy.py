"""Host<->device copies of NumPy arrays, by where the host array lives.

For each size (1 MiB, 16 MiB, 256 MiB, 1 GiB by default) and each host allocator

  numpy     NumPy's default allocator (pageable memory)
  plain     a datamem arena with no settings
  lock      a datamem arena with `lock: true` (mlock'ed)
  pinned    a datamem arena with `pinned: cuda` (cudaHostRegister'ed)
  mallochost  cudaMallocHost, the CUDA runtime's own pinned memory (the reference)

it times, through ctypes on the CUDA runtime (libcudart, the library datamem
registers with: DATAMEM_CUDART is set to the same path):

  h2d, d2h            cudaMemcpy, one call (wall time of the call)
  h2d_async, d2h_async  cudaMemcpyAsync on a non-blocking stream, then
                      cudaStreamSynchronize (wall time of both); `*_enqueue` is
                      the time until cudaMemcpyAsync returned: near zero for
                      pinned memory, the whole copy (or most of it) for pageable
                      memory, which the runtime stages through its own buffer

in rounds; each round visits the allocators in a new random order (interleaved,
so drift of the machine hits them all alike). It reports medians of all copies,
GB/s (1e9 bytes), ratios to NumPy's default, and the spread of per-round medians.

It also times what an allocator costs before the first copy: in a fresh process
per allocator (repeated, interleaved), np.empty then fill of each size ("first":
the arena's extent is mapped, and locked or registered, there) and the same again
after the arrays were freed ("again", median of 5: a pinned arena keeps its
registered pages; NumPy's default maps and faults big arrays anew each time).

Without a CUDA runtime and a GPU it prints one line and exits 0.

Usage: python3 bench/gpu_copy.py [--sizes 1M,16M,256M,1G] [--rounds 7]
                                 [--first-rounds 3] [--out FILE] [--cudart PATH]
"""
import argparse
import atexit
import contextvars
import ctypes
import ctypes.util
import glob
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MODES = ["numpy", "plain", "lock", "pinned", "mallochost"]
OPS = ["h2d", "d2h", "h2d_async", "d2h_async"]
TAGS = {"plain": "gpubench_plain", "lock": "gpubench_lock", "pinned": "gpubench_pinned"}
ARENAS = {"plain": "plain", "lock": "locked", "pinned": "gpu"}
POLICY = """version: 1
default: general
arenas:
  general: {}
  plain: {}
  locked: {lock: true}
  gpu: {pinned: cuda}
rules:
  - {name: plain, match: {tag: gpubench_plain}, arena: plain}
  - {name: lock, match: {tag: gpubench_lock}, arena: locked}
  - {name: pinned, match: {tag: gpubench_pinned}, arena: gpu}
"""
H2D, D2H = 1, 2  # cudaMemcpyKind
MiB = 1 << 20


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def human(n):
    for unit, b in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= b and n % b == 0:
            return "%d %s" % (n // b, unit)
    return "%d B" % n


# ---- the CUDA runtime ------------------------------------------------------------------------

def cudart_candidates(explicit):
    if explicit:
        return [explicit]
    out = []
    if os.environ.get("DATAMEM_CUDART"):
        out.append(os.environ["DATAMEM_CUDART"])
    # The names datamem tries (runtime/os.c), then the wheels' and toolkit's folders.
    out += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    for d in sys.path:
        out += sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so*")))
        out += sorted(glob.glob(os.path.join(d, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    out += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    return out


def loaded_path(lib, fn):
    """The file a loaded library came from (/proc/self/maps), so datamem opens the same one."""
    addr = ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) >= 6:
                return parts[5]
    return None


class Cuda:
    def __init__(self, lib):
        self.lib = lib
        c_int, c_size, vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
        sig = {
            "cudaGetDeviceCount": [ctypes.POINTER(c_int)],
            "cudaSetDevice": [c_int],
            "cudaFree": [vp],
            "cudaMalloc": [ctypes.POINTER(vp), c_size],
            "cudaMallocHost": [ctypes.POINTER(vp), c_size],
            "cudaFreeHost": [vp],
            "cudaMemcpy": [vp, vp, c_size, c_int],
            "cudaMemcpyAsync": [vp, vp, c_size, c_int, vp],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaStreamSynchronize": [vp],
            "cudaDeviceSynchronize": [],
            "cudaRuntimeGetVersion": [ctypes.POINTER(c_int)],
            "cudaDriverGetVersion": [ctypes.POINTER(c_int)],
            "cudaPointerGetAttributes": [vp, vp],
            "cudaDeviceGetAttribute": [ctypes.POINTER(c_int), c_int, c_int],
        }
        for name, args in sig.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, c_int
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [c_int], ctypes.c_char_p

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError("%s: %s (%d)" % (what, self.lib.cudaGetErrorString(rc).decode(), rc))

    def int_out(self, fn, *args):
        v = ctypes.c_int()
        self.check(getattr(self.lib, fn)(ctypes.byref(v), *args), fn)
        return v.value

    def malloc(self, n):
        p = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(p), n), "cudaMalloc(%d)" % n)
        return p.value

    def malloc_host(self, n):
        p = ctypes.c_void_p()
        self.check(self.lib.cudaMallocHost(ctypes.byref(p), n), "cudaMallocHost(%d)" % n)
        return p.value

    def free_host(self, p):
        self.check(self.lib.cudaFreeHost(p), "cudaFreeHost")

    def stream(self):
        s = ctypes.c_void_p()
        self.check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreate")
        return s.value

    def memory_type(self, p):
        """cudaPointerGetAttributes' type: 0 unregistered (pageable), 1 host (pinned)."""
        # {int type; int device; void *dev, *host; ...}: CUDA 13 added fields to the
        # struct, so leave it room (a 32-byte buffer was overrun there).
        attrs = (ctypes.c_int * 128)()
        rc = self.lib.cudaPointerGetAttributes(attrs, p)
        if rc != 0:
            self.lib.cudaGetLastError()  # clear the sticky-free error of older runtimes
            return "error %d" % rc
        return {0: "pageable", 1: "pinned", 2: "device", 3: "managed"}.get(attrs[0], attrs[0])


def open_cuda(explicit):
    """(Cuda, path) or (None, why): a runtime that loads and sees at least one GPU."""
    why = "no libcudart found"
    for cand in cudart_candidates(explicit):
        try:
            lib = ctypes.CDLL(cand)
            lib.cudaGetDeviceCount
        except (OSError, AttributeError) as e:
            why = str(e)
            continue
        cuda = Cuda(lib)
        n = ctypes.c_int()
        rc = lib.cudaGetDeviceCount(ctypes.byref(n))
        if rc != 0 or n.value < 1:
            return None, "%s: cudaGetDeviceCount: %s (%d), %d devices" % (
                cand, lib.cudaGetErrorString(rc).decode(), rc, n.value)
        return cuda, loaded_path(lib, "cudaGetDeviceCount") or cand
    return None, why


# ---- host arrays -----------------------------------------------------------------------------

def handler_name(a):
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:
        from numpy.core.multiarray import get_handler_name
    while a.base is not None and isinstance(a.base, np.ndarray):
        a = a.base
    return get_handler_name(a)


class Host:
    """Makes uint8 arrays in one of the MODES."""

    def __init__(self, cuda, datamem):
        self.cuda, self.datamem = cuda, datamem
        self.owned = {}  # id(array) -> cudaMallocHost pointer

    def empty(self, mode, n):
        if mode == "numpy":  # a fresh context: NumPy's handler ContextVar at its default
            return contextvars.Context().run(np.empty, n, np.uint8)
        if mode == "mallochost":
            p = self.cuda.malloc_host(n)
            a = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p))
            self.owned[id(a)] = p
            return a
        with self.datamem.tag(TAGS[mode]):
            return np.empty(n, np.uint8)

    def free(self, mode, a):
        if mode == "mallochost":
            self.cuda.free_host(self.owned.pop(id(a)))

    def where(self, mode, a):
        if mode == "mallochost":
            return "cudaMallocHost"
        if mode == "numpy":
            return handler_name(a)
        return "datamem:" + str(self.datamem.arena_of(a))


# ---- the first-allocation child --------------------------------------------------------------

def first_touch(mode, sizes, again):
    """Runs in a fresh process: times np.empty and fill of each size, first and again."""
    cuda, path = open_cuda(os.environ["DATAMEM_CUDART"])
    cuda.check(cuda.lib.cudaFree(None), "cudaFree(0)")  # the context, outside the timings
    import datamem
    datamem.install(os.environ["GPU_COPY_POLICY"])
    host = Host(cuda, datamem)
    # Warm NumPy's fill, the fresh context and the tag path outside the arenas measured.
    contextvars.Context().run(np.empty, 16, np.uint8).fill(1)
    with datamem.tag("gpubench_warm"):
        np.empty(16, np.uint8).fill(1)
    out = {"first": {}, "again": {}}
    live = []
    for n in sizes:
        t0 = time.perf_counter()
        a = host.empty(mode, n)
        t1 = time.perf_counter()
        a.fill(1)
        t2 = time.perf_counter()
        out["first"][n] = {"empty": t1 - t0, "fill": t2 - t1}
        live.append(a)
    for a in live:
        host.free(mode, a)
    del live, a
    for n in sizes:
        runs = []
        for _ in range(again):
            t0 = time.perf_counter()
            a = host.empty(mode, n)
            t1 = time.perf_counter()
            a.fill(1)
            t2 = time.perf_counter()
            host.free(mode, a)
            del a
            t3 = time.perf_counter()
            runs.append({"empty": t1 - t0, "fill": t2 - t1, "free": t3 - t2})
        out["again"][n] = runs
    out["stats"] = arena_stats(datamem)
    print(json.dumps(out))


def arena_stats(datamem):
    s = datamem.stats()["arenas"]
    keys = ("pinned_bytes", "locked_bytes", "placement_errors")
    return {a: {k: s[a].get(k) for k in keys} for a in ARENAS.values() if a in s}


# ---- copies ----------------------------------------------------------------------------------

def reps_for(n):
    return max(3, min(30, (256 * MiB) // n))  # 30, 16, 3, 3 copies at 1M-1G


def time_copies(cuda, stream, dev, a, op, reps):
    lib = cuda.lib
    h, n = a.ctypes.data, a.nbytes
    kind = H2D if op.startswith("h2d") else D2H
    dst, src = (dev, h) if kind == H2D else (h, dev)
    total, enq = [], []
    for _ in range(reps):
        if op.endswith("async"):
            t0 = time.perf_counter()
            rc = lib.cudaMemcpyAsync(dst, src, n, kind, stream)
            t1 = time.perf_counter()
            rc2 = lib.cudaStreamSynchronize(stream)
            t2 = time.perf_counter()
            cuda.check(rc or rc2, "cudaMemcpyAsync")
            enq.append(t1 - t0)
            total.append(t2 - t0)
        else:
            t0 = time.perf_counter()
            rc = lib.cudaMemcpy(dst, src, n, kind)
            t1 = time.perf_counter()
            cuda.check(rc, "cudaMemcpy")
            total.append(t1 - t0)
    return total, enq


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def summarize(samples_by_round, n):
    flat = [x for r in samples_by_round for x in r]
    per_round = [statistics.median(r) for r in samples_by_round if r]
    med = statistics.median(flat)
    return {"median_s": med, "gbps": n / med / 1e9, "p10_s": pct(flat, 0.1),
            "p90_s": pct(flat, 0.9), "round_medians_s": per_round,
            "gbps_round_min": n / max(per_round) / 1e9, "gbps_round_max": n / min(per_round) / 1e9,
            "samples": len(flat)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,16M,256M,1G")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--first-rounds", type=int, default=3,
                    help="fresh processes per allocator for the first-allocation cost (0: skip)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "out", "gpu_copy.json"))
    ap.add_argument("--cudart", help="path of libcudart (default: DATAMEM_CUDART, then the "
                                     "names datamem tries, the CUDA wheels and /usr/local/cuda)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--first-touch", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    if args.first_touch:
        return first_touch(args.first_touch, sizes, 5)

    cuda, path = open_cuda(args.cudart)
    if cuda is None:
        print("gpu_copy: no CUDA runtime with a GPU (%s): nothing measured" % path)
        return 0
    os.environ["DATAMEM_CUDART"] = path  # datamem registers with this very library
    cuda.check(cuda.lib.cudaSetDevice(0), "cudaSetDevice")
    cuda.check(cuda.lib.cudaFree(None), "cudaFree(0)")

    import datamem
    tmp = tempfile.mkdtemp(prefix="gpu_copy_")
    atexit.register(shutil.rmtree, tmp, True)  # the policy lives until the process ends
    policy = os.path.join(tmp, "policy.yaml")
    with open(policy, "w") as f:
        f.write(POLICY)
    datamem.install(policy)
    rng = random.Random(args.seed)
    meta = describe(cuda, path, datamem, sizes, args)
    print("gpu_copy: %s, driver %s, CUDA runtime %s, %s" % (
        meta["gpu"].get("name"), meta["gpu"].get("driver"), meta["cuda_runtime"], path))

    # First allocation in fresh processes, interleaved.
    first = {m: [] for m in MODES}
    env = dict(os.environ, GPU_COPY_POLICY=policy, DATAMEM_CUDART=path)
    env.pop("DATAMEM_CONFIG", None)
    for r in range(args.first_rounds):
        order = MODES[:]
        rng.shuffle(order)
        for m in order:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--first-touch", m,
                                "--sizes", args.sizes], env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit("gpu_copy: first-touch child (%s) failed:\n%s" % (m, p.stderr))
            if p.stderr.strip():
                print(p.stderr.strip(), file=sys.stderr)
            first[m].append(json.loads(p.stdout.strip().splitlines()[-1]))
    first_summary = summarize_first(first, sizes)

    # Copies.
    host = Host(cuda, datamem)
    arrays = {}
    for m in MODES:
        for n in sizes:
            a = host.empty(m, n)
            a[:] = np.arange(n, dtype=np.uint64).astype(np.uint8) if n <= 16 * MiB else 1
            arrays[m, n] = a
    placement = {}
    for (m, n), a in arrays.items():
        placement["%s/%d" % (m, n)] = {
            "where": host.where(m, a), "start": cuda.memory_type(a.ctypes.data),
            "end": cuda.memory_type(a.ctypes.data + n - 1)}
    dev = cuda.malloc(max(sizes))
    stream = cuda.stream()
    verified = verify(cuda, host, arrays, dev, sizes)
    for a in arrays.values():  # warm-up: one copy each way per array
        for op in OPS:
            time_copies(cuda, stream, dev, a, op, 1)

    raw = {m: {n: {op: [] for op in OPS + ["h2d_async_enqueue", "d2h_async_enqueue"]}
               for n in sizes} for m in MODES}
    for r in range(args.rounds):
        order = MODES[:]
        rng.shuffle(order)
        for n in sizes:
            for m in order:
                for op in OPS:
                    total, enq = time_copies(cuda, stream, dev, arrays[m, n], op, reps_for(n))
                    raw[m][n][op].append(total)
                    if enq:
                        raw[m][n][op + "_enqueue"].append(enq)
        print("  round %d/%d done" % (r + 1, args.rounds), flush=True)

    results = {}
    for m in MODES:
        for n in sizes:
            for op, rounds in raw[m][n].items():
                results.setdefault(m, {}).setdefault(str(n), {})[op] = summarize(rounds, n)
    for m in MODES:  # ratios to NumPy's default: time ratio (below 1: faster)
        for n in sizes:
            for op in raw[m][n]:
                cell = results[m][str(n)][op]
                cell["time_vs_numpy"] = cell["median_s"] / results["numpy"][str(n)][op]["median_s"]
    doc = {"meta": meta, "placement": placement, "verified": verified,
           "arena_stats": arena_stats(datamem), "copies": results, "first_alloc": first_summary,
           "raw": {"copies": {m: {str(n): v for n, v in raw[m].items()} for m in raw},
                   "first_alloc": first}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print_tables(doc, sizes)
    print("wrote", args.out)
    return 0


def verify(cuda, host, arrays, dev, sizes):
    """Round trip of the patterned arrays: H2D from each mode, D2H into a NumPy array."""
    out = {}
    for m in MODES:
        n = min(sizes)
        a = arrays[m, n]
        back = np.zeros(n, np.uint8)
        cuda.check(cuda.lib.cudaMemcpy(dev, a.ctypes.data, n, H2D), "cudaMemcpy")
        cuda.check(cuda.lib.cudaMemcpy(back.ctypes.data, dev, n, D2H), "cudaMemcpy")
        out[m] = bool(np.array_equal(a, back))
    return out


def summarize_first(first, sizes):
    out = {}
    for m, runs in first.items():
        for n in sizes:
            k = str(n)
            if not runs:
                continue
            f = [r["first"][k]["empty"] + r["first"][k]["fill"] for r in runs]
            fe = [r["first"][k]["empty"] for r in runs]
            ag = [x["empty"] + x["fill"] for r in runs for x in r["again"][k]]
            out.setdefault(m, {})[k] = {
                "first_s": statistics.median(f), "first_min_s": min(f), "first_max_s": max(f),
                "first_empty_s": statistics.median(fe),
                "again_s": statistics.median(ag), "again_min_s": min(ag), "again_max_s": max(ag)}
    return out


def describe(cuda, path, datamem, sizes, args):
    gpu = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.max,"
                            "pcie.link.width.max,pcie.link.gen.current,pcie.link.width.current,memory.total",
                            "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
        name, drv, gen, width, cgen, cwidth, mem = [x.strip() for x in
                                                    q.splitlines()[0].split(",")]
        gpu = {"name": name, "driver": drv, "pcie_gen_max": gen, "pcie_width_max": width,
               "pcie_gen_current": cgen, "pcie_width_current": cwidth, "memory": mem}
    except Exception as e:  # noqa: BLE001 (metadata only)
        gpu = {"nvidia_smi": str(e)}
    for attr, key in ((85, "pci_bus"), (86, "pci_device"), (16, "multiprocessors")):
        try:
            gpu[key] = cuda.int_out("cudaDeviceGetAttribute", attr, 0)
        except RuntimeError:
            pass
    rt = cuda.int_out("cudaRuntimeGetVersion")
    dr = cuda.int_out("cudaDriverGetVersion")
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    thp = ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    return {"gpu": gpu, "cuda_runtime": "%d.%d" % (rt // 1000, rt % 1000 // 10),
            "cuda_driver_api": "%d.%d" % (dr // 1000, dr % 1000 // 10), "cudart": path,
            "python": sys.version.split()[0], "numpy": np.__version__,
            "datamem": getattr(datamem, "__version__", "?"), "datamem_file": datamem.__file__,
            "kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count(), "thp": thp,
            "memlock_limit": "unlimited" if memlock == resource.RLIM_INFINITY else memlock,
            "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")),
            "sizes": sizes, "rounds": args.rounds, "first_rounds": args.first_rounds,
            "reps": {str(n): reps_for(n) for n in sizes}, "seed": args.seed,
            "policy": POLICY, "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def print_tables(doc, sizes):
    c = doc["copies"]
    print("\nwhere each array lives (cudaPointerGetAttributes at its first and last byte):")
    for k, v in doc["placement"].items():
        print("  %-22s %-22s %-9s %s" % (k, v["where"], v["start"], v["end"]))
    print("round trip verified:", doc["verified"])
    w = 30
    head = "  %-8s" % "size" + "".join("%*s" % (w, m) for m in MODES)
    for op in OPS + ["h2d_async_enqueue", "d2h_async_enqueue"]:
        if op.endswith("enqueue"):
            print("\n%s: us until cudaMemcpyAsync returned (median), time vs numpy" % op[:9])
        else:
            print("\n%s: GB/s (median of all copies) [min-max of round medians], time vs numpy" % op)
        print(head)
        for n in sizes:
            row = "  %-8s" % human(n)
            for m in MODES:
                x = c[m][str(n)][op]
                if op.endswith("enqueue"):
                    cell = "%.1f us %.2fx" % (x["median_s"] * 1e6, x["time_vs_numpy"])
                else:
                    cell = "%.1f [%.1f-%.1f] %.2fx" % (
                        x["gbps"], x["gbps_round_min"], x["gbps_round_max"], x["time_vs_numpy"])
                row += "%*s" % (w, cell)
            print(row)
    f = doc["first_alloc"]
    if f:
        print("\nnp.empty + fill, ms: first in a fresh process, median [min-max] / again, median")
        print(head)
        for n in sizes:
            row = "  %-8s" % human(n)
            for m in MODES:
                x = f[m][str(n)]
                row += "%*s" % (w, "%.1f [%.1f-%.1f] / %.1f" % (
                    x["first_s"] * 1e3, x["first_min_s"] * 1e3, x["first_max_s"] * 1e3,
                    x["again_s"] * 1e3))
            print(row)


if __name__ == "__main__":
    sys.exit(main())
