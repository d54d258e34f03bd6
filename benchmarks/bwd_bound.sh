#!/bin/bash
# How much of the backward waits on its grouped row loads? Diagnostic builds (wrong results,
# so no --check) of kernels/sdm_bwd.cu: a1 loads round 1's pass A pieces (the dM rows of the
# writes, the bank rows of the unlinked reads) from 256 rows that stay in L2, a2 loads none;
# r2 loads none of round 2's dM pieces; a2r2 neither. Each difference to base bounds what a
# redesign that hides those loads (prefetching a chunk ahead, with the rows the later chunk
# changes patched afterwards) could gain; the staged snapshots and the scatter are unchanged.
#   STEPS="w16" (the default; w8 for W = 8)
# Stop 47 (H100, W = 16): a1 -2.2%, a2 -8.1%, r2 -4.8%, a2r2 -10.6% (RESULTS).
# Run from the repository root, carrying .whl: BUDGET=300 ABT=250 bash benchmarks/bwd_bound.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-300}
. benchmarks/device_lib.sh
B=../kernels/sdm_bwd.cu
for step in ${STEPS:-w16}; do
  ab base=$B a1=$B:-DSDM_BWD_PROBE_A=1 a2=$B:-DSDM_BWD_PROBE_A=2 r2=$B:-DSDM_BWD_PROBE_R2=2 \
     a2r2="$B:-DSDM_BWD_PROBE_A=2 -DSDM_BWD_PROBE_R2=2" base2=$B \
     --source bwd --graph --backward --W ${step#w} --reps 8
done
echo "total $(( $(date +%s) - T0 )) s"
