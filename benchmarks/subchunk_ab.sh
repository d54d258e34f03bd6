#!/bin/bash
# Branch wip/subchunk-snapshots, one device call (about 450 s with a cold lease):
#   1. the GPU suite;
#   2. interleaved A/B, forward+backward (fwd_ab.py), at plans equal to main's
#      (SUB_SNAPSHOTS=0, BWD_DM_STAGE=0): main's sdm_bwd.cu against this branch's, whose DS = 0
#      instances are main's machine code byte for byte (a control: equal times expected); then
#      the branch's defaults (sub-chunk snapshots + the dM stage at the backward's halved chunk);
#      then the forward alone: the sub-chunk pass's cost, and the forward's code (main's source
#      with the CB argument against the branch's);
#   3. the full sweep (bench_gpu.py) with the branch's defaults.
# Run from the repository root on the device: bash benchmarks/subchunk_ab.sh
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl -e . > ${OUT:-/tmp}/pip.log 2>&1
PYTEST_TIMEOUT=300 timeout 330 python3 benchmarks/gpu_check.py --no-bench --pytest-args "-n 16" 2>&1 | tail -8
cd benchmarks
ab() { echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"; timeout 120 python3 fwd_ab.py "$@" 2>&1 | grep -E "^\| [a-z]|bitwise|Error|error|forward\+"; }
B=../kernels/sdm_bwd.cu
M=sdm_bwd_main.cu   # main's kernels/sdm_bwd.cu (stop 20's), kept on this branch for the A/B
OFF=SUB_SNAPSHOTS=0,BWD_DM_STAGE=0
for a in "" "--W 8" "--W 32" "--hd 64" "--W 4"; do
ab main=$M@$OFF dmcode=$B@$OFF new=$B main2=$M@$OFF new2=$B --source bwd --backward --graph --reps 6 $a
done
ab main=$M@$OFF new=$B --source bwd --graph --reps 8   # the forward alone: the pass's cost
# the forward's code: main's source (CB accepted, unused) against the branch's, same plans
ab fmain=sdm_fwd_main.cu fnew=../kernels/sdm_fwd.cu fmain2=sdm_fwd_main.cu --source fwd --graph --reps 8
ab fmain=sdm_fwd_main.cu fnew=../kernels/sdm_fwd.cu fmain2=sdm_fwd_main.cu --source fwd --graph --reps 8 --W 8
echo "A/B done (elapsed $(( $(date +%s) - T0 )) s)"
timeout 250 python3 bench_gpu.py --out ${OUT:-/tmp} 2>&1 | tail -24
echo "total $(( $(date +%s) - T0 )) s"
