"""The planner's predictions against measurements: step time and each device's peak.

For each plan (a model family, K cells, M micro-batches, recompute, schedule), the
trainer runs it with `--plan=check` (tools/trainer.py): it predicts the step and
per-device peak from the measured layer costs and machine figures (both read from
one cost cache, filled by a `--mode=plan` run per family and setting first, so a
measured run measures nothing on its devices), trains, and writes the median
measured step beside the prediction (train/plan_check.json). Two settings:

  workers   one loopback worker process per device (tools/worker.py, one thread each,
            --memory_log): each device's peak is its own process's allocator peak
            since it started (weights, slots, stash, steps);
  logical   logical CPU devices in the trainer's process: one allocator, so the
            measured peak is the devices' total, set beside the sum of the
            predicted peaks.

Families (synthetic data, Adam, registered from a param file written to a temporary
directory, as a user would): a Transformer LM, an encoder-decoder MT Transformer,
AmoebaNet-D. Then today's default for one family (K = the devices, partitioned by
parameters, M = 4K, re-materialized, gpipe) against `--plan=auto` on two workers: at a
budget the default does not fit (80% of its measured peak), and with room to spare
(the measured speedup). Finally the planner's own run time for
mt.Multilingual128L6B's shape (64 wide) on 16 devices, its layer costs cached.

  python bench/planner.py                       # every plan, both settings
  python bench/planner.py --only lm_k2_m4_always_gpipe --settings workers \
      --versus_default= --no_plan_time
  python bench/planner.py --only lm_k2_m4_always_gpipe --settings workers --versus_default=Lm
  python bench/planner.py --only none --versus_default= --no_plan_time --shipped 3
  python bench/planner.py --only none --versus_default= --no_plan_time \
      --auto_choice lm.TransformerTiny,keras_examples.KerasTransformerLm

The last line printed is one JSON object: per plan and setting the predicted and
measured step and peaks and their errors (measured / predicted − 1), the median and
worst absolute errors per setting, versus_default,
plan_seconds_multilingual128_16, and with --shipped N the library's small models as
shipped, each run N times (`shipped`: the tiny size class, where the bound must hold
too), and with --auto_choice whether `--plan=auto` chose the fastest of its top three
distinct candidates, each trained for real (`auto_choice`).
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
sys.path.insert(0, str(REPO))
LOGICAL_DEVICES = "cpu:{n}"  # the logical setting's --devices (--logical_devices)

PARAM_FILE = textwrap.dedent('''
    """Planner benchmark models (written by bench/planner.py)."""

    from lingvo_gpipe import model_registry
    from lingvo_gpipe.base_model_params import SingleTaskModelParams
    from lingvo_gpipe.core import optimizers
    from lingvo_gpipe.inputs.synthetic_images import SyntheticImages
    from lingvo_gpipe.inputs.synthetic_text import SyntheticLm, SyntheticTranslation
    from lingvo_gpipe.models import amoeba_net, transformer
    from lingvo_gpipe.tasks.image_classification import ImageClassificationTask
    from lingvo_gpipe.tasks.language_model import LanguageModelTask
    from lingvo_gpipe.tasks.translation import TranslationTask


    class _Bench(SingleTaskModelParams):
      BATCH = 32

      def _train(self, p):
        p.pipeline.set(num_cells=2, num_micro_batches=4, partition_cost="flops")
        p.train.optimizer = optimizers.Adam.Params().set(learning_rate=1e-4)
        p.train.set(save_interval_steps=100000, summary_interval_steps=100000,
                    log_interval_steps=1)
        return p

      def eval_input(self):
        return None


    @model_registry.register
    class Lm(_Bench):
      """Transformer LM: 8 layers, 256 wide (hidden 1024, 4 heads), 64 tokens."""

      def task(self):
        p = LanguageModelTask.Params().set(name="lm")
        vocab = self.train_input().instantiate().vocab.size
        p.stack = transformer.lm_stack(vocab, 256, 1024, 4, 8, residual_keep_prob=0.9)
        return self._train(p)

      def train_input(self):
        return SyntheticLm.Params().set(name="lm_train", num_examples=4096,
                                        batch_size=self.BATCH, sequence_length=64)


    @model_registry.register
    class Mt(_Bench):
      """Encoder-decoder Transformer: 4 + 4 layers, 256 wide, 32 tokens."""

      def task(self):
        p = TranslationTask.Params().set(name="mt")
        vocab = self.train_input().instantiate().vocab.size
        p.stack = transformer.encoder_decoder_stack(vocab, 256, 1024, 4, 4)
        return self._train(p)

      def train_input(self):
        return SyntheticTranslation.Params().set(name="mt_train", num_examples=4096,
                                                 batch_size=self.BATCH, sequence_length=32)


    @model_registry.register
    class Amoeba(_Bench):
      """AmoebaNet-D (3, 32) on 32×32 images."""

      def task(self):
        body = amoeba_net.amoeba_net("D", num_normal_cells=3, filters=32, image_size=32,
                                     num_classes=10, stem="cifar", stem_filters=32)
        p = ImageClassificationTask.Params().set(name="amoeba")
        p.body = body.stack
        p.softmax.set(input_dim=body.feature_dim, num_classes=10)
        return self._train(p)

      def train_input(self):
        return SyntheticImages.Params().set(name="amoeba_train", batch_size=self.BATCH,
                                            num_examples=4096, image_size=32,
                                            num_classes=10)


    @model_registry.register
    class Multilingual128(_Bench):
      """mt.Multilingual128L6B's shape at 64 wide: 64 + 64 layers, batch 64."""
      BATCH = 64

      def task(self):
        p = TranslationTask.Params().set(name="mt128")
        vocab = self.train_input().instantiate().vocab.size
        p.stack = transformer.encoder_decoder_stack(vocab, 64, 256, 4, 64)
        return self._train(p)

      def train_input(self):
        return SyntheticTranslation.Params().set(name="mt128_train", num_examples=4096,
                                                 batch_size=self.BATCH)
