#!/usr/bin/env bash
# The GPU checks in one command (docs/gpu.md): run on a machine with one NVIDIA GPU.
#
#   tools/gpu_check.sh [OUT_DIR]            every stage, results under OUT_DIR
#   STAGES="tests train" tools/gpu_check.sh  some stages (a rationed GPU: one call each)
#   REHEARSAL=1 tools/gpu_check.sh /tmp/x    every stage on logical CPUs, tiny sizes: checks
#                                            the script and its commands without a GPU
#
# Stages, in order (each writes <stage>.json or .log/.xml under OUT_DIR, with the device):
#   info          TensorFlow, its CUDA build, the GPUs TensorFlow sees, nvidia-smi
#   smoke         tools/gpu_smoke.py: each feature a step uses, one at a time, then a
#                 training step on one and on two logical GPUs (a crash names its feature)
#   audit         tools/gpu_audit.py --quick: every GPU op has a kernel (no GPU needed)
#   tests         the pipeline tests on 4 logical GPUs of one GPU (LINGVO_GPIPE_TEST_DEVICES):
#                 the equivalence grid (K = 1, 2, 4; every schedule, recompute, dtype),
#                 placement, mixed precision, token slices, replicas, the internals' pins
#   train         `make train` on 2 logical GPUs
#   dtypes        bfloat16 ÷ float32 step time (bench/mixed_precision_accuracy.py)
#   plans         three plans' allocator peaks against the planner (bench/planner.py,
#                 one allocator per logical GPU)
#   amoeba        the largest AmoebaNet-D per 8 GB logical GPU, naive against pipelined
#                 (bench/amoeba_size.py: GPipe's Table 1)
#   token_slices  K=4, S=4 against S=1 on the host's CPU cores, one core per worker
#
# TensorFlow: PYTHON (default python3) must import a TensorFlow 2.21 that sees the GPU.
# If it cannot, the script installs `tensorflow[and-cuda]==2.21.0` and this project into
# a venv: from WHEELS=DIR (pip download them where a registry is reachable, e.g.
#   pip download -d wheels 'tensorflow[and-cuda]==2.21.0' -e . ; about 2.5 GB)
# without an index, or else from the registry. TensorFlow 2.21's GPU build needs
# CUDA 12 libraries (nvidia-*-cu12); a machine with only CUDA 13 needs those wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STAGES=${STAGES:-info smoke audit tests train dtypes plans amoeba token_slices}
PYTHON=${PYTHON:-python3}
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ -n "${REHEARSAL:-}" ]]; then
  KIND=cpu; GPU4="cpu:4"; GPU2="cpu:2"; SMOKE="cpu:2"; SPLIT="cpu:{n}"; AMOEBA_DEVICES="cpu:{k}"
  AMOEBA_ARGS="--sizes 3x8,3x16 --image_size 32 --batch 8 --modes naive,pipeline-2"
  STEPS=3; TRAIN_STEPS=2; SLICE_ARGS="--workers 2 --slices 1,2 --length 64 --steps 2 --weight_gradient_group S"
else
  KIND=gpu; GPU4="gpu:4:${TEST_GPU_MB:-4096}"; GPU2="gpu:2:8192"; SMOKE="gpu:2:2048"; SPLIT="gpu:{n}:8192"
  AMOEBA_DEVICES="gpu:{k}:8192"; AMOEBA_ARGS="--modes naive,pipeline-1,pipeline-2,pipeline-4"
  STEPS=30; TRAIN_STEPS=100; SLICE_ARGS="--workers 4 --slices 1,4 --weight_gradient_group S"
fi

tf_sees_gpu() {
  "$1" -c "import sys, tensorflow as tf; sys.exit(0 if tf.config.list_physical_devices('GPU') else 1)" \
    >/dev/null 2>&1
}

if [[ $KIND == gpu ]] && ! tf_sees_gpu "$PYTHON"; then
  echo "== $PYTHON has no TensorFlow that sees a GPU: installing tensorflow[and-cuda]==2.21.0"
  python3 -m venv "$WORK/venv" || exit 1
  FROM=()
  [[ -n "${WHEELS:-}" ]] && FROM=(--no-index --find-links "$WHEELS")
  LINGVO_GPIPE_TF_REQUIREMENT='tensorflow[and-cuda]==2.21.0' \
    "$WORK/venv/bin/pip" install -q "${FROM[@]}" -e '.[test]' || exit 1
  PYTHON="$WORK/venv/bin/python"
  if ! tf_sees_gpu "$PYTHON"; then
    echo "TensorFlow was installed but sees no GPU (missing CUDA 12 libraries?):" >&2
    "$PYTHON" -c "import tensorflow as tf; print(tf.config.list_physical_devices())" >&2
    exit 1
  fi
