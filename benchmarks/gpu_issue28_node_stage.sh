#!/usr/bin/env bash
# On the GPU machine's 16 cores (the GPU unused): the control plane's exchange alone as a node
# grows (probe_node_stage.py: a node of N and a node of one, two nodes of N, flat on N + 1;
# no pipeline running, a core a process), ROUNDS rounds (default 3) of SIZES (default
# 1,2,4,8,15) -> $OUT/node_stage.json, $OUT/node_stage.log.
# Then, with RESHARD=1, issue 26's 4 -> 2 reshard with its phases timed (CKPT_BENCH_PHASES=1):
# this tree with its roots in /tmp (the disk's file system), the tree at .ab_old (git worktree
# add --detach .ab_old OLD; git -C .ab_old rev-parse HEAD > .ab_old/commit.txt; carried; left
# out when absent) in /tmp, this tree in /dev/shm
# -> $OUT/reshard_{tmp,old_tmp,shm}.json.
# Usage: git rev-parse HEAD > commit.txt; OUT=/some/empty/dir bash benchmarks/gpu_issue28_node_stage.sh
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/node_stage.log"
echo "$(nproc) cores; $(head -1 "$OUT/gpu.txt")" > "$LOG"
timeout -k 10 "${PROBE_LIMIT:-300}" python3 benchmarks/probe_node_stage.py \
  --sizes "${SIZES:-1,2,4,8,15}" --rounds "${ROUNDS:-3}" --exchanges "${EXCHANGES:-400}" \
  --out "$OUT/node_stage.json" >> "$LOG" 2>&1
echo "probe_node_stage: exit $? after ${SECONDS} s" >> "$LOG"
if [ "${RESHARD:-0}" = 1 ]; then
  # this tree in /tmp, the tree at .ab_old (when carried) in /tmp, this tree in /dev/shm
  for where in tmp old_tmp shm; do
    root=/tmp/rph; [ "$where" = shm ] && root=/dev/shm/rph
    dir=.; [ "$where" = old_tmp ] && dir=.ab_old
    [ -d "$dir/benchmarks" ] || continue
    (cd "$dir" && { [ ! -f commit.txt ] || export CKPT_BENCH_COMMIT="$(head -c 12 commit.txt)"; } \
      && CKPT_BENCH_PHASES=1 PYTHONPATH="/tmp/site:$PWD" timeout -k 10 \
      "${RESHARD_LIMIT:-100}" python3 benchmarks/bench_reshard.py --repeats \
      "${RESHARD_REPEATS:-2}" --cases 4to2 --root "$root" --out "$OUT/reshard_$where.json" \
      > "$OUT/reshard_$where.log" 2>&1)
    echo "reshard $where: exit $? after ${SECONDS} s" >> "$LOG"
    rm -rf "$root"
    grep -E "^4to2" "$OUT/reshard_$where.log" | sed "s/^/$where /" >> "$LOG"
  done
fi
grep -E "exit [^0]|Error" "$LOG" | head -5
grep -vE "^round " "$LOG"
