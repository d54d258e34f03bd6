#!/bin/bash
# Stop 39's device call: the overlap probe (benchmarks/overlap_probe.py: can the forward's
# pre-pass run beside the forward kernel?), then, on an H200 only, main's headline with FLA's
# anchor and the GPU suite (issue 3's targets are judged there; stop 38 ran both on an H100).
#   probe   overlap_probe.py at W = 8 and 16 (PROBE_S seconds, default 150)
#   bench   bench_gpu.py --quick (carry .whl)
#   suite   the GPU suite with the time left (SUITE_S caps)
#   pretest the GPU test of the pre-pass's block sizes (bitwise equal results)
#   prethreads  the pre-pass's block size: prepass_time.py (both forms) at 128, 256 and 512
#           threads for W in PRE_W (default "4 8 12 16 24 32"), then fwd_ab.py graph replays
#           of the forward and of forward+backward at W = 8, 512 against 256 threads
#           (PREPASS_THREADS, checked bit for bit)
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
    pretest)
      echo "== pretest (elapsed $(( $(date +%s) - T0 )) s)"
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_backend.py \
        -k prepass_block 2>&1 | tail -15 ;;
    prethreads)
      for w in ${PRE_W:-4 8 12 16 24 32}; do
        echo "== prepass_time W = $w (elapsed $(( $(date +%s) - T0 )) s)"
        (cd benchmarks && timeout 60 python3 prepass_time.py --threads 128 256 512 --W $w \
           --reps 30 2>&1 | grep -E "^\||chunks|Error")
      done
      F=../kernels/sdm_fwd.cu
      ab t512=$F t256=$F@PREPASS_THREADS=256 t512b=$F t256b=$F@PREPASS_THREADS=256 --W 8 \
         --graph --check --reps 20
      ab t512=$F t256=$F@PREPASS_THREADS=256 t512b=$F t256b=$F@PREPASS_THREADS=256 --W 8 \
         --graph --check --backward --reps 12 ;;
    bench) [ $H200 = 1 ] || [ "${ANY_CARD:-0}" = 1 ] && bench_step ;;
    suite) [ $H200 = 1 ] || [ "${ANY_CARD:-0}" = 1 ] && suite_step ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
