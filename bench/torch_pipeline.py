"""PyTorch's own pipelining on the same models, for side-by-side figures (not a dependency).

Runs under a separate virtual environment with a CPU build of PyTorch (`python -m venv
/tmp/torchvenv && /tmp/torchvenv/bin/pip install torch numpy`), never under the
project's:

  /tmp/torchvenv/bin/python bench/torch_pipeline.py --micro_batches 2,4,8

Two processes (gloo on loopback), each with one intra-op and one inter-op thread, as
bench/pipeline_speedup.py's two one-thread TensorFlow workers. Each trains the models
of that bench with `torch.distributed.pipelining` (same shapes: an 8-layer 1024-wide
ReLU MLP at batch 256, and 8 pre-norm causal Transformer LM layers, model dim 512,
8 heads, hidden 2048, 16×64 tokens; --models tiny: 8 × Linear 64→64 at batch 64; loss
mean(out²), plain SGD) under each schedule of
--schedules: gpipe, 1f1b (one stage per rank), interleaved_1f1b, interleaved_zb (two
stages per rank, round-robin) and zbv (two per rank in a V). The plain model runs on
rank 0 alone (one thread; the other rank waits) as the baseline, and every
configuration alternates with it step by step; the figures are medians.

The last line printed is one JSON object: per configuration its median step seconds,
the plain step and their ratio (`speedup_vs_plain_single`); per model and schedule,
`per_action_<model>_k2_<schedule>`: milliseconds per action at each M and what one
more action adds (bench/action_cost.py, computed as bench/pipeline_speedup.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import action_cost
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812 (PyTorch's own spelling)
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")


class TransformerLmLayer(nn.Module):
  """Pre-norm causal self-attention then feed-forward, each with a residual: the
  shapes of lingvo_gpipe.models.transformer.TransformerLmLayer at these params."""

  def __init__(self, dim: int = 512, hidden: int = 2048, heads: int = 8):
    super().__init__()
    self.heads = heads
    self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
    self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
    self.inner, self.outer = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
               for z in self.qkv(self.norm1(x)).split(d, dim=-1))
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.out(attended.transpose(1, 2).reshape(b, t, d))
    return x + self.outer(F.relu(self.inner(self.norm2(x))))


def model_layers(name: str) -> tuple[list[nn.Module], torch.Tensor]:
  """The 8 layers of `name` and its input batch."""
  torch.manual_seed(1)
  if name == "tiny":  # compute next to nothing: a step is the library's cost per action
    return ([nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)],
            torch.randn(64, 64))
  if name == "mlp":
    return ([nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)],
            torch.randn(256, 1024))
  return [TransformerLmLayer() for _ in range(8)], torch.randn(16, 64, 512)


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
  """The stages rank `rank` holds: one (gpipe, 1f1b), two round-robin (interleaved),
  or two in a V (zbv: rank and 2·world − 1 − rank)."""
  if schedule in ("gpipe", "1f1b"):
    return [rank]
  if schedule == "zbv":
    return [rank, 2 * world - 1 - rank]
  return [rank, rank + world]


def make_schedule(name: str, stages: list, micro_batches: int):
  from torch.distributed import pipelining as p

  def loss_fn(output: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()

  if name in ("gpipe", "1f1b"):
    kind = p.ScheduleGPipe if name == "gpipe" else p.Schedule1F1B
    return kind(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn)
  kind = {"interleaved_1f1b": p.ScheduleInterleaved1F1B,
          "interleaved_zb": p.ScheduleInterleavedZeroBubble,
          "zbv": p.ScheduleZBVZeroBubble}[name]
  return kind(stages, n_microbatches=micro_batches, loss_fn=loss_fn)


def pipelined_step(model_name: str, schedule: str, micro_batches: int, rank: int, world: int):
  """One training step of this rank's stages: run() → None (every rank calls it)."""
  from torch.distributed.pipelining import PipelineStage

  layers, batch = model_layers(model_name)
  indices = stage_indices(schedule, rank, world)
  num_stages = world * len(indices)
  per_stage = len(layers) // num_stages
  stages, parameters = [], []
  for i in indices:
    module = nn.Sequential(*layers[i * per_stage:(i + 1) * per_stage])
    parameters += list(module.parameters())
    stages.append(PipelineStage(module, i, num_stages, torch.device("cpu")))
  runner = make_schedule(schedule, stages, micro_batches)
  optimizer = torch.optim.SGD(parameters, lr=1e-4)
  target = torch.zeros(())

  inputs = (batch,) if 0 in indices else ()  # the first stage's rank feeds the batch
  targets = ({"target": target.expand(batch.shape[0])} if num_stages - 1 in indices
             else {})  # the last stage's rank computes the loss

  def run() -> None:
    runner.step(*inputs, **targets)
    optimizer.step()
    optimizer.zero_grad()

  return run


