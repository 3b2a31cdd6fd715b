#!/usr/bin/env bash
# On the GPU machine's 16 cores (the GPU unused): the per-node control plane's commit on ONE
# pretend node of 2, 4, 8 and 16 ranks, so that the node stage is all that grows (the leaders'
# exchange has one member) and, up to 8 ranks, at most half the cores are busy. ROUNDS rounds
# (default 3) of hier, each size in turn, then FLAT_ROUNDS rounds (default 1) of the flat
# control plane at the same sizes; SAVES saves each (default 20). -> $OUT/one_node.json (every
# run's JSON and the medians), $OUT/one_node.log; the table last.
# Then, with RESHARD=1, issue 26's 4 -> 2 reshard with its phases timed (CKPT_BENCH_PHASES=1),
# its roots in /tmp (the disk's file system) and in /dev/shm, and with io_threads=1 in /tmp
# -> $OUT/reshard_{tmp,shm,tmp_t1}.json.
# Usage: git rev-parse HEAD > commit.txt; OUT=/some/empty/dir bash benchmarks/gpu_issue28_one_node.sh
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/one_node.log"
RUNS=/tmp/one-node-runs
rm -rf "$RUNS"; mkdir -p "$RUNS"
echo "$(nproc) cores; $(head -1 "$OUT/gpu.txt")" > "$LOG"
run() {  # CONTROL RANKS NAME
  rm -rf /dev/shm/ckpt-one
  timeout -k 10 60 python3 benchmarks/bench_scale.py --ranks "$2" --replicas 0 \
    --saves "${SAVES:-20}" --ranks-per-node "$2" --control "$1" --dir /dev/shm/ckpt-one \
    --timeout-s 50 --out "$RUNS/one_$3.json" >> "$LOG" 2>&1
  echo "$3: exit $? after ${SECONDS} s" >> "$LOG"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for size in 2 4 8 16; do run hier "$size" "hier_${size}_${round}"; done
done
for round in $(seq 1 "${FLAT_ROUNDS:-1}"); do
  for size in 2 4 8 16; do run flat "$size" "flat_${size}_${round}"; done
done
rm -rf /dev/shm/ckpt-one
python3 - "$OUT/one_node.json" "$RUNS"/one_*.json <<'PY' >> "$LOG" 2>&1
import json, os, statistics, sys
runs = {os.path.basename(p)[4:-5]: json.load(open(p)) for p in sys.argv[2:]}
rows = {}
for name, run in runs.items():
    control, size = name.split("_")[:2]
    for c in run["configs"]:
        if c.get("status") == "ok":
            row = rows.setdefault((control, int(size)), {"commit": [], "vote": []})
            row["commit"].append(c["aggregates"]["commit_stage_s"]["max_over_ranks"])
            row["vote"].append(c["cross_rank"]["commit_after_last_shard_s"]["median"])
table = {f"{c} {n}": {"commit_stage_max_s": r["commit"], "median_s": statistics.median(r["commit"]),
                      "vote_s": r["vote"], "vote_median_s": statistics.median(r["vote"])}
         for (c, n), r in sorted(rows.items())}
first = next(iter(runs.values()))
json.dump({"benchmark": "one_node", "machine": first["machine"], "args": first["args"],
           "medians": table, "runs": runs}, open(sys.argv[1], "w"), indent=1)
for k, row in table.items():
    print(f"one node, {k} ranks: commit max over ranks, median {row['median_s']*1e3:.2f} ms "
          f"({', '.join(f'{x*1e3:.2f}' for x in row['commit_stage_max_s'])}); "
          f"vote {row['vote_median_s']*1e3:.2f} ms")
PY
if [ "${RESHARD:-0}" = 1 ]; then
  for where in tmp shm tmp_t1; do
    root=/tmp/rph; [ "$where" = shm ] && root=/dev/shm/rph
    threads=0; [ "$where" = tmp_t1 ] && threads=1
    CKPT_BENCH_PHASES=1 CKPT_BENCH_IO_THREADS=$threads timeout -k 10 "${RESHARD_LIMIT:-100}" \
      python3 benchmarks/bench_reshard.py --repeats "${RESHARD_REPEATS:-2}" --cases 4to2 \
      --root "$root" --out "$OUT/reshard_$where.json" > "$OUT/reshard_$where.log" 2>&1
    echo "reshard $where: exit $? after ${SECONDS} s" >> "$LOG"
    rm -rf "$root"
    grep -E "4 ?-> ?2|4to2" "$OUT/reshard_$where.log" | head -3 >> "$LOG"
  done
fi
grep -E "exit [^0]|Error" "$LOG" | head -5
grep -E "^one node|^reshard|4to2|4 -> 2" "$LOG"
