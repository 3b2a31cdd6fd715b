#!/usr/bin/env bash
# Issue 26 on one GPU machine. PART=1: the CUDA reshard test (two gloo ranks sharing the GPU
# save, one restores; and 1 -> 2) and the 2 -> 1 benchmark against 1 -> 1 (gpu_reshard.py,
# MIB MiB, REPEATS times). PART=2: every gpu-marked test and the CUDA test set
# (gpu_tests.sh). CPU=1 with PART=1: after the test, bench_reshard.py on this host's CPUs too
# (1 GiB, CPU_REPEATS rounds, default 3, within CPU_LIMIT s, default 240). Results under $OUT.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
if [ "${PART:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/reshard/test_reshard_gpu.py -rs \
    > "$OUT/reshard_gpu_test.log" 2>&1
  echo "reshard gpu test exit $?" >> "$OUT/reshard_gpu_test.log"
  if [ "${CPU:-0}" = 1 ]; then
    timeout -k 10 "${CPU_LIMIT:-240}" python3 benchmarks/bench_reshard.py \
      --repeats "${CPU_REPEATS:-3}" --root /tmp/reshard-bench \
      --out "$OUT/reshard_cpu_gpuhost.json" > "$OUT/reshard_cpu.log" 2>&1
    echo "bench_reshard exit $?" >> "$OUT/reshard_cpu.log"
    tail -n 14 "$OUT/reshard_cpu.log"
  fi
  timeout "${BENCH_LIMIT:-330}" python3 benchmarks/gpu_reshard.py --mib "${MIB:-4096}" \
    --repeats "${REPEATS:-3}" --dir /tmp --out "$OUT/reshard_gpu.json" > "$OUT/reshard_gpu.log" 2>&1
  echo "gpu reshard bench exit $?" >> "$OUT/reshard_gpu.log"
  cat "$OUT/gpu.txt"
  tail -n 15 "$OUT/reshard_gpu_test.log"
  tail -n 8 "$OUT/reshard_gpu.log"
else
  # shellcheck source=benchmarks/gpu_tests.sh
  . "$(dirname "$0")/gpu_tests.sh"
  rm -rf /dev/shm/ckpt-gpu-test-* /dev/shm/ckpt-test-* 2>/dev/null
  tail -n 3 "$OUT/gpu_tests.log" "$OUT/cuda_set.log"
  grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.log" "$OUT/cuda_set.log" | head -20
fi
