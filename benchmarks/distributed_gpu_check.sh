#!/usr/bin/env bash
# The 2-GPU check of the distributed issue, in one call on a machine with 2 CUDA devices:
# the gpu-marked tests (FSDP2 with NCCL training and the gloo control plane included), then the
# FSDP2 example under torchrun: a run killed with SIGKILL after two commits, the resume, and a
# final no-op resume. Logs and a summary go to $OUT (or ./distributed-gpu-check).
set -uo pipefail
out="${OUT:-distributed-gpu-check}"
mkdir -p "$out"
root="$(mktemp -d)/ckpt"
log="$out/example_killed.log"

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
python3 -m pytest tests/test_gpu.py tests/coordination/test_fsdp.py -v -p no:cacheprovider 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed"

run_example() {
  python3 -m torch.distributed.run --nproc-per-node 2 examples/train_distributed.py --device cuda --root "$root" \
    --steps 400 --save-every 50 "$@"
}

# 1. a run killed with SIGKILL once two saves are committed
setsid python3 -m torch.distributed.run --nproc-per-node 2 examples/train_distributed.py --device cuda --root "$root" \
  --steps 400 --save-every 50 --fresh --sleep-per-step 0.02 >"$log" 2>&1 &
leader=$!
for _ in $(seq 1 600); do
  [ "$(grep -c 'committed step' "$log")" -ge 2 ] && break
  kill -0 "$leader" 2>/dev/null || break
  sleep 0.2
done
kill -9 -- "-$leader" 2>/dev/null
pkill -9 -f "examples/train_distributed.py" 2>/dev/null  # torchrun's workers have their own groups
wait "$leader" 2>/dev/null
echo "== killed run (last lines)"; grep -v '^W' "$log" | tail -4

# 2. resume to the end, 3. resume again: nothing left to train
run_example 2>&1 | tee "$out/example_resumed.log" | grep -v '^W' | tail -6
run_example 2>&1 | tee "$out/example_noop.log" | grep -v '^W' | tail -3
