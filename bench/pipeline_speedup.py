"""Pipeline speedup with one worker process per stage, on loopback.

Starts `--max_workers` TensorFlow servers (tools/worker.py), each with one inter-op
and one intra-op thread so that each behaves like one sequential accelerator
(tools/worker.py says why the environment, not a ConfigProto, sets that), joins them
as a client, and times training steps (forward, recomputed
forward, backward, SGD update) at a fixed global batch:

  K = 1: every cell on worker 0 (one "accelerator", re-materialized, M micro-batches);
  K = k: k cells on workers 0..k-1.

for M in --micro_batches, on (a) an 8-layer 1024-wide ReLU MLP at batch 256 and (b) a
stack of 8 Transformer language-model layers (causal self-attention with 8 heads, then
feed-forward; model dim 512, hidden 2048) at 16×64 tokens; with --models=tiny,
(c) 8 × Linear 64→64 at batch 64, whose compute is next to nothing (the engine's own
cost per action); with --models=keras_transformer, (d) the layers of (b) written in
Keras (MultiHeadAttention, LayerNormalization, Dense in a functional model) and
pipelined through `g.from_keras`, 16 units (docs/keras.md). K=1 and K=k steps
alternate, so that machine noise hits both alike; the figures are medians. The
fill-drain bubble bounds the K=2 speedup by 2·M/(M+1).

  python bench/pipeline_speedup.py                 # K ∈ {1, 2}, M ∈ {1, 2, 4, 8, 16}
  python bench/pipeline_speedup.py --max_workers 4 # also K = 4 (needs ≥ 5 cores)

Each K>1 runs with every schedule of --schedules (default gpipe, 1f1b, zb_h1, and
interleaved_1f1b with V=2, i.e. 2K cells, two per worker; zbv, two cells per worker in
a V, on request), and each
configuration with `PipeliningLayer.weight_gradient_group` G ∈ --weight_gradient_groups
(default 1 and M: weight gradients per micro-batch, or over all M at once; the
split-backward schedules, zb_h1, zbv and interleaved_zb, run at G=1 only: they place
one W per backward themselves).

Each K>1 configuration runs with every recompute policy of --recompute (default
always and never; rows without re-materialization end in `_never`).

The headline is **`speedup_vs_plain_single`**: what a user whose model fits one
device runs instead of a 2-stage pipeline is the plain model on one device: the same
layers as one `layers.Sequential`, a `tf.function` of GradientTape and SGD with no
pipeline code (no micro-batches, no re-materialization, no loop; `make_plain_step`),
on worker 0 with the same thread settings. Each K=2 row is divided into it, measured
in the same alternation; the JSON's `speedup_vs_plain_single_<model>` is the best K=2
row. **`engine_overhead_k1_m1_<model>`** is what the engine itself costs: ours at K=1,
M=1, recompute='never' ÷ plain TensorFlow (median over the M runs). The older
`speedup_vs_best_single` compares with the fastest of our own K=1 runs, which
re-materialize (a handicapped baseline, kept for comparison with earlier tables), and
`speedup` is K=1 ÷ K=2 at the same M and G.

The step is the trainer's
(`train_step.TrainStep`): it records the measured schedule (timeline.py), and the
JSON reports, per configuration, the measured bubble (idle share of the workers)
beside (K−1)/(M+K−1), the plan's bubble simulated with the step's own measured call
times (`bubble_planned`: what the schedule would give with free hand-offs), each
cell's busy fraction, and for the split-backward schedules the share of backward time
the W actions took (`weight_share`: W / (B + W), what they can move into the bubble);
medians over the timed steps.

TensorFlow's default CPU build leaves oneDNN off on CPUs without AVX-512, and its
Eigen kernel for a matmul with a transposed right operand (every backward pass's
dX = dY·Wᵀ) then runs 4-5× slower than the same product untransposed (measured on
2026-11-22: 12.4 ms against 2.7 ms at 32×1024×1024). The benchmark turns oneDNN on
(TF_ENABLE_ONEDNN_OPTS=1, for the workers and the client) unless the environment
says otherwise; the JSON records which.

`--steps_per_call N` runs N training steps per call of the traced step (the trainer's
task.train.steps_per_call), ours and the plain model's alike (the plain one as a Python
loop in its tf.function), and reports a call's time ÷ N as the step: the client's round
trip to the workers, paid per call, is then shared by N steps.

The last line printed is one JSON object: `results` per configuration;
`per_action_<model>_k2_<schedule>[_never]`: milliseconds per action at each M and what
one more action adds (bench/action_cost.py; bench/torch_pipeline.py reports PyTorch's
the same way); and
`speedup_vs_best_single_<model>_k2_m8[_<schedule>][_g8]`, `<model>_k1_m8[_g8]_over_m1`
(the single device's cost of splitting into 8), `speedup_k2_m8` (the MLP's K=1 ÷ K=2
median step time at M=8, G=1), and per model at M=8 the measured bubbles of zb_h1 and
interleaved_1f1b over 1f1b's (`<model>_m8_bubble_over_1f1b_<schedule>`); with zbv
and zb_h1 both run, `zbv_bubble_vs_zb_h1_<model>`, the highest ratio of their measured
bubbles over the configurations run.

Each worker's peak memory is measured for the schedules of --peak_schedules (default
1f1b and zbv) at every K>1, M and recompute policy run, each in a fresh process with
fresh workers that log their allocators (tools/worker.py --memory_log; on CPU that is
TensorFlow's BFC allocator, the one GPUs use): a worker's peak counts from its start,
and the timed runs share theirs. Results carry `peak_bytes_per_worker`, and the JSON
names `<schedule>_peak_vs_1f1b_<model>`: that schedule's peak over 1f1b's at the same K,
M and recompute, the highest over the workers and the configurations run (issue 50's
target for zbv: ≤ 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # inherited by the worker processes


def model_layers(name: str, batch: int = 16, length: int = 64, keep_prob: float = 1.0):
  """The 8-layer stack of `name` and its pipeline inputs (a tuple of [B, ...] tensors;
  the Transformer's: `batch` sequences of `length` tokens, with dropout of `keep_prob`
  on its residuals, attention weights and feed-forward hidden units)."""
  import tensorflow as tf

  from lingvo_gpipe.core import layers
  from lingvo_gpipe.models import transformer

  if name == "tiny":  # compute next to nothing: a step is the engine's own cost per action
    return ([layers.Linear.Params().set(name=f"fc{i}", input_dim=64, output_dim=64,
                                        activation="RELU") for i in range(8)],
            (tf.random.stateless_normal([64, 64], seed=[1, 2]),))
  if name == "keras_transformer":  # the same blocks in Keras: 16 units (attention, ff)
    return (keras_transformer_units(), (tf.random.stateless_normal([batch, length, 512],
                                                                   seed=[1, 2]),))
  if name == "mlp":
    return ([layers.Linear.Params().set(name=f"fc{i}", input_dim=1024, output_dim=1024,
                                        activation="RELU") for i in range(8)],
            (tf.random.stateless_normal([256, 1024], seed=[1, 2]),))
  return ([transformer.TransformerLmLayer.Params().set(
              name=f"layer{i}", input_dim=512, hidden_dim=2048, num_heads=8,
              residual_keep_prob=keep_prob, atten_keep_prob=keep_prob, relu_keep_prob=keep_prob)
           for i in range(8)],
          (tf.random.stateless_normal([batch, length, 512], seed=[1, 2]),
           tf.zeros([batch, length])))


def keras_transformer_units(layers: int = 8, dim: int = 512, hidden: int = 2048,
                            heads: int = 8, length: int = 64) -> list:
  """`transformer`'s 8 pre-norm layers as a functional Keras model (MultiHeadAttention,
  LayerNormalization, Dense), through `g.from_keras`: one unit per residual block."""
  import keras
  import tensorflow as tf

  import lingvo_gpipe as g

  with tf.Graph().as_default():  # (built for its config: nothing allocated)
    x = inputs = keras.Input((length, dim))
    for i in range(layers):
      a = keras.layers.LayerNormalization(epsilon=1e-6, name=f"attention{i}_norm")(x)
      a = keras.layers.MultiHeadAttention(heads, dim // heads, name=f"attention{i}")(
          a, a, use_causal_mask=True)
      x = keras.layers.Add(name=f"attention{i}_residual")([x, a])
      f = keras.layers.LayerNormalization(epsilon=1e-6, name=f"ff{i}_norm")(x)
      f = keras.layers.Dense(hidden, activation="relu", name=f"ff{i}_inner")(f)
      f = keras.layers.Dense(dim, name=f"ff{i}_outer")(f)
      x = keras.layers.Add(name=f"ff{i}_residual")([x, f])
    return g.from_keras(keras.Model(inputs, x)).layers


PLAIN = ("plain",)  # the runner key of plain TensorFlow on one worker


# Training steps per call of the traced step (`--steps_per_call`, the trainer's
# task.train.steps_per_call), for our runs and the plain model's alike: a step's time
# is its call's ÷ this.
STEPS_PER_CALL = 1


def make_step(model_name: str, num_cells: int, num_micro_batches: int, devices: list[str],
              schedule: str = "gpipe", weight_gradient_group: int = 1,
              recompute: str = "always"):
  """A traced, warmed-up training step of `model_name` on `num_cells` workers
  (interleaved_1f1b and zbv: two cells on each)."""
  from lingvo_gpipe.pipeline import schedule as schedules

  virtual_stages = 2 if schedule in schedules.VIRTUAL_STAGES else 1
  return _make_step(model_name, num_cells * virtual_stages, num_micro_batches,
                    devices[:num_cells], schedule, weight_gradient_group, virtual_stages,
                    recompute)


def make_plain_step(model_name: str, device: str, **shape: int):
  """What a user whose model fits one device runs instead: the same layers as one
  `layers.Sequential` on `device`, a `tf.function` of GradientTape and plain SGD
  (`assign_sub`), no pipeline code at all (no micro-batches, no re-materialization,
  no loop, no timeline). `shape`: model_layers' batch and length. run() → (seconds,
  None)."""
  import tensorflow as tf

  from lingvo_gpipe.core import base_layer, layers

  with tf.device(device):
    stack, inputs = model_layers(model_name, **shape)
    model = layers.Sequential.Params().set(name=model_name, layers=stack,
                                           random_seed=1).instantiate()
  variables = model.trainable_variables

  def one_step(inputs):
    with tf.device(device):  # the backward too: a tape's gradient ops get no device
      with tf.GradientTape() as tape:
        with base_layer.step_context(training=True):
          out = tf.nest.flatten(model(*inputs))[0]
          loss = tf.reduce_mean(tf.square(out))
      for v, g in zip(variables, tape.gradient(loss, variables)):
        v.assign_sub(1e-4 * g)
      return loss

  @tf.function
  def step(inputs):  # STEPS_PER_CALL steps, as a user's own loop in a tf.function would
    return [one_step(inputs) for _ in range(STEPS_PER_CALL)][-1]

  def run() -> tuple[float, None]:
    start = time.perf_counter()
    step(inputs).numpy()
    return (time.perf_counter() - start) / STEPS_PER_CALL, None

  run()  # trace and warm up
  return run


def _make_step(model_name: str, num_cells: int, num_micro_batches: int, devices: list[str],
               schedule: str, weight_gradient_group: int, virtual_stages: int,
               recompute: str):
  """A traced, warmed-up training step of `model_name`: run() → (seconds, measured
  schedule); run.graph_def is the traced step's GraphDef, its function library holding
  the cells' forward and backward bodies."""
  import tensorflow as tf

  from lingvo_gpipe.pipeline import layer as gpipe

  with tf.device(devices[0]):
    stack, inputs = model_layers(model_name)
  model = gpipe.PipeliningLayer.Params().set(
      name=model_name, layers=stack, num_cells=num_cells, num_micro_batches=num_micro_batches,
      devices=devices, recompute=recompute, schedule=schedule,
      virtual_stages=virtual_stages, weight_gradient_group=weight_gradient_group,
      random_seed=1).instantiate()

  def mean_square(outputs, _):
    out = tf.nest.flatten(outputs)[0]
    return {"loss": (tf.reduce_mean(tf.square(out)), tf.cast(tf.shape(out)[0], tf.float32))}

  run = train_step_runner(model, mean_square, inputs, devices[0])
  run.graph_def = run.step_fn.get_concrete_function(
      *run.call_args).graph.as_graph_def()
  return run


