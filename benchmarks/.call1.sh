. benchmarks/gpu_env.sh
timeout 200 python3 benchmarks/gpu_register_stall.py --out "$OUT/register_stall.json" > "$OUT/register_stall.log" 2>&1; echo "stall exit $?" >> "$OUT/register_stall.log"
bash benchmarks/gpu_issue24_tests.sh > "$OUT/tests_summary.log" 2>&1
tail -5 "$OUT/tests_summary.log"; tail -12 "$OUT/register_stall.log"
