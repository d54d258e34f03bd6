#!/bin/bash
# The backward's dM stage (gpu.BWD_DM_STAGE) against the snapshot stage alone, forward+backward
# over shapes, interleaved graph replays; on the device: bash benchmarks/dm_stage_ab.sh
# (stop 21: it fits at W = 4 and is off elsewhere at the forward's chunk; BWD_CHUNK=32 shows it at the headline)
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl -e . > ${OUT:-/tmp}/pip.log 2>&1
cd benchmarks
ab() { echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"; timeout 200 python3 fwd_ab.py "$@" 2>&1 | grep -E "^\| [a-z]|bitwise|Error|error|forward\+"; }
B=../kernels/sdm_bwd.cu
V="off=$B@BWD_DM_STAGE=0 dm=$B@BWD_DM_STAGE=1 off2=$B@BWD_DM_STAGE=0 dm2=$B@BWD_DM_STAGE=1"
for a in "" "--W 4" "--W 8" "--W 12" "--W 24" "--W 32" "--hd 64" "--hd 256" "--float32" "--float32 --W 8" "--float32 --W 4"; do
ab $V --source bwd --backward --graph --reps 8 $a
done
echo "total $(( $(date +%s) - T0 )) s"
