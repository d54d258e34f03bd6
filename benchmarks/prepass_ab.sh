#!/bin/bash
# The pre-pass of stop 29 against the one before it, on the device: interleaved CUDA-graph
# replays of the forward (and of forward+backward), each variant checked bitwise against the
# first:
#   main  the pre-pass before stop 29 (a copy of its source in $BASE, default
#         benchmarks/prepass_main.cu, e.g. `git show f9d2e2f:kernels/sdm_prepass.cu`; dense
#         G, H, Ainv: 68 KB per block, 3 per SM);
#   new   kernels/sdm_prepass.cu: packed triangles, 4 forward-form blocks per SM, each thread
#         loading its entries' ids before it pushes any;
#   new3  the same with 3 blocks' registers (what the fourth block gives);
#   main2, new2  the same again (the spread between equal variants).
# Then the pre-pass alone (prepass_time.py). Stop 29 ran an earlier form of this script, with
# the packed kernel without grouped loads as a variant of its own (RESULTS.md).
# Run from the repository root (about 40 s once the modules are cached):
#   bash benchmarks/prepass_ab.sh
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl -e . > ${OUT:-/tmp}/pip.log 2>&1
cd benchmarks
BASE=${BASE:-prepass_main.cu}
P=../kernels/sdm_prepass.cu
ab() { echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"; timeout 150 python3 fwd_ab.py "$@" 2>&1 | grep -E "^\| [a-z]|bitwise|Error|error|forward"; }
# the old layout's pre-pass bytes (gpu._smem before stop 29, C = 64, float32 weights)
old() { case $1 in 4) echo 60160;; 8) echo 68352;; 16) echo 68096;; esac; }
for W in 16 8 4; do
  ab main=$BASE new=$P new3=$P:-DSDM_PREPASS_MINB=3 main2=$BASE new2=$P --source prepass \
     --smem-pre main=$(old $W) --smem-pre main2=$(old $W) --W $W --graph --check --reps 20
done
ab main=$BASE new=$P main2=$BASE new2=$P --source prepass --smem-pre main=68096 \
   --smem-pre main2=68096 --backward --graph --check --reps 12
timeout 60 python3 prepass_time.py --threads 512 2>&1 | tail -4
echo "total $(( $(date +%s) - T0 )) s"
