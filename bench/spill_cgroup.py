"""A job whose live arrays outgrow its memory cgroup: NumPy's default, a RAM
policy, a RAM policy with a worker limit, and a spill policy; and the
sequential throughput of a spilled array against the disk's own.

The job holds N_ARRAYS arrays of 64 MiB (float64 filled from np.arange, each
times its index), in all HOLD x the cgroup's limit, then checks every array's
sum against the closed form. It runs in a fresh memory cgroup (v1
memory.limit_in_bytes where /sys/fs/cgroup/memory is mounted, else v2
memory.max) made here and removed after. Recorded per mode: the outcome
(completed with correct sums, MemoryError, or killed by a signal), wall time
(the job's own, and the process's), bytes the job wrote to storage
(/proc/self/io write_bytes), its peak RSS (VmHWM) and its RSS at the end
(VmRSS, resident file pages included), read by the job at its end, and the cgroup's peak usage (v1 memory.max_usage_in_bytes, v2
memory.peak; RSS plus page cache).

Throughput: one 4 GiB float64 array on the spill arena, written (one
np.ndarray.fill) and read (one sum), in the same cgroup, against
dd if=/dev/zero of=DIR/f bs=1M count=4096 oflag=direct (and iflag=direct back).

Needs root (a cgroup) and SPILL_DIR (default /var/tmp/datamem-spill-bench,
made 0700). Usage: python3 bench/spill_cgroup.py [--limit-mib 1024] [MODE ...]
  modes: default, ram, ram-limit, spill, throughput (no mode: all)
  writes bench/results/spill_cgroup.json
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "results", "spill_cgroup.json")
HOLD = 2.5
ARRAY_MIB = 64

JOB = r"""
import json, os, sys, time
import numpy as np
n, mib = int(sys.argv[1]), int(sys.argv[2])
elems = (mib << 20) // 8
t0 = time.monotonic()
held = []
try:
    for i in range(n):
        a = np.arange(elems, dtype=np.float64)
        a *= i + 1
        held.append(a)
    want = elems * (elems - 1) / 2
    ok = all(abs(float(a.sum()) - want * (i + 1)) <= 1e-9 * want * (i + 1)
             for i, a in enumerate(held))
    outcome = "completed" if ok else "wrong sums"
except MemoryError as e:
    outcome = "MemoryError after %d arrays" % len(held)
wall = time.monotonic() - t0
io = dict(line.split(": ") for line in open("/proc/self/io").read().split("\n") if line)
status = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith("Vm")}
hwm, rss = status["VmHWM"], status["VmRSS"]
extra = {}
try:
    import datamem
    s = datamem.stats()
    if s and "spill" in s["arenas"]:
        extra = {"spilled_arrays": sum(datamem.arena_of(a) == "spill" for a in held),
                 "backing_disk_bytes": s["arenas"]["spill"]["backing_disk_bytes"]}
except Exception:
    pass
print(json.dumps(dict(outcome=outcome, wall_s=round(wall, 2), arrays=len(held),
                      write_bytes=int(io["write_bytes"]), peak_rss_bytes=int(hwm) * 1024,
                      end_rss_bytes=int(rss) * 1024,
                      **extra)))
"""

THROUGHPUT = r"""
import json, sys, time
import numpy as np
import datamem
n = (int(sys.argv[1]) << 30) // 8
t0 = time.monotonic()
a = np.empty(n)
a.fill(1.0)
t1 = time.monotonic()
s = float(a.sum())
t2 = time.monotonic()
print(json.dumps(dict(arena=datamem.arena_of(a), ok=s == float(n), write_s=round(t1 - t0, 2),
                      read_s=round(t2 - t1, 2))))
