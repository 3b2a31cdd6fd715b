#!/usr/bin/env bash
# A/B on one GPU machine: the CUDA restore of gpu_reshard.py (1 -> 1 and 2 -> 1, MIB MiB,
# REPEATS restores) with the tree at .ab_old (git worktree add --detach .ab_old <commit>,
# carried) against the working tree, one after the other on the same machine. Made for the
# host buffer's making at open against after the restore (pool_prep). Results under $OUT.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
run() {  # NAME DIR
  (cd "$2" && PYTHONPATH="/tmp/site:$PWD" timeout "${CASE_LIMIT:-150}" python3 \
    benchmarks/gpu_reshard.py --mib "${MIB:-2048}" --repeats "${REPEATS:-3}" --dir /tmp \
    --out "$OUT/reshard_$1.json" > "$OUT/reshard_$1.log" 2>&1
   echo "$1 exit $?" >> "$OUT/reshard_$1.log")
  echo "== $1"; tail -n 5 "$OUT/reshard_$1.log"
}
cat "$OUT/gpu.txt"
run old .ab_old
run new .
