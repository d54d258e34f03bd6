#!/bin/bash
# Main on the device in one call (BUDGET, default 580 s, under the 600 s limit):
#   suite     the GPU suite (benchmarks/gpu_check.py, 16 workers; at most SUITE_S s, default
#             400: 317 s on an H100 and about 400 s on an H200 with the modules compiled cold,
#             stop 30);
#   bench     bench_gpu.py --quick with the time left (the headline cases and FLA's anchor; its
#             JSON and plot go to $OUT);
#   sanitize  benchmarks/sanitize.py with the time left (every kernel path under
#             compute-sanitizer: memcheck first, then synccheck, racecheck, initcheck).
# STEPS picks them, in that order (default "suite bench"). Run from the repository root on the
# device, carrying .whl (FLA's wheels for the bench):
#   bash benchmarks/device_main.sh
#   STEPS="suite sanitize" bash benchmarks/device_main.sh
set -u
cd "$(dirname "$0")/.."
STEPS=${STEPS:-suite bench}
BUDGET=${BUDGET:-580}
. benchmarks/device_lib.sh
for step in $STEPS; do
  L=$(left)
  echo "== $step, ${L} s left"
  case $step in
    suite) run_suite $(( L < ${SUITE_S:-400} ? L : ${SUITE_S:-400} )) ;;   # the bench's share stays
    bench) run_bench $L ;;
    sanitize) run_sanitize $L ;;
  esac
done