def plain_step(model_name: str):
  """The same layers as one module on this process, forward, backward and SGD."""
  layers, batch = model_layers(model_name)
  model = nn.Sequential(*layers)
  optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

  def run() -> None:
    model(batch).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()

  return run


def worker(rank: int, world: int, args: argparse.Namespace, results: dict) -> None:
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  dist.init_process_group("gloo", rank=rank, world_size=world)
  out = {}
  for model_name in args.models.split(","):
    plain = plain_step(model_name) if rank == 0 else None
    for m in (int(x) for x in args.micro_batches.split(",")):
      runners = {s: pipelined_step(model_name, s, m, rank, world)
                 for s in args.schedules.split(",")}
      times: dict[str, list[float]] = {s: [] for s in runners}
      times["plain"] = []
      for step in range(args.steps + 1):  # the first: warm-up, not timed
        dist.barrier()
        start = time.perf_counter()
        if plain is not None:
          plain()
        dist.barrier()
        if step:
          times["plain"].append(time.perf_counter() - start)
        for name, run in runners.items():
          dist.barrier()
          start = time.perf_counter()
          run()
          dist.barrier()
          if step:
            times[name].append(time.perf_counter() - start)
      medians = {name: statistics.median(t) for name, t in times.items()}
      for name in runners:
        out[f"torch_{model_name}_k{world}_m{m}_{name}"] = {
            "step_seconds": round(medians[name], 4),
            "step_seconds_plain": round(medians["plain"], 4),
            "speedup_vs_plain_single": round(medians["plain"] / medians[name], 3)}
        if rank == 0:
          print(f"torch {model_name} M={m} {name:17s} {medians[name]:.4f} s  plain "
                f"{medians['plain']:.4f} s  vs plain {medians['plain'] / medians[name]:.2f}",
                flush=True)
  if rank == 0:
    results.update(out)
  dist.destroy_process_group()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="transformer,mlp")
  parser.add_argument("--micro_batches", default="2,4,8")
  parser.add_argument("--schedules", default=",".join(SCHEDULES))
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--port", type=int, default=29512)
  args = parser.parse_args()
  with mp.Manager() as manager:
    results = manager.dict()
    mp.spawn(worker, args=(2, args, results), nprocs=2, join=True)
    summary = {"bench": "torch_pipeline", "torch": torch.__version__,
               "machine": f"{platform.machine()} {os.cpu_count()} cores",
               "results": dict(results)}
  # Milliseconds per action, and what one more action adds (bench/action_cost.py, as
  # bench/pipeline_speedup.py reports ours).
  for model_name in args.models.split(","):
    for schedule in args.schedules.split(","):
      steps = {m: summary["results"][f"torch_{model_name}_k2_m{m}_{schedule}"]["step_seconds"]
               for m in (int(x) for x in args.micro_batches.split(","))}
      figures = action_cost.per_action_figures(steps, schedule)
      if figures:
        summary[f"per_action_{model_name}_k2_{schedule}"] = figures
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
