#!/usr/bin/env bash
# README command 2: set up, build, install, and run every test (the stages are
# listed in the README). Exits non-zero on the first failing stage; the last line
# counts the stages.
set -euo pipefail
cd "$(dirname "$0")/.."
nstages=0
stage() {  # each stage's start says how long the one before took, and the time so far
  [ "$nstages" -eq 0 ] || printf '(stage %d took %d s; %d s so far)\n' "$nstages" \
    $((SECONDS - stage_t0)) "$SECONDS"
  nstages=$((nstages + 1)); stage_t0=$SECONDS; printf '\n=== %s ===\n' "$*"
}
# set -e stops at the first failing stage; reaching the end means all passed.
lane_pid= lane_dir=
on_exit() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    if [ -n "$lane_pid" ] && kill -0 "$lane_pid" 2>/dev/null; then
      kill -- -"$lane_pid" 2>/dev/null || true
      wait "$lane_pid" 2>/dev/null || true
      printf '\n--- the second lane, stopped (its output so far) ---\n'; cat "$lane_dir/log"
    fi
    printf "\nstages: %d passed, 1 failed\n" $((nstages - 1))
  fi
  [ -z "$lane_dir" ] || rm -rf "$lane_dir"   # its log and stage count, made below
}
trap on_exit EXIT

stage "set-up"
bash scripts/setup.sh
stage "build and install the wheel"
bash scripts/build.sh

# The second lane: the stages that use only dist/ (this build's wheel, the
# manylinux wheels) and the Debian roots, never the main interpreter's install,
# run beside the main lane's stages below, and print once both are done. The
# run uses about 1.1 of the machine's 2 cores one lane at a time (40% idle over
# a minute of the NumPy 1.26 stage). Its stages are counted with the rest.
lane_dir=$(mktemp -d)
# Two commands in one root at once (two clones testing on one machine): each
# has a /tmp of its own and its own view of the clone (scripts/roots.sh).
roots_apart() {
  local out
  out=$( (bash scripts/roots.sh run forky sh -c 'echo first > /tmp/mine; sleep 3; cat /tmp/mine; test -f /tmp/datamem-src/README.md && echo clone' &
          sleep 1
          bash scripts/roots.sh run forky sh -c 'test ! -e /tmp/mine && echo second > /tmp/mine && cat /tmp/mine'
          wait) | tr '\n' ' ')
  [ "$out" = "second first clone " ] || { echo "roots.sh: two runs in one root share a /tmp or lose the clone: '$out'" >&2; return 1; }
}
other_lane() {
  nstages=0
  stage "Python tests under NumPy 1.26 (same wheel)"
  venv=.venv-numpy126
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "numpy>=1.26,<1.27" pytest \
    hypothesis prometheus_client
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps dist/datamem-*.whl
  "$venv/bin/python" -m pytest -q tests/python

  stage "Debian roots: testing (CPython 3.14), bookworm arm64 (qemu), bullseye (glibc 2.31) (scripts/roots.sh), free-threaded CPython 3.13t from trixie's source (scripts/ft-python.sh); all cached"
  for r in forky arm64 bullseye; do bash scripts/roots.sh make "$r"; done
  roots_apart
  bash scripts/ft-python.sh make

  stage "manylinux_2_28 wheels, CPython 3.10-3.14 (x86_64 and aarch64) and 3.13t (x86_64) (scripts/wheels.sh)"
  bash scripts/wheels.sh

  stage "the CPython 3.13 wheel: Python tests in a fresh virtual environment"
  bash scripts/wheel-venv-test.sh 3.13

  stage "the free-threaded CPython 3.13t wheel: Python tests under PYTHON_GIL=0 in a fresh virtual environment"
  bash scripts/wheel-venv-test.sh 3.13t

  stage "each x86_64 wheel this machine has a Python for: only glibc outside it (ldd), imports with system libyaml/libnuma hidden"
  host_wheels=()
  for w in dist/datamem-*-manylinux_*_x86_64.whl; do
    abi=$(basename "$w" | cut -d- -f3)
    [ ! -x ".venv-wheels/$abi/bin/python" ] || host_wheels+=("$w")
  done
  python3 tools/check_wheels.py "${host_wheels[@]}"

  stage "the CPython 3.14 wheel in Debian testing (NumPy 2.5): Python tests"
  bash scripts/root-test.sh forky tests/python

  stage "the aarch64 CPython 3.11 wheel under qemu (bookworm arm64): smoke tests"
  bash scripts/root-test.sh arm64 tests/python/house/test_packaging.py tests/python/house/test_build.py \
    tests/python/engine/test_handler.py tests/python/engine/test_processes.py

  stage "the x86_64 CPython 3.11 wheel on glibc 2.31 (bullseye): smoke tests"
  bash scripts/root-test.sh bullseye tests/python/house/test_packaging.py tests/python/house/test_build.py \
    tests/python/engine/test_handler.py tests/python/engine/test_processes.py
  printf '(stage %d took %d s; %d s so far)\n' "$nstages" $((SECONDS - stage_t0)) "$SECONDS"
  echo "$nstages" > "$lane_dir/count"
}
set -m  # the lane in a process group of its own: a failure here stops it whole
( other_lane ) > "$lane_dir/log" 2>&1 &
lane_pid=$!
set +m

