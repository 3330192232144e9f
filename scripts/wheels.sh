#!/usr/bin/env bash
# The manylinux wheels, into dist/: CPython 3.10-3.14, each for x86_64 and aarch64,
# and free-threaded CPython 3.13t for x86_64 (no 3.13t interpreter for aarch64 can be
# made here to test one, and no wheel ships that no test ran),
# tagged manylinux_2_28 (glibc >= 2.28: RHEL 8, Debian bullseye, Ubuntu 20.04 and
# later; the floor NumPy's own wheels have). The extension links jemalloc, libyaml
# and libnuma statically (docs/building.md), so nothing is grafted: auditwheel
# checks each wheel against the tag and fails if a library outside glibc is needed.
#
# The compiler is zig cc (PyPI's `ziglang`, in .venv-wheels/tools) for the targets
# x86_64-linux-gnu.2.28 and aarch64-linux-gnu.2.28: one tool gives both the other
# architecture and glibc 2.28's symbol versions. Each target has its own Bazel
# output base (under ~/.cache/datamem-wheels), so this machine's own build
# (scripts/build.sh) keeps its cache; jemalloc is built there once per target.
#
# Interpreters (for the Python and NumPy headers, NumPy >= 2): python3.X on PATH,
# else pyenv's newest 3.X, else, for 3.14, Debian testing's in the root that
# scripts/roots.sh makes (needs root); for 3.13t the one scripts/ft-python.sh makes
# (needs root the first time), whose NumPy (2.4, free-threaded) its venv shares. The aarch64 wheels use the same headers
# (the same ABI on both architectures: docs/building.md).
#
#   bash scripts/wheels.sh                  build them all
#   bash scripts/wheels.sh --python 3.13    print this machine's interpreter for 3.13
#   DATAMEM_WHEEL_ARCHS=x86_64 DATAMEM_WHEEL_VERSIONS="3.11 3.13t" bash scripts/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=(${DATAMEM_WHEEL_VERSIONS:-3.10 3.11 3.12 3.13 3.14 3.13t})
ARCHS=(${DATAMEM_WHEEL_ARCHS:-x86_64 aarch64})
GLIBC=2.28
ZIG=ziglang==0.15.2

