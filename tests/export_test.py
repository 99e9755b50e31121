"""SavedModel export and decode (exporter.py, decoder.py, tasks' serving functions).

Oracles: the trainer's own task, restored from the same checkpoint and run forward as
eval runs it (pipelined over two cells, layer by layer: another path than the export's
single-device stack); greedy decoding without a cache, one full forward per token, in
numpy; the MT eval's own greedy decode. Exported models are loaded in a fresh Python
process in which importing lingvo_gpipe fails, and by TensorFlow's saved_model_cli.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import run_trainer
from tiers import EXHAUSTIVE, quick_sample

from lingvo_gpipe import decoder, exporter, model_registry
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.inputs import vocabulary
from lingvo_gpipe.tasks import serving
from lingvo_gpipe.trainer import Trainer

MODELS = {"image": "image.AmoebaNetTiny", "lm": "lm.TransformerTiny",
          "mt": "mt.MultilingualTiny"}
BATCH = 8

# Run in a fresh interpreter: loads each SavedModel with TensorFlow alone and calls one
# signature per job on the inputs of an .npz, writing its outputs to another .npz.
LOAD_AND_CALL = r"""
import json, sys
sys.modules["lingvo_gpipe"] = None  # importing the library fails in this process
import numpy as np
import tensorflow as tf
for job in json.load(open(sys.argv[1])):
  loaded = tf.saved_model.load(job["dir"])
  inputs = dict(np.load(job["inputs"]))
  inputs.update({k: tf.constant(v[()] if v.shape == () else v) for k, v in
                 job.get("scalars", {}).items() for v in [np.asarray(v, job["dtypes"][k])]})
  out = loaded.signatures[job["signature"]](**{k: tf.constant(v) for k, v in inputs.items()})
  np.savez(job["outputs"], **{k: v.numpy().astype(bytes) if v.dtype == tf.string
                              else v.numpy() for k, v in out.items()})
loaded_modules = [m for m, v in sys.modules.items() if m.startswith("lingvo_gpipe") and v]
print(json.dumps({"lingvo_gpipe_modules": loaded_modules}))
"""


def tiny_params(key: str):
  """The model's params for a test: batch 8, 16 eval examples, checkpoints every step."""
  model_registry.load_param_files([])
  p = model_registry.get_params(key)
  p.train_input.batch_size = BATCH
  p.eval_input.set(batch_size=BATCH, num_examples=16)
  p.task.train.set(save_interval_steps=1, summary_interval_steps=1, log_interval_steps=1)
  p.task.pipeline.partition_cost = "params"  # (AmoebaNetTiny's 'measured' profiles first)
  return p.freeze()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """{task: (params, logdir, trainer restored at its last checkpoint)}: each tiny model
  trained 3 steps (checkpoints at 1, 2, 3), pipelined over two cells."""
  out = {}
  for name, key in MODELS.items():
    params = tiny_params(key)
    logdir = str(tmp_path_factory.mktemp(name))
    trainer = Trainer(params, logdir, log=lambda _: None)
    trainer.train(3)
    out[name] = (params, logdir, trainer)
  return out


def eval_batch(params) -> dict:
  return {k: v.numpy() for k, v in next(iter(params.eval_input.instantiate().dataset())).items()}


def stack_outputs(task, inputs):
  """The trainer's eval forward of the main stack (pipelined: cell by cell)."""
  with base_layer.step_context(training=False, step=0):
    return base_layer.call_with(task.main_stack, inputs)


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def reference_token_log_probs(task, ids: np.ndarray, paddings: np.ndarray) -> np.ndarray:
  """log p(ids[t] | ids[<t]) at t >= 1 from the trainer's forward (0 at t = 0, padded)."""
  logp = log_softmax(stack_outputs(task, (tf.constant(ids), tf.constant(paddings))).numpy())
  picked = np.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=2)[..., 0]
  return np.pad(picked * (1 - paddings[:, 1:]), [[0, 0], [1, 0]])


