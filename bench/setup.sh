#!/usr/bin/env bash
# Set-up for bench/ only (not needed by the tests): the allocators that
# bench/run.py and bench/jobs/ compare against through LD_PRELOAD, matplotlib
# for the plots, and the libraries the real jobs use (pandas, scikit-learn,
# SciPy: bench/jobs/). Never part of CI's test requirements.
# Idempotent; Debian bookworm, root or sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(libjemalloc2 libtcmalloc-minimal4 libmimalloc2.0 valgrind)
need=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
if [ "${#need[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
python3 -c "import matplotlib" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check "matplotlib>=3.5"
python3 -c "import pandas, sklearn, scipy" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check "pandas>=2" "scikit-learn>=1.3" "scipy>=1.10"
# bench/jobs/pandas3_etl.py: pandas 3 (Python >= 3.11), run with and without pyarrow.
python3 -c "import sys, pandas, pyarrow; sys.exit(int(pandas.__version__.split('.')[0]) < 3)" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check "pandas>=3" "pyarrow>=15" ||
  echo "bench/setup.sh: pandas 3 and pyarrow not installed: python3 -m bench.jobs --only without pandas3_etl,pandas3_arrow" >&2
