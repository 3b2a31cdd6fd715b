#!/usr/bin/env bash
# A/B of issue 23 on ONE GPU machine: the tree before the redesign step and this tree,
# alternated twice, so that the disk and the machine are the same for both sides (the
# before/after runs of gpu_issue23_run.sh landed on different machines and disagreed by more
# than this benchmark's noise). Before the call, here:
#   rm -rf .ab_old && mkdir .ab_old && git archive 6ab4663 ckpt_pipeline benchmarks | tar -x -C .ab_old
# and carry .ab_old (with .whl). Results under $OUT: ab_{side}_{round}.json and a table.
# One round (both sides, about 6 min) fits one device call: run it twice back to back, on the
# same warm machine, with ORDER="old new" ROUND=1 and then ORDER="new old" ROUND=2.
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
STEPS="${STEPS:-600}"
here="$PWD"
ORDER="${ORDER:-old new}"
for round in ${ROUND:-1}; do
  for side in $ORDER; do
    tree="$here"; [ "$side" = old ] && tree="$here/.ab_old"
    (cd "$tree/benchmarks" && PYTHONPATH="/tmp/site:$tree" python3 bench_training.py \
      --variants ckpt_pipeline --steps "$STEPS" --write-repeats 1 --read-repeats 1 \
      --budget-s 150 --hard-limit-s 170 --out "$OUT/ab_${side}_${round}.json") \
      > "$OUT/ab_${side}_${round}.log" 2>&1
    echo "$side $round exit $?"
  done
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(open(out / "gpu.txt").read().strip(), "| host", __import__("socket").gethostname(),
      "| boot", open("/proc/sys/kernel/random/boot_id").read().strip())
print("side round  x_none  blocking_ms_med  durable_s_med  restore_s")
for f in sorted(out.glob("ab_*_*.json")):
    d = json.loads(f.read_text()); v = d["variants"]["ckpt_pipeline"]; s = d["summary"]
    saves = sorted(x["durable_s"] for x in v["saves"]); blk = sorted(x["blocking_s"] for x in v["saves"])
    ratio = v["total_s"] / d["variants"]["none"]["total_s"]
    print(f.stem, f"{ratio:.3f}", f"{1000 * blk[len(blk) // 2]:.1f}", f"{saves[len(saves) // 2]:.2f}",
          v.get("restore_check", {}).get("restore_s"))
PY
