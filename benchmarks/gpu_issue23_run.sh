#!/usr/bin/env bash
# One call on the GPU machine for issue 23 (the second redesign step, behaviour unchanged):
#   MODE=before  the training benchmark only (the pipeline's own variants), on the tree before
#   MODE=after   every gpu-marked test, the CUDA test set of gpu_issue22_run.sh, then the same
#                benchmark
# The three figures compared: training overhead (step-time ratio against no checkpointing in
# the same run), blocking per save (blocking_s) and restore time (restore_check.restore_s).
# Wheels the image lacks come from ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0 (.whl/).
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
MODE="${MODE:-after}"
if [ "$MODE" = after ]; then
  # shellcheck source=benchmarks/gpu_tests.sh
  . "$(dirname "$0")/gpu_tests.sh"
fi
(cd benchmarks && python3 bench_training.py --variants ckpt_pipeline,ckpt_pipeline_staged \
  --budget-s "${BUDGET_S:-300}" --hard-limit-s "${HARD_LIMIT_S:-360}" ${STEPS:+--steps "$STEPS"} \
  --out "$OUT/training_gpu_issue23_$MODE${STEPS:+_$STEPS}.json") > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
cat "$OUT/gpu.txt"
[ "$MODE" = after ] && tail -6 "$OUT/gpu_tests.log" && tail -4 "$OUT/cuda_set.log"
tail -30 "$OUT/bench.log"