def train_step_runner(model, head, inputs, input_device: str):
  """The trainer's step (`train_step.TrainStep`, plain SGD) of the pipeline `model`
  with `head` on the batch {"inputs": inputs}, traced and run once: run() → (seconds,
  measured schedule); run.plan is its schedule, run.first_step_seconds what the
  first call took (tracing included), run.step_fn and run.call_args the traced step and
  its arguments."""
  import tensorflow as tf

  from lingvo_gpipe import train_step
  from lingvo_gpipe.core import optimizers
  from lingvo_gpipe.pipeline import timeline

  wrapped = train_step.StackWithLoss(model, head)
  optimizer = optimizers.SGD.Params().set(learning_rate=1e-4, momentum=0.0).instantiate()
  optimizer.create_slots(wrapped.trainable_variables)
  step = train_step.TrainStep(wrapped, optimizer, tf.Variable(0, dtype=tf.int64),
                              input_device=input_device)
  batch = {"inputs": inputs}
  if STEPS_PER_CALL == 1:
    step_fn, call_args = tf.function(step), (batch,)
  else:  # (the trainer's task.train.steps_per_call)
    step_fn, call_args = tf.function(step.steps), ([batch] * STEPS_PER_CALL,)

  def run() -> tuple[float, timeline.MeasuredTimeline]:
    """One step: its wall time (seconds; a call's ÷ STEPS_PER_CALL) and its measured
    schedule (the call's last step's)."""
    start = time.perf_counter()
    results = step_fn(*call_args)
    outputs, fetched = results if STEPS_PER_CALL == 1 else results[-1]
    outputs["loss"].numpy()
    seconds = (time.perf_counter() - start) / STEPS_PER_CALL
    return seconds, timeline.MeasuredTimeline.from_fetched([t.numpy() for t in fetched])

  started = time.perf_counter()
  run()  # trace and warm up
  run.first_step_seconds = time.perf_counter() - started
  run.plan, run.step_fn, run.call_args = step.plan, step_fn, call_args
  return run