find_python() {  # find_python 3.13 -> path of a working, GIL-enabled CPython 3.13, or nothing
  local v=$1 c cands=()
  if [ "${v%t}" != "$v" ]; then  # 3.13t: free-threaded, only scripts/ft-python.sh's
    [ "$v" = 3.13t ] && bash scripts/ft-python.sh python 2>/dev/null
    return 0
  fi
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
if ! "$tools/bin/python" -c 'import ziglang' 2>/dev/null || [ ! -x "$tools/bin/auditwheel" ]; then
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel "$ZIG"
fi
zig=$("$tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')

cache=${DATAMEM_WHEELS_CACHE:-$HOME/.cache/datamem-wheels}/$(pwd -P | md5sum | cut -c1-12)
mkdir -p "$cache/zig-cache"

# cc_for ARCH -> the C compiler for ARCH-linux-gnu.2.28, for Bazel (CC) and for
# jemalloc's configure (DATAMEM_TARGET_CC): scripts/zig-cc.sh with its settings.
cc_for() {
  local w=$cache/cc-$1
  printf '#!/bin/sh\nexec %q %q %q %q "$@"\n' "$PWD/scripts/zig-cc.sh" "$zig" \
    "$1-linux-gnu.$GLIBC" "$cache/zig-cache" > "$w.tmp"
  chmod +x "$w.tmp"; mv "$w.tmp" "$w"
  echo "$w"
}

mkdir -p dist
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
built=()
for v in "${VERSIONS[@]}"; do
  py=$(find_python "$v"); root=""
  if [ -z "$py" ] && [ "$v" = 3.13t ] && [ "$(id -u)" -eq 0 ]; then
    py=$(bash scripts/ft-python.sh make)  # built once from Debian's source, cached
  fi
  if [ -n "$py" ]; then
    venv=$PWD/.venv-wheels/cp${v/./}
    if [ ! -x "$venv/bin/python" ]; then
      # free-threaded: NumPy 2.5 has no cp313t wheel; the interpreter's own 2.4 serves
      if [ "${v%t}" != "$v" ]; then "$py" -m venv --system-site-packages "$venv"; else "$py" -m venv "$venv"; fi
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "numpy>=2"
    py=$venv/bin/python
    np=$("$py" -c 'import numpy; print(numpy.__version__)')
  elif [ "$v" = 3.14 ] && [ "$(id -u)" -eq 0 ]; then
    root=$(bash scripts/roots.sh make forky)   # Debian testing: CPython 3.14, NumPy >= 2
    py=/opt/v/bin/python
    np=$(bash scripts/roots.sh run forky python -c 'import numpy; print(numpy.__version__)')
  else
    echo "wheels.sh: no CPython $v found, skipped"; continue
  fi
  for arch in "${ARCHS[@]}"; do
    if [ "${v%t}" != "$v" ] && [ "$arch" != x86_64 ]; then
      echo "wheels.sh: no CPython $v for $arch here to test a wheel with, skipped"; continue
    fi
    echo "--- CPython $v (${root:+$root:}$py), NumPy $np, $arch-linux-gnu.$GLIBC"
    cc=$(cc_for "$arch")
    bz=(bazel --output_base="$cache/bazel-$arch" --max_idle_secs=300)
    opts=(--symlink_prefix=/ --sandbox_writable_path="$cache/zig-cache")
    export DATAMEM_PYTHON=$py DATAMEM_PYTHON_ROOT=$root DATAMEM_TARGET=$arch-linux-gnu.$GLIBC \
           DATAMEM_TARGET_CC=$cc CC=$cc
    "${bz[@]}" build "${opts[@]}" //:wheel
    bin=$("${bz[@]}" info "${opts[@]}" bazel-bin 2>/dev/null)
    unset DATAMEM_PYTHON DATAMEM_PYTHON_ROOT DATAMEM_TARGET DATAMEM_TARGET_CC CC
    name=$(cat "$bin/datamem.whl.name")
    rm -f dist/datamem-*-"${name#*-*-}"   # the same Python and platform, any version
    cp -f "$bin/datamem.whl" "$tmp/$name"
    chmod 644 "$tmp/$name"
    # The wheel is tagged manylinux_2_28 (python_configure.bzl: the glibc it is built
    # against, and about the oldest it is tested on, scripts/test.sh), not the lower
    # tag auditwheel would allow (no symbol newer than 2.17). auditwheel checks it:
    # the glibc symbol versions fit that tag, and nothing outside glibc is needed.
    show=$("$tools/bin/auditwheel" show "$tmp/$name" 2>&1 | tr -s '\n ' '  ' || true)
    ok=$(sed -n 's/.*consistent with the following platform tag: "manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1 \2/p' <<<"$show")
    if [ -z "$ok" ] || [ "$(printf '%s\n' "${ok/ /.}" "$GLIBC" | sort -V | tail -1)" != "$GLIBC" ]; then
      echo "$show"; echo "wheels.sh: $name does not fit manylinux_${GLIBC/./_}" >&2; exit 1
    fi
    # whole or not at all: the main lane's tests glob dist/ while this runs (scripts/test.sh)
    cp -f "$tmp/$name" "dist/.$name.part"
    mv -f "dist/.$name.part" "dist/$name"
    echo "$name: auditwheel: its symbols fit manylinux_${ok/ /_}, tagged manylinux_${GLIBC/./_}"
    built+=("cp${v/./}-$arch")
  done
done
[ "${#built[@]}" -gt 0 ] || { echo "wheels.sh: no CPython ${VERSIONS[*]} found" >&2; exit 1; }
echo "wheels.sh: built ${built[*]}"
ls -1 dist/datamem-*-manylinux_*.whl
