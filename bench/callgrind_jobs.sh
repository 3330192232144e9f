#!/usr/bin/env bash
# User-space instructions of whole real jobs (bench/jobs/child.py) under NumPy's
# default and datamem's minimal.yaml (and any bench/policies/NAME.yaml named in
# POLICIES), counted by callgrind: repeatable where wall and
# CPU time on a shared machine are not (the same binary and input give the same
# count whatever else runs). One line per (job, config): JOB CONFIG INSTRUCTIONS,
# then each job's ratios to the default.
#
#   bash bench/callgrind_jobs.sh [SCALE] [JOB...]      default 0.1, every job
#   PY=/path/to/python bash bench/callgrind_jobs.sh    an interpreter with pandas 3 etc.
#   POLICIES="minimal throughput" bash bench/callgrind_jobs.sh   more policies
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
  local policy="$PWD/configs/$cfg.yaml"
  [ -e "$policy" ] || policy="$PWD/bench/policies/$cfg.yaml"
  [ "$cfg" = default ] || env+=(DATAMEM_CONFIG="$policy")
  "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$OUT/$job-$cfg.out" \
    "$PY" bench/jobs/child.py "$job" --scale "$SCALE" >/dev/null 2>"$OUT/$job-$cfg.err" ||
    { tail -5 "$OUT/$job-$cfg.err" >&2; exit 1; }
  callgrind_annotate "$OUT/$job-$cfg.out" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
}
read -r -a POLS <<< "${POLICIES:-minimal}"
printf '%-18s %12s' job default
for p in "${POLS[@]}"; do printf ' %12s' "$p"; done
for p in "${POLS[@]}"; do printf ' %12s' "$p/"; done
printf '\n'
for job in "${JOBS[@]}"; do
  d=$(count "$job" default); counts=()
  for p in "${POLS[@]}"; do counts+=("$(count "$job" "$p")"); done
  printf '%-18s %12s' "$job" "$d"
  for c in "${counts[@]}"; do printf ' %12s' "$c"; done
  for c in "${counts[@]}"; do printf ' %12.4f' "$(echo "$c / $d" | bc -l)"; done
  printf '\n'
done
