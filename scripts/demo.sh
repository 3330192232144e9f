#!/usr/bin/env bash
# README command 1: set up, build, install, and run the demo job under the demo policy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
DATAMEM_CONFIG=configs/demo.yaml python3 examples/demo_job.py
