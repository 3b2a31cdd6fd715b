#!/usr/bin/env bash
# Issue 28 on the GPU machine (its 16 cores; the GPU is not used): bench_scale.py at 8, 16, 32,
# 64 and 128 ranks on pretend nodes of 8 ranks, roots in /dev/shm, the flat control plane and
# the per-node one taking turns in the same run -> $OUT/scale_hier.json, the progress in
# $OUT/scale.log, the table last. Then, with no more ranks than cores, how the per-node commit
# grows with the nodes (nodes of 2: 4, 8 and 16 ranks -> $OUT/scale_nodes.json) and with the
# ranks of a node (2 nodes of 2, 4 and 8 -> $OUT/scale_node_size_{2,4,8}.json). About 5
# minutes on 16 cores; every configuration is bounded by TIMEOUT_S (default 200 s) and the
# first run by LIMIT (default 330 s); MAIN=0 leaves the first run out. RESHARD=1 then runs issue 26's bench_reshard.py on this
# host's CPUs (1 GiB, RESHARD_REPEATS rounds (1), within RESHARD_LIMIT, default 150 s) -> $OUT/reshard_*.json.
# Revised for the point-to-point node stage: the runs with no more ranks than cores come first
# (a quiet machine), each 2-node series NODE_REPEATS times (default 3) with SAVES saves (20),
# merged into $OUT/scale_node_size.json.
# Usage: git rev-parse HEAD > commit.txt; OUT=/some/empty/dir bash benchmarks/gpu_issue28_run.sh
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
RANKS="${RANKS:-8,16,32,64,128}"
ulimit -n 65536 2>/dev/null || true  # 128 gloo ranks in full mesh, several groups each
echo "open files: $(ulimit -n); $(nproc) cores; $(head -1 "$OUT/gpu.txt")" > "$OUT/scale.log"
rm -rf /dev/shm/ckpt-scale
# Quiet machine first: the slope within a node (2 nodes of 2, 4 and 8 ranks), NODE_REPEATS
# rounds taking turns (default 3), then the slope per node (nodes of 2), then the big run.
for round in $(seq 1 "${NODE_REPEATS:-3}"); do
  for size in 2 4 8; do
    timeout -k 10 40 python3 benchmarks/bench_scale.py --ranks $((2 * size)) --replicas 0 \
      --saves "${SAVES:-20}" --ranks-per-node "$size" --control hier --dir /dev/shm/ckpt-scale \
      --timeout-s 35 --out "/tmp/node_size_${size}_${round}.json" >> "$OUT/scale.log" 2>&1
    echo "2 nodes of $size, round $round: exit $? after ${SECONDS} s" >> "$OUT/scale.log"
  done
done
python3 - "$OUT/scale_node_size.json" /tmp/node_size_*.json <<'PY' >> "$OUT/scale.log" 2>&1
import json, statistics, sys
runs = [json.load(open(p)) for p in sys.argv[2:]]
by_size = {}
for run in runs:
    for c in run["configs"]:
        if c.get("status") == "ok":
            per_node = c["ranks"] // c["nodes"]
            by_size.setdefault(per_node, []).append(c["aggregates"]["commit_stage_s"]["max_over_ranks"])
table = {size: {"commit_stage_max_s": v, "median_s": statistics.median(v)} for size, v in sorted(by_size.items())}
json.dump({"benchmark": "scale_node_size", "machine": runs[0]["machine"], "args": runs[0]["args"],
           "by_ranks_per_node": table, "runs": runs}, open(sys.argv[1], "w"), indent=1)
for size, row in table.items():
    print(f"2 nodes of {size}: commit max over ranks, median of rounds {row['median_s']*1e3:.2f} ms "
          f"({', '.join(f'{x*1e3:.2f}' for x in row['commit_stage_max_s'])})")
PY
rm -rf /dev/shm/ckpt-scale
timeout -k 10 90 python3 benchmarks/bench_scale.py --ranks 4,8,16 --replicas 0 --saves "${SAVES:-20}" \
  --ranks-per-node 2 --control flat,hier --dir /dev/shm/ckpt-scale --timeout-s 60 \
  --out "$OUT/scale_nodes.json" >> "$OUT/scale.log" 2>&1
echo "nodes of 2: exit $? after ${SECONDS} s" >> "$OUT/scale.log"
rm -rf /dev/shm/ckpt-scale
if [ "${MAIN:-1}" = 1 ]; then  # MAIN=0: only the runs with no more ranks than cores
  timeout -k 10 "${LIMIT:-330}" python3 benchmarks/bench_scale.py --ranks "$RANKS" \
    --replicas 0 --saves 10 --ranks-per-node 8 --control flat,hier --dir /dev/shm/ckpt-scale \
    --timeout-s "${TIMEOUT_S:-200}" --out "$OUT/scale_hier.json" >> "$OUT/scale.log" 2>&1
  echo "bench_scale exit $? after ${SECONDS} s" >> "$OUT/scale.log"
fi
rm -rf /dev/shm/ckpt-scale
if [ "${RESHARD:-0}" = 1 ]; then  # issue 26 on this host's CPUs (1 GiB, 4->2, 2->4, baselines)
  timeout -k 10 "${RESHARD_LIMIT:-150}" python3 benchmarks/bench_reshard.py --repeats "${RESHARD_REPEATS:-1}" \
    --root /tmp/reshard-bench --out "$OUT/reshard_cpu_gpuhost.json" > "$OUT/reshard.log" 2>&1
  echo "bench_reshard exit $? after ${SECONDS} s" >> "$OUT/reshard.log"
  tail -n 12 "$OUT/reshard.log"
fi
grep -E "^(error|warning)|Error" "$OUT/scale.log" | head -8
grep -E "^ +[0-9]+ +0 +(ok|failed)|exit|^2 nodes of" "$OUT/scale.log" | tail -n 40
