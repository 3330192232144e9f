#!/usr/bin/env bash
# Instructions per np.empty create/destroy (one malloc + one free through NumPy's
# NEP 49 handler), counted exactly by callgrind: NumPy's default allocator vs
# datamem, and for datamem how many are jemalloc's (its entry points, inclusive;
# none on a block-cache hit) and how many are datamem's dispatch (h_malloc/h_free
# inclusive minus jemalloc's). The target: dispatch <= 20 instructions on
# top of one jemalloc call.
#
#   bash bench/callgrind.sh [SIZES...]      default sizes: 64 16384 262144
#   POLICY=bench/policies/throughput.yaml bash bench/callgrind.sh 64
#
# Each measurement is the difference of two runs (N2 and N1 iterations of
# `np.empty(size, np.uint8)` in a Python loop), divided by N2 - N1, so start-up
# allocations cancel out. Only PyDataMem_UserNEW/PyDataMem_UserFREE and what they
# call are collected (--toggle-collect). Needs valgrind (bench/setup.sh) and the
# installed wheel (its .so keeps its symbols: `file` says "not stripped").
# The sampled profiler's cost on whole real jobs: bench/callgrind_profiler.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(64 16384 262144)
POLICY=${POLICY:-configs/minimal.yaml}
N1=${N1:-20000}
N2=${N2:-120000}
PY=$(python3 -c 'import sys; print(sys.executable)')  # not a pyenv shim script
command -v valgrind >/dev/null || { echo "valgrind missing: bash bench/setup.sh" >&2; exit 1; }
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

cat > "$OUT/loop.py" <<'EOF'
import sys
import numpy as np
n, size = int(sys.argv[1]), int(sys.argv[2])
u = np.uint8
for _ in range(n):
    np.empty(size, u)
EOF

run() { # config size n
  local cfg=$1 size=$2 n=$3
  local env=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE -u DATAMEM_CONFIG
             -u LD_PRELOAD OPENBLAS_NUM_THREADS=1)
  [ "$cfg" = datamem ] && env+=(DATAMEM_CONFIG="$POLICY")
  "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$OUT/$cfg.$size.$n.out" \
    --toggle-collect=PyDataMem_UserNEW --toggle-collect=PyDataMem_UserFREE \
    "$PY" "$OUT/loop.py" "$n" "$size" >/dev/null 2>&1
  callgrind_annotate --inclusive=yes --threshold=100 "$OUT/$cfg.$size.$n.out" \
    > "$OUT/$cfg.$size.$n.incl" 2>/dev/null
  callgrind_annotate --inclusive=no --threshold=100 "$OUT/$cfg.$size.$n.out" \
    > "$OUT/$cfg.$size.$n.self" 2>/dev/null
}

for size in "${SIZES[@]}"; do
  for cfg in default datamem; do
    run "$cfg" "$size" "$N1"
    run "$cfg" "$size" "$N2"
  done
done

python3 - "$OUT" "$N1" "$N2" "$POLICY" "${SIZES[@]}" <<'EOF'
import re, sys
out, n1, n2, policy, sizes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
LINE = re.compile(r"^\s*([\d,]+)\s+\([^)]*\)\s+(.*?):([A-Za-z_][\w.]*)\s")

def table(path):
    d = {}
    for line in open(path):
        m = LINE.match(line)
        if m:
            name = m.group(3)
            d[name] = d.get(name, 0) + int(m.group(1).replace(",", ""))
    return d

def per_pair(cfg, size, kind):
    a = table("%s/%s.%s.%d.%s" % (out, cfg, size, n1, kind))
    b = table("%s/%s.%s.%d.%s" % (out, cfg, size, n2, kind))
    return {k: (b.get(k, 0) - a.get(k, 0)) / (n2 - n1) for k in set(a) | set(b)}

NUMPY = ("PyDataMem_UserNEW", "PyDataMem_UserFREE")
print("callgrind: instructions per np.empty malloc+free pair (datamem policy %s)" % policy)
print("%-8s %9s %9s %9s %9s %9s %9s" % ("size", "default", "datamem", "numpy+py", "handler",
                                        "jemalloc", "dispatch"))
rows = []
for size in sizes:
    d = per_pair("default", size, "incl")
    m = per_pair("datamem", size, "incl")
    s = per_pair("datamem", size, "self")
    tot_d = sum(d.get(k, 0) for k in NUMPY)
    tot_m = sum(m.get(k, 0) for k in NUMPY)
    handler = m.get("h_malloc", 0) + m.get("h_free", 0)
    # jemalloc's entry points, inclusive (the block cache calls none on a hit)
    je = sum(m.get(k, 0) for k in ("dmje_malloc", "dmje_free", "dmje_calloc", "dmje_mallocx",
                                   "dmje_dallocx", "dmje_rallocx", "dmje_sallocx"))
    print("%-8s %9.0f %9.0f %9.0f %9.0f %9.0f %9.0f" % (size, tot_d, tot_m, tot_m - handler,
                                                      handler, je, handler - je))
    rows.append((size, s, m))
print()
print("datamem's own instructions per pair (self cost), by function:")
mine = ("h_malloc", "h_free", "dm_alloc", "dm_calloc", "dm_free", "alloc_impl",
        "slot_alloc", "route", "tcache_flags", "__tls_get_addr", "PyCapsule_GetPointer",
        "__strcmp_avx2", "strcmp", "_dl_tlsdesc_dynamic", "free_slow", "bcache_miss")
for size, s, m in rows:
    parts = []
    for k in sorted(s, key=lambda k: -s[k]):
        base = k.split(".")[0]
        if (base in mine or base.startswith("dm_") or base.startswith("alloc_")
                or base.startswith("slot_")) and s[k] >= 0.5:
            parts.append("%s %.0f" % (k, s[k]))
    print("  %-8s %s" % (size, ", ".join(parts)))
print("(__tls_get_addr: jemalloc's own thread state, one per jemalloc call; _dl_tlsdesc_dynamic:"
      " datamem's, one per handler call; PyCapsule_GetPointer+strcmp are NumPy's, made for every"
      " handler but its own; dispatch = handler - jemalloc)")
EOF
