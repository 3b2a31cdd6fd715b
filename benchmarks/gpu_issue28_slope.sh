#!/usr/bin/env bash
# Issue 28's two slopes, with the pipelines running and no more processes than cores, on the
# GPU machine's 16 cores (the GPU is not used). Roots in /dev/shm, replicas=0, SAVES saves
# (default 20), ROUNDS rounds (default 3) taking turns:
# - within a node: a node of N beside a node of one (N + 1 processes: N = 1, 2, 4, 8), so
#   that a rank added to a node adds one process, never a node, and 8 ranks a node leave
#   7 cores free (the 2-node series of gpu_issue28_run.sh puts 16 processes on 16 cores)
#   -> $OUT/slope_node_size.json;
# - per node: nodes of 2 (2, 4 and 8 nodes), flat and per node in turns -> $OUT/slope_nodes.json.
# The progress in $OUT/slope.log, the table last. About 4 minutes.
# Usage: git rev-parse HEAD > commit.txt; OUT=/some/empty/dir bash benchmarks/gpu_issue28_slope.sh
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
echo "$(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(head -1 "$OUT/gpu.txt")" > "$OUT/slope.log"
rm -rf /dev/shm/ckpt-scale /tmp/slope_*.json
for round in $(seq 1 "${ROUNDS:-3}"); do
  for n in ${SIZES:-1 2 4 8}; do
    timeout -k 10 45 python3 benchmarks/bench_scale.py --ranks $((n + 1)) --node-sizes "$n,1" \
      --replicas 0 --saves "${SAVES:-20}" --control hier --dir /dev/shm/ckpt-scale \
      --timeout-s 40 --out "/tmp/slope_node_${n}_${round}.json" >> "$OUT/slope.log" 2>&1
    echo "a node of $n beside one, round $round: exit $? after ${SECONDS} s" >> "$OUT/slope.log"
  done
  timeout -k 10 120 python3 benchmarks/bench_scale.py --ranks "${NODES:-4,8,16}" --replicas 0 \
    --saves "${SAVES:-20}" --ranks-per-node 2 --control flat,hier --dir /dev/shm/ckpt-scale \
    --timeout-s 60 --out "/tmp/slope_nodes_${round}.json" >> "$OUT/slope.log" 2>&1
  echo "nodes of 2, round $round: exit $? after ${SECONDS} s" >> "$OUT/slope.log"
done
rm -rf /dev/shm/ckpt-scale
python3 - "$OUT" /tmp/slope_*.json <<'PY' 2>&1 | tee -a "$OUT/slope.log"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {p: json.load(open(p)) for p in sys.argv[2:]}
def commits(kind):
    table = {}
    for path, run in sorted(runs.items()):
        if (kind == "node") != ("slope_node_" in path):
            continue
        for c in run["configs"]:
            if c.get("status") != "ok":
                continue
            key = (c["node_sizes"][0] if kind == "node" else c["nodes"], c["control"])
            table.setdefault(key, []).append(c["aggregates"]["commit_stage_s"]["max_over_ranks"])
    return table
for kind, name, label in (("node", "slope_node_size.json", "a node of {} beside one"),
                          ("nodes", "slope_nodes.json", "{} nodes of 2")):
    table = commits(kind)
    rows = [{"size": k[0], "control": k[1], "commit_stage_max_s": v,
             "median_s": statistics.median(v)} for k, v in sorted(table.items())]
    first = next(iter(runs.values()))
    json.dump({"benchmark": f"scale_slope_{kind}", "machine": first["machine"],
               "rows": rows, "runs": {Path(p).name: r for p, r in runs.items()
                                      if (kind == "node") == ("slope_node_" in p)}},
              open(out / name, "w"), indent=1)
    for r in rows:
        print(f"{label.format(r['size']):>24} {r['control']:>5}: commit median "
              f"{r['median_s'] * 1e3:6.2f} ms ({', '.join(f'{x * 1e3:.2f}' for x in r['commit_stage_max_s'])})")
PY
grep -E "FAILED|exit [1-9]" "$OUT/slope.log" | head -8
