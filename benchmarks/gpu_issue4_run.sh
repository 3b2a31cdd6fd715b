#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked tests (plus the direct-I/O and streamed-save
# tests on CUDA), then the training benchmark with every variant, results under $OUT.
#   bash benchmarks/gpu_issue4_run.sh            # OUT defaults to ./gpu-out
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
# Without a .git of its own (a `git archive`), say which commit this is: CKPT_BENCH_COMMIT.
if [ -z "${CKPT_BENCH_COMMIT:-}" ] && [ -f commit.txt ]; then
  export CKPT_BENCH_COMMIT="$(cat commit.txt)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/save/test_streamed.py \
  tests/save/test_direct_io.py -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
(cd benchmarks && python3 bench_training.py --budget-s "${BUDGET_S:-470}" \
  --hard-limit-s "${HARD_LIMIT_S:-530}" --out "$OUT/training_gpu.json") > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
tail -3 "$OUT/gpu_tests.log"
tail -30 "$OUT/bench.log"
