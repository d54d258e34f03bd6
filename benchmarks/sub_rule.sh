#!/bin/bash
# Branch wip/subchunk-snapshots, on the device: where do the branch's plans (sub-chunk
# snapshots, the backward at half the forward's chunk with its dM stage) beat main's? One
# interleaved forward+backward A/B per shape (off, new, off2, new2: the spread between equal
# variants; `same`: the dM stage only where it fits at the backward's own chunk, no halving),
# then the headline split into its two parts: the halved chunk with main's forward
# chunk too (no sub-chunks), and the sub-chunks without the dM stage.
# Run from the repository root on the device: bash benchmarks/sub_rule.sh
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl -e . > ${OUT:-/tmp}/pip.log 2>&1
cd benchmarks
B=../kernels/sdm_bwd.cu
OFF=SUB_SNAPSHOTS=0,BWD_DM_STAGE=0
ab() { echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"; timeout 150 python3 fwd_ab.py "$@" 2>&1 | grep -E "^\| [a-z]|Error|error|forward\+"; }
fb() { ab off=$B@$OFF new=$B same=$B@BWD_DM_HALVE=0 off2=$B@$OFF new2=$B --source bwd --backward --graph --reps 6 "$@"; }
ab off=$B@$OFF new=$B same=$B@BWD_DM_HALVE=0 nosub=$B@SUB_SNAPSHOTS=0,FWD_CHUNK=32,BWD_CHUNK=32 nodm=$B@BWD_DM_STAGE=0,BWD_CHUNK=32 off2=$B@$OFF new2=$B --source bwd --backward --graph --reps 6
for a in "--W 8" "--W 10" "--W 12" "--W 20" "--W 24" "--W 32" "--W 4" \
         "--hd 64 --W 8" "--hd 64" "--hd 64 --W 24" "--hd 64 --W 64" "--float32" "--S 65536"; do
  fb $a
done
echo "total $(( $(date +%s) - T0 )) s"