def reference_greedy(task, prefix: np.ndarray, num_new: int) -> np.ndarray:
  """Greedy continuation without a cache: the whole sequence so far through the
  trainer's forward for every new token."""
  sequence = prefix
  for _ in range(num_new):
    logits = stack_outputs(task, (tf.constant(sequence),
                                  tf.zeros(sequence.shape, tf.float32))).numpy()
    sequence = np.concatenate([sequence, logits[:, -1].argmax(-1)[:, None].astype(np.int32)],
                              axis=1)
  return sequence[:, prefix.shape[1]:]


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
  """Each model exported (single device, float32) and called in one fresh process that
  cannot import lingvo_gpipe: {task: {signature: outputs}}, plus the inputs used."""
  work = tmp_path_factory.mktemp("fresh_process")
  jobs, inputs = [], {}
  for name, (params, logdir, _) in trained.items():
    path = exporter.export(params, logdir, model_name=MODELS[name], log=lambda _: None)
    batch = eval_batch(params)
    if name == "image":
      calls = {"classify": ({"images": batch["image"]}, {})}
    elif name == "lm":
      calls = {"score": ({"ids": batch["ids"], "paddings": batch["paddings"]}, {}),
               "generate": ({"prefix_ids": batch["ids"][:, :3]},
                            {"max_new_tokens": (6, "int32"), "temperature": (0.0, "float32"),
                             "seed": (7, "int64")})}
    else:
      vocab = params.eval_input.instantiate().vocab
      sources = np.array([vocab.decode(ids) for ids in batch["src_ids"]], dtype=object)
      calls = {"translate": ({"sources": sources.astype(bytes)}, {}),
               "translate_ids": ({"src_ids": batch["src_ids"],
                                  "src_paddings": batch["src_paddings"]}, {})}
    inputs[name] = batch
    for signature, (arrays, scalars) in calls.items():
      np.savez(work / f"{name}_{signature}_in.npz", **arrays)
      jobs.append({"dir": path, "signature": signature,
                   "inputs": str(work / f"{name}_{signature}_in.npz"),
                   "outputs": str(work / f"{name}_{signature}_out.npz"),
                   "scalars": {k: v for k, (v, _) in scalars.items()},
                   "dtypes": {k: t for k, (_, t) in scalars.items()}})
  (work / "jobs.json").write_text(json.dumps(jobs))
  (work / "load_and_call.py").write_text(LOAD_AND_CALL)
  done = subprocess.run([sys.executable, str(work / "load_and_call.py"), str(work / "jobs.json")],
                        capture_output=True, text=True, cwd=work, timeout=300,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=""))
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.strip().splitlines()[-1]) == {"lingvo_gpipe_modules": []}
  outputs = {}
  for job in jobs:
    name, signature = Path(job["outputs"]).name.split("_", 1)
    outputs.setdefault(name, {})[signature.removesuffix("_out.npz")] = dict(
        np.load(job["outputs"]))
  return outputs, inputs


def test_classify_in_a_fresh_process_equals_the_trainers_eval_forward(trained, exported):
  outputs, inputs = exported
  task = trained["image"][2].task
  features = stack_outputs(task, tf.constant(inputs["image"]["image"]))
  with base_layer.step_context(training=False):
    expected = tf.nn.softmax(task.softmax(features)).numpy()
  got = outputs["image"]["classify"]
  np.testing.assert_allclose(got["probabilities"], expected, atol=1e-5, rtol=1e-4)
  np.testing.assert_array_equal(got["top_k_classes"][:, 0], expected.argmax(-1))
  assert got["top_k_classes"].shape == (BATCH, 5)


def test_score_and_generate_in_a_fresh_process_equal_the_trainers_forward(trained, exported):
  outputs, inputs = exported
  task = trained["lm"][2].task
  batch = inputs["lm"]
  expected = reference_token_log_probs(task, batch["ids"], batch["paddings"])
  score = outputs["lm"]["score"]
  # log-probs of a 200-word vocabulary are O(5): float32 sums differ in the 6th digit
  np.testing.assert_allclose(score["token_log_probs"], expected, atol=1e-4)
  np.testing.assert_allclose(score["log_prob"], expected.sum(1), atol=1e-3)
  # The cache changes speed, not results: greedy without it, one full forward per token.
  generated = outputs["lm"]["generate"]["ids"]
  np.testing.assert_array_equal(generated, reference_greedy(task, batch["ids"][:, :3], 6))


