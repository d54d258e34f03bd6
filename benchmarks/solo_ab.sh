#!/bin/bash
# Stop 48: the backward's solo entries (kernels/sdm_bwd.cu, SDM_BWD_SOLO_READS). Stop 48's
# bound (bwd_bound.sh last, H100, W = 16) put 1.45 ms of 4.90 in the dM scatter: 0.82 ms its
# atomics (most of them the grad bank's floor bytes), 0.62 ms its run walks. Most runs hold
# one entry; round 2 now adds a solo write's term to the dM piece it has just loaded, the solo
# reads' terms go out in the phase after u, and the scatter walks only runs of two or more.
# Graph replays of forward+backward, checked bit for bit against the old build (first):
#   old   -DSDM_BWD_NO_SOLO (the scatter adds every run, as before stop 48)
#   base  main (solo reads after u)        r1  solo reads in round 2
#   list  the scatter's tasks from a list of the longer runs' heads (-DSDM_BWD_HEAD_LIST)
# at W = 16 and 8 (list at 16 only, unless LIST=0), then the GPU suite with the time left (SUITE_S caps).
# Run from the repository root, carrying .whl: BUDGET=560 bash benchmarks/solo_ab.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-560}
. benchmarks/device_lib.sh
for w in ${WS:-16 8}; do
  ab old=$B:-DSDM_BWD_NO_SOLO base=$B r1=$B:-DSDM_BWD_SOLO_READS=1 \
     $([ $w = 16 ] && [ "${LIST:-1}" = 1 ] && echo list=$B:-DSDM_BWD_HEAD_LIST) old2=$B:-DSDM_BWD_NO_SOLO \
     --source bwd --graph --backward --check --W $w --reps 8
done
[ "${SUITE:-1}" = 1 ] && suite_step
echo "total $(( $(date +%s) - T0 )) s"
