#!/usr/bin/env bash
# A/B on the GPU machine's 16 cores (the GPU unused): bench_reshard.py with the tree at .ab_old
# (git worktree add --detach .ab_old <commit>, carried) against the working tree, in turns,
# ROUNDS rounds (default 3) of one repeat each, the cases in CASES (default 4to2,2to4,2to2,4to4),
# every round with DCP in the same job. Made for the reading groups' cut (738580d) against the
# tree before it. Results under $OUT: ab_<tree>_<round>.json, reshard_ab.log, reshard_ab.json
# (the medians per tree); the table last.
# Usage: git worktree add --detach .ab_old OLD; git rev-parse HEAD > commit.txt;
#        OUT=/some/empty/dir bash benchmarks/gpu_issue26_ab.sh  (carry .ab_old)
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/reshard_ab.log"
echo "$(nproc) cores; $(head -1 "$OUT/gpu.txt"); old $(cd .ab_old && git rev-parse --short HEAD 2>/dev/null || echo '?')" > "$LOG"
for round in $(seq 1 "${ROUNDS:-3}"); do
  for tree in old new; do
    dir=.; [ "$tree" = old ] && dir=.ab_old
    (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" timeout -k 10 "${LIMIT:-90}" python3 \
      benchmarks/bench_reshard.py --repeats 1 --cases "${CASES:-4to2,2to4,2to2,4to4}" \
      --root /tmp/reshard-ab --out "$OUT/ab_${tree}_${round}.json" >> "$LOG" 2>&1)
    echo "${tree} round ${round}: exit $? after ${SECONDS} s" >> "$LOG"
  done
done
python3 - "$OUT/reshard_ab.json" "$OUT"/ab_*.json <<'PY' >> "$LOG" 2>&1
import json, os, statistics, sys
rows = {}
for p in sys.argv[2:]:
    tree = os.path.basename(p).split("_")[1]
    run = json.load(open(p))
    for case, libs in run["median_s"].items():
        for lib, s in libs.items():
            rows.setdefault((case, tree, lib), []).append(s)
med = {f"{c} {t} {lib}": {"seconds": v, "median_s": statistics.median(v)}
       for (c, t, lib), v in sorted(rows.items())}
json.dump({"benchmark": "reshard_ab", "medians": med}, open(sys.argv[1], "w"), indent=1)
for case in sorted({c for c, _, _ in rows}):
    for tree in ("old", "new"):
        ours = statistics.median(rows.get((case, tree, "ckpt_pipeline"), [float("nan")]))
        dcp = statistics.median(rows.get((case, tree, "dcp"), [float("nan")]))
        print(f"{case} {tree}: ckpt_pipeline {ours:.3f} s, dcp {dcp:.3f} s, dcp/ours {dcp/ours:.2f}")
PY
grep -E "exit [^0]|Error" "$LOG" | head -5
grep -E "dcp/ours" "$LOG"
