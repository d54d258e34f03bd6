#!/bin/bash
# Does ptxas's register allocation policy move the kernels? NVRTC passes -Xptxas options to
# ptxas (CuPy loads the cubin, not PTX, where NVRTC knows the card), and
# --register-usage-level=L (0-10, default 5) changes the headline instances' machine code
# (NVRTC 13, sm_90, bf16 bank, float32 grads: backward 10,104 instructions and 8/24 bytes of
# spills at 5, 10,384 and none at 0-3, 10,088 and 8/24 at 6-10; forward staged instance 4,592
# at 5-10, 4,688 at 0-3). Every variant is checked bit for bit against base (same source).
#   STEPS="bwd16 bwd8 fwd" (the default)
# Run from the repository root, carrying .whl: BUDGET=300 bash benchmarks/ptxas_ab.sh
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_lib.sh   # B, F: the backward and forward sources
R=-Xptxas=--register-usage-level
for step in ${STEPS:-bwd16 bwd8 fwd}; do
  case $step in
    bwd16|bwd8) ab base=$B r0=$B:$R=0 r8=$B:$R=8 base2=$B \
                   --source bwd --graph --check --backward --W ${step#bwd} --reps 8 ;;
    fwd) for w in 16 8; do
           ab base=$F r0=$F:$R=0 base2=$F --graph --check --W $w --reps 20
         done ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
