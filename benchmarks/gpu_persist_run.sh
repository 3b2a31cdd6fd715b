#!/usr/bin/env bash
# One call on the GPU machine for the persistent tier (issue 14): its GPU test, then the
# issue-4 training workload with and without persist_every=2 (a directory on the same disk as
# the local root stands in for the shared file system: the harshest case, both tiers write to
# one disk). Results under $OUT.
#   bash benchmarks/gpu_persist_run.sh            # OUT defaults to ./gpu-out
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider tests/persist/test_persist.py -m gpu -rs \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
(cd benchmarks && python3 bench_training.py --variants none,ckpt_pipeline,ckpt_pipeline_persist \
  --steps "${STEPS:-600}" --every "${EVERY:-100}" --skip-floors --no-restore-check \
  --budget-s "${BUDGET_S:-300}" --hard-limit-s "${HARD_LIMIT_S:-340}" \
  --out "$OUT/training_persist.json") > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
tail -3 "$OUT/gpu_tests.log"
tail -25 "$OUT/bench.log"
