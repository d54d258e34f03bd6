#!/bin/bash
# Branch wip/subchunk-snapshots, on the device:
#   1. the GPU suite;
#   2. interleaved A/B, forward+backward (fwd_ab.py): the branch at main's plans
#      (SUB_SNAPSHOTS=0, BWD_DM_STAGE=0, its DS = 0 instances, main's machine code byte for
#      byte) against its defaults (sub-chunk snapshots + the dM stage at the backward's halved
#      chunk), each twice (off/off2, new/new2: the spread between equal variants);
#      then the forward alone: the sub-chunk pass's cost, and the forward's code (main's source
#      with the CB argument against the branch's);
#   3. the full sweep (bench_gpu.py) with the branch's defaults.
# Run from the repository root on the device: bash benchmarks/subchunk_ab.sh
# SUITE=0 skips step 1 and SWEEP=0 step 3 (the three steps take about 200 + 300 + 250 s, more
# than one 600-second device command: the branch's suite passed on the H200 in stop 24).
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation .whl/*.whl -e . > ${OUT:-/tmp}/pip.log 2>&1
if [ "${SUITE:-1}" != 0 ]; then
  PYTEST_TIMEOUT=300 timeout 330 python3 benchmarks/gpu_check.py --no-bench --pytest-args "-n 16" 2>&1 | tail -8
fi
cd benchmarks
ab() { echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"; timeout 120 python3 fwd_ab.py "$@" 2>&1 | grep -E "^\| [a-z]|bitwise|Error|error|forward\+"; }
B=../kernels/sdm_bwd.cu
# main's backward is the branch's DS = 0 instances (the same machine code, NVRTC, stop 21);
# its source cannot stand in: it lacks the DS template argument that the launcher names
OFF=SUB_SNAPSHOTS=0,BWD_DM_STAGE=0
# the decisive cases first (a lease may end early): the headline and W = 8, then where the
# forward's pass cost goes, then the other shapes
fb() { ab off=$B@$OFF new=$B off2=$B@$OFF new2=$B --source bwd --backward --graph --reps 6 "$@"; }
fb
fb --W 8
# the narrower rule (stop 27): the dM stage only where it fits at the backward's own chunk, no
# sub-chunks (on the branch's plans that is W = 4 only, of these shapes)
for a in "--W 4" "--W 8" ""; do
  ab dm=$B@SUB_SNAPSHOTS=0 off=$B@$OFF dm2=$B@SUB_SNAPSHOTS=0 off2=$B@$OFF --source bwd --backward --graph --reps 6 $a
done
# the forward's cost of the sub-chunk snapshots (stop 24: +11.1% as a pass of its own): in the
# scatter's walk (the default), as the separate pass, none (wrong snapshots), the separate
# pass's scan alone (wrong), main's plans
F=../kernels/sdm_fwd.cu
ab fused=$F sep=$F:-DSDM_FWD_SUB_SEPARATE nopass=$F:-DSDM_FWD_NO_SUB_PASS "scan=$F:-DSDM_FWD_SUB_SEPARATE -DSDM_FWD_SUB_SCAN_ONLY" off=$F@$OFF --source fwd --graph --reps 8 --check
for a in "--W 32" "--hd 64" "--W 4"; do fb $a; done
ab off=$B@$OFF new=$B --source bwd --graph --reps 8   # the forward alone: the pass's cost
# the forward's code: main's source (CB accepted, unused) against the branch's, same plans
ab fmain=sdm_fwd_main.cu fnew=../kernels/sdm_fwd.cu fmain2=sdm_fwd_main.cu --source fwd --graph --reps 8
ab fmain=sdm_fwd_main.cu fnew=../kernels/sdm_fwd.cu fmain2=sdm_fwd_main.cu --source fwd --graph --reps 8 --W 8
echo "A/B done (elapsed $(( $(date +%s) - T0 )) s)"
if [ "${SWEEP:-1}" != 0 ]; then
  timeout 250 python3 bench_gpu.py --out ${OUT:-/tmp} 2>&1 | tail -24
fi
echo "total $(( $(date +%s) - T0 )) s"
