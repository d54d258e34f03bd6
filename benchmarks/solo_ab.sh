#!/bin/bash
# Stop 48: the backward's solo entries (kernels/sdm_bwd.cu, -DSDM_BWD_SOLO; prepared, not yet
# run on a GPU). Stop 48's bound (bwd_bound.sh last, H100, W = 16) put 1.45 ms of 4.90 in the
# dM scatter: 0.82 ms its atomics (most of them the grad bank's floor bytes), 0.62 ms its run
# walks. About 94% of a chunk's runs hold one entry at the headline; with -DSDM_BWD_SOLO round
# 2 adds a solo write's term to the dM piece it has just loaded, the solo reads' terms go out
# in the phase after u, and the scatter walks only runs of two or more; on the fast path only
# since stop 49 (+88 instructions at the headline, not +1,136). (Stop 19 tried the writes'
# half alone, RESULTS: -2.1% at the headline, +1.8% at W = 8.)
# Graph replays of forward+backward, checked bit for bit against main's build (first):
#   base  main        solo  -DSDM_BWD_SOLO        r1  ... with the solo reads in round 2
# at W = 16, 8 and 32 (WS; fwd_ab.py compiles each instance alone since stop 49, and CuPy's
# cache serves the later W); on an H200, main's headline with FLA's anchor (bench_gpu.py
# --quick, at most BENCH_S s, default 200; BENCH=0: none; the last H200 headline is stop
# 31's); then the GPU suite with the time left (SUITE=0: none; SUITE_S caps).
# Run from the repository root, carrying .whl: BUDGET=560 ABT=200 bash benchmarks/solo_ab.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-560}
. benchmarks/device_lib.sh
for w in ${WS:-16 8 32}; do
  ab base=$B solo=$B:-DSDM_BWD_SOLO r1="$B:-DSDM_BWD_SOLO -DSDM_BWD_SOLO_READS=1" base2=$B \
     --source bwd --graph --backward --check --W $w --reps 8
done
[ "${BENCH:-1}" = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 &&
  BENCH_S=${BENCH_S:-200} bench_step
[ "${SUITE:-1}" = 1 ] && suite_step
echo "total $(( $(date +%s) - T0 )) s"
