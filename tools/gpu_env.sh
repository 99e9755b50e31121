#!/usr/bin/env bash
# Sourced on a lent GPU machine with CUDA 13 and no TensorFlow (docs/gpu.md, "A lent machine
# without TensorFlow"), in this repository's root, after tools/gpu_pack.sh's pieces were
# copied to PIECES_DIR (one device call each):
#
#   source tools/gpu_env.sh /tmp/p && STAGES="info smoke tests" tools/gpu_check.sh "$OUT"
#
# Unpacks TensorFlow and the CUDA 12 cuBLAS and runtime into /tmp/site once, points
# TensorFlow at the machine's CUDA 13 cuDNN 9, cuFFT, cuSOLVER and cuSPARSE (cuFFT and
# cuSOLVER under their CUDA 12 names), and installs this project into python3 (no
# dependencies). Not a supported configuration: CUDA 12 and CUDA 13 libraries in one
# process; what ran on it is in docs/benchmarks_history.md, the "GPU readiness" entries of
# 2026-11-26 ("The kernel audit and the first GPU contact") and 2026-11-27 ("The second
# GPU contact").
#
# CUBLAS=machine (a hypothesis to try, docs/gpu.md): TensorFlow gets the machine's CUDA 13
# cuBLAS under the CUDA 12 names, and the pieces c.* (the packed CUDA 12 cuBLAS) need not
# be sent. Default: the packed one (CUBLAS=packed).
PIECES=${1:?usage: source tools/gpu_env.sh PIECES_DIR}
SITE=/tmp/site
CUBLAS=${CUBLAS:-packed}
if [[ ! -e $SITE/.unpacked ]]; then
  mkdir -p "$SITE"
  { cat "$PIECES"/a.?? | tar -xz -C "$SITE" && cat "$PIECES"/b.?? | tar -xz -C "$SITE"; } \
    || { echo "gpu_env: the pieces in $PIECES do not unpack" >&2; return 3; }
  if [[ $CUBLAS == packed ]]; then
    cat "$PIECES"/c.?? | tar -xz -C "$SITE" \
      || { echo "gpu_env: no CUDA 12 cuBLAS pieces (c.*) in $PIECES; CUBLAS=machine?" >&2
           return 3; }
  fi
  touch "$SITE/.unpacked"
fi
_cuda13_lib() {  # the machine's copy of library $1 (PyTorch's wheels hold CUDA 13's)
  find /opt /usr/local /usr/lib /usr/lib64 -name "$1" 2>/dev/null | grep -v "^$SITE" | head -1
}
mkdir -p /tmp/cuda12_names
ln -sf "$(_cuda13_lib libcufft.so.12)" /tmp/cuda12_names/libcufft.so.11
ln -sf "$(_cuda13_lib libcusolver.so.12)" /tmp/cuda12_names/libcusolver.so.11
if [[ $CUBLAS == machine ]]; then  # every cuBLAS function TensorFlow calls is in 13's
  ln -sf "$(_cuda13_lib libcublas.so.13)" /tmp/cuda12_names/libcublas.so.12
  ln -sf "$(_cuda13_lib libcublasLt.so.13)" /tmp/cuda12_names/libcublasLt.so.12
fi
LD_LIBRARY_PATH=/tmp/cuda12_names
for lib in libcudnn.so.9 libcufft.so.12 libcusolver.so.12 libcusparse.so.12 libcublasLt.so.13 \
           libnvJitLink.so.13 libnccl.so.2 libcupti.so.13; do
  found=$(_cuda13_lib "$lib")
  [[ -n $found ]] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$found")
done
export LD_LIBRARY_PATH PYTHONPATH=$SITE PYTHONFAULTHANDLER=1 PYTHON=python3
if ! python3 -c "import tensorflow" 2>/dev/null; then  # the machine's protobuf too old
  mkdir -p /tmp/site_protobuf && python3 -m zipfile -e "$PIECES/protobuf.whl" /tmp/site_protobuf
  export PYTHONPATH=/tmp/site_protobuf:$SITE
fi
python3 -c "import lingvo_gpipe_params, lingvo_gpipe.tools" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
