#!/usr/bin/env bash
# Free-threaded CPython 3.13t (PEP 703) for building and testing datamem without
# the GIL. Debian packages no free-threaded interpreter, so it is built once from
# the upstream tarball inside Debian trixie's python3.13 source package (the only
# 3.13 source on the reachable archive), configured --disable-gil, and kept under
# $DATAMEM_ROOTS/py313t (default /var/cache/datamem-roots, outside any clone),
# with NumPy (2.4.6 has a cp313t wheel) and the test tools installed into it. A
# clone makes its virtual environments from it with --system-site-packages
# (scripts/wheels.sh, scripts/wheel-venv-test.sh), so they need no download.
#
#   bash scripts/ft-python.sh make     make it if missing; print its python3.13t
#   bash scripts/ft-python.sh python   print its python3.13t (fails if not made)
#
# Needs the host's -dev packages for ssl, zlib, ctypes, bz2, lzma (scripts/setup.sh).
set -euo pipefail
ROOTS=${DATAMEM_ROOTS:-/var/cache/datamem-roots}
D=$ROOTS/py313t
# Written into the marker: an interpreter made by another recipe is made again.
RECIPE=1
# NumPy 2.5 has no cp313t wheel (pip would build it from the sdist, ~4 minutes);
# hypothesis >= 6.150 needs Rust crates that are not reachable from here.
PKGS=("numpy<2.5" pytest "hypothesis<6.150" prometheus_client)

die() { echo "ft-python.sh: $*" >&2; exit 1; }
PY=$D/bin/python3.13t
made() { [ "$(cat "$D/.datamem-root-ok" 2>/dev/null)" = "$RECIPE" ] && [ -x "$PY" ]; }

# The source tarball through a private apt state: trixie's deb-src beside the
# host's bookworm lists, touching no system apt state.
fetch_source() {
  local into=$1 s=$1/apt
  mkdir -p "$s/lists/partial" "$s/cache/archives/partial"
  sed -e 's/^Types: deb$/Types: deb-src/' -e 's/bookworm-security/trixie-security/' \
      -e 's/bookworm-updates/trixie-updates/' -e 's/Suites: bookworm/Suites: trixie/' \
      /etc/apt/sources.list.d/debian.sources > "$s/trixie.sources"
  local o=(-qq -o "Dir::State=$s" -o "Dir::State::Lists=$s/lists" -o "Dir::Cache=$s/cache"
           -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$s"
           -o Acquire::Check-Valid-Until=false)
  apt-get "${o[@]}" update >/dev/null || die "apt-get update (trixie deb-src) failed"
  (cd "$into" && apt-get "${o[@]}" source --download-only python3.13/trixie >/dev/null) ||
    die "apt-get source python3.13/trixie failed"
  ls "$into"/python3.13_*.orig.tar.xz >/dev/null 2>&1 || die "no python3.13 orig tarball in $into"
}

make_it() {
  made && { echo "$PY"; return 0; }
  mkdir -p "$ROOTS"
  exec 9>"$ROOTS/py313t.lock"
  flock 9  # another clone making it at the same time waits, then finds it made
  made && { echo "$PY"; return 0; }
  echo "ft-python.sh: building free-threaded CPython 3.13 into $D (about 6 minutes)" >&2
  rm -rf --one-file-system "$D"
  mkdir -p "$D/src"
  fetch_source "$D/src"
  tar -xf "$D"/src/python3.13_*.orig.tar.xz -C "$D/src"
  local src
  src=$(echo "$D"/src/Python-3.13*/)
  (cd "$src" && ./configure -q --disable-gil --prefix="$D" --with-ensurepip=install >"$D/build.log" 2>&1 &&
    make -s -j"$(nproc)" >>"$D/build.log" 2>&1 && make -s install >>"$D/build.log" 2>&1) ||
    { tail -20 "$D/build.log" >&2; die "building CPython 3.13t failed (log: $D/build.log)"; }
  rm -rf "$D/src"
  "$PY" -c 'import sys, ssl, zlib, ctypes, bz2, lzma; assert not sys._is_gil_enabled()' ||
    die "$PY lacks a module or has the GIL enabled"
  PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q "${PKGS[@]}" ||
    die "pip install into $D failed"
  echo "$RECIPE" > "$D/.datamem-root-ok"
  echo "$PY"
}

case ${1:-} in
  make) make_it ;;
  python) made || die "no free-threaded CPython in $D (bash scripts/ft-python.sh make)"; echo "$PY" ;;
  *) die "usage: ft-python.sh make | python" ;;
esac
