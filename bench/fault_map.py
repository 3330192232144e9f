"""Where a job's page faults land: datamem's arenas, glibc's heap, the rest.

    python3 bench/fault_map.py --python PY [--policy configs/minimal.yaml] \\
        [--job pandas3_arrow] [--scale 0.5] [--out F.json]

Runs one job of bench/jobs in a child with hugepages off for the process
(`PR_SET_THP_DISABLE`, so every fault is one 4 KiB page the kernel zeroes) under
`perf record -c 1 -e page-faults -d`, which records the address of every fault
of the child and its threads; as the job ends, the child writes its memory map,
each mapping marked with whether datamem owns it (`datamem.arena_of` of an
array at an address in it). Each fault is put in the mapping that held its address at
the end:

- `datamem`: datamem's arenas (NumPy's array data under a policy);
- `heap`: glibc's heap (`[heap]`: pandas', Python's and, under NumPy's default,
  the arrays up to glibc's mmap threshold);
- `anon>=1G`: other anonymous mappings of 1 GiB or more (pyarrow's memory pool
  reserves one);
- `anon`: the other anonymous mappings (glibc's mapped chunks still live,
  Python's arenas, thread stacks);
- `files`: libraries and other files; `gone`: addresses unmapped before the end
  (glibc's mapped chunks, among them NumPy's arrays under the default).

The counts are the child's own, so they repeat from run to run whatever else
the machine runs. Needs `perf` (linux-perf) and the right to record page-fault
events (root, or perf_event_paranoid <= 1). Prints one JSON object.
"""
import argparse
import bisect
import collections
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in the child: the job as bench/jobs/child.py runs it, then the map.
CHILD = r"""
import atexit, ctypes, os, runpy, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
out, root = sys.argv[1], sys.argv[2]

def dump():
    owner = None
    if "datamem" in sys.modules:
        import numpy as np
        from datamem import arena_of
        def owner(a):
            return arena_of(np.ctypeslib.as_array((ctypes.c_char * 1).from_address(a)))
    with open("/proc/self/maps") as f, open(out, "w") as g:
        for line in f:
            lo = int(line.split("-", 1)[0], 16)
            g.write("%d %s" % (owner is not None and owner(lo) is not None, line))

atexit.register(dump)
sys.path.insert(0, os.path.join(root, "bench", "jobs"))
sys.argv = [os.path.join(root, "bench", "jobs", "child.py")] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

PLACES = ["datamem", "heap", "anon>=1G", "anon", "files", "gone"]


def read_maps(lines):
    """[(lo, hi, place)] sorted, from the child's marked map lines."""
    out = []
    for line in lines:
        f = line.split()
        if len(f) < 6:
            continue
        ours, (lo, hi), perms = f[0] == "1", (int(x, 16) for x in f[1].split("-")), f[2]
        name = f[6] if len(f) > 6 else ""
        if ours:
            place = "datamem"
        elif name == "[heap]":
            place = "heap"
        elif name.startswith("/") or name.startswith("[v"):
            place = "files"
        else:
            place = "anon>=1G" if hi - lo >= 1 << 30 else "anon"
        out.append((lo, hi, place))
    return sorted(out)


def classify(addrs, maps):
    """Counts of the fault addresses per place (PLACES)."""
    los = [m[0] for m in maps]
    c = collections.Counter({p: 0 for p in PLACES})
    for a in addrs:
        i = bisect.bisect_right(los, a) - 1
        c[maps[i][2] if i >= 0 and a < maps[i][1] else "gone"] += 1
    return dict(c)


def run(python, policy, job, scale):
    env = dict(os.environ)
    env.pop("DATAMEM_CONFIG", None)
    if policy:
        env["DATAMEM_CONFIG"] = os.path.abspath(policy)
    # A preloaded library (a sanitizer's runtime) is the job's, not perf's
    preload = env.pop("LD_PRELOAD", None)
    child = (["env", "LD_PRELOAD=" + preload] if preload else []) + [python]
    with tempfile.TemporaryDirectory(prefix="fault_map.") as d:
        maps, data = os.path.join(d, "maps"), os.path.join(d, "perf.data")
        p = subprocess.run(["perf", "record", "-q", "-c", "1", "-e", "page-faults", "-d", "-o", data] +
                           child + ["-c", CHILD, maps, ROOT, job, "--scale", str(scale)],
                           env=env, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit("fault_map: %s %s failed:\n%s" % (python, job, p.stderr[-2000:]))
        res = json.loads(p.stdout.strip().splitlines()[-1])
        addrs = subprocess.run(["perf", "script", "-i", data, "-F", "addr"], env=env,
                               capture_output=True, text=True, check=True).stdout.split()
        with open(maps) as f:
            places = classify((int(a, 16) for a in addrs), read_maps(f))
    return {"job": job, "policy": policy, "faults": len(addrs), "job_faults": res.get("faults"),
            "maxrss_mb": res.get("maxrss_mb"), "handler": res.get("handler"), "places": places}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--policy", help="a policy file; none: NumPy's default")
    ap.add_argument("--job", default="pandas3_arrow")
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    text = json.dumps(run(a.python, a.policy, a.job, a.scale))
    if a.out:
        with open(a.out, "w") as f:
            print(text, file=f)
    print(text)


if __name__ == "__main__":
    main()
