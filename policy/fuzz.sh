#!/usr/bin/env bash
# fuzz.sh [SECONDS]: builds policy/parse_fuzz.c with libFuzzer, ASan and UBSan
# (clang, outside Bazel) into $TMPDIR and runs it for SECONDS (default 30) from
# two seed corpora: tests/fuzz/policy_corpus (inputs no fixture holds) and the
# policy fixtures in tests/policies (read recursively). New inputs go to a
# scratch corpus in $TMPDIR, never into the checked-in ones. Exits non-zero on a crash, a leak
# or a failed check; the reproducer is left in the scratch directory.
set -euo pipefail
secs="${1:-30}"
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${TMPDIR:-/tmp}/datamem-policy-fuzz"
mkdir -p "$work/corpus"
cd "$root"

srcs=$(ls policy/*.c | grep -v -e '_test\.c$' -e 'gen_reference\.c$' -e 'check\.c$' \
       -e 'fuzz_driver\.c$')
clang -std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I"$root" $srcs -lyaml -o "$work/parse_fuzz"

# Every schema key as a dictionary word, straight from the schema table.
sed -n 's/^DM_SCHEMA_ROW([A-Z_]*, [A-Z_]*, "\([a-z_]*\)".*/"\1"/p' policy/schema.def \
  | grep -v '^""$' > "$work/policy.dict"
printf '%s\n' '"KiB"' '"MiB"' '"GiB"' '"ms"' '"never"' '"float32"' '"number"' \
  '"[0, 1]"' '"{bind: "' '"- name: "' '"&a"' '"*a"' '"---"' >> "$work/policy.dict"

cd "$work"
exec ./parse_fuzz -max_total_time="$secs" -max_len=4096 -timeout=10 \
  -dict="$work/policy.dict" -print_final_stats=1 \
  "$work/corpus" "$root/tests/fuzz/policy_corpus" "$root/tests/policies"
