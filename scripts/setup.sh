#!/usr/bin/env bash
# One-shot, idempotent set-up for a fresh Debian bookworm machine: system packages
# (apt), Python test tools (pip). Safe to run again; does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(bazel-bootstrap libyaml-dev libnuma-dev dpkg-dev
          clang libclang-rt-14-dev valgrind numactl build-essential autoconf
          prometheus chromium   # real-Prometheus and headless-browser tests
          debootstrap qemu-user-static binfmt-support   # scripts/roots.sh: other Pythons, arm64
          iproute2   # ip netns: test_cluster_netns.py's hosts
          linux-perf   # bench/fault_map.py: the address of every page fault
          btrfs-progs xfsprogs)   # test_spill_cowfs.py: a full btrfs and XFS on a loop device

need_apt=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done

# jemalloc's source comes from Debian's source archive: add deb-src for the same suites.
src_list=/etc/apt/sources.list.d/datamem-src.sources
if [ ! -f "$src_list" ] && [ ! -f /etc/apt/sources.list.d/datamem-src.list ]; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then   # deb822 (bookworm images)
    sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src_list"
  else                                                     # one-line format
    grep -h '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | sed 's/^deb /deb-src /' > /etc/apt/sources.list.d/datamem-src.list
  fi
  need_update=1
fi

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
if [ "${#need_apt[@]}" -gt 0 ] || [ -n "${need_update:-}" ]; then
  $SUDO apt-get update -qq
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi
# Tests run their own Prometheus on a free loopback port; the packaged service is not used.
if [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
fi

python3 -m pip install -q --disable-pip-version-check -r requirements-dev.txt