def test_translate_in_a_fresh_process_returns_what_the_mt_eval_decodes(trained, exported):
  outputs, inputs = exported
  params, _, trainer = trained["mt"]
  batch = inputs["mt"]
  eval_input = params.eval_input.instantiate()
  decoded = trainer._decode_step({k: tf.constant(v) for k, v in batch.items()},
                                 eval_input.full_batch_spec())
  vocab = eval_input.vocab
  np.testing.assert_array_equal(outputs["mt"]["translate_ids"]["ids"],
                                decoded["hyp_ids"].numpy())
  np.testing.assert_array_equal(outputs["mt"]["translate"]["ids"], decoded["hyp_ids"].numpy())
  assert [t.decode() for t in outputs["mt"]["translate"]["translations"]] == [
      vocab.decode(ids) for ids in decoded["hyp_ids"].numpy()]


@EXHAUSTIVE
def test_saved_model_cli_shows_the_signatures_and_runs_classify(trained, exported, tmp_path):
  outputs, inputs = exported
  logdir = trained["image"][1]
  path = os.path.join(logdir, "export", "3")
  cli = shutil.which("saved_model_cli", path=os.path.dirname(sys.executable))
  assert cli, "TensorFlow's saved_model_cli is installed beside this interpreter"
  shown = subprocess.run([cli, "show", "--all", "--dir", path], capture_output=True,
                         text=True, timeout=120)
  assert shown.returncode == 0, shown.stderr[-2000:]
  assert "signature_def['classify']" in shown.stdout
  assert "outputs['probabilities']" in shown.stdout
  np.save(tmp_path / "images.npy", inputs["image"]["image"])
  ran = subprocess.run([cli, "run", "--dir", path, "--tag_set", "serve", "--signature_def",
                        "classify", "--inputs", f"images={tmp_path / 'images.npy'}",
                        "--outdir", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
  assert ran.returncode == 0, ran.stderr[-2000:]
  np.testing.assert_allclose(np.load(tmp_path / "out" / "probabilities.npy"),
                             outputs["image"]["classify"]["probabilities"], atol=1e-6)
  facts = json.loads(Path(path, "assets", "version.json").read_text())
  assert facts["step"] == 3 and facts["model"] == "image.AmoebaNetTiny"
  assert facts["tensorflow"] == tf.__version__ and facts["lingvo_gpipe"]
  assert Path(path, "assets", "params.txt").read_text() == trained["image"][0].to_text()


@pytest.mark.parametrize("name", quick_sample(["image", "lm", "mt"], quick=["lm"]))
def test_pipelined_export_on_two_devices_equals_the_single_device_one(trained, exported,
                                                                     tmp_path, cpu_devices,
                                                                     name):
  outputs, inputs = exported
  params, logdir, _ = trained[name]
  copy = tmp_path / name
  shutil.copytree(os.path.join(logdir, "train"), copy / "train")
  path = exporter.export(params, str(copy), devices=cpu_devices[:2], log=lambda _: None)
  keep_devices = tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
  loaded = tf.saved_model.load(path, options=tf.saved_model.LoadOptions(
      experimental_variable_policy=keep_devices))
  assert {v.device.split("/")[-1] for v in loaded.weights.values()} == {
      d.split("/")[-1] for d in cpu_devices[:2]}
  batch, expected = inputs[name], outputs[name]
  if name == "image":  # 4 micro-batches of 2 through two cells, batch norm at its averages
    got = loaded.signatures["classify"](images=tf.constant(batch["image"]))
    np.testing.assert_allclose(got["probabilities"].numpy(),
                               expected["classify"]["probabilities"], atol=1e-5, rtol=1e-4)
  elif name == "lm":
    score = loaded.signatures["score"](ids=tf.constant(batch["ids"]),
                                       paddings=tf.constant(batch["paddings"]))
    np.testing.assert_allclose(score["token_log_probs"].numpy(),
                               expected["score"]["token_log_probs"], atol=1e-4)
    generated = loaded.signatures["generate"](
        prefix_ids=tf.constant(batch["ids"][:, :3]), max_new_tokens=tf.constant(6),
        temperature=tf.constant(0.0), seed=tf.constant(7, tf.int64))
    np.testing.assert_array_equal(generated["ids"].numpy(), expected["generate"]["ids"])
  else:
    got = loaded.signatures["translate_ids"](src_ids=tf.constant(batch["src_ids"]),
                                             src_paddings=tf.constant(batch["src_paddings"]))
    np.testing.assert_array_equal(got["ids"].numpy(), expected["translate_ids"]["ids"])


def test_bfloat16_export_stores_half_precision_weights_and_agrees_to_its_precision(trained):
  params, logdir, _ = trained["image"]
  task, _, _ = exporter.restore_for_inference(params, logdir, None, None, "bfloat16",
                                              log=lambda _: None)
  eval_input = params.eval_input.instantiate()
  model = serving.ServingModel(task, eval_input, serving.ServingOptions(dtype="bfloat16"))
  assert {v.dtype for v in model.weights.values() if v.dtype.is_floating} == {tf.bfloat16}
  images = eval_batch(params)["image"]
  full = serving.ServingModel(*exporter.restore_for_inference(
      params, logdir, None, None, "float32", log=lambda _: None)[:1], eval_input,
      serving.ServingOptions())
  half = model("classify", images=images)["probabilities"].numpy()
  np.testing.assert_allclose(half, full("classify", images=images)["probabilities"].numpy(),
                             atol=0.05)  # bfloat16 keeps 8 bits of mantissa through a deep net
  assert half.dtype == np.float32


@pytest.mark.parametrize("name,dtype", quick_sample(
    [("image", "float16"), ("lm", "bfloat16"), ("lm", "float16"), ("mt", "bfloat16"),
     ("mt", "float16")], quick=[("mt", "bfloat16")]))
def test_half_precision_exports_of_every_task_agree_with_float32(trained, name, dtype):
  """Each task's serving functions in bfloat16 and float16 (weights stored so), against
  the float32 ones, to the half dtype's precision through a small net."""
  params, logdir, _ = trained[name]
  eval_input = params.eval_input.instantiate()

  def model(dtype: str) -> serving.ServingModel:
    task, _, _ = exporter.restore_for_inference(params, logdir, None, None, dtype,
                                                log=lambda _: None)
    return serving.ServingModel(task, eval_input, serving.ServingOptions(dtype=dtype))

  half, full = model(dtype), model("float32")
  assert {v.dtype for v in half.weights.values() if v.dtype.is_floating} == {
      tf.as_dtype(dtype)}
  batch = eval_batch(params)
  # A half dtype's relative step (2^-8 bfloat16, 2^-11 float16), through a few layers.
  tolerance = {"bfloat16": 0.1, "float16": 0.02}[dtype]
  if name == "image":
    got, want = (m("classify", images=batch["image"])["probabilities"] for m in (half, full))
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=tolerance)
  elif name == "lm":
    got, want = (m("score", ids=batch["ids"], paddings=batch["paddings"])["token_log_probs"]
                 for m in (half, full))
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=tolerance * 5, rtol=tolerance)
    generated = half("generate", prefix_ids=batch["ids"][:, :2], max_new_tokens=4,
                     temperature=0.0, seed=1)["ids"].numpy()
    assert generated.shape == (BATCH, 4) and generated.min() >= 0
  else:
    out = half("translate_ids", src_ids=batch["src_ids"],
               src_paddings=batch["src_paddings"].astype(np.float32))["ids"].numpy()
    want = full("translate_ids", src_ids=batch["src_ids"],
                src_paddings=batch["src_paddings"].astype(np.float32))["ids"].numpy()
    assert out.shape == want.shape and out.min() >= 0
    assert out.max() < eval_input.vocab.size


