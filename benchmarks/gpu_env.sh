# Sourced by the gpu_*_run.sh scripts, on the GPU machine: $OUT made, the wheels the image
# lacks (.whl/, from ../shared/tools/gpu-wheels.sh pytest-timeout==2.4.0) put on PYTHONPATH,
# and the GPU's name, memory and driver written to $OUT/gpu.txt.
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
# The copy on the GPU machine may carry a stale .git: the commit the run is of comes from
# commit.txt when it is carried (git rev-parse HEAD > commit.txt before the call).
if [ -f commit.txt ]; then CKPT_BENCH_COMMIT="$(head -c 12 commit.txt)"; export CKPT_BENCH_COMMIT; fi
