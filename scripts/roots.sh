#!/usr/bin/env bash
# Debian roots for the wheels this machine cannot run natively: CPython 3.14
# (Debian testing), arm64 (under qemu-user), and an older glibc (bullseye, 2.31).
# Each root is made once with debootstrap and kept under $DATAMEM_ROOTS
# (default /var/cache/datamem-roots, outside any clone), with a virtual
# environment /opt/v holding NumPy and the test tools. Needs root.
#
#   bash scripts/roots.sh make NAME           make the root if missing; print its path
#   bash scripts/roots.sh run NAME CMD...     run CMD in the root (chroot), with /proc,
#                                             /dev, a /tmp of its own and /tmp/datamem-src
#                                             (the clone, read-only) bound only while it runs
#   NAME: forky (x86_64, CPython 3.14), arm64 (bookworm arm64, CPython 3.11),
#         bullseye (x86_64, glibc 2.31, CPython 3.11 built from bookworm's source)
#
# Buster (glibc 2.28) is no longer on Debian's main archive and the archive
# server is not reachable from here, so bullseye is the oldest root made.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOTS=${DATAMEM_ROOTS:-/var/cache/datamem-roots}
APT_OPTS=(-o Acquire::Check-Valid-Until=false -o APT::Install-Recommends=false -qq)
# What the Python tests import (requirements-dev.txt less matplotlib, which only
# the benchmark plots use).
TEST_PKGS=(pytest hypothesis prometheus_client)
# What the tests run besides Python: nm and readelf (tests/python/house/test_build.py).
ROOT_DEBS=binutils
# Written into each root's marker: a root made by another recipe is made again.
RECIPE=2

die() { echo "roots.sh: $*" >&2; exit 1; }
made() { [ "$(cat "$1/.datamem-root-ok" 2>/dev/null)" = "$RECIPE" ]; }  # made by this recipe
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot, mount)"

host_pkgs() {  # debootstrap, and qemu-user for the arm64 root
  local need=() p
  for p in debootstrap "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
  done
  if [ "${#need[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
}

enable_qemu() {
  host_pkgs qemu-user-static binfmt-support
  mountpoint -q /proc/sys/fs/binfmt_misc || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
  update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || die "qemu-aarch64 is not registered with binfmt_misc"
}

# Mounts for one command in a root; undone by the caller's trap. `run` makes
# them in a mount namespace of its own with a /tmp of its own (a directory it
# made under $ROOTS, removed after), so that two clones testing in one root at
# once neither see nor unmount each other's clone, wheel or pytest directories.
MOUNTED=()
RUN_TMP=
bind_mounts() {
  local r=$1
  mkdir -p "$r/proc" "$r/dev" "$r/tmp"
  mount --bind /proc "$r/proc" && MOUNTED+=("$r/proc")
  mount --bind /dev "$r/dev" && MOUNTED+=("$r/dev")
  if [ -n "$RUN_TMP" ]; then
    mount --bind "$RUN_TMP" "$r/tmp" && MOUNTED+=("$r/tmp")
  fi
  mkdir -p "$r/tmp/datamem-src"
  mount --bind "$PWD" "$r/tmp/datamem-src" && MOUNTED+=("$r/tmp/datamem-src")
  mount -o remount,bind,ro "$r/tmp/datamem-src"
}
unmount_all() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTED[$i]}" 2>/dev/null || true; done
  MOUNTED=()
  if [ -n "$RUN_TMP" ]; then rm -rf --one-file-system "$RUN_TMP"; RUN_TMP=; fi
}