# Run in a fresh interpreter: each job sends one request to a signature of a loaded
# SavedModel and records whether it raised (and what) or what it returned; the process
# must outlive them all.
BAD_REQUESTS = r"""
import json, sys
import numpy as np
import tensorflow as tf
results = []
loaded = {}
for job in json.load(open(sys.argv[1])):
  model = loaded.setdefault(job["dir"], tf.saved_model.load(job["dir"]))
  inputs = {k: tf.constant(np.asarray(v, dtype=job["dtypes"][k]))
            for k, v in job["inputs"].items()}
  try:
    out = model.signatures[job["signature"]](**inputs)
    results.append({"raised": None, "outputs": {k: v.numpy().tolist() for k, v in out.items()
                                                if v.dtype != tf.string}})
  except Exception as e:
    results.append({"raised": type(e).__name__, "message": str(e)[-600:]})
print(json.dumps(results))
"""

BIG = 2**31 - 1


def bad_requests(trained) -> list[tuple[str, str, dict, dict, str]]:
  """(model, signature, inputs, dtypes, a word the error must hold) of the table."""
  vocab = trained["lm"][0].eval_input.instantiate().vocab.size
  lm = {"prefix_ids": [[1, 5]], "max_new_tokens": 3, "temperature": 0.0, "seed": 1}
  lm_types = {"prefix_ids": "int32", "max_new_tokens": "int32", "temperature": "float32",
              "seed": "int64"}

  def generate(word, **changed):
    return ("lm", "generate", {**lm, **changed}, lm_types, word)

  score_types = {"ids": "int32", "paddings": "float32"}
  mt_types = {"src_ids": "int32", "src_paddings": "float32"}
  source = [[2] + [5] * 11]
  return [
      ("image", "classify", {"images": np.zeros([32, 32, 3]).tolist()}, {"images": "float32"},
       "images"),
      ("image", "classify", {"images": np.zeros([1, 16, 16, 3]).tolist()},
       {"images": "float32"}, "images"),
      ("lm", "score", {"ids": [[1, -1]], "paddings": [[0, 0]]}, score_types, "ids"),
      ("lm", "score", {"ids": [[1, vocab]], "paddings": [[0, 0]]}, score_types, "ids"),
      ("lm", "score", {"ids": [1, 2], "paddings": [[0, 0]]}, score_types, "ids"),
      ("lm", "score", {"ids": [[1, 2]], "paddings": [[0, 7]]}, score_types, "paddings"),
      ("lm", "score", {"ids": [[1, 2]], "paddings": [[0, 0.5]]}, score_types, "paddings"),
      ("lm", "score", {"ids": [[1, 2]], "paddings": [[0, float("nan")]]}, score_types,
       "paddings"),
      ("lm", "score", {"ids": [[1, 2]], "paddings": [[0, 0, 0]]}, score_types, "paddings"),
      generate("prefix_ids", prefix_ids=[[-7, 1]]),
      generate("prefix_ids", prefix_ids=[[1, -1]]),
      generate("prefix_ids", prefix_ids=[[1, vocab]]),
      generate("prefix_ids", prefix_ids=[[1, 10**6]]),
      generate("max_new_tokens", max_new_tokens=BIG),
      generate("max_new_tokens", max_new_tokens=-1),
      generate("temperature", temperature=-1.0),
      generate("temperature", temperature=float("nan")),
      generate("temperature", temperature=float("inf")),
      generate("prefix", prefix_ids=np.zeros([1, 0], np.int32).tolist()),
      ("mt", "translate_ids", {"src_ids": [[2] + [10**6] * 11], "src_paddings": [[0] * 12]},
       mt_types, "src_ids"),
      ("mt", "translate_ids", {"src_ids": [[-1] * 12], "src_paddings": [[0] * 12]}, mt_types,
       "src_ids"),
      ("mt", "translate_ids", {"src_ids": [[2, 5]], "src_paddings": [[0] * 12]}, mt_types,
       "src_ids"),
      ("mt", "translate_ids", {"src_ids": source, "src_paddings": [[0] * 12]},
       {"src_ids": "int32", "src_paddings": "int32"}, ""),
  ]


