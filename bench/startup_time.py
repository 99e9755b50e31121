"""Time to the first training step, and the steady step time, through the trainer.

Runs `tools/trainer.py` in a fresh process for each configuration and timestamps its
output lines: process start → "First step done" (Python and TensorFlow start-up,
building the model, tracing the training step, the first step's graph optimization
and run), then the steady step time (median of the following steps, each logged).

Configurations (synthetic data, logical CPU devices, one per cell):

  l{L}_m{M}         a 64-wide Transformer LM (hidden 256, 4 heads) of L layers, K=2 cells,
                    M micro-batches, batch 32, for L in --layers and M in --micro_batches;
  depth{L}          the depth sweep: the same LM of L layers (--depths), K=4, M=8, batch 32;
  transformer48     lm.Transformer48's shape: 48 layers, K=8, M=32 (64 wide, batch 32);
  multilingual128   mt.Multilingual128L6B's shape: 64 encoder + 64 decoder layers, K=16,
                    M=64 (64 wide, batch 64);
  l1663             lm.TransformerL1663's shape: 1663 layers, K=128, M=512, batch 512 (not
                    run unless named in --only);
  l1663_w16         the same 16 wide (hidden 64), so that the step's own compute is small
                    (not run unless named in --only).

--apart runs each configuration a second time with every layer traced on its own
(task.pipeline.share_layer_functions=False), named <config>_apart: the engine before
layers of one kind shared a traced function, measured in the same run. --unstacked
does the same with one tf.Variable per weight (task.pipeline.stack_variables=False),
named <config>_unstacked: the engine before weights were stacked per cell. --scan runs
each with a cell's consecutive layers of one kind as one loop over their stacked
weights (task.pipeline.scan_layers=True), named <config>_scan.

The models are registered in a param file written to a temporary directory and
passed with --params_path, as a user would.

  python bench/startup_time.py                  # everything (about 10 minutes here)
  python bench/startup_time.py --only l8_m4,l8_m32

The last line printed is one JSON object: first_step_s_<config>, steady_step_s_<config>,
peak_rss_gb_<config> (the trainer process's peak resident memory), first_save_s_<config>
(from the last step's line to "Saved": the run's one checkpoint, written at its end, with
Adam's slots), model_built_s_<config>
and step_traced_s_<config> (when the trainer began and finished tracing the step) for
each, first_step_ratio_l8_m32_over_m4, and first_step_s_per_layer and
peak_rss_gb_per_layer: the least-squares slopes of the depth sweep's first-step times and
peaks over L. Each configuration's line also gives the resident memory as each phase
(model built, step traced, first step) ended.
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
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PARAM_FILE = textwrap.dedent('''
    """Start-up benchmark shapes (written by bench/startup_time.py)."""

    from lingvo_gpipe import model_registry
    from lingvo_gpipe.base_model_params import SingleTaskModelParams
    from lingvo_gpipe.core import optimizers
    from lingvo_gpipe.inputs.synthetic_text import SyntheticLm, SyntheticTranslation
    from lingvo_gpipe.models import transformer
    from lingvo_gpipe.tasks.language_model import LanguageModelTask
    from lingvo_gpipe.tasks.translation import TranslationTask

    def _width(dim):
      return dict(model_dim=dim, hidden_dim=4 * dim, num_heads=4, logits_abs_max=30.0)


    class _Shape(SingleTaskModelParams):
      LAYERS, CELLS, MICRO_BATCHES, BATCH = 8, 2, 4, 32
      TRANSLATION = False
      SHARE = True
      STACK = True
      SCAN = False
      DIM = 64

      def task(self):
        vocab = self.train_input().instantiate().vocab.size
        if self.TRANSLATION:
          p = TranslationTask.Params().set(name="startup")
          p.stack = transformer.encoder_decoder_stack(vocab, num_layers=self.LAYERS,
                                                      **_width(self.DIM))
        else:
          p = LanguageModelTask.Params().set(name="startup")
          p.stack = transformer.lm_stack(vocab, num_layers=self.LAYERS, residual_keep_prob=0.9,
                                         **_width(self.DIM))
        p.pipeline.set(num_cells=self.CELLS, num_micro_batches=self.MICRO_BATCHES,
                       share_layer_functions=self.SHARE, stack_variables=self.STACK,
                       scan_layers=self.SCAN)
        p.train.optimizer = optimizers.Adam.Params().set(learning_rate=1e-3)
        p.train.set(save_interval_steps=100000, summary_interval_steps=100000,
                    log_interval_steps=1)
        return p

      def train_input(self):
        cls = SyntheticTranslation if self.TRANSLATION else SyntheticLm
        return cls.Params().set(name="startup_train", num_examples=4096,
                                batch_size=self.BATCH)

      def eval_input(self):
        return None


    def _register(name, **settings):
      model_registry.register(type(name, (_Shape,), dict(settings, __module__=__name__)))
''')


def configs(args) -> dict[str, dict]:
  """name → {class settings, devices}."""
  out = {}
  for layers in args.layers:
    for m in args.micro_batches:
      out[f"l{layers}_m{m}"] = dict(LAYERS=layers, CELLS=2, MICRO_BATCHES=m, BATCH=32)
  for layers in args.depths:
    out[f"depth{layers}"] = dict(LAYERS=layers, CELLS=4, MICRO_BATCHES=8, BATCH=32)
  out["transformer48"] = dict(LAYERS=48, CELLS=8, MICRO_BATCHES=32, BATCH=32)
  out["multilingual128"] = dict(LAYERS=64, CELLS=16, MICRO_BATCHES=64, BATCH=64,
                                TRANSLATION=True)
  only = args.only.split(",")
  if any(n.startswith("l1663") and "_w16" not in n for n in only):
    out["l1663"] = dict(LAYERS=1663, CELLS=128, MICRO_BATCHES=512, BATCH=512)
  if any(n.startswith("l1663_w16") for n in only):  # the step's own compute small
    out["l1663_w16"] = dict(LAYERS=1663, CELLS=128, MICRO_BATCHES=512, BATCH=512, DIM=16)
  base = list(out.items())
  if args.apart:
    out.update({f"{name}_apart": dict(settings, SHARE=False) for name, settings in base})
  if args.unstacked:
    out.update({f"{name}_unstacked": dict(settings, STACK=False) for name, settings in base})
  if args.scan:
    out.update({f"{name}_scan": dict(settings, SCAN=True) for name, settings in base})
  return out


def slope(points: list[tuple[float, float]]) -> float:
  """Least-squares slope of y over x."""
  mean_x = statistics.mean(x for x, _ in points)
  mean_y = statistics.mean(y for _, y in points)
  return (sum((x - mean_x) * (y - mean_y) for x, y in points)
          / sum((x - mean_x) ** 2 for x, _ in points))


def resident_gb(pid: int) -> float:
  """The process's resident set now (VmRSS), GB; its peak is read at exit."""
  with open(f"/proc/{pid}/status") as status:
    for line in status:
      if line.startswith("VmRSS:"):
        return round(int(line.split()[1]) / 2**20, 2)  # kB
  return float("nan")


