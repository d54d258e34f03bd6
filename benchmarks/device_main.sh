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
T0=$(date +%s)
STEPS=${STEPS:-suite bench}
left() { echo $(( ${BUDGET:-580} - ($(date +%s) - T0) )); }
# the card and its clocks and power cap (stop 30's H200 ran the pre-pass in 0.166 ms, stop 31's
# in 0.130-0.144: timings vary between leases of the same kind)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu \
    --format=csv,noheader
# the carried wheels (FLA for the benchmarks) when there, and the checkout itself
python3 -m pip install -q --no-deps --no-build-isolation $(ls .whl/*.whl 2>/dev/null) -e . \
    > ${OUT:-/tmp}/pip.log 2>&1 || { echo "pip install failed:"; tail -5 ${OUT:-/tmp}/pip.log; }
for step in $STEPS; do
  L=$(left)
  echo "== $step, ${L} s left"
  case $step in
    suite) S=$(( L < ${SUITE_S:-400} ? L : ${SUITE_S:-400} ))   # the bench's share stays
           # the deadline covers the modules' warm-up too (stop 30, H200: 70 s of warm-up, and
           # the outer timeout cut gpu_check before it printed anything)
           PYTEST_TIMEOUT=$S PYTEST_DEADLINE=$(( $(date +%s) + S - 15 )) timeout $S \
             python3 benchmarks/gpu_check.py \
             --no-bench --pytest-args "-n 16" 2>&1 | tail -6 ;;
    bench) (cd benchmarks && timeout $L python3 bench_gpu.py --quick --out ${OUT:-.} 2>&1 | tail -16) ;;
    sanitize) timeout $(( L + 15 )) python3 benchmarks/sanitize.py --timeout $L \
                --tools memcheck,synccheck,racecheck,initcheck 2>&1 | tail -12 ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