@EXHAUSTIVE
def test_bad_requests_raise_in_the_serving_process_and_it_survives(trained, exported,
                                                                    tmp_path):
  """Every signature of the three tiny exports gets a table of bad requests in a child
  process: each raises (an error naming the input where TensorFlow lets it), none
  aborts the process, and a long source is translated with source_truncated set."""
  table = bad_requests(trained)
  vocab = trained["mt"][0].eval_input.instantiate().vocab
  long_source = " ".join(vocab.decode([i]) for i in range(vocab.num_reserved,
                                                          vocab.num_reserved + 40))
  jobs = [{"dir": os.path.join(trained[m][1], "export", "3"), "signature": sig,
           "inputs": inputs, "dtypes": dtypes} for m, sig, inputs, dtypes, _ in table]
  jobs.append({"dir": os.path.join(trained["mt"][1], "export", "3"), "signature": "translate",
               "inputs": {"sources": [long_source, vocab.decode([vocab.num_reserved])]},
               "dtypes": {"sources": "object"}})
  (tmp_path / "jobs.json").write_text(json.dumps(jobs))
  (tmp_path / "bad_requests.py").write_text(BAD_REQUESTS)
  done = subprocess.run([sys.executable, str(tmp_path / "bad_requests.py"),
                         str(tmp_path / "jobs.json")], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(done.stdout.strip().splitlines()[-1])
  for (model, signature, inputs, _, word), result in zip(table, results):
    request = f"{model} {signature} {json.dumps(inputs)[:120]}"
    assert result["raised"] is not None, f"{request} returned {result['outputs']}"
    assert word in result["message"], f"{request}: {result['message']}"
  translated = results[-1]
  assert translated["raised"] is None, translated
  assert translated["outputs"]["source_truncated"] == [True, False]


def test_generate_samples_by_seed_and_stops_counting_at_eos(trained):
  params, logdir, _ = trained["lm"]
  task, _, _ = exporter.restore_for_inference(params, logdir, None, None, "float32",
                                              log=lambda _: None)
  model = serving.ServingModel(task, params.eval_input.instantiate(),
                               serving.ServingOptions(max_decode_length=16))
  prefix = np.full([4, 1], vocabulary.BOS_ID, np.int32)

  def sample(seed):
    return model("generate", prefix_ids=prefix, max_new_tokens=12, temperature=1.0,
                 seed=seed)

  first, again, other = sample(1), sample(1), sample(2)
  np.testing.assert_array_equal(first["ids"].numpy(), again["ids"].numpy())
  assert not np.array_equal(first["ids"].numpy(), other["ids"].numpy())
  ids = first["ids"].numpy()
  lengths = [list(row).index(vocabulary.EOS_ID) if vocabulary.EOS_ID in row else len(row)
             for row in ids]
  assert first["lengths"].numpy().tolist() == lengths
  with pytest.raises(tf.errors.InvalidArgumentError, match="max_new_tokens must be <= 16"):
    model("generate", prefix_ids=prefix, max_new_tokens=16, temperature=0.0, seed=1)


@pytest.mark.parametrize("name,metric", quick_sample(
    [("image", "accuracy"), ("lm", "log_pplx"), ("mt", "bleu")], quick=[("mt", "bleu")]))
def test_decode_writes_records_and_the_evals_metric(trained, tmp_path, name, metric):
  params, logdir, trainer = trained[name]
  copy = tmp_path / name
  shutil.copytree(os.path.join(logdir, "train"), copy / "train")
  path, metrics = decoder.decode(params, str(copy), log=lambda _: None)
  assert path == str(copy / "decode_3.jsonl")
  records = [json.loads(line) for line in Path(path).read_text().splitlines()]
  assert len(records) == 16
  expected = trainer.evaluate()[metric]
  assert metrics[metric] == pytest.approx(expected, abs=1e-3 if metric != "bleu" else 1e-6)
  assert list((copy / "decode").glob("events.*"))


def test_a_bucketed_eval_input_decodes_as_the_full_length_one(trained, tmp_path):
  """Length buckets cut each eval batch to its bound. Decode mode pads a bucket's sources
  back to the signature's length, and the trainer's eval decodes every hypothesis to the
  full target length, so both give the unbucketed input's hypotheses (a
  hypothesis cut at its bucket's bound would differ)."""
  params, logdir, _ = trained["mt"]
  bucketed = params.copy()
  bucketed.eval_input.set(bucket_upper_bounds=[7, 12], bucket_batch_sizes=[8, 8])
  bucketed.freeze()
  paths = {}
  for name, p in [("full", params), ("bucketed", bucketed)]:
    shutil.copytree(os.path.join(logdir, "train"), tmp_path / name / "train")
    paths[name], _ = decoder.decode(p, str(tmp_path / name), log=lambda _: None)
  records = {name: sorted((json.loads(line) for line in Path(path).read_text().splitlines()),
                          key=lambda r: r["source_ids"][:r["source_ids"].index(
                              vocabulary.EOS_ID) + 1])
             for name, path in paths.items()}
  assert len(records["bucketed"]) == 16
  for full, cut in zip(records["full"], records["bucketed"]):
    assert cut["hypothesis_ids"] == full["hypothesis_ids"], (cut, full)
  short = [r for r in records["bucketed"] if r["source_ids"].index(vocabulary.EOS_ID) < 7]
  assert short and any(len(r["hypothesis"].split()) > 7 for r in short), (
      "no hypothesis of the short bucket runs past its bound: the test cannot tell")
  trainer = Trainer(bucketed, str(tmp_path / "bucketed"), log=lambda _: None)
  assert trainer.restore_latest() == 3
  decoded = []  # what the trainer's eval decodes, bucket by bucket
  trainer.task.decode_metrics = lambda outputs, _: decoded.extend(outputs) or {}
  trainer.evaluate()
  assert {out["src_ids"].shape[1] for out in decoded} == {7, 12}
  by_source = {tuple(r["source_ids"][:r["source_ids"].index(vocabulary.EOS_ID) + 1]):
               r["hypothesis_ids"] for r in records["full"]}
  for out in decoded:
    for source, hyp in zip(out["src_ids"].tolist(), out["hyp_ids"].tolist()):
      assert hyp == by_source[tuple(source[:source.index(vocabulary.EOS_ID) + 1])]


@EXHAUSTIVE
def test_bad_exports_exit_2_with_one_line_and_write_nothing(trained, tmp_path):
  params, logdir, _ = trained["lm"]
  empty = tmp_path / "empty"
  empty.mkdir()
  done = run_trainer("--model=lm.TransformerTiny", f"--logdir={empty}", "--mode=export")
  assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
  assert "no checkpoint in" in done.stderr and not list(empty.iterdir())
  # Another model's logdir: refused by its params text, before anything is built.
  other = run_trainer("--model=mt.MultilingualTiny", f"--logdir={logdir}", "--mode=export")
  assert other.returncode == 2 and "which this model lacks" in other.stderr, other.stderr
  assert other.stderr.strip().count("\n") == 0
  # A damaged newest checkpoint: the previous one is exported, as training would resume.
  copy = tmp_path / "lm"
  shutil.copytree(os.path.join(logdir, "train"), copy / "train")
  shutil.copy(os.path.join(logdir, "params.txt"), copy / "params.txt")
  for data in (copy / "train").glob("ckpt-3.data-*"):
    data.write_bytes(b"damaged")
  before = sorted(p.name for p in (copy / "train").iterdir())
  done = run_trainer("--model=lm.TransformerTiny", f"--logdir={copy}", "--mode=export",
                     f"--params_override={overrides(params)}")
  assert done.returncode == 0, done.stderr
  assert "ckpt-3 cannot be read" in done.stdout and (copy / "export" / "2").is_dir()
  assert sorted(p.name for p in (copy / "train").iterdir()) == before  # export only reads
  # An export that exists is refused (the binary turns ExportError into exit 2) unless
  # overwritten, and either way no partial folder is left beside it.
  with pytest.raises(exporter.ExportError, match="exists .*--overwrite"):
    exporter.export(params, str(copy), log=lambda _: None)
  assert sorted(p.name for p in (copy / "export").iterdir()) == ["2"]
  exporter.export(params, str(copy), overwrite=True, log=lambda _: None)
  assert sorted(p.name for p in (copy / "export").iterdir()) == ["2"]
  assert tf.saved_model.load(str(copy / "export" / "2")).signatures["score"] is not None
  # An overwrite on a full disk (no file may pass 200 KiB): exit 1, one line, and the
  # export it was to replace whole, with nothing of the new one beside it.
  before = files_of(copy / "export")
  full = run_trainer("--model=lm.TransformerTiny", f"--logdir={copy}", "--mode=export",
                     "--overwrite", f"--params_override={overrides(params)}",
                     file_size_limit=200 * 1024)
  assert full.returncode == 1 and "File too large" in full.stderr, full.stderr
  assert full.stderr.strip().count("\n") == 0, full.stderr
  assert files_of(copy / "export") == before
  # A decode on a full disk (no file may pass 1 KiB): exit 1, one line, no
  # decode_2.jsonl and no decode_2.jsonl.partial left.
  full = run_trainer("--model=lm.TransformerTiny", f"--logdir={copy}", "--mode=decode",
                     f"--params_override={overrides(params)}", file_size_limit=1024)
  assert full.returncode == 1 and "File too large" in full.stderr, full.stderr
  assert full.stderr.strip().count("\n") == 0, full.stderr
  assert not list(copy.glob("decode_2.jsonl*"))
  decoded = run_trainer("--model=lm.TransformerTiny", f"--logdir={copy}", "--mode=decode",
                        f"--params_override={overrides(params)}")
  assert decoded.returncode == 0, decoded.stderr
  assert "decode at step 2: log_pplx" in decoded.stdout
  assert len((copy / "decode_2.jsonl").read_text().splitlines()) == 16


def files_of(folder: Path) -> dict[str, bytes]:
  """Every file below `folder` by its relative path, with its bytes."""
  return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def overrides(params) -> str:
  """The --params_override that makes the registered model the test's tiny_params."""
  return (f"train_input.batch_size={BATCH};eval_input.batch_size={BATCH};"
          "eval_input.num_examples=16")

