#!/usr/bin/env bash
# One call on the GPU machine for issue 15: every gpu-marked test in the suite, then the export
# round trip of docs/export.md on CUDA (train, SIGKILL, resume, export, load into a fresh model,
# compare outputs). Results under $OUT. Wheels the image lacks come from
#   ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0        (into .whl/, carried along)
set -uo pipefail
# shellcheck source=benchmarks/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"
python3 -m pytest -q -p no:cacheprovider -m gpu tests -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_tests.log"
python3 benchmarks/export_roundtrip.py --device cuda --out "$OUT/export_roundtrip.json" \
  > "$OUT/roundtrip.log" 2>&1
echo "round trip exit $?" >> "$OUT/roundtrip.log"
cat "$OUT/gpu.txt"
tail -15 "$OUT/gpu_tests.log"
cat "$OUT/roundtrip.log"