fi

# This project importable by PYTHON as installed (params/ and tools/ are packages there).
if ! "$PYTHON" -c "import lingvo_gpipe, lingvo_gpipe_params, lingvo_gpipe.tools" 2>/dev/null; then
  echo "== installing this project into $PYTHON (no dependencies)"
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi

failed=()
stage() {  # stage NAME COMMAND...: runs it, its output in NAME.log, its status remembered
  local name=$1; shift
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "== $name: $*"
  local start=$SECONDS
  "$@" >"$OUT_DIR/$name.log" 2>&1
  local status=$?
  tail -3 "$OUT_DIR/$name.log"
  echo "== $name: exit $status in $((SECONDS - start)) s"
  [[ $status == 0 ]] || failed+=("$name")
}

last_json() {  # last_json LOG OUT: the log's last line, a JSON object, with the device
  tail -1 "$1" | "$PYTHON" -c "
import json, subprocess, sys
found = json.loads(sys.stdin.read())
try:
  gpu = subprocess.run(['nvidia-smi', '--query-gpu=name', '--format=csv,noheader'],
                       capture_output=True, text=True).stdout.strip() or None
except OSError:
  gpu = None
found.update(device=gpu or 'no GPU ($KIND rehearsal)')
json.dump(found, open('$2', 'w'), indent=1)" || echo "no JSON line in $1" >&2
}

info() {
  "$PYTHON" - "$OUT_DIR/info.json" <<'EOF'
import json, platform, subprocess, sys, time
import tensorflow as tf
try:
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError:
  smi = None
info = {"date": time.strftime("%Y-%m-%d %H:%M"), "tensorflow": tf.__version__,
        "built_with_cuda": tf.test.is_built_with_cuda(),
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "nvidia_smi": smi, "cpu": platform.processor(), "python": platform.python_version()}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
EOF
}

audit() {
  if "$PYTHON" -c "import sys, tensorflow as tf; sys.exit(0 if tf.test.is_built_with_cuda() else 1)"; then
    "$PYTHON" tools/gpu_audit.py --quick --json_out="$OUT_DIR/audit.json"
  else
    echo "skipped: this TensorFlow has no GPU kernels (tensorflow-cpu); make gpu-audit"
  fi
}

tests() {
  LINGVO_GPIPE_TEST_DEVICES=$GPU4 "$PYTHON" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/tests.xml" tests/gpipe_test.py tests/pipeline_placement_test.py \
    tests/mixed_precision_test.py tests/token_slices_test.py tests/hybrid_test.py \
    tests/tf_internals_test.py tests/placement_audit_test.py ${PYTEST_ARGS:-}
}

smoke() {
  "$PYTHON" tools/gpu_smoke.py --devices="$SMOKE" \
    && last_json "$OUT_DIR/smoke.log" "$OUT_DIR/smoke.json"
}

train() {
  "$PYTHON" tools/trainer.py --model=image.AmoebaNetTiny --devices="$GPU2" \
    --logdir="$WORK/train" --mode=train_and_eval --max_steps=$TRAIN_STEPS
}

dtypes() {
  "$PYTHON" bench/mixed_precision_accuracy.py --devices="$GPU2" --steps=$STEPS \
    --dtypes=float32,bfloat16 && last_json "$OUT_DIR/dtypes.log" "$OUT_DIR/dtypes.json"
}

plans() {
  "$PYTHON" bench/planner.py --settings=logical --logical_devices="$SPLIT" \
    --only=lm_k2_m4_always_gpipe,lm_k2_m8_never_1f1b,amoeba_k2_m4_always_gpipe \
    --versus_default= --no_plan_time --steps=4 \
    && last_json "$OUT_DIR/plans.log" "$OUT_DIR/plans.json"
}

amoeba() {
  # shellcheck disable=SC2086
  "$PYTHON" bench/amoeba_size.py --devices="$AMOEBA_DEVICES" $AMOEBA_ARGS \
    && last_json "$OUT_DIR/amoeba.log" "$OUT_DIR/amoeba.json"
}

token_slices() {
  # shellcheck disable=SC2086
  "$PYTHON" bench/token_slices.py $SLICE_ARGS \
    && last_json "$OUT_DIR/token_slices.log" "$OUT_DIR/token_slices.json"
}

stage info info
stage smoke smoke
stage audit audit
stage tests tests
stage train train
stage dtypes dtypes
stage plans plans
stage amoeba amoeba
stage token_slices token_slices

if (( ${#failed[@]} )); then
  echo "FAILED stages: ${failed[*]} (their logs are in $OUT_DIR)"
  exit 1
fi
echo "All stages passed; results in $OUT_DIR"
