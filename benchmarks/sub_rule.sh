#!/bin/bash
# The backward's dM stage and the forward's sub-chunk snapshots (stop 28), on the device:
#   1. forward+backward, interleaved CUDA-graph replays, per shape: `off` (neither: the plans
#      and machine code before stop 28), `new` (gpu.BWD_DM_HALVE on: the backward halves its
#      chunk for the dM stage, the saving forward keeps its chunk and saves sub-chunk
#      snapshots), `same` (the defaults: the dM stage only where it fits at the backward's own
#      chunk), off2 and new2 (the spread between equal variants). At the headline also
#      `nosub` (the halved chunk for the forward too) and `nodm` (sub-chunks, no dM stage);
#   2. the headline forward alone with sub-chunk snapshots (BWD_DM_HALVE on), each variant
#      checked bitwise against `fused` (the default: stored in the scatter's walk): `sep` (a
#      pass of its own, must be equal), `nopass` and `scan` (no sub-chunk snapshots: wrong
#      snapshots), `off`.
# Run from the repository root on the device (about 130 s; carry .whl for the pip line):
#   bash benchmarks/sub_rule.sh
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl -e . > ${OUT:-/tmp}/pip.log 2>&1
cd benchmarks
B=../kernels/sdm_bwd.cu
F=../kernels/sdm_fwd.cu
OFF=SUB_SNAPSHOTS=0,BWD_DM_STAGE=0
H=BWD_DM_HALVE=1
ab() { echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"; timeout 150 python3 fwd_ab.py "$@" 2>&1 | grep -E "^\| [a-z]|bitwise|Error|error|forward\+"; }
fb() { ab off=$B@$OFF new=$B@$H same=$B off2=$B@$OFF new2=$B@$H --source bwd --backward --graph --reps 6 "$@"; }
ab off=$B@$OFF new=$B@$H same=$B nosub=$B@SUB_SNAPSHOTS=0,FWD_CHUNK=32,BWD_CHUNK=32 \
   nodm=$B@BWD_DM_STAGE=0,BWD_CHUNK=32 off2=$B@$OFF new2=$B@$H --source bwd --backward --graph --reps 6
for a in "--W 8" "--W 10" "--W 12" "--W 20" "--W 24" "--W 32" "--W 4" \
         "--hd 64 --W 8" "--hd 64" "--hd 64 --W 24" "--hd 64 --W 64" "--float32" "--S 65536"; do
  fb $a
done
ab fused=$F@$H sep=$F:-DSDM_FWD_SUB_SEPARATE@$H nopass=$F:-DSDM_FWD_NO_SUB_PASS@$H \
   "scan=$F:-DSDM_FWD_SUB_SEPARATE -DSDM_FWD_SUB_SCAN_ONLY@$H" off=$F@$OFF --source fwd --graph --reps 8 --check
echo "total $(( $(date +%s) - T0 )) s"