''')

# name → (family, K cells, M, recompute, schedule, V[, S token slices])
PLANS = {
    "lm_k1_m4_always_gpipe": ("Lm", 1, 4, "always", "gpipe", 1),
    "lm_k2_m4_always_gpipe": ("Lm", 2, 4, "always", "gpipe", 1),
    "lm_k2_m8_never_1f1b": ("Lm", 2, 8, "never", "1f1b", 1),
    "lm_k4_m8_always_zb_h1": ("Lm", 4, 8, "always", "zb_h1", 1),
    "lm_k4v2_m4_always_interleaved": ("Lm", 4, 4, "always", "interleaved_1f1b", 2),
    "lm_k2_m4_always_1f1b_s4": ("Lm", 2, 4, "always", "1f1b", 1, 4),
    "lm_k2_m4_never_1f1b_s4": ("Lm", 2, 4, "never", "1f1b", 1, 4),
    "mt_k2_m4_always_1f1b": ("Mt", 2, 4, "always", "1f1b", 1),
    "mt_k4_m8_never_gpipe": ("Mt", 4, 8, "never", "gpipe", 1),
    "amoeba_k1_m2_never_gpipe": ("Amoeba", 1, 2, "never", "gpipe", 1),
    "amoeba_k2_m4_always_gpipe": ("Amoeba", 2, 4, "always", "gpipe", 1),
    "amoeba_k2_m8_never_1f1b": ("Amoeba", 2, 8, "never", "1f1b", 1),
}


def trainer_command(param_dir: str, model: str, cache: str, *extra: str) -> list[str]:
  return [sys.executable, str(REPO / "tools" / "trainer.py"), f"--params_path={param_dir}",
          f"--model=planner_models.{model}", f"--cost_cache={cache}",
          "--device_memory=16GB", *extra]


def run(command: list[str], timeout: int = 1200) -> str:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
  result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)
  if result.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n"
                       f"{result.stderr[-3000:]}")
  return result.stdout


def with_workers(num_workers: int, body):
  """body(cluster spec, memory log dir) with `num_workers` fresh loopback workers."""
  from lingvo_gpipe.runtime.local_workers import start_local_workers

  with tempfile.TemporaryDirectory() as log_dir:
    spec, procs = start_local_workers(num_workers, memory_log_dir=log_dir)
    try:
      return body(spec, log_dir)
    finally:
      for proc in procs:
        proc.kill()
      for proc in procs:
        proc.wait()


def override(plan: tuple) -> str:
  _, k, m, recompute, name, v, *slices = plan
  return (f"task.pipeline.num_cells={k};task.pipeline.num_micro_batches={m};"
          f"task.pipeline.recompute={recompute};task.pipeline.schedule={name};"
          f"task.pipeline.virtual_stages={v};"
          f"task.pipeline.num_token_slices={slices[0] if slices else 1}")


def measure(name: str, setting: str, param_dir: str, cache: str, steps: int,
            logs: str | None = None) -> dict:
  """One plan in one setting through the trainer: its plan_check.json, and on workers
  each worker's peak from its memory log."""
  from lingvo_gpipe.runtime.memory_log import memory_log_path, read_memory_log

  plan = PLANS[name]
  devices = num_devices(plan)
  logdir = tempfile.mkdtemp(prefix=f"planner_{name}_{setting}_", dir=logs)
  args = [f"--logdir={logdir}", f"--max_steps={steps}", "--plan=check",
          f"--params_override={override(plan)}"]

  def on_workers(spec: str, log_dir: str) -> dict:
    run(trainer_command(param_dir, plan[0], cache, f"--cluster_spec={spec}", *args))
    time.sleep(1.5)  # the memory logs poll every 0.5 s
    used = plan[1] // plan[5]
    return {"measured_peak_per_device": [
        read_memory_log(memory_log_path(log_dir, t))["peak_bytes_in_use"]
        for t in range(used)]}

  if setting == "workers":
    extra = with_workers(devices, on_workers)
  else:
    run(trainer_command(param_dir, plan[0], cache,
                        f"--devices={LOGICAL_DEVICES.format(n=devices)}", *args))
    extra = {}
  found = json.loads((Path(logdir) / "train" / "plan_check.json").read_text())
  out = {"predicted_step_s": found["predicted_step_s"],
         "measured_step_s": found["measured_step_s"], "step_error": found["step_error"],
         "predicted_peak_per_device": found["predicted_peak_bytes"]}
  if setting == "workers":
    out.update(extra)
    out["peak_error"] = [m / p - 1 for m, p in zip(extra["measured_peak_per_device"],
                                                  found["predicted_peak_bytes"])]
  elif len(found["measured_peak_bytes"]) > 1:  # logical GPUs: an allocator each
    out["measured_peak_per_device"] = found["measured_peak_bytes"]
    out["peak_error"] = found["peak_error"]
  else:  # logical CPUs: one allocator for all
    out["measured_peak_total"] = found["measured_peak_bytes"][0]
    out["predicted_peak_total"] = sum(found["predicted_peak_bytes"])
    out["peak_error"] = found["peak_error"]
  return out


def num_devices(plan: tuple) -> int:
  """The devices a plan's run gets: its K / V, and 2 at least (the machine's link)."""
  return max(plan[1] // plan[5], 2)


def fill_cache(family: str, setting: str, devices: int, param_dir: str, cache: str) -> None:
  """Measures the family's layer costs and the machine on `devices` devices of
  `setting` (--mode=plan), so that the measured runs find them cached."""
  args = ["--mode=plan"]
  if setting == "workers":
    with_workers(devices, lambda spec, _: run(trainer_command(
        param_dir, family, cache, f"--cluster_spec={spec}", *args)))
  else:
    run(trainer_command(param_dir, family, cache,
                        f"--devices={LOGICAL_DEVICES.format(n=devices)}", *args))


def versus_default(family: str, devices: int, param_dir: str, cache: str, steps: int,
                   logs: str | None) -> dict:
  """Today's default (K = the devices, partitioned by parameters, M = 4K, recompute
  always, gpipe) against --plan=auto on `devices` loopback workers: (1) at a budget
  of 80% of the default's measured peak (the default does not fit it), the plan's
  measured peak; (2) with room to spare, the measured steps."""
  default = (f"task.pipeline.num_cells={devices};task.pipeline.num_micro_batches="
             f"{4 * devices};task.pipeline.partition_cost=params;"
             f"task.pipeline.recompute=always;task.pipeline.schedule=gpipe")

  def trained(extra: list[str], memory: str) -> dict:
    from lingvo_gpipe.runtime.memory_log import memory_log_path, read_memory_log

    logdir = tempfile.mkdtemp(prefix=f"planner_default_{family}_", dir=logs)

    def body(spec: str, log_dir: str) -> dict:
      command = trainer_command(param_dir, family, cache, f"--cluster_spec={spec}",
                                f"--logdir={logdir}", f"--max_steps={steps}", *extra)
      command[command.index("--device_memory=16GB")] = f"--device_memory={memory}"
      run(command)
      time.sleep(1.5)
      found = json.loads((Path(logdir) / "train" / "plan_check.json").read_text())
      return {"measured_step_s": found["measured_step_s"],
              "predicted_step_s": found["predicted_step_s"], "shape": found["shape"],
              "measured_peak_per_device": [
                  read_memory_log(memory_log_path(log_dir, t))["peak_bytes_in_use"]
                  for t in range(devices)],
              "predicted_peak_per_device": found["predicted_peak_bytes"]}

    return with_workers(devices, body)

  fill_cache(family, "workers", devices, param_dir, cache)
  base = trained(["--plan=check", f"--params_override={default}"], "16GB")
  budget = 0.8 * max(base["measured_peak_per_device"])
  try:
    tight = trained(["--plan=auto"], f"{budget:.0f}")
    fits = max(tight["measured_peak_per_device"]) <= budget
  except RuntimeError as e:  # the planner found no plan that fits: it says so, exit 2
    refusal = [line for line in str(e).splitlines() if "no plan fits" in line]
    if not refusal:
      raise
    tight, fits = {"refused": refusal[0]}, None
  roomy = trained(["--plan=auto"], "16GB")
  return {"default": base, "budget_bytes": budget, "planned_at_budget": tight,
          "plan_fits_budget": fits, "planned_unconstrained": roomy,
          "speedup_over_default": base["measured_step_s"] / roomy["measured_step_s"]}


def plan_seconds(param_dir: str, cache: str) -> float:
  """The planner's own run time for the 64-wide Multilingual128 shape on 16 logical
  devices, its costs cached (a first run measures them)."""
  command = trainer_command(param_dir, "Multilingual128", cache, "--mode=plan",
                            "--devices=cpu:16")
  run(command, timeout=3000)
  out = run(command, timeout=3000)
  line = next(line for line in out.splitlines() if line.startswith("Planned in "))
  return float(line.split()[2])


# The library's small models as shipped: the size class where fixed buffers and small
# allocations weigh most (docs/benchmarks.md, "The bound at small sizes").
SHIPPED = ("lm.TransformerTiny", "keras_examples.KerasTransformerLm", "image.AmoebaNetTiny",
           "keras_examples.KerasConvNet")


def shipped(repeats: int, logs: str | None) -> dict:
  """Each SHIPPED model `repeats` times with `--plan=check` on two logical CPUs (one
  allocator, the input pipeline's bytes counted), its own cost cache cold for the first
  run: per model each run's peak and step error, and the worst (the bound holds where
  the worst peak error is ≤ 0) and the median."""
  out = {}
  with tempfile.TemporaryDirectory() as scratch:
    for model in SHIPPED:
      cache = str(Path(scratch) / f"{model}.json")
      peaks, steps = [], []
      for r in range(repeats):
        logdir = str(Path(logs or scratch) / f"shipped_{model}_{r}")
        run([sys.executable, str(REPO / "tools" / "trainer.py"), f"--model={model}",
             "--devices=cpu:2", "--plan=check", "--device_memory=1GB", "--max_steps=6",
             f"--cost_cache={cache}", f"--logdir={logdir}"])
        found = json.loads((Path(logdir) / "train" / "plan_check.json").read_text())
        peaks.append(found["peak_error"][0])
        steps.append(found["step_error"])
      out[model] = {"peak_errors": peaks, "worst_peak_error": max(peaks),
                    "median_peak_error": statistics.median(peaks), "step_errors": steps,
                    "median_step_error": statistics.median(steps)}
      print(json.dumps({model: out[model]}), flush=True)
  return out


def auto_choice(model: str, repeats: int, steps: int, logs: str | None) -> dict:
  """Does `--plan=auto` choose the fastest of its top three distinct candidates? On two
  logical CPUs, at two budgets: room (1 GB) and a tight one (80% of the room's best
  plan's predicted peak, so that it does not fit): `--mode=plan` lists the candidates
  (planner.plan lists each step once); each is trained `repeats` times, the rounds
  interleaved (these machines drift between minutes), the first through `--plan=auto`
  itself (its "Plan:" line must be the list's first). Per budget: each candidate's
  predicted and median measured step, and the chosen one's median ÷ the fastest's
  (target ≤ 1.05)."""
  from lingvo_gpipe.pipeline import planner

  out = {}
  with tempfile.TemporaryDirectory() as scratch:
    cache = str(Path(scratch) / "costs.json")
    trainer = [sys.executable, str(REPO / "tools" / "trainer.py"), f"--model={model}",
               "--devices=cpu:2", f"--cost_cache={cache}"]

    def candidates(memory: str) -> list[dict]:
      listed = run(trainer + ["--mode=plan", f"--device_memory={memory}"])
      return json.loads(listed.strip().splitlines()[-1])["plans"][:3]

    room = candidates("1GB")
    tight_bytes = 0.8 * max(room[0]["peak_bytes"]) / 0.9
    for budget, memory in (("room", "1GB"), ("tight", f"{tight_bytes:.0f}")):
      plans = room if budget == "room" else candidates(memory)
      measured: list[list[float]] = [[] for _ in plans]
      for r in range(repeats):
        for i, plan in enumerate(plans):
          logdir = str(Path(logs or scratch) / f"auto_{model}_{budget}_{i}_{r}")
          how = (["--plan=auto"] if i == 0 else
                 ["--plan=check", f"--params_override={plan['params_override']}"])
          printed = run(trainer + how + [f"--device_memory={memory}", f"--logdir={logdir}",
                                         f"--max_steps={steps}"])
          if i == 0 and f"Plan: {plan['params_override']}" not in printed:
            raise RuntimeError(f"--plan=auto trained another plan than --mode=plan's first:"
                               f"\n{printed[-2000:]}")
          found = json.loads((Path(logdir) / "train" / "plan_check.json").read_text())
          measured[i].append(found["measured_step_s"])
      medians = [statistics.median(m) for m in measured]
      out[budget] = {
          "device_memory_bytes": planner.parse_bytes(memory),
          "candidates": [{"params_override": p["params_override"],
                          "predicted_step_s": p["step_s"], "measured_step_s": m,
                          "median_step_s": med}
                         for p, m, med in zip(plans, measured, medians)],
          "chosen_over_fastest": medians[0] / min(medians),
          "fastest_measured": medians.index(min(medians))}
      print(json.dumps({f"{model}/{budget}": out[budget]}), flush=True)
  return out


def summary(errors: list[float]) -> dict:
  absolute = [abs(e) for e in errors]
  return {"median": statistics.median(absolute), "worst": max(absolute)} if absolute else {}


def main() -> None:
  global LOGICAL_DEVICES
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", default="", help="comma-separated plan names ('none': "
                      "only --versus_default and the planner's time)")
  parser.add_argument("--settings", default="workers,logical")
  parser.add_argument("--steps", type=int, default=8, help="training steps per run")
  parser.add_argument("--no_plan_time", action="store_true")
  parser.add_argument("--logs", default=None, help="keep the runs' logdirs here")
  parser.add_argument("--logical_devices", default="cpu:{n}",
                      help="the logical setting's --devices, {n} the count (e.g. "
                      "gpu:{n}:8192: one GPU split, an allocator per logical GPU)")
  parser.add_argument("--versus_default", default="Lm",
                      help="the family to run today's default against --plan=auto with "
                      "('' for none)")
  parser.add_argument("--shipped", type=int, default=0,
                      help="also run the library's small models N times each (SHIPPED)")
  parser.add_argument("--auto_choice", default="",
                      help="comma-separated models: train --plan=auto's top three "
                      "candidates for real at two budgets (auto_choice)")
  parser.add_argument("--auto_repeats", type=int, default=3,
                      help="--auto_choice: runs of each candidate (their median)")
  args = parser.parse_args()
  LOGICAL_DEVICES = args.logical_devices
  names = ([] if args.only == "none" else
           [n for n in (args.only.split(",") if args.only else PLANS)])
  settings = args.settings.split(",")
  results: dict = {"machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                   "command": " ".join(sys.argv), "plans": {}}
  with tempfile.TemporaryDirectory() as param_dir:
    (Path(param_dir) / "planner_models.py").write_text(PARAM_FILE)
    cache = str(Path(param_dir) / "costs.json")
    for setting in settings:
      for family, devices in sorted({(PLANS[n][0], num_devices(PLANS[n])) for n in names}):
        fill_cache(family, setting, devices, param_dir, cache)
      for name in names:
        got = measure(name, setting, param_dir, cache, args.steps, args.logs)
        results["plans"][f"{name}/{setting}"] = got
        print(json.dumps({f"{name}/{setting}": got}), flush=True)
    for setting in settings:
      mine = [v for k, v in results["plans"].items() if k.endswith("/" + setting)]
      results[f"step_error_{setting}"] = summary([v["step_error"] for v in mine
                                                  if v["step_error"] is not None])
      results[f"peak_error_{setting}"] = summary([e for v in mine for e in v["peak_error"]])
    if args.versus_default:
      results["versus_default"] = versus_default(args.versus_default, 2, param_dir, cache,
                                                 args.steps, args.logs)
      print(json.dumps({"versus_default": results["versus_default"]}), flush=True)
    if not args.no_plan_time:
      results["plan_seconds_multilingual128_16"] = plan_seconds(param_dir, cache)
  if args.shipped:
    results["shipped"] = shipped(args.shipped, args.logs)
  if args.auto_choice:
    results["auto_choice"] = {
        model: auto_choice(model, args.auto_repeats, max(args.steps, 20), args.logs)
        for model in args.auto_choice.split(",")}
  print(json.dumps(results))


if __name__ == "__main__":
  main()
