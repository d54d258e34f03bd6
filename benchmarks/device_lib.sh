# The device scripts' common part (device_main.sh, stop33_ab.sh, stop34_ab.sh, ...): source it
# from the repository root (BUDGET defaults to 300 s). It prints the card with its clocks, power
# cap and temperature (timings vary between leases of one kind: stop 30's H200 ran the pre-pass
# in 0.166 ms, stop 31's in 0.130-0.144), installs the carried wheels (.whl: FLA for the
# benchmarks) and the checkout without the registry, and defines B and F (the backward's and
# the forward's source, as fwd_ab.py's variants name them from benchmarks/) and:
#   left            seconds left of BUDGET since the source
#   run_suite S     the GPU suite (benchmarks/gpu_check.py, 16 workers) for at most S seconds;
#                   the deadline covers the modules' warm-up too (stop 30, H200: 70 s of
#                   warm-up, and an outer timeout alone cut gpu_check before it printed)
#   run_bench S     bench_gpu.py --quick for at most S seconds (the headline cases and FLA's
#                   anchor; its JSON and plot go to $OUT)
#   run_sanitize S  benchmarks/sanitize.py, every tool (memcheck first), S seconds
#   suite_step      the stop scripts' suite: run_suite for the time left less 10 s, at most
#                   SUITE_S (which leaves the rest to later steps)
#   bench_step      run_bench for the time left, at most BENCH_S (which leaves the rest to
#                   later steps)
#   ab ARGS         benchmarks/fwd_ab.py ARGS in benchmarks/ (variant files relative to it) for
#                   at most ABT seconds (default 150), its table and check lines only; the
#                   whole output also goes to $OUT/ab.log, which comes back with the call
#                   (`python benchmarks/plot_ab.py ab.log --out ab.png` plots its tables)
ROOT=$(pwd)
T0=$(date +%s)
BUDGET=${BUDGET:-300}
B=../kernels/sdm_bwd.cu
F=../kernels/sdm_fwd.cu
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu \
    --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation $(ls .whl/*.whl 2>/dev/null) -e . \
    > ${OUT:-/tmp}/pip.log 2>&1 || { echo "pip install failed:"; tail -5 ${OUT:-/tmp}/pip.log; }
run_suite() {
  (cd "$ROOT" && PYTEST_TIMEOUT=$1 PYTEST_DEADLINE=$(( $(date +%s) + $1 - 15 )) timeout $1 \
     python3 benchmarks/gpu_check.py --no-bench --pytest-args "-n 16" 2>&1 | tail -8)
}
run_bench() {
  (cd "$ROOT/benchmarks" && timeout $1 python3 bench_gpu.py --quick --out ${OUT:-.} 2>&1 \
     | tail -16)
}
run_sanitize() {
  (cd "$ROOT" && timeout $(( $1 + 15 )) python3 benchmarks/sanitize.py --timeout $1 \
     --tools memcheck,synccheck,racecheck,initcheck 2>&1 | tail -14)
}
ab() {
  echo "== $* (elapsed $(( $(date +%s) - T0 )) s)"
  (cd "$ROOT/benchmarks" && timeout ${ABT:-150} python3 fwd_ab.py "$@" 2>&1 \
     | tee -a ${OUT:-/tmp}/ab.log | grep -E "^\| [a-z]|bitwise|Error|error|forward")
}
suite_step() {
  local L=$(( $(left) - 10 ))
  L=$(( ${SUITE_S:-$L} < L ? ${SUITE_S:-$L} : L ))
  echo "== suite, ${L} s"
  run_suite $L
}
bench_step() {
  local L=$(left)
  L=$(( ${BENCH_S:-$L} < L ? ${BENCH_S:-$L} : L ))
  echo "== bench, ${L} s"
  run_bench $L
}