def run_one(name: str, settings: dict, param_dir: Path, steps: int) -> dict:
  """Runs the trainer on `name`; returns its first-step and steady step seconds."""
  logdir = tempfile.mkdtemp(prefix=f"startup_{name}_")
  command = [sys.executable, str(REPO / "tools" / "trainer.py"),
             f"--params_path={param_dir}", f"--model=startup_shapes.{name}",
             f"--devices=cpu:{settings['CELLS']}", f"--logdir={logdir}",
             f"--max_steps={steps}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  start = time.perf_counter()
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=REPO)
  first_step = built = model_built = saved = None
  phase_rss: dict[str, float] = {}  # the trainer's resident GB as each phase ends
  step_times = []
  for line in proc.stdout:
    now = time.perf_counter() - start
    if line.startswith("Building the training step"):
      model_built = now
      phase_rss["model_built"] = resident_gb(proc.pid)
    elif line.startswith("Built the training step"):
      built = now
      phase_rss["step_traced"] = resident_gb(proc.pid)
    elif line.startswith("First step done"):
      first_step = now
      phase_rss["first_step"] = resident_gb(proc.pid)
    elif line.startswith("step "):
      step_times.append(now)
    elif line.startswith("Saved ") and step_times:
      saved = now - step_times[-1]
  stderr = proc.stderr.read()
  _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak resident memory
  code = os.waitstatus_to_exitcode(status)
  if code != 0 or first_step is None:
    raise RuntimeError(f"{name} failed (exit {code}):\n{stderr[-3000:]}")
  # Step 1's line follows "First step done"; steady steps are the intervals after it.
  intervals = [b - a for a, b in zip(step_times[1:], step_times[2:])]
  return {"first_step_s": round(first_step, 1), "built_s": round(built, 1),
          "model_built_s": round(model_built, 1), "rss_gb_at": phase_rss,
          "steady_step_s": round(statistics.median(intervals), 4) if intervals else None,
          "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),  # ru_maxrss: KiB on Linux
          "first_save_s": round(saved, 2) if saved is not None else None}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")],
                      default=[8, 32])
  parser.add_argument("--micro_batches", type=lambda s: [int(x) for x in s.split(",")],
                      default=[1, 4, 16, 32])
  parser.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")],
                      default=[8, 32, 128])
  parser.add_argument("--apart", action="store_true",
                      help="also run each configuration with every layer traced apart")
  parser.add_argument("--unstacked", action="store_true",
                      help="also run each configuration with one tf.Variable per weight")
  parser.add_argument("--scan", action="store_true",
                      help="also run each configuration with each cell's runs of one kind "
                      "of layer as one loop (task.pipeline.scan_layers=True)")
  parser.add_argument("--steps", type=int, default=6,
                      help="steps per run (>= 4 for a steady step; 1: the first step only)")
  parser.add_argument("--only", default="", help="comma-separated configuration names")
  args = parser.parse_args()
  all_configs = configs(args)
  names = args.only.split(",") if args.only else list(all_configs)
  unknown = [n for n in names if n not in all_configs]
  if unknown:
    parser.error(f"unknown configurations {unknown}; valid: {list(all_configs)}")

  param_dir = Path(tempfile.mkdtemp(prefix="startup_params_"))
  registrations = "".join(f"_register({n!r}, **{all_configs[n]!r})\n" for n in names)
  (param_dir / "startup_shapes.py").write_text(PARAM_FILE + "\n\n" + registrations)
  summary: dict = {"bench": "startup_time",
                   "machine": f"{platform.machine()} {os.cpu_count()} cores"}
  for name in names:
    result = run_one(name, all_configs[name], param_dir, args.steps)
    print(f"{name:18s} first step {result['first_step_s']:7.1f} s  (model built at "
          f"{result['model_built_s']:.1f} s, step traced at {result['built_s']:.1f} s)  "
          f"steady step {result['steady_step_s']} s  first save {result['first_save_s']} s  "
          f"peak {result['peak_rss_gb']} GB  "
          f"resident at each phase's end {result['rss_gb_at']}", flush=True)
    summary[f"first_step_s_{name}"] = result["first_step_s"]
    summary[f"peak_rss_gb_{name}"] = result["peak_rss_gb"]
    summary[f"steady_step_s_{name}"] = result["steady_step_s"]
    summary[f"model_built_s_{name}"] = result["model_built_s"]
    summary[f"step_traced_s_{name}"] = result["built_s"]
    summary[f"first_save_s_{name}"] = result["first_save_s"]
  if "first_step_s_l8_m4" in summary and "first_step_s_l8_m32" in summary:
    summary["first_step_ratio_l8_m32_over_m4"] = round(
        summary["first_step_s_l8_m32"] / summary["first_step_s_l8_m4"], 3)
  for suffix in ("", "_apart", "_unstacked", "_scan"):
    for figure, per_layer in (("first_step_s", "first_step_s_per_layer"),
                              ("peak_rss_gb", "peak_rss_gb_per_layer")):
      depth = [(d, summary[f"{figure}_depth{d}{suffix}"]) for d in args.depths
               if f"{figure}_depth{d}{suffix}" in summary]
      if len(depth) >= 2:
        summary[f"{per_layer}{suffix}"] = round(slope(depth), 5)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