stage "C unit tests"
bazel test //...

stage "C unit tests under ASan+UBSan"
bazel test --config=asan //policy/... //runtime/... //service/...

stage "runtime, stress, spill and service thread tests under TSan"
# The free-threaded CPython run (scripts/tsan-ft.sh) is not a stage: it does not
# fit the CI budget (docs/building.md, "Races under free-threaded CPython").
# (fork_test is not here: TSan supports no threads in a fork child; it skips.)
bazel test --config=tsan //runtime:runtime_test //runtime:bcache_test //runtime:arena_test \
  //runtime:tables_test //runtime:stress_test //runtime:tally_test \
  //runtime:spill_test //runtime:lend_test //service:http_test //service:textfile_test

stage "valgrind memcheck (the C tests that fit the time budget)"
# --vgdb=no: each test runs in its own PID namespace, so two valgrinds running at once
# are both pid 11 or so and their gdbserver FIFOs (/tmp/vgdb-pipe-...-<pid>-...) collide;
# one unlinks the other's and valgrind stops with "vgdb FIFO cannot be opened".
bazel test --run_under='valgrind -q --vgdb=no --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite' \
  //policy:units_test //policy:parse_test //policy:corpus_test //policy:schema_test \
  //runtime:runtime_test //runtime:bcache_test //runtime:arena_test //runtime:fork_test \
  //runtime:tables_test //runtime:bigblock_test //runtime:lend_test

if [ -x policy/fuzz.sh ]; then
  stage "policy fuzzer (libFuzzer, bounded)"
  policy/fuzz.sh "${DATAMEM_FUZZ_SECONDS:-30}"
fi

stage "Python tests (NumPy $(python3 -c 'import numpy; print(numpy.__version__)'))"
python3 -m pytest -q tests/python

stage "performance net: page faults, instructions and peak RSS against bench/budgets.json (bench/net.py)"
# Figures that repeat run to run (docs/performance.md, "The net"); a figure past
# its budget's tolerance fails. The jobs' libraries (pandas 3, scikit-learn;
# pyarrow and SciPy come with the main environment) go into a venv that sees the
# main site-packages (numpy, the installed wheel), as the engines stage does.
venv=.venv-net
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -c "import sys, pandas, sklearn, scipy, pyarrow; sys.exit(int(pandas.__version__.split('.')[0]) < 3)" 2>/dev/null ||
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "pandas>=3" "scikit-learn>=1.3" "scipy>=1.10" "pyarrow>=15"
"$venv/bin/python" bench/net.py

stage "Python tests with the extension built under ASan+UBSan"
bash scripts/asan-python.sh

stage "Dask, Ray and joblib workers (their own virtual environment)"
# Engines go into a venv that sees the main site-packages (numpy, pytest, the
# installed wheel), so the main interpreter and the ASan stage stay without them.
venv=.venv-engines
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "distributed>=2023.4" \
  "ray>=2.9" "joblib>=1.3"
"$venv/bin/python" -m pytest -q tests/python/cluster/test_engines.py tests/python/cluster/test_cluster_tasks.py \
  tests/python/cluster/test_cluster_netns.py

stage "NumPy's own test suite (slice) under datamem vs the default allocator"
python3 tools/numpy_suite.py   # the whole suite: python3 tools/numpy_suite.py --full

stage "the second lane: NumPy 1.26, the Debian roots, the manylinux wheels and their tests (run beside the stages above)"
lane_rc=0
wait "$lane_pid" || lane_rc=$?
lane_pid=
cat "$lane_dir/log"
[ "$lane_rc" -eq 0 ] || { printf '\nthe second lane failed (exit %d)\n' "$lane_rc"; exit 1; }
nstages=$((nstages - 1 + $(cat "$lane_dir/count")))  # its stages instead of its wait
printf '(%d s in all)\n' "$SECONDS"
printf '\nstages: %d passed, 0 failed\n' "$nstages"
