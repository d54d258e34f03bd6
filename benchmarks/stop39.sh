#!/bin/bash
# Stop 39's device call: the overlap probe (benchmarks/overlap_probe.py: can the forward's
# pre-pass run beside the forward kernel?), then, on an H200 only, main's headline with FLA's
# anchor and the GPU suite (issue 3's targets are judged there; stop 38 ran both on an H100).
#   probe   overlap_probe.py at W = 8 and 16 (PROBE_S seconds, default 150)
#   bench   bench_gpu.py --quick (carry .whl)
#   suite   the GPU suite with the time left
# STEPS picks them (default "probe bench suite"); ANY_CARD=1 runs bench and suite on any card.
# Run from the repository root: bash benchmarks/stop39.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-570}
. benchmarks/device_lib.sh
H200=0
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && H200=1
for step in ${STEPS:-probe bench suite}; do
  case $step in
    probe)
      echo "== probe (elapsed $(( $(date +%s) - T0 )) s)"
      (cd benchmarks && timeout ${PROBE_S:-150} python3 overlap_probe.py --W ${PROBE_W:-8 16} \
         --reps ${PROBE_REPS:-30} 2>&1 | grep -vE "^\s*$|Warning|warn") ;;
    bench) [ $H200 = 1 ] || [ "${ANY_CARD:-0}" = 1 ] && bench_step ;;
    suite) [ $H200 = 1 ] || [ "${ANY_CARD:-0}" = 1 ] && suite_step ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
