"""What reserving a spill arena's disk blocks in whole 2 MiB chunks costs
(runtime/spill.c, "chunks"): per array size, N arrays made and written in a
spill arena, then freed; recorded: the bytes the arrays hold, the arena's
reserved bytes (`backing_reserved_bytes`, what `backing.max` counts) and its
file's disk bytes (`backing_disk_bytes`) while they live, and the fallocate
calls the process made (strace: reservations, mode 0; punches), per array.

Usage: python3 bench/spill_chunks.py [--dir DIR] [--n 32] [--out FILE]
  (DIR: default /var/tmp/datamem-spill-bench, made 0700; needs strace.)
  writes one JSON object: the installed datamem's numbers per size.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

MiB = 1 << 20
SIZES = [5 * MiB // 4, 5 * MiB // 2, 7 * MiB // 2, 5 * MiB, 7 * MiB, 16 * MiB, 64 * MiB]

INNER = r"""
import json, sys, numpy as np, datamem
size, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for i in range(n):
    a = np.empty(size // 8)
    a[:] = i
    held.append(a)
s = datamem.stats()["arenas"]["disk"]
print(json.dumps(dict(array_bytes=sum(a.nbytes for a in held),
                      reserved=s["backing_reserved_bytes"], disk=s["backing_disk_bytes"])))
"""


def one(size, n, d):
    with tempfile.TemporaryDirectory() as t:
        pol = os.path.join(t, "p.yaml")
        with open(pol, "w") as f:
            f.write("version: 1\ndefault: general\narenas:\n  general: {}\n"
                    "  disk: {decay: {dirty: 0}, backing: {dir: '%s'}}\n"
                    "rules:\n  - {name: big, match: {size: {min: 1MiB}}, arena: disk}\n" % d)
        trace = os.path.join(t, "trace")
        r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=fallocate", "-o", trace,
                            sys.executable, "-c", INNER, str(size), str(n)],
                           env=dict(os.environ, DATAMEM_CONFIG=pol), capture_output=True,
                           text=True, check=True, timeout=600)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        calls = open(trace).read()
    reserve = len(re.findall(r"fallocate\(\d+, 0,", calls))
    punch = len(re.findall(r"FALLOC_FL_PUNCH_HOLE", calls))
    out.update(size=size, n=n, fallocate_reserve=reserve, fallocate_punch=punch,
               reserve_per_array=reserve / n,
               extra_reserved_per_array=(out["reserved"] - out["array_bytes"]) / n)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/datamem-spill-bench")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    import datamem
    res = dict(kernel=os.uname().release, datamem=getattr(datamem, "__version__", "?"),
               dir=a.dir, rows=[one(s, a.n, a.dir) for s in SIZES])
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
