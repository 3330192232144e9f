#!/usr/bin/env bash
# Builds the wheel with Bazel and installs it into the python3 on PATH.
# Idempotent: Bazel caches, pip reinstalls only this package.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //:wheel
mkdir -p dist
name=$(cat bazel-bin/datamem.whl.name)
rm -f dist/datamem-*.whl
cp -f bazel-bin/datamem.whl "dist/$name"
chmod u+w "dist/$name"
python3 -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "dist/$name"
echo "installed dist/$name"