def worker_peaks(model_name: str, k: int, m: int, schedule: str, recompute: str) -> list[int]:
  """Each worker's allocator peak (bytes) over a traced step and one more of `model_name`
  at K=k, M=m: measured in a fresh process with fresh workers (`_print_worker_peaks`),
  since a worker's peak counts from its start and the timed runs share their workers."""
  command = [sys.executable, os.path.abspath(__file__), "--peak_of",
             f"{model_name},{k},{m},{schedule},{recompute}"]
  result = subprocess.run(command, capture_output=True, text=True, timeout=600)
  if result.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.splitlines()[-1])["peak_bytes_per_worker"]


def _print_worker_peaks(config: str) -> None:
  """--peak_of MODEL,K,M,SCHEDULE,RECOMPUTE: starts K workers that log their device
  memory (tools/worker.py --memory_log, TensorFlow's BFC allocator on CPU, the one GPUs
  use), runs the step twice and prints {"peak_bytes_per_worker": [...]}: everything
  each worker held at once (weights, activations kept or stashed, gradients, hand-off
  buffers, the batch on worker 0)."""
  from lingvo_gpipe.runtime.local_workers import local_cluster
  from lingvo_gpipe.runtime.memory_log import memory_log_path, read_memory_log

  model_name, k, m, schedule, recompute = config.split(",")
  with tempfile.TemporaryDirectory() as log_dir:
    with local_cluster(int(k), memory_log_dir=log_dir) as (devices, _):
      run = make_step(model_name, int(k), int(m), devices, schedule, recompute=recompute)
      run()
      time.sleep(1.5)  # the workers poll their allocators every 0.5 s
      peaks = [read_memory_log(memory_log_path(log_dir, task))["peak_bytes_in_use"]
               for task in range(int(k))]
  print(json.dumps({"peak_bytes_per_worker": peaks}))


