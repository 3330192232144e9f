#!/usr/bin/env bash
# Issue 13's proof: for each real job of bench/jobs/, profile it (sampled),
# let `datamem suggest` write its policy, then benchmark NumPy's default,
# throughput.yaml (bench/policies/) and the suggested policy side by side (fresh process per run,
# interleaved, medians; python3 -m bench.jobs's discipline).
#
#   bash bench/suggest_proof.sh [--reps N] [--scale S]      (bench/setup.sh first)
#
# Writes bench/out/suggest/<job>.yaml (the policies) and suggest.json (results);
# prints one markdown table per job.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3
SCALE=0.4
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2 ;;
    --scale) SCALE=$2; shift 2 ;;
    *) echo "usage: $0 [--reps N] [--scale S]" >&2; exit 2 ;;
  esac
done
OUT=bench/out/suggest
rm -rf "$OUT" && mkdir -p "$OUT"
JOBS=(pandas_etl sklearn_pipeline scipy_cg fft_image stencil_big threadpool)
for job in "${JOBS[@]}"; do
  python3 -m datamem profile --out "$OUT/prof-$job" -- \
    python3 bench/jobs/child.py "$job" --scale "$SCALE" > /dev/null
  python3 -m datamem suggest "$OUT/prof-$job" > "$OUT/$job.yaml"
  python3 -m datamem check "$OUT/$job.yaml" > /dev/null
done
for job in "${JOBS[@]}"; do
  python3 -m bench.jobs --only "$job" --scale "$SCALE" --reps "$REPS" \
    --configs default,dm-throughput \
    --variant "dm-suggested:DATAMEM_CONFIG=$OUT/$job.yaml" \
    --out "$OUT/$job.json"
done