# rm -rf of a root, never through a mount: a run killed before its trap (or
# debootstrap's own /proc) can leave /dev or the clone bound inside it.
remove_root() {
  local d=$1 m
  [ -e "$d" ] || return 0
  while read -r m; do umount -l "$m" 2>/dev/null || true; done < <(
    awk -v d="$(realpath "$d")/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r)
  if awk -v d="$(realpath "$d")/" 'index($2, d) == 1' /proc/self/mounts | grep -q .; then
    die "$d still has mounts under it; not removed"
  fi
  rm -rf --one-file-system "$d"
}

in_root() {  # in_root ROOT CMD...: chroot with the mounts, a clean environment
  local r=$1; shift
  env -i PATH=/opt/v/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$(command -v chroot)" "$r" "$@"
}

make_root() {
  local name=$1 r=$ROOTS/$1
  made "$r" && { echo "$r"; return 0; }
  local arch=amd64 suite include=ca-certificates,$ROOT_DEBS
  case $name in
    forky) suite=testing ;;
    arm64) suite=bookworm; arch=arm64; include=$include,python3,python3-venv; enable_qemu ;;
    bullseye) suite=bullseye ;;
    *) die "unknown root '$name' (forky, arm64, bullseye)" ;;
  esac
  host_pkgs
  mkdir -p "$ROOTS"
  # Two clones making the same root at once would remove each other's .part:
  # the second waits here, then finds it made.
  exec 9>"$r.lock"
  flock 9
  made "$r" && { echo "$r"; return 0; }
  echo "roots.sh: making $r ($suite, $arch)" >&2
  remove_root "$r"; remove_root "$r.part"
  debootstrap --arch="$arch" --variant=minbase --include="$include" "$suite" "$r.part" \
    >"$ROOTS/$name.log" 2>&1 || { tail -20 "$ROOTS/$name.log" >&2; die "debootstrap $suite failed (log: $ROOTS/$name.log)"; }
  cp /etc/ssl/certs/ca-certificates.crt "$r.part/etc/ssl/certs/"
  [ -f /etc/pip.conf ] && cp /etc/pip.conf "$r.part/etc/pip.conf"
  trap unmount_all EXIT
  bind_mounts "$r.part"
  case $name in
    forky)
      in_root "$r.part" sh -c "apt-get ${APT_OPTS[*]} update && DEBIAN_FRONTEND=noninteractive apt-get ${APT_OPTS[*]} install -y python3.14 python3.14-venv python3.14-dev >/dev/null"
      in_root "$r.part" python3.14 -m venv /opt/v ;;
    arm64)
      in_root "$r.part" python3 -m venv /opt/v ;;
    bullseye)
      build_cpython "$r.part"
      in_root "$r.part" /opt/python/bin/python3 -m venv /opt/v ;;
  esac
  in_root "$r.part" /opt/v/bin/python -m pip install -q "numpy>=2" "${TEST_PKGS[@]}"
  unmount_all
  trap - EXIT
  echo "$RECIPE" > "$r.part/.datamem-root-ok"
  mv "$r.part" "$r"
  echo "$r"
}

# CPython 3.11 for the bullseye root (bullseye ships 3.9, older than any wheel):
# the upstream tarball inside bookworm's python3.11 source package, configured
# without optimisation passes and built with the root's own gcc and glibc 2.31.
build_cpython() {
  local r=$1 dl
  dl=$(mktemp -d)
  (cd "$dl" && apt-get source --download-only -qq python3.11/bookworm >/dev/null 2>&1) ||
    die "apt-get source python3.11 failed (run scripts/setup.sh: it adds deb-src entries)"
  mkdir -p "$r/opt/src"
  tar -xf "$dl"/python3.11_*.orig.tar.* -C "$r/opt/src"
  rm -rf "$dl"
  in_root "$r" sh -c "apt-get ${APT_OPTS[*]} update && DEBIAN_FRONTEND=noninteractive apt-get ${APT_OPTS[*]} install -y gcc make libc6-dev zlib1g-dev libffi-dev libssl-dev libbz2-dev liblzma-dev >/dev/null"
  echo "roots.sh: building CPython 3.11 in $r (a few minutes)" >&2
  in_root "$r" sh -c "cd /opt/src/Python-3.11* && ./configure -q --prefix=/opt/python >/dev/null &&
    make -s -j$(nproc) >/opt/src/make.log 2>&1 && make -s install >/dev/null 2>&1" ||
    { tail -20 "$r/opt/src/make.log" >&2 2>/dev/null; die "building CPython in $r failed"; }
  in_root "$r" /opt/python/bin/python3 -c 'import ssl, zlib, ctypes, bz2, lzma' || die "CPython in $r lacks a module"
  rm -rf "$r/opt/src"
}

cmd=${1:-}; shift || true
case $cmd in
  make) [ $# -eq 1 ] || die "usage: roots.sh make NAME"; make_root "$1" ;;
  run)
    [ $# -ge 2 ] || die "usage: roots.sh run NAME CMD..."
    if [ -z "${DATAMEM_ROOT_NS:-}" ]; then  # the mounts below in a namespace of this run's own
      DATAMEM_ROOT_NS=1 exec unshare --mount --propagation private bash "$PWD/scripts/roots.sh" run "$@"
    fi
    r=$ROOTS/$1; shift
    made "$r" ||
      die "no root $r, or one made by an older scripts/roots.sh (bash scripts/roots.sh make $(basename "$r"))"
    [ "$(basename "$r")" != arm64 ] || enable_qemu
    trap unmount_all EXIT
    RUN_TMP=$(mktemp -d "$ROOTS/tmp.$(basename "$r").XXXXXX")
    chmod 1777 "$RUN_TMP"
    bind_mounts "$r"
    in_root "$r" "$@" ;;
  *) die "usage: roots.sh make NAME | run NAME CMD..." ;;
esac
