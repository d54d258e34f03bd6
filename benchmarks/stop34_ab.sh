#!/bin/bash
# Stop 34's device calls: L2 prefetches of the row tiles a block needs next, as interleaved
# CUDA-graph replays in one process (benchmarks/fwd_ab.py, each variant checked against the
# first), then the GPU suite with the time left.
#   fwdpf  the staged forward with chunk n+1's bank row tiles prefetched into L2 while chunk n
#          runs (-DSDM_FWD_L2PF: 1 write rows, 2 read rows, 4 issued in the X pass instead of
#          the Y pass), at W = 16 and W = 8
#   bwdpf  the backward with L2 prefetches (-DSDM_BWD_L2PF: 1 this chunk's unlinked read slots'
#          dM rows at round 1's start, for the scatter; after round 1, chunk n-1's 2 gather rows,
#          4 snapshot rows, 8 read slots' dM rows), forward+backward at W = 16 and W = 8
#   plain  the same with one prefetch.global.L2 per 128-byte line (-DSDM_PF_PLAIN) instead of
#          the bulk prefetches, which the first call measured 9-27% slower
#   rows4  (branch wip/fwd-rows4) the staged forward copying its ids and weights as four arrays
#          of one row plan (cp_rows4_pow2) against one cp_rows_pow2 each (-DSDM_FWD_ROWS_EACH),
#          at W = 16 and W = 8
#   suite  the GPU suite (benchmarks/gpu_check.py, 16 workers) with the time left (SUITE_S caps)
#   bench  bench_gpu.py --quick (the headline and FLA's anchor; carry .whl)
# fwdpf, bwdpf and plain ran at 4900398 (their macros were removed after: every variant was
# slower, benchmarks/RESULTS.md stop 34); check that commit's kernels out to run them again.
# STEPS picks them (default "fwdpf bwdpf"). Run from the repository root:
#   bash benchmarks/stop34_ab.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-570}
. benchmarks/device_lib.sh   # left, suite_step, bench_step, ab
F=../kernels/sdm_fwd.cu
B=../kernels/sdm_bwd.cu
for step in ${STEPS:-fwdpf bwdpf}; do
  case $step in
    fwdpf)
      V="new=$F p1=$F:-DSDM_FWD_L2PF=1 p2=$F:-DSDM_FWD_L2PF=2 p3=$F:-DSDM_FWD_L2PF=3 p7=$F:-DSDM_FWD_L2PF=7 new2=$F"
      ab $V --W 16 --graph --check --reps 16
      ab $V --W 8 --graph --reps 16 ;;
    bwdpf)
      V="base=$B p1=$B:-DSDM_BWD_L2PF=1 p2=$B:-DSDM_BWD_L2PF=2 p6=$B:-DSDM_BWD_L2PF=6 p10=$B:-DSDM_BWD_L2PF=10 p15=$B:-DSDM_BWD_L2PF=15 base2=$B"
      ABT=260 ab $V --source bwd --backward --graph --check --reps 10
      ABT=200 ab base=$B p${BW8:-15}=$B:-DSDM_BWD_L2PF=${BW8:-15} base2=$B --source bwd --backward --W 8 --graph --reps 10 ;;
    plain)
      PL=-DSDM_PF_PLAIN
      ab new=$F p1=$F:"-DSDM_FWD_L2PF=1 $PL" p3=$F:"-DSDM_FWD_L2PF=3 $PL" new2=$F --W 16 --graph --check --reps 16
      ABT=200 ab base=$B p1=$B:"-DSDM_BWD_L2PF=1 $PL" p2=$B:"-DSDM_BWD_L2PF=2 $PL" base2=$B --source bwd --backward \
         --graph --reps 10 ;;
    rows4)
      RE=$F:-DSDM_FWD_ROWS_EACH
      ab each=$RE new=$F each2=$RE new2=$F --W 16 --graph --check --reps 20
      ab each=$RE new=$F each2=$RE new2=$F --W 8 --graph --check --reps 20 ;;
    suite) suite_step ;;
    bench) bench_step ;;   # the headline with FLA's anchor (carry .whl), its JSON and plot to $OUT
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
