#!/bin/bash
# device run: thread scaling and whole-job wall times on 16 cores
# Copy the cp312 manylinux wheel (DATAMEM_WHEEL_ARCHS=x86_64 DATAMEM_WHEEL_VERSIONS=3.12 bash scripts/wheels.sh)
# and the peers (libjemalloc.so.2, libtcmalloc_minimal.so.4, libmimalloc.so.2 from Debian's
# packages, dpkg-deb -x) into .venv-devlibs/, carry it to the 16-core machine, and run this
# there from the repository root with OUT set to a folder for the results.
set -u
T0=$SECONDS; BUDGET=${BUDGET:-540}
left() { echo $((BUDGET - (SECONDS - T0))); }
r=$(mktemp -d /tmp/datamem-16core.XXXXXX) || exit 1   # its own: results, then read back
export r
{
echo "cores $(nproc)"; python3 -V; uname -r; cat /sys/kernel/mm/transparent_hugepage/enabled
python3 -m pip install -q --no-deps --no-index .venv-devlibs/datamem-0.1.0-cp312-*.whl || echo PIPFAIL
python3 -c "import numpy,pandas,sklearn,scipy;print('numpy',numpy.__version__,'pandas',pandas.__version__,'sklearn',sklearn.__version__,'scipy',scipy.__version__)"
python3 -c "import pyarrow;print('pyarrow',pyarrow.__version__)"
} > $r/env.txt 2>&1
export DATAMEM_BENCH_LIBDIR=$PWD/.venv-devlibs
for t in 1 2 4 8 16; do
  l=$(($(left) - 200)); [ $l -gt 20 ] || break
  timeout $l python3 bench/threads.py --threads $t --reps 2 --configs default,jemalloc,tcmalloc,mimalloc,dm-threads \
     --out $r/threads-T$t.json > $r/threads-T$t.txt 2>&1; echo "threads T=$t rc $? at $((SECONDS-T0)) s" >> $r/env.txt
done
for j in pandas_etl pandas3_etl fft_image sklearn_pipeline threadpool stencil_big scipy_cg; do
  l=$(($(left) - 15)); [ $l -gt 10 ] || break
  timeout $l python3 -m bench.jobs --only $j --reps 2 --configs default,dm-minimal,dm-throughput,tcmalloc,jemalloc \
     --out $r/jobs-$j.json > $r/jobs-$j.txt 2>&1; echo "jobs $j rc $? at $((SECONDS-T0)) s" >> $r/env.txt
done
python3 - <<'PY'
import glob, json, os
out = {}
for f in sorted(glob.glob(os.environ["r"] + "/*.json")):
    try: out[os.path.basename(f)] = json.load(open(f))
    except Exception as e: out[os.path.basename(f)] = repr(e)
json.dump(out, open(os.environ["OUT"] + "/device-16core.json", "w"))
PY
for f in $r/*.txt; do echo "=== $f"; cat $f; done > $OUT/device-16core.txt
cat $r/env.txt; for f in $r/*.txt; do echo "== $f"; tail -15 $f; done | tail -150
