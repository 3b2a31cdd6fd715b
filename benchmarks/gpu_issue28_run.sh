#!/usr/bin/env bash
# Issue 28 on the GPU machine (its 16 cores; the GPU is not used): bench_scale.py at 8, 16, 32,
# 64 and 128 ranks on pretend nodes of 8 ranks, roots in /dev/shm, the flat control plane and
# the per-node one taking turns in the same run -> $OUT/scale_hier.json, the progress in
# $OUT/scale.log, the table last. About 4 minutes on 16 cores; every configuration is bounded
# by TIMEOUT_S (default 200 s) and the whole by LIMIT (default 540 s).
# Usage: git rev-parse HEAD > commit.txt; OUT=/some/empty/dir bash benchmarks/gpu_issue28_run.sh
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
RANKS="${RANKS:-8,16,32,64,128}"
ulimit -n 65536 2>/dev/null || true  # 128 gloo ranks in full mesh, several groups each
echo "open files: $(ulimit -n); $(nproc) cores; $(head -1 "$OUT/gpu.txt")" > "$OUT/scale.log"
rm -rf /dev/shm/ckpt-scale
timeout -k 10 "${LIMIT:-540}" python3 benchmarks/bench_scale.py --ranks "$RANKS" --replicas 0 \
  --saves 10 --ranks-per-node 8 --control flat,hier --dir /dev/shm/ckpt-scale \
  --timeout-s "${TIMEOUT_S:-200}" --out "$OUT/scale_hier.json" >> "$OUT/scale.log" 2>&1
echo "bench_scale exit $? after ${SECONDS} s" >> "$OUT/scale.log"
rm -rf /dev/shm/ckpt-scale
grep -E "^(error|warning)|Error" "$OUT/scale.log" | head -8
tail -n 16 "$OUT/scale.log"