def weight_gradient_groups(spec: str, m: int) -> list[int]:
  """The G values of a --weight_gradient_groups spec ('1,M': per micro-batch, and all M
  at once) at M=m (bench/micro_batch_profile.py's --groups too)."""
  groups = [m if g.strip() == "M" else min(int(g), m) for g in spec.split(",")]
  return sorted(set(groups))


def _config_name(model_name: str, k: int, m: int, schedule: str, group: int,
                 recompute: str = "always") -> str:
  return (f"{model_name}_k{k}_m{m}" + (f"_{schedule}" if schedule != "gpipe" else "")
          + (f"_g{group}" if group > 1 else "") + ("_never" if recompute == "never" else ""))


def _weight_share(measured) -> float:
  """The W actions' share of the backward time (B + W) over the cells that defer."""
  _, backward, weight = measured.action_times()
  deferring = [k for k, w in enumerate(weight) if w > 0]
  total_w = sum(weight[k] for k in deferring)
  return total_w / max(total_w + sum(backward[k] for k in deferring), 1e-12)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--max_workers", type=int, default=2)
  parser.add_argument("--micro_batches", default="1,2,4,8,16")
  parser.add_argument("--weight_gradient_groups", default="1,M",
                      help="G values of PipeliningLayer.weight_gradient_group; M: all "
                      "micro-batches at once")
  parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
  parser.add_argument("--models", default="mlp,transformer")
  parser.add_argument("--schedules", default="gpipe,1f1b,zb_h1,interleaved_1f1b",
                      help="schedules of the K>1 runs")
  parser.add_argument("--recompute", default="always,never",
                      help="recompute policies of the K>1 runs")
  parser.add_argument("--peak_schedules", default="1f1b,zbv",
                      help="schedules (of --schedules) whose workers' peaks are measured, "
                      "each K>1, M and recompute policy in fresh workers; empty: none")
  parser.add_argument("--steps_per_call", type=int, default=1,
                      help="training steps per call of the traced step, ours and the "
                      "plain model's (the trainer's task.train.steps_per_call)")
  parser.add_argument("--peak_of", help=argparse.SUPPRESS)  # MODEL,K,M,SCHEDULE,RECOMPUTE
  args = parser.parse_args()
  global STEPS_PER_CALL
  STEPS_PER_CALL = args.steps_per_call
  if args.peak_of:
    _print_worker_peaks(args.peak_of)
    return
  micro_batches = [int(m) for m in args.micro_batches.split(",")]
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import action_cost
  worker_counts = [k for k in (2, 4, 8) if k <= args.max_workers]
  policies = args.recompute.split(",")

  from lingvo_gpipe.pipeline.schedule import SPLIT_BACKWARD
  from lingvo_gpipe.runtime.local_workers import local_cluster

  with local_cluster(args.max_workers) as (devices, _):
    import tensorflow as tf

    results: dict = {}
    m8_over_m1: dict = {}  # K=1 step at M=8 (per G) ÷ at M=1, measured side by side
    overheads: dict = {}   # per model: ours K=1, M=1, recompute never ÷ plain TF, per M run
    for model_name in args.models.split(","):
      for m in micro_batches:
        # What a user could run instead (plain TensorFlow on one device; ours on one
        # device at M=1 without and with re-materialization, and at this M with each
        # G) and the K>1 runs, alternate step by step: the machine drifts, so every
        # ratio compares steps measured side by side.
        runners = {PLAIN: make_plain_step(model_name, devices[0]),
                   (1, "gpipe", 1, 1, "always"): make_step(model_name, 1, 1, devices),
                   (1, "gpipe", 1, 1, "never"): make_step(model_name, 1, 1, devices,
                                                          recompute="never")}
        for group in weight_gradient_groups(args.weight_gradient_groups, m):
          runners[(1, "gpipe", group, m, "always")] = make_step(
              model_name, 1, m, devices, weight_gradient_group=group)
          for k in worker_counts:
            for schedule in args.schedules.split(","):
              if schedule in SPLIT_BACKWARD and group > 1:
                continue
              for policy in policies:
                runners[(k, schedule, group, m, policy)] = make_step(
                    model_name, k, m, devices, schedule, group, policy)
        times: dict = {key: [] for key in runners}
        schedules: dict = {key: [] for key in runners}
        for _ in range(args.steps):
          for key, run in runners.items():
            seconds, measured = run()
            times[key].append(seconds)
            schedules[key].append(measured)
        medians = {key: statistics.median(v) for key, v in times.items()}
        plain = medians.pop(PLAIN)
        results.setdefault(f"{model_name}_plain", {"step_seconds": round(plain, 4)})
        print(f"{model_name + '_plain':30s} {plain:.4f} s (plain TensorFlow, one worker)",
              flush=True)
        overheads.setdefault(model_name, []).append(
            medians[(1, "gpipe", 1, 1, "never")] / plain)
        single = {_config_name(model_name, 1, m_run, "gpipe", group, policy): t
                  for (k, _, group, m_run, policy), t in medians.items() if k == 1}
        best_name = min(single, key=single.get)
        for name, step_1 in single.items():
          results.setdefault(name, {"step_seconds": round(step_1, 4)})
          print(f"{name:30s} K=1 {step_1:.4f} s", flush=True)
        if m == 8:
          one = single[_config_name(model_name, 1, 1, "gpipe", 1)]
          for group in weight_gradient_groups(args.weight_gradient_groups, m):
            m8_over_m1[f"{model_name}_k1_m8" + (f"_g{group}" if group > 1 else "")] = round(
                single[_config_name(model_name, 1, 8, "gpipe", group)] / one, 3)
        for (k, schedule, group, _, policy), step_k in medians.items():
          if k == 1:
            continue
          name = _config_name(model_name, k, m, schedule, group, policy)
          base = medians[(1, "gpipe", group, m, "always")]
          runs = schedules[(k, schedule, group, m, policy)]
          num_cells = runs[0].num_cells
          busy = [statistics.median(s.busy_fractions()[c] for s in runs)
                  for c in range(num_cells)]
          bubble = statistics.median(s.bubble() for s in runs)
          plan = runners[(k, schedule, group, m, policy)].plan
          planned = statistics.median(s.summary(plan)["pipeline/bubble_planned"] for s in runs)
          results[name] = {"step_seconds_k1": round(base, 4),
                           f"step_seconds_k{k}": round(step_k, 4),
                           "step_seconds_plain": round(plain, 4),
                           "speedup": round(base / step_k, 3),
                           "speedup_vs_plain_single": round(plain / step_k, 3),
                           "best_single": best_name,
                           "speedup_vs_best_single": round(single[best_name] / step_k, 3),
                           "bubble_bound": round(k * m / (m + k - 1), 3),
                           "bubble_measured": round(bubble, 3),
                           "bubble_planned": round(planned, 3),
                           "bubble_theoretical": round((k - 1) / (m + k - 1), 3),
                           "busy_fractions": [round(b, 3) for b in busy]}
          if schedule in SPLIT_BACKWARD:
            results[name]["weight_share"] = round(
                statistics.median(_weight_share(s) for s in runs), 3)
          print(f"{name:30s} K=1 {base:.4f} s  K={k} {step_k:.4f} s  "
                f"vs plain {plain / step_k:.2f}  speedup {base / step_k:.2f}  "
                f"(bound {k * m / (m + k - 1):.2f})  "
                f"vs best single ({best_name}) {single[best_name] / step_k:.2f}  "
                f"bubble {bubble:.3f} (plan {planned:.3f}, GPipe theory "
                f"{(k - 1) / (m + k - 1):.3f})", flush=True)
    # Each worker's peak, per schedule of --peak_schedules (fresh workers each: a
    # worker's peak counts from its start).
    peak_schedules = [s for s in args.peak_schedules.split(",")
                      if s and s in args.schedules.split(",")]
    for model_name in args.models.split(","):
      for m in micro_batches:
        for k in worker_counts:
          for policy in policies:
            for schedule in peak_schedules:
              name = _config_name(model_name, k, m, schedule, 1, policy)
              results[name]["peak_bytes_per_worker"] = worker_peaks(
                  model_name, k, m, schedule, policy)
              print(f"{name:30s} peak per worker "
                    + " ".join(f"{b / 2**20:.1f}" for b in results[name][
                        "peak_bytes_per_worker"]) + " MiB", flush=True)
    summary = {
        "bench": "pipeline_speedup",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, TF {tf.__version__}",
        "workers": args.max_workers, "steps_per_config": args.steps,
        "steps_per_call": args.steps_per_call,
        "onednn": os.environ["TF_ENABLE_ONEDNN_OPTS"],
        "results": results,
    }
    for model_name in args.models.split(","):
      summary[f"engine_overhead_k1_m1_{model_name}"] = round(
          statistics.median(overheads[model_name]), 3)
      pipelined = {name: r["speedup_vs_plain_single"] for name, r in results.items()
                   if name.startswith(f"{model_name}_k2_") and "speedup_vs_plain_single" in r}
      if pipelined:
        best = max(pipelined, key=pipelined.get)
        summary[f"speedup_vs_plain_single_{model_name}"] = pipelined[best]
        summary[f"speedup_vs_plain_single_{model_name}_config"] = best
      for name, result in results.items():
        if name.startswith(f"{model_name}_k2_m8") and "speedup_vs_best_single" in result:
          summary[f"speedup_vs_best_single_{name}"] = result["speedup_vs_best_single"]
      one_f = results.get(f"{model_name}_k2_m8_1f1b")
      for schedule in ("zb_h1", "interleaved_1f1b"):
        other = results.get(f"{model_name}_k2_m8_{schedule}")
        if one_f and other:
          summary[f"{model_name}_m8_bubble_over_1f1b_{schedule}"] = round(
              other["bubble_measured"] / max(one_f["bubble_measured"], 1e-9), 3)
      # ZB-V against zb_h1, same K, M, G and recompute: the highest ratio of measured
      # bubbles over the M run (issue 50's target: <= 0.6).
      ratios = [result["bubble_measured"] / max(results[name.replace("_zbv", "_zb_h1")][
                    "bubble_measured"], 1e-9)
                for name, result in results.items()
                if name.startswith(f"{model_name}_k") and "_zbv" in name
                and name.replace("_zbv", "_zb_h1") in results]
      if ratios:
        summary[f"zbv_bubble_vs_zb_h1_{model_name}"] = round(max(ratios), 3)
      # Each schedule's peak against 1f1b's, same K, M and recompute: the highest ratio
      # over the workers and the configurations run (issue 50's target for zbv: <= 1.05).
      for schedule in peak_schedules:
        ratios = [max(a / b for a, b in zip(result["peak_bytes_per_worker"],
                                            results[name.replace(f"_{schedule}", "_1f1b")][
                                                "peak_bytes_per_worker"]))
                  for name, result in results.items()
                  if name.startswith(f"{model_name}_k") and f"_{schedule}" in name
                  and schedule != "1f1b" and "peak_bytes_per_worker" in result
                  and "peak_bytes_per_worker" in results.get(
                      name.replace(f"_{schedule}", "_1f1b"), {})]
        if ratios:
          summary[f"{schedule}_peak_vs_1f1b_{model_name}"] = round(max(ratios), 3)
      # Milliseconds per action at K=2, and what one more action adds
      # (bench/action_cost.py; bench/torch_pipeline.py reports PyTorch's alike).
      for schedule in args.schedules.split(","):
        for policy in policies:
          names = {m: _config_name(model_name, 2, m, schedule, 1, policy) for m in micro_batches}
          steps = {m: results[n]["step_seconds_k2"] for m, n in names.items()
                   if "step_seconds_k2" in results.get(n, {})}
          figures = action_cost.per_action_figures(steps, schedule) if steps else {}
          if figures:
            summary[f"per_action_{model_name}_k2_{schedule}"
                    + ("_never" if policy == "never" else "")] = figures
      if f"{model_name}_k2_m8_zb_h1" in results:
        summary[f"{model_name}_weight_share"] = results[f"{model_name}_k2_m8_zb_h1"][
            "weight_share"]
    if "mlp_k2_m8" in results:
      summary["speedup_k2_m8"] = results["mlp_k2_m8"]["speedup"]
      summary["bubble_bound_k2_m8"] = results["mlp_k2_m8"]["bubble_bound"]
    for name, ratio in m8_over_m1.items():
      summary[f"{name}_over_m1"] = ratio
    print(json.dumps(summary))


if __name__ == "__main__":
  main()
