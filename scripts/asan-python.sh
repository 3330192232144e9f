#!/usr/bin/env bash
# Runs the Python tests against the extension built with ASan+UBSan, the
# sanitizer runtimes preloaded into the interpreter (leak detection off: CPython
# itself does not free everything at exit). Called by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build --config=asan //pyext:_ext.so //pyext:libdatamem_tls.so
bin=$(bazel info --config=asan bazel-bin 2>/dev/null)
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
mkdir "$pkg/datamem"
cp -R python/datamem/. "$pkg/datamem/"  # the package with its sub-packages (_cli, _stats, _profile)
find "$pkg/datamem" -name __pycache__ -prune -exec rm -rf {} +
cp configs/minimal.yaml "$pkg/datamem/"  # the preset tune measures, as the wheel ships it
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cp "$bin/pyext/_ext.so" "$pkg/datamem/_ext$suffix"
cp "$bin/pyext/libdatamem_tls.so" "$pkg/datamem/"
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# test_build inspects the installed wheel's symbols, not this build.
PYTHONPATH="$pkg" LD_PRELOAD="$preload" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  python3 -m pytest -q -s -p no:cacheprovider tests/python --deselect tests/python/house/test_build.py \
    --deselect tests/python/engine/test_activation.py::test_pth_hook_is_installed
