#!/usr/bin/env bash
# Race detection as CPython's own free-threading CI does it: datamem's extension
# and runtime built with -fsanitize=thread (Bazel's --config=tsan, gcc) for the
# free-threaded CPython 3.13t built --with-thread-sanitizer (scripts/ft-python.sh
# make-tsan, cached outside the clone), running the threaded Python tests. Every
# process the tests start writes its reports under one directory; any report the
# suppressions (tools/tsan-ft.supp: code that is not datamem's, each entry
# justified there) do not cover fails the run, as does a failing test.
#
#   bash scripts/tsan-ft.sh [PYTEST ARGS]   default: the tests in TESTS below
#
# NumPy's cp313t wheel is not instrumented (nor is it in CPython's CI); TSan does
# not see its accesses, only ours and the interpreter's.
set -euo pipefail
cd "$(dirname "$0")/.."
TESTS=(tests/python/engine/test_free_threading.py)
py=$(bash scripts/ft-python.sh make-tsan)

# Its own Bazel output base: the interpreter differs from the clone's main build,
# whose cache then stays as it is.
cache=${DATAMEM_TSAN_CACHE:-$HOME/.cache/datamem-tsan-ft}/$(pwd -P | md5sum | cut -c1-12)
bz=(bazel --output_base="$cache/bazel" --max_idle_secs=300)
# --strip=never: symbols in the reports.
opts=(--config=tsan --strip=never --symlink_prefix=/)
# python_configure.bzl runs the interpreter: CPython's own reports are off there.
DATAMEM_PYTHON=$py TSAN_OPTIONS=report_bugs=0:exitcode=0 \
  "${bz[@]}" build "${opts[@]}" //pyext:_ext.so //pyext:libdatamem_tls.so
bin=$(DATAMEM_PYTHON=$py "${bz[@]}" info "${opts[@]}" bazel-bin 2>/dev/null)

# The package goes into a venv's site-packages with datamem.pth, as pip puts
# it, so that tests which start datamem from DATAMEM_CONFIG in a fresh
# interpreter run as they do anywhere else (.pth files are read only there).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/logs"
TSAN_OPTIONS=report_bugs=0 "$py" -m venv --system-site-packages --without-pip "$tmp/venv"
vpy=$tmp/venv/bin/python
site=$(TSAN_OPTIONS=report_bugs=0 "$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
mkdir "$site/datamem"
cp -R python/datamem/. "$site/datamem/"  # the package with its sub-packages (_cli, _stats, _profile)
find "$site/datamem" -name __pycache__ -prune -exec rm -rf {} +
cp configs/minimal.yaml "$site/datamem/"  # the preset tune measures, as the wheel ships it
cp python/_datamem_boot.py python/datamem.pth "$site/"
suffix=$(TSAN_OPTIONS=report_bugs=0 "$vpy" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cp "$bin/pyext/_ext.so" "$site/datamem/_ext$suffix"
cp "$bin/pyext/libdatamem_tls.so" "$site/datamem/"

# detect_deadlocks=0: a fork takes every arena's locks and jemalloc's, more than
# the 64 that TSan's lock-order detector can hold at once (it stops the process
# with "CHECK failed: ... n_all_locks_"); races are what this run looks for.
# exitcode=0: a report does not fail the process that has it (the tests' own
# subprocesses would fail for it); the reports are counted here instead. So a
# pytest that TSan ended early exits 0 as well: its JUnit file, written only at
# the end of the session, says whether the session finished.
rc=0
OPENBLAS_NUM_THREADS=1 \
  TSAN_OPTIONS="suppressions=$PWD/tools/tsan-ft.supp:log_path=$tmp/logs/tsan:exitcode=0:detect_deadlocks=0" \
  "$vpy" -m pytest -q -rfE -p no:cacheprovider --junitxml="$tmp/junit.xml" \
  "${@:-${TESTS[@]}}" || rc=$?
[ -s "$tmp/junit.xml" ] || { [ "$rc" -ne 0 ] || rc=70; echo "tsan-ft.sh: pytest did not finish its session" >&2; }

n=$(cat "$tmp/logs"/tsan.* 2>/dev/null | grep -cE '^(WARNING|FATAL): ThreadSanitizer|ThreadSanitizer: CHECK failed' || true)
if [ "$n" -gt 0 ]; then
  cat "$tmp/logs"/tsan.* | tee "$cache/reports.txt" >&2
  echo "tsan-ft.sh: $n ThreadSanitizer report(s) not suppressed (above; kept in $cache/reports.txt)" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || { echo "tsan-ft.sh: the tests failed (rc $rc)" >&2; exit "$rc"; }
echo "tsan-ft.sh: no ThreadSanitizer reports (suppressions: tools/tsan-ft.supp)"
