"""What datamem's start-up hook costs an interpreter that does not use it.

Measures, with DATAMEM_CONFIG unset:
  1. site.addpackage() on datamem.pth alone (exactly the work the hook adds to
     start-up), median of many runs in one process;
  2. `python -c pass` wall time, median over fresh processes, for context;
  3. which modules the hook imported (must be none of datamem's or NumPy's);
  4. `python -c pass` CPU time (user + system, getrusage of the children),
     median of 10 fresh processes, with DATAMEM_CONFIG unset and set to
     configs/minimal.yaml (the hook must cost nothing until NumPy is imported).
Usage: python3 bench/startup.py [runs]
"""
import os
import resource
import site
import statistics
import subprocess
import sys
import time


def pth_dir():
    for d in site.getsitepackages():
        if os.path.exists(os.path.join(d, "datamem.pth")):
            return d
    sys.exit("datamem.pth not found: install datamem first (scripts/build.sh)")


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    os.environ.pop("DATAMEM_CONFIG", None)
    d = pth_dir()
    before = set(sys.modules)
    costs = []
    for _ in range(runs):
        t0 = time.perf_counter()
        site.addpackage(d, "datamem.pth", set())
        costs.append(time.perf_counter() - t0)
    imported = sorted(set(sys.modules) - before)
    env = dict(os.environ)
    walls = []
    for _ in range(min(runs, 40)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        walls.append(time.perf_counter() - t0)
    print("datamem.pth processing (site.addpackage): median %.1f us, max %.1f us over %d runs"
          % (statistics.median(costs) * 1e6, max(costs) * 1e6, runs))
    print("python -c pass: median %.1f ms over %d runs" % (statistics.median(walls) * 1e3, len(walls)))
    print("modules imported by the hook: %s" % (imported or "none"))
    policy = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "minimal.yaml")
    for what, extra in (("DATAMEM_CONFIG unset", {}), ("DATAMEM_CONFIG set", {"DATAMEM_CONFIG": policy})):
        print("python -c pass CPU, %s: median %.1f ms over 10 runs"
              % (what, statistics.median(cpu_times(dict(env, **extra), 10)) * 1e3))


def cpu_times(env, runs):
    """User + system CPU seconds of each of `runs` fresh `python -c pass`."""
    out = []
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return out


if __name__ == "__main__":
    main()
