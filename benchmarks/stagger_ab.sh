#!/bin/bash
# Stop 46's probe (run in stop 47 on an H100: no gain anywhere, RESULTS): do the kernels lose
# time because all 128 blocks reach their gathers at once and then compute while memory idles? The blocks of odd (b, p) sleep
# before their first chunk (-DSDM_BWD_STAGGER=ns, -DSDM_FWD_STAGGER=ns, compile-time, off by
# default: without them the machine code is main's), so that half the SMs gather while the
# other half compute. 1 ns is the control: the same machine code as the staggered variants
# (only the sleep's immediate differs), which differs from main's; "main" is main's code.
# A chunk takes about 60 us of backward at W = 16 on an H100, 30 us at W = 8, and 15 us of
# forward at W = 16, so the sleeps are a quarter and half of that. q15: four phases, the blocks
# of (b, p) mod 4 = k sleeping k times 15 us.
#   STEPS="bwd16 bwd8 fwd" (the default), each fwd_ab.py graph replays checked bit for bit
# Run from the repository root, carrying .whl: BUDGET=300 bash benchmarks/stagger_ab.sh
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_lib.sh   # B, F: the backward and forward sources
for step in ${STEPS:-bwd16 bwd8 fwd}; do
  case $step in
    bwd16) ab c1=$B:-DSDM_BWD_STAGGER=1 s15=$B:-DSDM_BWD_STAGGER=15000 \
              s30=$B:-DSDM_BWD_STAGGER=30000 \
              q15="$B:-DSDM_BWD_STAGGER=15000 -DSDM_STAGGER_PHASES=4" \
              c2=$B:-DSDM_BWD_STAGGER=1 main=$B \
              --source bwd --graph --check --backward --W 16 --reps 10 ;;
    bwd8) ab c1=$B:-DSDM_BWD_STAGGER=1 s8=$B:-DSDM_BWD_STAGGER=8000 \
             s15=$B:-DSDM_BWD_STAGGER=15000 c2=$B:-DSDM_BWD_STAGGER=1 main=$B \
             --source bwd --graph --check --backward --W 8 --reps 10 ;;
    fwd) ab c1=$F:-DSDM_FWD_STAGGER=1 s4=$F:-DSDM_FWD_STAGGER=4000 \
            s8=$F:-DSDM_FWD_STAGGER=8000 c2=$F:-DSDM_FWD_STAGGER=1 main=$F \
            --graph --check --W 16 --reps 20 ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