"""


class Cgroup:
    """A fresh memory cgroup with a limit; v1 where mounted, else v2."""

    def __init__(self, limit):
        v1 = "/sys/fs/cgroup/memory"
        self.v1 = os.path.isdir(v1) and os.path.exists(os.path.join(v1, "memory.limit_in_bytes"))
        base = v1 if self.v1 else "/sys/fs/cgroup"
        self.path = os.path.join(base, "datamem-spill-bench-%d" % os.getpid())
        os.mkdir(self.path)
        self._write("memory.limit_in_bytes" if self.v1 else "memory.max", str(limit))
        if not self.v1:
            self._write("memory.swap.max", "0")

    def _write(self, leaf, value):
        with open(os.path.join(self.path, leaf), "w") as f:
            f.write(value)

    def peak(self):
        leaf = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        try:
            with open(os.path.join(self.path, leaf)) as f:
                return int(f.read())
        except OSError:
            return None

    def reset_peak(self):
        if self.v1:
            self._write("memory.max_usage_in_bytes", "0")

    def run(self, argv, env, timeout):
        """Runs argv inside the cgroup; returns (rc, stdout, stderr, wall_s)."""
        procs = os.path.join(self.path, "cgroup.procs")
        wrapped = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs] + argv
        t0 = time.monotonic()
        p = subprocess.Popen(wrapped, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        return p.returncode, out, err, time.monotonic() - t0

    def remove(self):
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def policies(spill_dir, tmp):
    ram = os.path.join(ROOT, "configs", "minimal.yaml")
    limit = os.path.join(tmp, "ram-limit.yaml")
    with open(limit, "w") as f:
        f.write("version: 1\ndefault: main\narenas:\n  main: {alignment: 64}\n"
                "worker_limit: 80%\n")
    spill = os.path.join(tmp, "spill.yaml")
    with open(os.path.join(ROOT, "configs", "spill.yaml")) as f:
        text = f.read().replace("/var/tmp/datamem-spill", spill_dir)
    with open(spill, "w") as f:
        f.write(text)
    everything = os.path.join(tmp, "all-spill.yaml")
    with open(everything, "w") as f:
        f.write(textwrap.dedent("""\
            version: 1
            default: main
            arenas:
              main: {{alignment: 64}}
              spill: {{decay: {{dirty: 1s}}, backing: {{dir: '{d}'}}}}
            rules:
              - {{name: big, match: {{size: {{min: 1MiB}}}}, arena: spill}}
            """).format(d=spill_dir))
    return {"default": None, "ram": ram, "ram-limit": limit, "spill": spill,
            "throughput": everything}


def env_for(config):
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    e.pop("DATAMEM_MEMORY_LIMIT", None)
    if config:
        e["DATAMEM_CONFIG"] = config
    return e


def run_job(cg, mode, config, n):
    cg.reset_peak()
    rc, out, err, wall = cg.run([sys.executable, "-c", JOB, str(n), str(ARRAY_MIB)],
                                env_for(config), timeout=1800)
    row = {"mode": mode, "returncode": rc, "process_wall_s": round(wall, 2),
           "cgroup_peak_bytes": cg.peak()}
    try:
        row.update(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        row["outcome"] = ("killed by signal %d" % -rc) if rc < 0 else "exit %d" % rc
        row["stderr_tail"] = err[-400:]
    return row


def dd(spill_dir, gib):
    f = os.path.join(spill_dir, "dd.bin")
    res = {}
    for what, args in (("write", ["if=/dev/zero", "of=" + f, "oflag=direct"]),
                       ("read", ["if=" + f, "of=/dev/null", "iflag=direct"])):
        r = subprocess.run(["dd", "bs=1M", "count=%d" % (gib << 10)] + args,
                           capture_output=True, text=True)
        m = re.search(r"copied, ([\d.]+) s", r.stderr)
        res[what + "_s"] = float(m.group(1)) if m else None
    os.unlink(f)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit-mib", type=int, default=1024)
    ap.add_argument("--gib", type=int, default=4, help="throughput: array size")
    ap.add_argument("modes", nargs="*")
    args = ap.parse_args()
    modes = args.modes or ["default", "ram", "ram-limit", "spill", "throughput"]
    spill_dir = os.environ.get("SPILL_DIR", "/var/tmp/datamem-spill-bench")
    os.makedirs(spill_dir, mode=0o700, exist_ok=True)
    limit = args.limit_mib << 20
    n = int(HOLD * limit) // (ARRAY_MIB << 20)
    results = {"limit_bytes": limit, "hold": HOLD, "arrays": n, "array_mib": ARRAY_MIB,
               "kernel": os.uname().release, "runs": []}
    tmp = tempfile.mkdtemp()
    pols = policies(spill_dir, tmp)
    cg = Cgroup(limit)
    try:
        for mode in modes:
            if mode == "throughput":
                cg.reset_peak()
                rc, out, err, _ = cg.run(
                    [sys.executable, "-c", THROUGHPUT, str(args.gib)], env_for(pols[mode]), 1800)
                row = {"mode": mode, "gib": args.gib, "returncode": rc}
                try:
                    row.update(json.loads(out.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    row["stderr_tail"] = err[-400:]
                row["dd"] = dd(spill_dir, args.gib)
            else:
                row = run_job(cg, mode, pols[mode], n)
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
    finally:
        cg.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
