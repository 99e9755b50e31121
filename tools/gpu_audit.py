"""Audits the training step of each paper model for GPU kernels, without a GPU.

  python tools/gpu_audit.py                 # every model × schedule × recompute × dtype,
                                            # token slices, replicas, scan_layers
                                            # (226 steps, ~50 min on 2 cores)
  python tools/gpu_audit.py --quick         # a covering subset (each value of each axis)
  make gpu-audit                            # installs the full TensorFlow wheel, runs it

Each configuration's step is traced with its cells on logical CPU devices CPU:1..N that
stand for GPU:0..N-1 (CPU:0 is the host), so variables, optimizer updates and cell ops
sit where they would on GPUs. `pipeline/placement_audit.py` then walks the step and
every function it calls and asks TensorFlow's kernel registry, for each op on a GPU,
whether a GPU or DEFAULT kernel admits its dtypes. That needs the registry of a CUDA
build: the full `tensorflow` wheel (not `tensorflow-cpu`); no GPU is needed.

Prints each configuration, then the ops without a GPU kernel (with the frame that
made each), the ops on the host on purpose (with the reason the code gives), and a
JSON line last. Exit 0: clean; 1: an op meant for a GPU has no kernel, an int32 crosses
a Case or If on a GPU, or a host op does not say why; 2: bad flags or a TensorFlow
without GPU kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # (a failed kernel lookup logs a warning)

import dataclasses  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

DEFAULT_MODELS = ("lm.TransformerTiny", "mt.MultilingualTiny", "image.AmoebaNetTiny")
SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv", "interleaved_zb")
RECOMPUTE = ("always", "except_last", "never")
DTYPES = ("float32", "bfloat16", "float16")
STAND_INS = 4  # logical CPUs standing for GPUs: K=2 × R=2, or K=4 cells interleaved on 2

FLAGS = flags.FLAGS
flags.DEFINE_list("models", list(DEFAULT_MODELS), "Registered models to audit.")
flags.DEFINE_bool("quick", False, "Each value of each axis once (schedule × recompute at "
                  "float32, each dtype at gpipe and zb_h1, slices, replicas) instead of "
                  "the whole product.")
flags.DEFINE_string("json_out", "", "Also write the findings as JSON to this file.")


@dataclasses.dataclass(frozen=True)
class Config:
  """One traced step: a model with pipeline overrides and a compute dtype."""
  model: str
  schedule: str = "gpipe"
  recompute: str = "always"
  dtype: str = "float32"
  token_slices: int = 1
  replicas: int = 1
  scan_layers: bool = False

  def overrides(self) -> dict[str, str]:
    pipeline = {"schedule": repr(self.schedule), "recompute": repr(self.recompute)}
    if self.schedule in ("interleaved_1f1b", "zbv", "interleaved_zb"):  # 4 cells, 2 devices
      pipeline.update(num_cells="4", virtual_stages="2")
    if self.token_slices > 1:
      pipeline.update(num_token_slices=str(self.token_slices),
                      weight_gradient_group=str(self.token_slices))
    if self.replicas > 1:
      pipeline.update(num_replicas=str(self.replicas))
    if self.scan_layers:
      pipeline.update(scan_layers="true")
    out = {f"task.pipeline.{k}": v for k, v in pipeline.items()}
    if self.dtype != "float32":
      out["task.fprop_dtype"] = repr(self.dtype)
    return out

  def __str__(self) -> str:
    extra = (f" S={self.token_slices}" if self.token_slices > 1 else "") + \
            (f" R={self.replicas}" if self.replicas > 1 else "") + \
            (" scan_layers" if self.scan_layers else "")
    return f"{self.model} {self.schedule} recompute={self.recompute} {self.dtype}{extra}"


def configs(models: list[str], quick: bool) -> list[Config]:
  """The grid: per model, schedule × recompute × dtype (quick: schedule × recompute at
  float32, and the other dtypes at gpipe and zb_h1), then token slices (the causal
  language models), replicas, and scan_layers under every schedule (× recompute;
  quick: always and never)."""
  out = []
  for model in models:
    if quick:
      grid = [Config(model, s, r) for s, r in itertools.product(SCHEDULES, RECOMPUTE)]
      grid += [Config(model, s, "always", d) for s in ("gpipe", "zb_h1") for d in DTYPES[1:]]
    else:
      grid = [Config(model, s, r, d)
              for s, r, d in itertools.product(SCHEDULES, RECOMPUTE, DTYPES)]
    if model.startswith("lm."):  # (causal models only: an encoder is refused)
      grid += [Config(model, s, "always", d, token_slices=2)
               for s in ("gpipe", "1f1b") for d in ("float32", "bfloat16")]
    grid += [Config(model, "1f1b", "always", d, replicas=2) for d in ("float32", "float16")]
    # A cell's run of layers as one loop (TensorLists inside the loops' Case branches),
    # under every schedule: its forward loops everywhere, its backward where not split.
    grid += [Config(model, s, r, scan_layers=True)
             for s in SCHEDULES for r in (("always", "never") if quick else RECOMPUTE)]
    out += grid
  return out


def trace_step(config: Config):
  """The training step's FuncGraph for `config`, its cells on the stand-in devices."""
  import tensorflow as tf

  from lingvo_gpipe import model_registry
  from lingvo_gpipe import trainer as trainer_lib
  from lingvo_gpipe.core import tf_internals

  params = model_registry.get_params(config.model)
  for key, value in config.overrides().items():
    params.set_from_text(key, value)
  with tempfile.TemporaryDirectory() as logdir:
    trainer = trainer_lib.Trainer(params, logdir, log=lambda line: None)
    step = tf.function(trainer.train_step, input_signature=[trainer.train_input.batch_spec()])
    with tf_internals.step_options():
      return step.get_concrete_function().graph


