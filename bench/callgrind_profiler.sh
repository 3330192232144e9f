#!/usr/bin/env bash
# Instructions the sampled allocation profiler (DATAMEM_PROFILE, default sample
# 512 KiB) adds to real jobs (bench/jobs/), counted by callgrind over the whole
# process, every thread included (the recording handlers' sampling checks, the
# stack captures of the samples, the writes to the profile file). Each job runs three times
# under the same policy:
#
#   imports  the job's libraries imported, the job not run
#   off      the job, no profile
#   on       the job with DATAMEM_PROFILE=DIR (the default rate)
#
# The profiler's cost is on - off; the job's own instructions are off - imports.
# The table also gives the cost per NumPy allocation (datamem.stats() of the
# "off" run) and per recorded sample, and the inclusive instructions of the
# profiler's own functions in the "on" run. Callgrind is deterministic up to the
# interpreter's hash seed (fixed here) and the kernel's timing (threads).
#
#   bash bench/callgrind_profiler.sh [JOBS...]   default: pandas_etl scipy_cg
#   SCALE=0.25 POLICY=configs/throughput.yaml (defaults)
#
# Needs valgrind (bench/setup.sh), the jobs' libraries and the installed wheel
# (not stripped). Results: bench/results/profiler-callgrind.md.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=("$@")
[ ${#JOBS[@]} -gt 0 ] || JOBS=(pandas_etl scipy_cg)
SCALE=${SCALE:-0.25}
POLICY=${POLICY:-configs/throughput.yaml}
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
  [ "$v" = imports ] && what=imports
  [ "$v" = on ] && env+=(DATAMEM_PROFILE="$OUT/prof.$job")
  "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$OUT/$job.$v.out" \
    "$PY" "$OUT/drive.py" "$PWD" "$job" "$SCALE" "$what" > "$OUT/$job.$v.json" 2>"$OUT/$job.$v.err" \
    || { cat "$OUT/$job.$v.err" >&2; exit 1; }
  callgrind_annotate --inclusive=yes --threshold=100 "$OUT/$job.$v.out" \
    > "$OUT/$job.$v.incl" 2>/dev/null
}

for job in "${JOBS[@]}"; do
  for v in imports off on; do
    echo "callgrind: $job $v" >&2
    run "$job" "$v"
  done
  python3 -c 'import sys, datamem._profile as p; print(len(p.load(sys.argv[1])))' \
    "$OUT/prof.$job" > "$OUT/$job.samples"
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

# The profiler's own functions (pyext recording handlers, service/profile.c);
# inclusive, so h_*_prof include the allocation they wrap.
PROF = ("h_malloc_prof", "h_calloc_prof", "h_realloc_prof", "h_free_prof", "prof_record",
        "prof_capture", "dm_prof_record_alloc", "dm_prof_record_free", "flush_locked")
print("callgrind: instructions the sampled profiler adds (policy %s, scale %s, sample 512 KiB)"
      % (policy, scale))
print("| job | imports | job (off - imports) | on - off | share of the job | NumPy allocations "
      "| per allocation | samples | per sample |")
print("|---|---|---|---|---|---|---|---|---|")
for job in jobs:
    ti, _ = totals("%s/%s.imports.incl" % (out, job))
    toff, _ = totals("%s/%s.off.incl" % (out, job))
    ton, fon = totals("%s/%s.on.incl" % (out, job))
    counts = json.load(open("%s/%s.off.json" % (out, job)))
    nalloc = counts["allocations"] + counts["reallocs"]
    samples = int(open("%s/%s.samples" % (out, job)).read())
    d, j = ton - toff, toff - ti
    print("| %s | %.3g | %.3g | %.3g | %.2f%% | %d | %.0f | %d | %.0f |" % (
        job, ti, j, d, 100.0 * d / j, nalloc, d / max(1, nalloc), samples, d / max(1, samples)))
    parts = ", ".join("%s %.3g" % (k, fon[k]) for k in PROF if k in fon)
    print("|  | inclusive in the on run: %s |||||||| " % (parts or "-"))
EOF
