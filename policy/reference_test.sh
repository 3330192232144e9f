#!/bin/sh
# reference_test.sh GEN DOC: fails when DOC (docs/policy-reference.md) is not
# exactly what GEN (//policy:gen_reference) prints from the schema table.
gen="$1"
doc="$2"
if "$gen" | diff -u "$doc" -; then
  echo "PASS: $doc is up to date"
  exit 0
fi
echo
echo "FAIL: docs/policy-reference.md is out of date with policy/schema.def. Run:"
echo "  bazel run //policy:gen_reference -- --write"
echo "(or: bazel run //policy:gen_reference > docs/policy-reference.md)"
exit 1
