#!/usr/bin/env bash
# Instructions the sampled allocation profiler (DATAMEM_PROFILE, default sample
# 512 KiB) adds to real jobs (bench/jobs/), counted by callgrind over the whole
# process, every thread included (the recording handlers' sampling checks, the
# stack captures of the samples, the writes to the profile file). Each job runs
# under the same policy as:
#
#   imports     the job's libraries imported, the job not run (twice)
#   imports-on  the same with DATAMEM_PROFILE=DIR (the default rate, 512 KiB)
#   off         the job, no profile
#   on          the job with DATAMEM_PROFILE=DIR
#
# The job's own instructions are off - imports; the profiler's start-up (its
# Python module and what it imports, the file, the exit flush) imports-on -
# imports; its cost while the job runs (on - imports-on) - (off - imports). The
# table also gives that per NumPy allocation (datamem.stats() of the "off" run)
# and per recorded sample, and prof_record's inclusive instructions (a sample's
# stack capture and record). Callgrind is deterministic up to the interpreter's
# hash seed (fixed here) and thread timing: the two `imports` runs differ by the
# noise floor.
#
#   bash bench/callgrind_profiler.sh [JOBS...]   default: pandas_etl scipy_cg
#   SCALE=0.25 POLICY=bench/policies/throughput.yaml (defaults: the policy the
#   results were measured under, three arenas)
#
# Needs valgrind (bench/setup.sh), the jobs' libraries and the installed wheel
# (not stripped). Results: bench/results/profiler-callgrind.md.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=("$@")
[ ${#JOBS[@]} -gt 0 ] || JOBS=(pandas_etl scipy_cg)
SCALE=${SCALE:-0.25}
POLICY=${POLICY:-bench/policies/throughput.yaml}
PY=$(python3 -c 'import sys; print(sys.executable)')  # not a pyenv shim script
command -v valgrind >/dev/null || { echo "valgrind missing: bash bench/setup.sh" >&2; exit 1; }
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

cat > "$OUT/drive.py" <<'EOF'
"""python drive.py ROOT JOB SCALE run|imports: imports the job's libraries, runs
the job or not, prints datamem's allocation counts."""
import importlib, json, os, sys
root, job, scale, what = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
sys.path[:0] = [os.path.join(root, "bench", "jobs"), os.path.join(root, "bench")]
from child import PRELOAD  # the libraries each job imports before its clock starts
for m in PRELOAD.get(job, []):
    importlib.import_module(m)
mod = importlib.import_module(job)
if what == "run":
    mod.run(scale)
import datamem
s = datamem.stats()
print(json.dumps({k: sum(a[k] for a in s["arenas"].values())
                  for k in ("allocations", "frees", "reallocs", "bytes_requested")}))
EOF

run() { # job variant
  local job=$1 v=$2 what=run
  local env=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE -u LD_PRELOAD -u DATAMEM_PROFILE
             -u DATAMEM_PROFILE_SAMPLE OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
             PYTHONHASHSEED=0 DATAMEM_CONFIG="$POLICY")
  case $v in imports*) what=imports ;; esac
  case $v in *on) env+=(DATAMEM_PROFILE="$OUT/prof.$job.$v") ;; esac
  "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$OUT/$job.$v.out" \
    "$PY" "$OUT/drive.py" "$PWD" "$job" "$SCALE" "$what" > "$OUT/$job.$v.json" 2>"$OUT/$job.$v.err" \
    || { cat "$OUT/$job.$v.err" >&2; exit 1; }
  callgrind_annotate --inclusive=yes --threshold=100 "$OUT/$job.$v.out" \
    > "$OUT/$job.$v.incl" 2>/dev/null
}

for job in "${JOBS[@]}"; do
  for v in imports imports2 imports-on off on; do
    echo "callgrind: $job $v" >&2
    run "$job" "$v"
  done
  python3 -c 'import sys, datamem._profile.read as p; print(len(p.load(sys.argv[1])))' \
    "$OUT/prof.$job.on" > "$OUT/$job.samples"
done

python3 - "$OUT" "$SCALE" "$POLICY" "${JOBS[@]}" <<'EOF'
import json, re, sys
out, scale, policy, jobs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
TOTAL = re.compile(r"^\s*([\d,]+)\s+\(100\.0%\)\s+PROGRAM TOTALS")
LINE = re.compile(r"^\s*([\d,]+)\s+\([^)]*\)\s+(?:\*\s+)?(.*?):([A-Za-z_][\w.]*)\s")

def totals(path):
    d, total = {}, None
    for line in open(path):
        m = TOTAL.match(line)
        if m:
            total = int(m.group(1).replace(",", ""))
        m = LINE.match(line)
        if m:
            d[m.group(3)] = max(d.get(m.group(3), 0), int(m.group(1).replace(",", "")))
    return total, d

print("callgrind: instructions the sampled profiler adds (policy %s, scale %s, sample 512 KiB)"
      % (policy, scale))
print("| job | job (off - imports) | noise (imports twice) | profiler start-up | profiler during "
      "the job | share of the job | NumPy allocations | per allocation | samples | "
      "prof_record |")
print("|---|---|---|---|---|---|---|---|---|---|")
for job in jobs:
    t = {v: totals("%s/%s.%s.incl" % (out, job, v)) for v in
         ("imports", "imports2", "imports-on", "off", "on")}
    counts = json.load(open("%s/%s.off.json" % (out, job)))
    nalloc = counts["allocations"] + counts["reallocs"]
    samples = int(open("%s/%s.samples" % (out, job)).read())
    j = t["off"][0] - t["imports"][0]
    start = t["imports-on"][0] - t["imports"][0]
    during = (t["on"][0] - t["imports-on"][0]) - j
    print("| %s | %.4g | %+d | %.3g | %.3g | %.2f%% | %d | %.0f | %d | %.3g |" % (
        job, j, t["imports2"][0] - t["imports"][0], start, during, 100.0 * during / j, nalloc,
        during / max(1, nalloc), samples, t["on"][1].get("prof_record", 0)))
EOF
