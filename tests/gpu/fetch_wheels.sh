#!/usr/bin/env bash
# Download (here, on a machine with PyPI) the wheels tests/gpu/first_run.sh installs on the GPU
# machine, which has torch but no FlashInfer and no network. They land in .whl/ (git-ignored)
# and travel with the device call's `carry: [".whl"]` (64 MiB limit; 28 MB in all).
#
# flashinfer-python 0.6.13, the version the engine image ships (JIT: its kernels compile with
# the machine's nvcc on first use), and the tvm-ffi it was checked with. Its other requirements
# are either in the GPU image (click, einops, ninja, numpy, nvidia-ml-py, packaging, requests,
# tabulate, tqdm) or only imported by kernels the engine does not use (nvidia-cudnn-frontend,
# nvidia-cutlass-dsl, cuda-tile): `import flashinfer` and its FA2 wrappers work without them.
# The server's own requirements and the `openai` client come with their dependencies, resolved
# together here (tests/gpu/test_gpu_server.py runs the real server on the GPU; 11 MB more),
# pinned to the versions the CPU suite runs.
# .whl/ is emptied first: two versions of one package stop the whole install there.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl
mkdir -p .whl
download() {
  python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$@"
}
download --no-deps flashinfer-python==0.6.13
download --no-deps apache-tvm-ffi==0.1.15.post2
# peft makes and runs the LoRA adapters of tests/gpu/test_lora_graph_cuda.py (its other
# requirements, psutil/pyyaml/safetensors/huggingface_hub, come with transformers' image)
download --no-deps peft==0.21.2 accelerate==1.16.0
download openai==3.60.0 aiohttp==3.14.5 prometheus_client==0.26.0 jinja2==3.1.6 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
ls -l .whl
du -sh .whl
