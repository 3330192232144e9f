#!/bin/sh
# reference_test.sh GEN DOC TARGET: fails when DOC (a checked-in reference:
# docs/policy-reference.md, docs/metrics-reference.md) is not exactly what GEN
# (the Bazel target TARGET) prints.
gen="$1"
doc="$2"
target="$3"
if "$gen" | diff -u "$doc" -; then
  echo "PASS: $doc is up to date"
  exit 0
fi
echo
echo "FAIL: $doc is out of date with what $target generates. Run:"
echo "  bazel run $target -- --write"
echo "(or: bazel run $target > $doc)"
exit 1
