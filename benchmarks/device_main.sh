#!/bin/bash
# Main, one device call (about 560 s with a cold lease, under the 600 s limit):
#   1. the GPU suite (main's kernels are stop 20's; its plans, the chunk-carrying snapshots and
#      their GPU tests have not run on a GPU yet);
#   2. benchmarks/sanitize.py with the time left: every kernel path under compute-sanitizer
#      (memcheck first, then synccheck, racecheck, initcheck).
# Run from the repository root on the device, carrying .whl: bash benchmarks/device_main.sh
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
# the carried wheels (FLA for the benchmarks) when there, and the checkout itself
python3 -m pip install -q --no-deps --no-build-isolation $(ls .whl/*.whl 2>/dev/null) -e . \
    > ${OUT:-/tmp}/pip.log 2>&1 || { echo "pip install failed:"; tail -5 ${OUT:-/tmp}/pip.log; }
PYTEST_TIMEOUT=280 timeout 300 python3 benchmarks/gpu_check.py --no-bench --pytest-args "-n 16" 2>&1 | tail -8
LEFT=$(( 560 - ($(date +%s) - T0) ))
echo "== sanitizer, ${LEFT} s left"
timeout $(( LEFT + 15 )) python3 benchmarks/sanitize.py --timeout $LEFT \
    --tools memcheck,synccheck,racecheck,initcheck 2>&1 | tail -12
echo "total $(( $(date +%s) - T0 )) s"
