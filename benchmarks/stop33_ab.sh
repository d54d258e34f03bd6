#!/bin/bash
# Stop 33's device call: the kernels' code-size changes against their earlier forms, as
# interleaved CUDA-graph replays in one process (benchmarks/fwd_ab.py, each variant checked
# bitwise against the first), then the sanitizer with the time left.
#   prepass  one body per key width (kernels/sdm_prepass.cu) against both bodies in every
#            instance (-DSDM_PREPASS_BOTH_BODIES, the form before stop 33); forward at W = 16,
#            then forward+backward
#   fwd      the staged forward (kernels/sdm_fwd.cu; u2: its X/Y loop unrolled by 2) against
#            main's before stop 33 ($FWD_BASE, default .pre/sdm_fwd_main.cu, ignored: `git show
#            15ff73f:kernels/sdm_fwd.cu > .pre/sdm_fwd_main.cu`, carried to the device), at
#            W = 16 and W = 8, then forward+backward
#   fwd2     (run at 55dce19, whose kernels/sdm_fwd.cu copied the rows and walked the scatter
#            without a division per piece) that form against the first form above ($FWD_PREV,
#            default .pre/sdm_fwd_s33a.cu: `git show 2ff0f5a:kernels/sdm_fwd.cu`, the form that
#            landed), the row copies alone ($FWD_CP, default .pre/sdm_fwd_s33b.cu: `git show
#            910c4af:kernels/sdm_fwd.cu`) and main, at W = 16 and W = 8, then forward+backward;
#            split: 55dce19's form with the read rows as a commit group of their own and X
#            summed while they arrive (.pre/sdm_fwd_split.cu, an experiment file with the header
#            inlined, -DSDM_FWD_SPLIT_WAIT; branch wip/fwd-split holds the same wait on the
#            landed form's loops)
#   final    (on branch wip/fwd-split) that form against the first form and main (stop 34 ran
#            it at be71022 with a fourth variant, early: u = Ainv w0 before the wait for the
#            read rows, -DSDM_FWD_U_EARLY; no gain, removed)
#   suite    the GPU suite (benchmarks/gpu_check.py, 16 workers) with the time left
#   bench    bench_gpu.py --quick (the headline and FLA's anchor) with the time left
# STEPS picks them (default "prepass fwd sanitize"). Run from the repository root:
#   bash benchmarks/stop33_ab.sh
set -u
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-570}
. benchmarks/device_lib.sh   # left, suite_step, bench_step, run_sanitize, ab
P=../kernels/sdm_prepass.cu
F=../kernels/sdm_fwd.cu
FB=${FWD_BASE:-../.pre/sdm_fwd_main.cu}
FP=${FWD_PREV:-../.pre/sdm_fwd_s33a.cu}
FC=${FWD_CP:-../.pre/sdm_fwd_s33b.cu}
for step in ${STEPS:-prepass fwd sanitize}; do
  case $step in
    prepass)
      ab one=$P both=$P:-DSDM_PREPASS_BOTH_BODIES one2=$P both2=$P:-DSDM_PREPASS_BOTH_BODIES \
         --source prepass --W 16 --graph --check --reps 20
      ab one=$P both=$P:-DSDM_PREPASS_BOTH_BODIES one2=$P both2=$P:-DSDM_PREPASS_BOTH_BODIES \
         --source prepass --backward --graph --check --reps 12 ;;
    fwd)
      ab main=$FB new=$F u2=$F:-DSDM_FWD_XY_UNROLL=2 main2=$FB new2=$F --W 16 --graph --check --reps 20
      ab main=$FB new=$F u2=$F:-DSDM_FWD_XY_UNROLL=2 main2=$FB new2=$F --W 8 --graph --reps 20
      ab main=$FB new=$F main2=$FB new2=$F --backward --graph --check --reps 12 ;;
    fwd2)
      SP=../.pre/sdm_fwd_split.cu:-DSDM_FWD_SPLIT_WAIT
      V="main=$FB prev=$FP cp=$FC new=$F split=$SP new2=$F"
      ab $V --W 16 --graph --check --reps 20
      ab $V --W 8 --graph --reps 20
      ab main=$FB prev=$FP new=$F split=$SP new2=$F --backward --graph --check --reps 12 ;;
    final)   # the last form (split wait on the first form's copy loop) against both
      ab main=$FB prev=$FP new=$F --W 16 --graph --check --reps 16
      ab main=$FB prev=$FP new=$F --W 8 --graph --reps 16 ;;
    suite) suite_step ;;
    bench) bench_step ;;   # the headline with FLA's anchor (carry .whl), its JSON and plot to $OUT
    sanitize)
      L=$(left)
      echo "== sanitize, ${L} s left"
      run_sanitize $L ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
