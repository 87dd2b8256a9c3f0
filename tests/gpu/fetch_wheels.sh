#!/usr/bin/env bash
# Download (here, on a machine with PyPI) the FlashInfer wheels tests/gpu/run.sh installs on a
# GPU machine that has no FlashInfer and no network. They land in .whl/ (git-ignored) and
# travel with the device call's `carry: [".whl"]`; < 64 MiB together.
#
# flashinfer-python 0.5.3 (7 MB, JIT: its prefill/decode modules compile with the machine's
# nvcc on first use) plus the two dependencies that image lacks. 0.7.x is 101 MB, over the
# device tool's 64 MiB limit. nvidia-cutlass-dsl (also required) is left out: only its CuTe
# DSL kernels, which the engine does not use, import it. .whl/ is in .gitignore.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
for spec in flashinfer-python==0.5.3 'apache-tvm-ffi>=0.1,<0.2' 'nvidia-cudnn-frontend>=1.13.0'; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
du -sh .whl
