#!/usr/bin/env bash
# One call on the lent GPU machine (Python 3.12, jax with the CUDA PJRT plugin, CuPy, no network,
# no meson-python): builds tpusync from this tree with the build wheels carried in .wheelhouse/
# (scripts/device_wheels.sh fetches them here), shows what tpusync finds on the GPU (its PJRT
# probe), and runs benchmarks/gpu_transfer.py and benchmarks/gpu_tiers.py (the PJRT engine
# beside pure JAX and cudaMemcpyAsync, bytes checked). Everything it prints also lands in $OUT.
#
#   run(command="bash scripts/device_check.sh", carry=[".wheelhouse"], timeout_s=540)
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
mkdir -p "$OUT"
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 || true
  "$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())'
  echo "== build"
  venv=$(mktemp -d)/venv
  "$PY" -m venv --system-site-packages "$venv"  # jax, numpy and CuPy come from the machine
  "$venv/bin/pip" install -q --no-index --find-links .wheelhouse meson-python meson ninja cython
  start=$(date +%s)
  "$venv/bin/pip" install -q --no-index --no-build-isolation --no-deps .
  echo "built in $(( $(date +%s) - start )) s"
  # Past the build, a failing step (even a crash) is reported and the next one still runs:
  # device time is scarce, and every step says something.
  step() { "$@" || echo "!! $1 ... exited with $?"; }
  echo "== tpusync info (the PJRT probe and each GPU's self-test)"
  (cd /tmp && step "$venv/bin/python" -m tpusync info)
  echo "== gpu_transfer"
  step "$venv/bin/python" benchmarks/gpu_transfer.py --json "$OUT/gpu_transfer.json" "$@"
  echo "== gpu_tiers"
  step "$venv/bin/python" benchmarks/gpu_tiers.py --json "$OUT/gpu_tiers.json"
} 2>&1 | tee "$OUT/device_check.log"