def stand_in_gpu(spec) -> int | None:
  """CPU:i (i ≥ 1) stands for GPU:i-1; CPU:0 is the host."""
  if spec.device_type == "CPU" and spec.device_index:
    return spec.device_index - 1
  return None


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    print(f"unexpected arguments {argv[1:]}", file=sys.stderr)
    return 2
  import tensorflow as tf

  if not tf.test.is_built_with_cuda():
    print(f"TensorFlow {tf.__version__} here has no GPU kernels to audit against (the "
          "tensorflow-cpu wheel); install the full wheel: make gpu-audit", file=sys.stderr)
    return 2
  from lingvo_gpipe import model_registry
  from lingvo_gpipe.pipeline import placement_audit
  from lingvo_gpipe.runtime import devices

  names = devices.configure_devices(f"cpu:{STAND_INS + 1}")
  devices.set_default_devices(names[1:])
  model_registry.load_param_files([])
  unknown = [m for m in FLAGS.models if m not in model_registry.keys()]
  if unknown:
    print(f"--models: unknown {unknown}; registered: {model_registry.keys()}",
          file=sys.stderr)
    return 2
  total = placement_audit.AuditReport()
  traced, refused = 0, []
  start = time.perf_counter()
  for config in configs(FLAGS.models, FLAGS.quick):
    try:
      graph = trace_step(config)
    except (ValueError, TypeError) as e:  # ParamsError, PipelineError: not applicable
      refused.append((str(config), str(e).splitlines()[0]))
      print(f"  n/a   {config}: {refused[-1][1]}", flush=True)
      continue
    report = placement_audit.audit(graph, stand_in_gpu)
    traced += 1
    print(f"  {'clean' if report.clean else 'FOUND'} {config}: {report.gpu_ops} GPU ops",
          flush=True)
    total.merge(report)
    del graph
    gc.collect()
  print_report(total, traced, refused)
  result = {"configurations": traced, "not_applicable": len(refused),
            "gpu_ops": total.gpu_ops,
            "without_kernel": sum(total.without_kernel.values()),
            "unexplained_host": sum(total.unexplained_host.values()),
            "deliberate_host": sum(total.on_host.values()),
            "unplaced_host": sum(total.unplaced_host.values()),
            "int32_across_branches": sum(total.int32_across_branches.values()),
            "unreadable_functions": len(total.unreadable_functions),
            "clean": total.clean, "seconds": round(time.perf_counter() - start, 1),
            "tensorflow": tf.__version__}
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(dict(result, findings=[dataclasses.asdict(e) | {"count": n} for e, n in
                                       (total.without_kernel + total.unexplained_host
                                        + total.int32_across_branches).items()],
                     refused=refused), f, indent=1)
  print(json.dumps(result))
  return 0 if total.clean else 1


def print_report(report, traced: int, refused: list[tuple[str, str]]) -> None:
  from lingvo_gpipe.pipeline.placement_audit import table

  print(f"\n{traced} steps traced, {len(refused)} configurations not applicable, "
        f"{report.gpu_ops} op placements on GPUs checked.")
  sections = [("Ops meant for a GPU without a GPU kernel", report.without_kernel, False),
              ("Ops on the host without a stated reason", report.unexplained_host, False),
              ("Case / If on a GPU taking or giving int32 (placement_audit)",
               report.int32_across_branches, False),
              ("Ops on the host on purpose", report.on_host, True),
              ("Ops no device scope reaches and no GPU kernel admits (the placer puts them "
               "on the host)", report.unplaced_host, False)]
  for title, entries, with_reason in sections:
    print(f"\n{title}: {sum(entries.values()) or 'none'}")
    if entries:
      print("\n".join(table(entries, with_reason)))
  if report.unreadable_functions:
    print(f"\nFunctions the audit could not read: {sorted(report.unreadable_functions)}")


def run() -> None:
  app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
  run()
