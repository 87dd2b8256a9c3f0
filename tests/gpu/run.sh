#!/usr/bin/env bash
# The GPU check, as ONE device call on an H200 whose image has torch but no FlashInfer:
#
#   bash tests/gpu/fetch_wheels.sh          # here, once: FlashInfer wheels into .whl/
#   device run, carry [".whl"], timeout_s 540:
#     bash tests/gpu/run.sh
#
# It installs the carried wheels into /tmp/site, then runs (budget < 8 minutes):
#   1. tests/gpu + tests/engine/test_engine_cuda.py + the kernel comparisons (FlashInfer JIT
#      compiles its prefill/decode modules on first use: ~1-2 min on 16 cores);
#   2. the decode throughput table (tests/gpu/bench_decode.py).
# Everything it prints also lands in $OUT/gpu-run.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-run.log") 2>&1
echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/engine_pod:$PWD/operator:$PWD/kernels:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 MSTAR_GPU_REQUIRE_FLASHINFER=1
# FlashInfer JIT: sm_90a only (the H200), its cache under /tmp, nvcc from PATH or CUDA_HOME.
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-jit FLASHINFER_CUDA_ARCH_LIST="9.0a" MAX_JOBS=16
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" \
  || echo "flashinfer did NOT import: the FlashInfer tests below fail (MSTAR_GPU_REQUIRE_FLASHINFER=1)"
rc=0
timeout 330 python3 -m pytest -q -s -p no:cacheprovider --timeout 300 \
  tests/gpu/test_gpu_engine.py tests/engine/test_engine_cuda.py \
  tests/unit/test_kernels_paged_attention.py || rc=$?
MSTAR_KV_DEBUG_ASSERTS=0 timeout 120 python3 tests/gpu/bench_decode.py --steps 48 || rc=$?
echo "run.sh exit: $rc"
exit $rc
