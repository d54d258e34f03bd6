#!/bin/bash
# Stop 42's device call (issue 3's targets are judged on an H200; the last H200 headline is
# stop 31's, before stops 33-36's forward changes). Steps, in the order STEPS gives them
# (default "bench ab"):
#   bench   bench_gpu.py --quick: the headline (and sdm.tune's plan), W = 8, FLA's anchor
#   ab      fwd_ab.py graph replays of main's own compile-time and launcher alternatives that
#           were measured on an H100 only, checked bit for bit: the forward at W = 16 and 8
#           with the old copy order (-DSDM_FWD_EARLY_PF), one wait per chunk
#           (-DSDM_FWD_ONE_WAIT) and 256-thread pre-pass blocks; forward+backward at W = 16
#           with the backward's chunk halved for its dM stage (BWD_DM_HALVE)
#   sweep   bench_gpu.py in full (S, W, T sweep with FLA's anchor; plot and JSON to $OUT),
#           at most SWEEP_S seconds (default 240)
#   suite   the GPU suite with the time left (SUITE_S caps)
# Run from the repository root, carrying .whl: BUDGET=580 bash benchmarks/stop42.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-580}
. benchmarks/device_lib.sh
F=../kernels/sdm_fwd.cu
for step in ${STEPS:-bench ab}; do
  case $step in
    bench) bench_step ;;
    ab)
      for w in 16 8; do
        ab base=$F early=$F:-DSDM_FWD_EARLY_PF onewait=$F:-DSDM_FWD_ONE_WAIT \
           p256=$F@PREPASS_THREADS=256 base2=$F --W $w --graph --check --reps 20
      done
      ab base=$F halve=$F@BWD_DM_HALVE=1 base2=$F --W 16 --graph --check --backward --reps 12 ;;
    sweep)
      echo "== sweep, $(left) s left"
      (cd benchmarks && timeout ${SWEEP_S:-240} python3 bench_gpu.py --out ${OUT:-.} 2>&1 | tail -40) ;;
    suite) suite_step ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
