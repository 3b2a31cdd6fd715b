#!/usr/bin/env bash
# One call on nvidia-h200-x2: replication's cost to FSDP2 training on two GPUs as two nodes
# (bench_replication_fsdp.py, on the local disk), then the control plane's cost per save at
# 8 to 64 CPU ranks (bench_scale.py, /dev/shm), results under $OUT. Wheels: see gpu_run.sh.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
nproc >> "$OUT/gpu.txt"
timeout "${FSDP_LIMIT_S:-330}" python3 -m torch.distributed.run --nproc-per-node 2 \
  benchmarks/bench_replication_fsdp.py ${FSDP_ARGS:---steps 600 --every 200} \
  --dir /var/tmp --out "$OUT/replication_fsdp.json" > "$OUT/fsdp.log" 2>&1
echo "fsdp exit $?" >> "$OUT/fsdp.log"
if [ -n "${SCALE_RANKS:-}" ]; then
  timeout "${SCALE_LIMIT_S:-200}" python3 benchmarks/bench_scale.py --ranks "$SCALE_RANKS" \
    --replicas 0,1 --saves "${SCALE_SAVES:-6}" --out "$OUT/scale.json" > "$OUT/scale.log" 2>&1
  echo "scale exit $?" >> "$OUT/scale.log"
  tail -14 "$OUT/scale.log"
fi
grep -v '^W' "$OUT/fsdp.log" | tail -14
