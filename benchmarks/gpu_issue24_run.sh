#!/usr/bin/env bash
# One call on the GPU machine for issue 24 (the memory tier), within the 600 s of a call:
#   PART=1  the gpu-marked tests of tests/memory (when that folder exists), the sweep at save
#           intervals 5 and 10, then the restore after SIGKILL  -> $OUT/memory_tier_part1.json
#   PART=2  the sweep at intervals 20 and 100                   -> $OUT/memory_tier_part2.json
#   PART=3  the sweep at intervals 20 and 100, then the restore (no tests) -> memory_tier_part3.json
#   PART=all (the default) all of it in one call               -> $OUT/memory_tier.json
#           (about 8 minutes on an H200 by the estimate in bench_memory_tier.py; what would start
#           past the budget is skipped and recorded, so use the two parts when it is tight)
# Each part: every variant of bench_memory_tier.py (none, ckpt_pipeline, the memory tier made
# by the first save, made at open, made at open with device_staging, nvrx_local; VARIANTS=a,b
# for a subset), both end-of-loop sync modes from the same loops. RUN_TESTS=0 and
# RUN_RESTORE=0 leave out a part's tests or its restore. A table last: plot_memory_tier.py of the JSON.
# Wheels the image lacks (.whl/, carried): ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0,
# and for nvrx_local nvidia_resiliency_ext-0.4.1-cp312-cp312-manylinux_2_31_x86_64.whl (see
# benchmarks/README.md: gpu-wheels.sh asks for manylinux_2_28 at most, which that wheel is not).
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
PART="${PART:-all}"
case "$PART" in
  1) INTERVALS=5,10; RESTORE=1; TESTS=1; JSON="$OUT/memory_tier_part1.json" ;;
  2) INTERVALS=20,100; RESTORE=0; TESTS=0; JSON="$OUT/memory_tier_part2.json" ;;
  3) INTERVALS=20,100; RESTORE=1; TESTS=0; JSON="$OUT/memory_tier_part3.json" ;;
  all) INTERVALS=5,10,20,100; RESTORE=1; TESTS=1; JSON="$OUT/memory_tier.json" ;;
  *) echo "PART must be 1, 2 or all (got $PART)" >&2; exit 2 ;;
esac
TESTS="${RUN_TESTS:-$TESTS}"; RESTORE="${RUN_RESTORE:-$RESTORE}"  # RUN_TESTS=0 / RUN_RESTORE=0: skip
INTERVALS="${RUN_INTERVALS:-$INTERVALS}"  # RUN_INTERVALS=20: other save intervals
LIMIT="${LIMIT:-585}"  # seconds of this call we may use (SECONDS counts from this script's start)
python3 -c "import nvidia_resiliency_ext.checkpointing.local" > "$OUT/nvrx_import.log" 2>&1 \
  && echo "nvrx importable" >> "$OUT/nvrx_import.log"
if [ "$TESTS" = 1 ] && [ -d tests/memory ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/memory -rs \
    > "$OUT/memory_tests.log" 2>&1
  echo "memory gpu tests exit $?" >> "$OUT/memory_tests.log"
fi
RESERVE=$(( RESTORE == 1 ? 100 : 0 ))  # for the restore after SIGKILL
HARD=$(( LIMIT - SECONDS - RESERVE - 10 ))
(cd benchmarks && python3 bench_memory_tier.py --intervals "$INTERVALS" --out "$JSON" \
  --hard-limit-s "$HARD" --budget-s "$(( HARD - 60 ))" ${STEPS:+--steps "$STEPS"} \
  ${VARIANTS:+--variants "$VARIANTS"}) \
  > "$OUT/sweep.log" 2>&1
echo "sweep exit $?" >> "$OUT/sweep.log"
if [ "$RESTORE" = 1 ]; then
  LEFT=$(( LIMIT - SECONDS - 5 ))
  (cd benchmarks && timeout "$LEFT" python3 bench_memory_tier.py --restore-after-kill \
    --out "$JSON" --child-timeout-s "$(( LEFT - 40 ))") > "$OUT/restore.log" 2>&1
  echo "restore exit $?" >> "$OUT/restore.log"
fi
rm -rf /dev/shm/ckpt-bench-*-memory /dev/shm/ckpt-bench-*-memory.aside 2>/dev/null
cat "$OUT/gpu.txt" "$OUT/nvrx_import.log"
[ -f "$OUT/memory_tests.log" ] && tail -4 "$OUT/memory_tests.log"
grep -E "FAILED|exit|watchdog|skipping" "$OUT/sweep.log" | tail -12
[ "$RESTORE" = 1 ] && tail -4 "$OUT/restore.log"
python3 benchmarks/plot_memory_tier.py "$JSON" 2>&1 | tail -40
