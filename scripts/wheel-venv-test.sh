#!/usr/bin/env bash
# Installs the manylinux wheel for CPython X.Y (from scripts/wheels.sh, in dist/)
# into a fresh virtual environment of that interpreter and runs the Python tests
# there: a user's pip install on an interpreter other than the build machine's
# default. Usage: bash scripts/wheel-venv-test.sh 3.13
set -euo pipefail
cd "$(dirname "$0")/.."
v=${1:?usage: wheel-venv-test.sh 3.13}
py=$(bash scripts/wheels.sh --python "$v")
whl=$(ls dist/datamem-*-cp${v/./}-cp${v/./}-manylinux_*_"$(uname -m)".whl 2>/dev/null | head -1)
[ -n "$whl" ] || { echo "wheel-venv-test.sh: no CPython $v manylinux wheel in dist/ (run scripts/wheels.sh)" >&2; exit 1; }
venv=.venv-wheel-test-cp${v/./}
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$whl" pytest hypothesis prometheus_client
echo "$whl in $venv: $("$venv/bin/python" -m datamem --version | tr '\n' ';')"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
