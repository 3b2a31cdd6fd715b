#!/usr/bin/env bash
# One call on the GPU machine for issue 27 (the integrations' blocking time, on CUDA), from the
# repository root with $OUT set, within LIMIT seconds (default 540: a call allows 600):
#   1. bench_lightning.py, bench_transformers.py and bench_accelerate.py with --device cuda
#      (a state of about 1 GB each) -> $OUT/{lightning,transformers,accelerate}_ckpt_cuda.json;
#      their output, after the GPU's name from gpu_env.sh, in $OUT/bench.log
#   2. every gpu-marked test of the suite                         -> $OUT/gpu_tests.log
#   3. tests/integrations, its gpu tests included, then its slow (multi-process) tests in what
#      is left of LIMIT: together `-m "gpu or not gpu"`       -> $OUT/integrations.log
# then the table of the three results (benchmarks/_call_timing.py) and the tests' summaries.
# Each step runs under `timeout`, capped so that the later steps keep their minimum; a step
# left with less than 30 s is skipped and says so. About 6 minutes on one H100 or H200.
# Wheels the image lacks (.whl/, carried): ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0
# Usage: git rev-parse HEAD > commit.txt; OUT=/some/empty/dir bash benchmarks/gpu_issue27_run.sh
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
LIMIT="${LIMIT:-540}"
BENCH_LOG="$OUT/bench.log"
mv "$OUT/gpu.txt" "$BENCH_LOG"  # the GPU's name, memory and driver head the benchmarks' log

run_step() {  # NAME CAP RESERVE LOG COMMAND...: at most CAP s, leaving RESERVE s of LIMIT
  local name=$1 cap=$2 reserve=$3 log=$4
  shift 4
  local left=$(( LIMIT - SECONDS - reserve ))
  local limit=$(( left < cap ? left : cap ))
  if [ "$limit" -lt 30 ]; then
    echo "$name: skipped ($limit s left of LIMIT=$LIMIT at ${SECONDS} s)" | tee -a "$log"
    return
  fi
  echo "== $name (timeout $limit s, at ${SECONDS} s)" >> "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  echo "$name: exit $? at ${SECONDS} s" | tee -a "$log"
}

#        name         cap reserve log  command...
run_step lightning     110 300 "$BENCH_LOG" python3 benchmarks/bench_lightning.py --device cuda \
  --out "$OUT/lightning_ckpt_cuda.json"
run_step transformers  120 240 "$BENCH_LOG" python3 benchmarks/bench_transformers.py \
  --device cuda --out "$OUT/transformers_ckpt_cuda.json"
run_step accelerate     90 200 "$BENCH_LOG" python3 benchmarks/bench_accelerate.py --device cuda \
  --out "$OUT/accelerate_ckpt_cuda.json"
run_step "gpu tests"   180  90 "$OUT/gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests -rs
run_step integrations  120  30 "$OUT/integrations.log" python3 -m pytest -q -p no:cacheprovider \
  tests/integrations -m "gpu or not slow" -rs
run_step "integrations slow" 300 0 "$OUT/integrations.log" python3 -m pytest -q \
  -p no:cacheprovider tests/integrations -m "slow and not gpu" -rs

echo "== issue 27 on $(head -1 "$BENCH_LOG"), ${SECONDS} s"
python3 benchmarks/_call_timing.py "$OUT"/lightning_ckpt_cuda.json \
  "$OUT"/transformers_ckpt_cuda.json "$OUT"/accelerate_ckpt_cuda.json
grep -E "Error|Traceback" "$BENCH_LOG" | tail -6
for log in gpu_tests integrations; do
  echo "== $log"
  [ -f "$OUT/$log.log" ] || continue
  grep -E "^(FAILED|ERROR) |^SKIPPED" "$OUT/$log.log" | head -12
  grep -E "[0-9]+ (passed|failed|error)|no tests ran|: (exit|skipped)" "$OUT/$log.log" | tail -4
done
