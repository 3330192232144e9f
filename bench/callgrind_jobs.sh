#!/usr/bin/env bash
# User-space instructions of whole real jobs (bench/jobs/child.py) under NumPy's
# default and datamem's policies, counted by callgrind: repeatable where wall and
# CPU time on a shared machine are not (the same binary and input give the same
# count whatever else runs). One line per (job, config): JOB CONFIG INSTRUCTIONS,
# then each job's ratios to the default.
#
#   bash bench/callgrind_jobs.sh [SCALE] [JOB...]      default 0.1, every job
#   PY=/path/to/python bash bench/callgrind_jobs.sh    an interpreter with pandas 3 etc.
#
# One BLAS thread; each run whole-process (start-up included, the same for every
# config). Needs valgrind and the installed wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=${1:-0.1}
shift || true
JOBS=("$@")
[ ${#JOBS[@]} -gt 0 ] || JOBS=(pandas_etl pandas3_etl pandas3_arrow sklearn_pipeline scipy_cg
                             fft_image stencil_big threadpool)
PY=${PY:-$(python3 -c 'import sys; print(sys.executable)')}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
count() { # job config -> instructions
  local job=$1 cfg=$2 env=(env -u DATAMEM_CONFIG OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  [ "$cfg" = default ] || env+=(DATAMEM_CONFIG="$PWD/configs/$cfg.yaml")
  "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$OUT/$job-$cfg.out" \
    "$PY" bench/jobs/child.py "$job" --scale "$SCALE" >/dev/null 2>"$OUT/$job-$cfg.err" ||
    { tail -5 "$OUT/$job-$cfg.err" >&2; exit 1; }
  callgrind_annotate "$OUT/$job-$cfg.out" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
}
printf '%-18s %12s %12s %12s %9s %9s\n' job default minimal throughput minimal/ throughput/
for job in "${JOBS[@]}"; do
  d=$(count "$job" default); m=$(count "$job" minimal); t=$(count "$job" throughput)
  printf '%-18s %12s %12s %12s %9.4f %9.4f\n' "$job" "$d" "$m" "$t" \
    "$(echo "$m / $d" | bc -l)" "$(echo "$t / $d" | bc -l)"
done
