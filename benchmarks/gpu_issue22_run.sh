#!/usr/bin/env bash
# One call on the GPU machine for issue 22: every gpu-marked test in the suite, the CUDA test
# set of gpu_run.sh (restores into live CUDA tensors among them), then the training benchmark
# (the pipeline's own variants), results under $OUT. Wheels the image lacks come from
#   ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0        (into .whl/, carried along)
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
# shellcheck source=benchmarks/gpu_tests.sh
. "$(dirname "$0")/gpu_tests.sh"
(cd benchmarks && python3 bench_training.py --variants ckpt_pipeline,ckpt_pipeline_staged \
  --budget-s "${BUDGET_S:-300}" --hard-limit-s "${HARD_LIMIT_S:-360}" \
  --out "$OUT/training_gpu_issue22.json") > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
cat "$OUT/gpu.txt"
tail -6 "$OUT/gpu_tests.log"
tail -4 "$OUT/cuda_set.log"
tail -30 "$OUT/bench.log"
