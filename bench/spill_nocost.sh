#!/usr/bin/env bash
# "No cost when not needed": a spill arena in a policy, with nothing spilled to
# it, against the same policy without it. Two pairs:
#   dm-minimal       configs/minimal.yaml
#   dm-min-spill     the same + a spill arena that no rule routes to (its pager
#                    thread running: resident_max set)
#   dm-worker        minimal.yaml + worker_limit: 100% (live bytes counted: the
#                    slow path on every allocation, with or without spilling)
#   dm-worker-spill  the same + the spill arena and worker_spill (never reached:
#                    the jobs hold far less than the machine's memory)
# Measured: instructions (callgrind) per np.empty create+free (bench/callgrind.sh)
# and for one whole real job (fft_image at --scale 0.1, everything the process
# runs, the pager thread included), then wall time and peak RSS of the real
# jobs (python3 -m bench.jobs --quick, every job but the pandas 3 ones).
# On a shared machine trust the instruction counts; wall time is noise-bound.
#
#   bash bench/spill_nocost.sh [--no-jobs]
#
# Writes bench/results/spill_nocost.{json,txt}. Needs valgrind and the real
# jobs' libraries (bench/setup.sh) and the installed wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=pandas_etl,sklearn_pipeline,scipy_cg,fft_image,stencil_big,threadpool
SPILL=$(mktemp -d /var/tmp/datamem-spill-XXXXXX)  # mode 0700: the directory rule
POL=$(mktemp -d)
trap 'rm -rf "$POL"; rmdir "$SPILL"' EXIT
ARENA="  spill: {decay: {dirty: 1s}, backing: {dir: \"$SPILL\", resident_max: 128MiB}}"
cp configs/minimal.yaml "$POL/minimal.yaml"
{ cat configs/minimal.yaml; echo "$ARENA"; } > "$POL/min-spill.yaml"
{ cat configs/minimal.yaml; echo "worker_limit: 100%"; } > "$POL/worker.yaml"
{ cat configs/minimal.yaml; echo "$ARENA"; echo "worker_limit: 100%"; echo "worker_spill: spill"; } \
  > "$POL/worker-spill.yaml"
TXT=bench/results/spill_nocost.txt
: > "$TXT"
for p in minimal min-spill worker worker-spill; do
  python3 -m datamem check "$POL/$p.yaml" >/dev/null
  echo "== $p: per np.empty create+free" | tee -a "$TXT"
  N1=10000 N2=40000 POLICY="$POL/$p.yaml" bash bench/callgrind.sh 64 16384 262144 \
    | sed -n 2,5p | tee -a "$TXT"
  out="$POL/job.$p.out"
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 DATAMEM_CONFIG="$POL/$p.yaml" \
    valgrind --tool=callgrind --callgrind-out-file="$out" \
    python3 bench/jobs/child.py fft_image --scale 0.1 >/dev/null 2>"$POL/job.$p.err"
  echo "   whole fft_image --scale 0.1 process: $(sed -n 's/^summary: //p' "$out") instructions" \
    | tee -a "$TXT"
done
[ "${1:-}" = --no-jobs ] && exit 0
python3 -m bench.jobs --quick --only "$JOBS" --configs default,dm-minimal \
  --variant "dm-min-spill:DATAMEM_CONFIG=$POL/min-spill.yaml" \
  --variant "dm-worker:DATAMEM_CONFIG=$POL/worker.yaml" \
  --variant "dm-worker-spill:DATAMEM_CONFIG=$POL/worker-spill.yaml" \
  --out bench/results/spill_nocost.json | tee -a "$TXT"
