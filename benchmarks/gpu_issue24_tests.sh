#!/usr/bin/env bash
# Issue 24 on one GPU machine, part 1: the memory tier's buffer (gpu_shm_check.py), every
# gpu-marked test (the memory tier's among them) and the CUDA test set (gpu_tests.sh).
# Results under $OUT: shm_check.json, gpu_tests.log, cuda_set.log.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
timeout 120 python3 benchmarks/gpu_shm_check.py --gib 4 --out "$OUT/shm_check.json" \
  > "$OUT/shm_check.log" 2>&1
echo "shm check exit $?" >> "$OUT/shm_check.log"
# shellcheck source=benchmarks/gpu_tests.sh
. "$(dirname "$0")/gpu_tests.sh"
rm -rf /dev/shm/ckpt-gpu-test-* /dev/shm/ckpt-test-* 2>/dev/null
cat "$OUT/gpu.txt" "$OUT/shm_check.log"
tail -n 3 "$OUT/gpu_tests.log" "$OUT/cuda_set.log"
grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" "$OUT/cuda_set.log" | head -20
