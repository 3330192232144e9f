#!/usr/bin/env bash
# zig cc as a gcc-like C compiler for one target, for Bazel's auto-configured C
# toolchain (CC) and jemalloc's configure (scripts/wheels.sh writes a two-line
# wrapper per target that calls this).
#
#   zig-cc.sh ZIG TARGET CACHE_DIR ARGS...      TARGET: e.g. aarch64-linux-gnu.2.28
#
# Drops what Bazel's toolchain adds for gcc and zig does not take, reading
# Bazel's params files (@file, one argument a line) to do so.
set -euo pipefail
zig=$1 target=$2 cache=$3
shift 3
export ZIG_GLOBAL_CACHE_DIR=$cache ZIG_LOCAL_CACHE_DIR=$cache
args=()
add() {
  case "$1" in
    -pass-exit-codes|-fuse-ld=*) return ;;  # gcc's; zig links with its own lld
    -lstdc++) return ;;                     # C only (zig would build libc++ for it)
    # zig's linker does not take it; the extension's version script (pyext/ext.lds,
    # `local: *`) hides the static libraries' symbols all the same.
    -Wl,--exclude-libs,ALL) return ;;
    # aarch64 uses TLS descriptors by default: what -mtls-dialect=gnu2 asks for on x86_64.
    -mtls-dialect=gnu2) if [[ $target == aarch64-* ]]; then return; fi ;;
  esac
  args+=("$1")
}
for a in "$@"; do
  if [[ $a == @* && -f ${a#@} ]]; then
    while IFS= read -r l || [ -n "$l" ]; do
      if [[ $l == \'*\' ]]; then l=${l:1:${#l}-2}; fi  # an argument with spaces is in single quotes
      add "$l"
    done < "${a#@}"
  else
    add "$a"
  fi
done
# -fno-sanitize=all: zig cc turns UBSan traps on in unoptimised (fastbuild) objects.
exec "$zig" cc -target "$target" -fno-sanitize=all "${args[@]}"
