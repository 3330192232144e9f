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
# The variant "tsan" is the same interpreter built --with-thread-sanitizer, as
# CPython's own free-threading CI runs it, in $DATAMEM_ROOTS/py313t-tsan
# (scripts/tsan-ft.sh runs datamem's threaded tests on it):
#
#   bash scripts/ft-python.sh make-tsan | python-tsan
#
# It is built with gcc, as Bazel's --config=tsan builds datamem: interpreter and
# extension then share one TSan runtime (gcc's libtsan.so; clang would link its
# own into the interpreter), and gcc defines __SANITIZE_THREAD__, which turns on
# the runtime's annotations of jemalloc's hand-offs (runtime/alloc.h). Its
# build and the package installs run with TSan's reports off (CPython's own
# races, which its CI suppresses, are no concern of this build).
#
# Needs the host's -dev packages for ssl, zlib, ctypes, bz2, lzma (scripts/setup.sh).
set -euo pipefail
ROOTS=${DATAMEM_ROOTS:-/var/cache/datamem-roots}
D=$ROOTS/py313t
# Written into the marker: an interpreter made by another recipe is made again.
RECIPE=1
CONFIGURE=(--disable-gil)
BUILD_ENV=()  # the environment of configure, make, the self-check and pip
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

# The thread-sanitized variant of the same recipe.
tsan_variant() {
  D=$ROOTS/py313t-tsan PY=$ROOTS/py313t-tsan/bin/python3.13t RECIPE=tsan-1
  CONFIGURE+=(--with-thread-sanitizer)
  BUILD_ENV=(CC=gcc TSAN_OPTIONS=report_bugs=0:exitcode=0)
}

make_it() {
  made && { echo "$PY"; return 0; }
  mkdir -p "$ROOTS"
  exec 9>"$D.lock"
  flock 9  # another clone making it at the same time waits, then finds it made
  made && { echo "$PY"; return 0; }
  echo "ft-python.sh: building free-threaded CPython 3.13 (${CONFIGURE[*]}) into $D (about 6 minutes; thread-sanitized longer)" >&2
  rm -rf --one-file-system "$D"
  mkdir -p "$D/src"
  fetch_source "$D/src"
  tar -xf "$D"/src/python3.13_*.orig.tar.xz -C "$D/src"
  local src
  src=$(echo "$D"/src/Python-3.13*/)
  (cd "$src" && env "${BUILD_ENV[@]}" ./configure -q "${CONFIGURE[@]}" --prefix="$D" \
      --with-ensurepip=install >"$D/build.log" 2>&1 &&
    env "${BUILD_ENV[@]}" nice make -s -j"$(nproc)" >>"$D/build.log" 2>&1 &&
    env "${BUILD_ENV[@]}" nice make -s install >>"$D/build.log" 2>&1) ||
    { tail -20 "$D/build.log" >&2; die "building CPython 3.13t failed (log: $D/build.log)"; }
  rm -rf "$D/src"
  env "${BUILD_ENV[@]}" "$PY" -c 'import sys, ssl, zlib, ctypes, bz2, lzma; assert not sys._is_gil_enabled()' ||
    die "$PY lacks a module or has the GIL enabled"
  env "${BUILD_ENV[@]}" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q "${PKGS[@]}" ||
    die "pip install into $D failed"
  echo "$RECIPE" > "$D/.datamem-root-ok"
  echo "$PY"
}

case ${1:-} in
  make | python) ;;
  make-tsan | python-tsan) tsan_variant ;;
  *) die "usage: ft-python.sh make | python | make-tsan | python-tsan" ;;
esac
case $1 in
  make*) make_it ;;
  python*) made || die "no free-threaded CPython in $D (bash scripts/ft-python.sh ${1/python/make})"; echo "$PY" ;;
esac
