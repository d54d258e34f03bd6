#!/bin/bash
# Where does the backward's time go? Diagnostic builds of kernels/sdm_bwd.cu (wrong results,
# so no --check; off by default, main's machine code unchanged), each timed against two
# copies of main's build; each difference bounds what a redesign of that part could gain.
#   rows  a1: round 1's pass A loads its pieces (the dM rows of the writes, the bank rows of
#         the unlinked reads) from 256 rows that stay in L2; a2: pass A loads nothing;
#         r2: round 2 loads none of its dM pieces; a2r2: neither round loads
#   last  the chunk's last phase: pe: no per-entry sums (da, dc with the overlap terms);
#         sc1: the dM scatter walks its runs but adds nothing; sc2: no scatter; pesc2: neither
# STEPS="rows last" (the default), at W (default 16).
# Stop 47 (H100, W = 16, rows): a1 -2.2%, a2 -8.1%, r2 -4.8%, a2r2 -10.6% (RESULTS).
# Stop 48 (H100, W = 16, last): pe -0.8%, sc1 -16.7%, sc2 -29.5%, pesc2 -36.0% (RESULTS).
# Run from the repository root, carrying .whl: BUDGET=400 ABT=190 bash benchmarks/bwd_bound.sh
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_lib.sh   # B: the backward source
for step in ${STEPS:-rows last}; do
  case $step in
    rows) ab base=$B a1=$B:-DSDM_BWD_PROBE_A=1 a2=$B:-DSDM_BWD_PROBE_A=2 \
             r2=$B:-DSDM_BWD_PROBE_R2=2 a2r2="$B:-DSDM_BWD_PROBE_A=2 -DSDM_BWD_PROBE_R2=2" \
             base2=$B --source bwd --graph --backward --W ${W:-16} --reps 8 ;;
    last) ab base=$B pe=$B:-DSDM_BWD_PROBE_PE sc1=$B:-DSDM_BWD_PROBE_SC=1 \
             sc2=$B:-DSDM_BWD_PROBE_SC=2 pesc2="$B:-DSDM_BWD_PROBE_PE -DSDM_BWD_PROBE_SC=2" \
             base2=$B --source bwd --graph --backward --W ${W:-16} --reps 8 ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
