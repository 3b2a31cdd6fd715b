#!/usr/bin/env bash
# One call on the GPU machine for the persistent tier (issue 14): its GPU test, then the
# issue-4 training workload without checkpoints, with them, and with persist_every=2 to a
# directory tier in two places:
#   ckpt_pipeline_persist      on the same disk as the local root (both tiers share one disk:
#                              the harshest case, more bytes per second than the disk writes)
#   ckpt_pipeline_persist_shm  in /dev/shm (a tier with a bandwidth of its own, as a shared
#                              file system or object store has; the upload still reads the
#                              local files and copies every byte)
# Before them, the restore from the persistent tier (bench_persist_restore.py: streamed against
# download-then-load). Results under $OUT; the last lines are a table of the ratios.
#   bash benchmarks/gpu_persist_run.sh            # OUT defaults to ./gpu-out
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
if [ -z "${TRAINING_ONLY:-}" ]; then  # TRAINING_ONLY=1: the training benchmark alone
  python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/persist/test_persist.py} -m gpu \
    -rs > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
  python3 benchmarks/bench_persist_restore.py --gb "${RESTORE_GB:-4}" --repeats 3 \
    --out "$OUT/persist_restore.json" > "$OUT/restore.log" 2>&1
  echo "restore bench exit $?" >> "$OUT/restore.log"
fi
(cd benchmarks && python3 bench_training.py \
  --variants "${VARIANTS:-none,ckpt_pipeline,ckpt_pipeline_persist,ckpt_pipeline_persist_shm}" \
  --steps "${STEPS:-600}" --every "${EVERY:-100}" --skip-floors --no-restore-check \
  --budget-s "${BUDGET_S:-360}" --hard-limit-s "${HARD_LIMIT_S:-400}" \
  --out "$OUT/training_persist.json") > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
[ -n "${TRAINING_ONLY:-}" ] || { tail -3 "$OUT/gpu_tests.log"; tail -7 "$OUT/restore.log"; }
tail -8 "$OUT/bench.log"
python3 - "$OUT/training_persist.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
base = s.get("ckpt_pipeline", {}).get("total_s")
print(f"{'variant':28} {'x none':>8} {'x no-persist':>12} {'block med ms':>12} {'block max ms':>12}")
for name in ("ckpt_pipeline", "ckpt_pipeline_persist", "ckpt_pipeline_persist_shm"):
    v = s.get(name)
    if not v:
        continue
    rel = v["total_s"] / base if base else float("nan")
    print(f"{name:28} {v['overhead_ratio']:8.4f} {rel:12.4f} {v['blocking_median_ms'] or 0:12.1f}"
          f" {v['blocking_max_ms'] or 0:12.1f}")
PY
