#!/usr/bin/env bash
# Flex attention's flash-attention backend (`drafter.flex_kernel_options.BACKEND=FLASH`, FlashAttention-4 in CuTeDSL)
# for the device machine, whose image lacks it: its wheels (Python 3.12, CUDA 13, ~111 MB) are over one call's
# 64 MiB carry, so this packs them into one tar split in two parts, `.fa4/1` and `.fa4/2` (git-ignored), each carried
# by its own call to a warm machine (bench/long_context/fa4.sh). Run on a machine with network:
#   bash bench/long_context/fa4_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
W=.fa4/wheels
rm -rf .fa4 && mkdir -p "$W" .fa4/1 .fa4/2
# the cu13 libraries in place of the cu12 ones that nvidia-cutlass-dsl names by default (the image's torch is cu130)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$W" \
  flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
  protobuf==7.36.2 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.1
# omegaconf for our benches, since the second call carries no .whl (with antlr4 where .whl has it: omegaconf 2.3 needs
# it, 2.4 does not)
cp .whl/omegaconf-*.whl "$W"/ || { echo "put omegaconf's wheel in .whl first (bench/README.md)"; exit 1; }
cp .whl/antlr4_python3_runtime-*.whl "$W"/ 2>/dev/null || true
tar cf .fa4/wheels.tar -C "$W" .
split -b 56m -d .fa4/wheels.tar .fa4/part
mv .fa4/part00 .fa4/1/wheels.tar.part00
for f in .fa4/part*; do mv "$f" ".fa4/2/wheels.tar.$(basename "$f")"; done
rm -rf "$W" .fa4/wheels.tar
du -sh .fa4/1 .fa4/2
