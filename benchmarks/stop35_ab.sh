#!/bin/bash
# Stop 35's device calls: the chunk start's copies (the bank-independent data of the next
# chunk, issued with cp.async while this one runs), as interleaved CUDA-graph replays in one
# process (benchmarks/fwd_ab.py, each variant checked bit for bit against the first), then the
# GPU suite and the headline.
#   bwdstart  the backward's chunk start, forward+backward at W = 16 and W = 8:
#             its ids and weights through one row plan (cp_rows4_pow2; -DSDM_BWD_ROWS_EACH: one
#             cp_rows each), its values and dr rows in one loop with a shift
#             (-DSDM_BWD_VD_EACH: a loop each, with divisions), and (-DSDM_BWD_SPANS) its
#             run links, sorted positions and CSR values and columns as one list of
#             16-byte pieces with the row pointers element by element
#   fwdspans  the staged forward's run links, CSR values and columns as one list of pieces,
#             its row pointers element by element (-DSDM_FWD_SPANS), at W = 16 and W = 8
#   late      the staged forward issuing chunk n+1's copies after chunk n's row copies, as a
#             third commit group (landed in stop 35) against before them (-DSDM_FWD_EARLY_PF;
#             at a3c4660 the experiment was opt-in, -DSDM_FWD_LATE_PF), at the shapes in
#             SHAPES (default "16 8": W = 16 and W = 8; also "32", "S4096", "f32")
#   bwdlate   the backward issuing a chunk's snapshot copies before chunk n-1's copies and
#             the wait for its own (-DSDM_BWD_LATE_PF), forward+backward at W = 16 and 8; it
#             ran at a3c4660 (branch wip/late-prefetch) and was not merged (no clear gain)
#   suite     the GPU suite (benchmarks/gpu_check.py, 16 workers) with the time left
#             (SUITE_S caps)
#   bench     bench_gpu.py --quick (the headline and FLA's anchor; carry .whl)
# bwdstart and fwdspans ran at 2815848 (branch wip/chunk-start; none of its variants was
# faster, benchmarks/RESULTS.md stop 35, so main does not have their macros): check that
# commit's kernels out to run them again.
# STEPS picks them (default "bwdstart fwdspans"). Run from the repository root:
#   bash benchmarks/stop35_ab.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-570}
. benchmarks/device_lib.sh   # left, suite_step, bench_step, ab
F=../kernels/sdm_fwd.cu
B=../kernels/sdm_bwd.cu
for step in ${STEPS:-bwdstart fwdspans}; do
  case $step in
    bwdstart)
      # the first A/B compiles the five forms (about 150 s on the H100: stop 35's call cut
      # it at ABT = 150 before its table; 300 leaves room)
      ABT=300 ab old=$B:"-DSDM_BWD_ROWS_EACH -DSDM_BWD_VD_EACH" rows=$B:-DSDM_BWD_VD_EACH \
         vd=$B:-DSDM_BWD_ROWS_EACH new=$B vds=$B:"-DSDM_BWD_ROWS_EACH -DSDM_BWD_SPANS" \
         news=$B:-DSDM_BWD_SPANS old2=$B:"-DSDM_BWD_ROWS_EACH -DSDM_BWD_VD_EACH" \
         --source bwd --backward --graph --check --reps 12 --W 16
      ABT=200 ab old=$B:"-DSDM_BWD_ROWS_EACH -DSDM_BWD_VD_EACH" rows=$B:-DSDM_BWD_VD_EACH \
         vd=$B:-DSDM_BWD_ROWS_EACH new=$B vds=$B:"-DSDM_BWD_ROWS_EACH -DSDM_BWD_SPANS" \
         news=$B:-DSDM_BWD_SPANS old2=$B:"-DSDM_BWD_ROWS_EACH -DSDM_BWD_VD_EACH" \
         --source bwd --backward --graph --reps 12 --W 8 ;;
    fwdspans)
      ab new=$F spans=$F:-DSDM_FWD_SPANS new2=$F spans2=$F:-DSDM_FWD_SPANS --W 16 --graph \
         --check --reps 20
      ab new=$F spans=$F:-DSDM_FWD_SPANS new2=$F spans2=$F:-DSDM_FWD_SPANS --W 8 --graph \
         --check --reps 20 ;;
    late)   # chunk n+1's copies after chunk n's row copies (landed: -DSDM_FWD_EARLY_PF before)
      for sh in ${SHAPES:-16 8}; do
        case $sh in
          S4096) X="--S 4096" ;;
          f32) X="--float32" ;;
          *) X="--W $sh" ;;
        esac
        ab early=$F:-DSDM_FWD_EARLY_PF late=$F early2=$F:-DSDM_FWD_EARLY_PF late2=$F --graph \
           --check --reps 20 $X
      done ;;
    bwdlate)   # the backward's snapshot copies before chunk n-1's copies and the wait
      ABT=300 ab base=$B late=$B:-DSDM_BWD_LATE_PF base2=$B late2=$B:-DSDM_BWD_LATE_PF \
         --source bwd --backward --graph --check --reps 12 --W 16
      ABT=200 ab base=$B late=$B:-DSDM_BWD_LATE_PF base2=$B late2=$B:-DSDM_BWD_LATE_PF \
         --source bwd --backward --graph --reps 12 --W 8 ;;
    suite) suite_step ;;
    bench) bench_step ;;   # the headline with FLA's anchor (carry .whl), its JSON and plot to $OUT
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
