#!/usr/bin/env bash
# Installs the manylinux wheel for CPython X.Y (from scripts/wheels.sh, in dist/)
# into a fresh virtual environment of that interpreter and runs the Python tests
# there: a user's pip install on an interpreter other than the build machine's
# default. Usage: bash scripts/wheel-venv-test.sh 3.13 (or 3.13t: free-threaded,
# the tests under PYTHON_GIL=0)
set -euo pipefail
cd "$(dirname "$0")/.."
v=${1:?usage: wheel-venv-test.sh 3.13}
py=$(bash scripts/wheels.sh --python "$v")
pv=${v%t}  # the Python tag: cp313 for 3.13t too, whose ABI tag is cp313t
whl=$(ls dist/datamem-*-cp${pv/./}-cp${v/./}-manylinux_*_"$(uname -m)".whl 2>/dev/null | head -1)
[ -n "$whl" ] || { echo "wheel-venv-test.sh: no CPython $v manylinux wheel in dist/ (run scripts/wheels.sh)" >&2; exit 1; }
venv=.venv-wheel-test-cp${v/./}
rm -rf "$venv"
"$py" -m venv "$venv"
pkgs=(pytest hypothesis prometheus_client)
# free-threaded: NumPy 2.5 has no cp313t wheel (pip would build it, minutes);
# hypothesis >= 6.150 needs Rust crates that are not reachable here
[ "$pv" = "$v" ] || { pkgs=(pytest "hypothesis<6.150" prometheus_client "numpy>=2.1,<2.5"); export PYTHON_GIL=0; }
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$whl" "${pkgs[@]}"
echo "$whl in $venv: $("$venv/bin/python" -m datamem --version | tr '\n' ';')"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
