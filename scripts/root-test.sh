#!/usr/bin/env bash
# Installs the wheel from dist/ that fits a Debian root (scripts/roots.sh) into the
# root's virtual environment and runs Python tests there: the manylinux wheels on
# interpreters, glibcs and architectures this machine does not have.
#
#   bash scripts/root-test.sh NAME [PYTEST ARGS...]   default: all of tests/python
#   NAME: forky (CPython 3.14), arm64 (aarch64 under qemu), bullseye (glibc 2.31)
#
# The clone is bound read-only into the root; pytest runs from a scratch directory
# in the run's own /tmp there (scripts/roots.sh), gone after the run; the wheel
# goes in on standard input, since that /tmp exists only while the run does.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: root-test.sh NAME [PYTEST ARGS...]}
shift
bash scripts/roots.sh make "$name" >/dev/null
abi_arch=$(bash scripts/roots.sh run "$name" python -c \
  'import sys, platform; print("cp%d%d %s" % (sys.version_info[:2] + (platform.machine(),)))')
read -r abi arch <<<"$abi_arch"
whl=${DATAMEM_TEST_WHEEL:-$(ls dist/datamem-*-"$abi"-"$abi"-manylinux_*_"$arch".whl 2>/dev/null | head -1 || true)}
[ -n "$whl" ] || { echo "root-test.sh: no $abi $arch wheel in dist/ (run scripts/wheels.sh)" >&2; exit 1; }
[ $# -gt 0 ] || set -- tests/python
# Arguments name files in the clone: make them paths inside the root.
args=()
for a in "$@"; do
  if [ -e "$a" ] || [ -e "${a%%::*}" ]; then args+=("/tmp/datamem-src/$a"); else args+=("$a"); fi
done
bash scripts/roots.sh run "$name" sh -c '
  set -e
  w=$1; shift
  cat > "/tmp/$w"   # the wheel, on standard input
  python -m pip install -q --force-reinstall --no-deps "/tmp/$w"
  cd "$(mktemp -d /tmp/datamem-run.XXXXXX)"   # its own (0700): python puts its directory on sys.path
  python -c "import os, platform, multiprocessing as mp, numpy, datamem
print(\"%s: %s, Linux %s, CPython %s, NumPy %s, glibc %s, %d-byte pages, start method %s\" % (
    \"${w##*/}\", platform.machine(), os.uname().release, platform.python_version(),
    numpy.__version__, os.confstr(\"CS_GNU_LIBC_VERSION\").split()[1],
    os.sysconf(\"SC_PAGE_SIZE\"), mp.get_start_method()))"
  PYTHONDONTWRITEBYTECODE=1 exec python -m pytest -q -p no:cacheprovider "$@" </dev/null
' sh "${whl##*/}" "${args[@]}" <"$whl"
