#!/usr/bin/env bash
# TensorFlow 2.21's GPU build for a lent GPU machine that has CUDA 13 and no registry
# (docs/gpu.md, "A lent machine without TensorFlow"): packs, here, where pip can download,
# what that machine lacks into pieces small enough for one device call each.
#
#   tools/gpu_pack.sh [PIECES_DIR]     (default .ship, which .git/info/exclude should list)
#
# What it packs (about 880 MB as 60 MiB pieces, a.* b.* and c.*; 2 minutes on 2 cores):
#   - tensorflow==2.21.0 for CPython 3.12 without its C++ headers, with the pure-Python
#     dependencies that machine lacks (keras, namex, optree, gast, astunparse,
#     google_pasta, termcolor);
#   - the real CUDA 12 cuBLAS (nvidia-cublas-cu12 12.5.3.2, TensorFlow's minimum; its own
#     pieces c.*) and CUDA runtime: a crash in every step was seen with CUDA 13's cuBLAS
#     behind CUDA 12 names, but the int32 crashes found later give the same symptom
#     (docs/gpu.md: whether the machine's cuBLAS 13 can serve is a hypothesis to try);
#   - protobuf 6.33, used only if the machine's is too old for TensorFlow.
# cuDNN 9, cuFFT, cuSOLVER and cuSPARSE are the machine's CUDA 13 builds (tools/gpu_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PIECES=${1:-.ship}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
download() {  # download DIR REQUIREMENT...: CPython 3.12 x86-64 wheels, no dependencies
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
download "$WORK/wheels" tensorflow==2.21.0 keras namex optree gast astunparse google_pasta \
  termcolor nvidia-cublas-cu12==12.5.3.2 nvidia-cuda-runtime-cu12==12.9.79
download "$WORK/pb" "protobuf>=6.31.1,<7"
mkdir -p "$WORK/site" "$PIECES"
for wheel in "$WORK"/wheels/*.whl; do unzip -q -o "$wheel" -d "$WORK/site"; done
rm -rf "$WORK"/site/tensorflow/include "$WORK"/site/nvidia/*/include \
  "$WORK"/site/nvidia/cublas/lib/libnvblas.so.*
# Three archives compressed side by side: a holds the 1.1 GB library, c the CUDA 12
# cuBLAS (optional on the machine: tools/gpu_env.sh CUBLAS=machine uses its CUDA 13 one),
# b the rest.
(cd "$WORK/site" && tar -czf "$WORK/a.tgz" tensorflow/libtensorflow_cc.so.2) &
(cd "$WORK/site" && tar -czf "$WORK/c.tgz" nvidia/cublas) &
(cd "$WORK/site" && tar -czf "$WORK/b.tgz" --exclude=tensorflow/libtensorflow_cc.so.2 \
  --exclude=nvidia/cublas .) &
wait
rm -f "$PIECES"/a.?? "$PIECES"/b.?? "$PIECES"/c.??
for archive in a b c; do split -b 60M -d -a 2 "$WORK/$archive.tgz" "$PIECES/$archive."; done
cp "$WORK"/pb/protobuf-*.whl "$PIECES/protobuf.whl"
cp tools/gpu_env.sh "$PIECES/"
ls -la "$PIECES"
