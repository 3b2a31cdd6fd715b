# Sourced by the gpu_*_run.sh scripts after gpu_env.sh, on the GPU machine: every gpu-marked
# test of the suite, then the CUDA test set (restores into live CUDA tensors, dtypes, save and
# restore, wait() failures) with its CPU cases too; logs and exit statuses under $OUT.
python3 -m pytest -q -p no:cacheprovider -m gpu tests -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_gpu.py \
  tests/restore/test_aliasing.py tests/restore/test_restore_atomic.py tests/save/test_dtypes.py \
  tests/pipeline/test_save_restore.py tests/pipeline/test_wait_failures.py -rs \
  > "$OUT/cuda_set.log" 2>&1
echo "cuda set exit $?" >> "$OUT/cuda_set.log"
