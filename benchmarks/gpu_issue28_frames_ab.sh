#!/usr/bin/env bash
# A/B on the GPU machine's 16 cores (the GPU unused): the per-node control plane's commit with
# the tree at .ab_old (git worktree add --detach .ab_old <commit>, carried) against the
# working tree, in turns, on pretend nodes with no more ranks than cores. Made for the node
# stage's one frame a message (_hierarchy._FRAME_BYTES) against a length and then the bytes.
# ROUNDS rounds (default 3) of 2 nodes of 2, 4 and 8 ranks (SAVES saves, default 20), each
# tree in turn; then (unless NODES2=0) one round of nodes of 2 (4, 8, 16 ranks) each. Results
# under $OUT:
# frames_ab.json (every run's JSON and the medians), frames_ab.log; the table last.
# Usage: git worktree add --detach .ab_old OLD; git rev-parse HEAD > commit.txt;
#        OUT=/some/empty/dir bash benchmarks/gpu_issue28_frames_ab.sh  (carry .ab_old)
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
ulimit -n 65536 2>/dev/null || true
LOG="$OUT/frames_ab.log"
RUNS=/tmp/frames-ab-runs
rm -rf "$RUNS"; mkdir -p "$RUNS"
echo "$(nproc) cores; $(head -1 "$OUT/gpu.txt"); old $(cd .ab_old && git rev-parse --short HEAD 2>/dev/null || echo '?')" > "$LOG"
run() {  # TREE RANKS PER_NODE NAME
  rm -rf /dev/shm/ckpt-ab
  (cd "$1" && PYTHONPATH="/tmp/site:$PWD" timeout -k 10 60 python3 benchmarks/bench_scale.py \
    --ranks "$2" --replicas 0 --saves "${SAVES:-20}" --ranks-per-node "$3" --control hier \
    --dir /dev/shm/ckpt-ab --timeout-s 50 --out "$RUNS/ab_$4.json" >> "$LOG" 2>&1)
  echo "$4: exit $? after ${SECONDS} s" >> "$LOG"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for size in 2 4 8; do
    for tree in old new; do
      dir=.; [ "$tree" = old ] && dir=.ab_old
      run "$dir" $((2 * size)) "$size" "node_${size}_${tree}_${round}"
    done
  done
done
for ranks in $([ "${NODES2:-1}" = 1 ] && echo 4 8 16); do
  for tree in old new; do
    dir=.; [ "$tree" = old ] && dir=.ab_old
    run "$dir" "$ranks" 2 "nodes2_${ranks}_${tree}"
  done
done
rm -rf /dev/shm/ckpt-ab
python3 - "$OUT/frames_ab.json" "$RUNS"/ab_*.json <<'PY' >> "$LOG" 2>&1
import json, os, statistics, sys
runs = {os.path.basename(p)[3:-5]: json.load(open(p)) for p in sys.argv[2:]}
rows = {}
for name, run in sorted(runs.items()):
    kind, a, tree = name.split("_")[:3]
    for c in run["configs"]:
        if c.get("status") == "ok":
            key = f"{kind} {a} {tree}"
            rows.setdefault(key, []).append(c["aggregates"]["commit_stage_s"]["max_over_ranks"])
table = {k: {"commit_stage_max_s": v, "median_s": statistics.median(v)} for k, v in rows.items()}
first = next(iter(runs.values()))
json.dump({"benchmark": "frames_ab", "machine": first["machine"], "args": first["args"],
           "medians": table, "runs": runs}, open(sys.argv[1], "w"), indent=1)
for k, row in sorted(table.items()):
    print(f"{k}: commit max over ranks, median {row['median_s']*1e3:.2f} ms "
          f"({', '.join(f'{x*1e3:.2f}' for x in row['commit_stage_max_s'])})")
PY
grep -E "exit [^0]|Error" "$LOG" | head -5
grep -E "commit max over ranks" "$LOG"
