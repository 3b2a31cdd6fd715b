#!/usr/bin/env bash
# One call on the GPU machine: the tests that exercise CUDA (every gpu-marked test, and the
# suites whose cases run on CUDA when it is there), then the training benchmark, results under
# $OUT. The machine's image lacks a few wheels: fetch them first with
#   ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0        (into .whl/, carried along)
# Environment: VARIANTS (default: the pipeline's own variants; "all" for every peer),
# BENCH_ARGS (extra arguments for bench_training.py), TESTS (default: the CUDA test set).
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
if [ -z "${CKPT_BENCH_COMMIT:-}" ] && [ -f commit.txt ]; then
  export CKPT_BENCH_COMMIT="$(cat commit.txt)"
fi
TESTS="${TESTS:-tests/test_gpu.py tests/save/test_streamed.py tests/save/test_direct_io.py tests/save/test_dtypes.py tests/save/test_layout.py tests/restore/test_restore_atomic.py tests/restore/test_adopt.py tests/format/test_format_v1.py tests/pipeline/test_concurrent_use.py tests/pipeline/test_save_restore.py}"
# shellcheck disable=SC2086
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" $TESTS -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
variants="${VARIANTS:-ckpt_pipeline,ckpt_pipeline_staged}"
variant_args=(--variants "$variants")
[ "$variants" = "all" ] && variant_args=()
# shellcheck disable=SC2086
(cd benchmarks && python3 bench_training.py "${variant_args[@]}" ${BENCH_ARGS:-} \
  --budget-s "${BUDGET_S:-420}" --hard-limit-s "${HARD_LIMIT_S:-480}" \
  --out "$OUT/training_gpu.json") > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
tail -4 "$OUT/gpu_tests.log"
tail -30 "$OUT/bench.log"
