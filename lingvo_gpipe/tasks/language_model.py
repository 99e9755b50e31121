"""Language modelling: a Transformer stack over token ids; log-perplexity per token."""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer, layers, token_slices
from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.inputs import vocabulary
from lingvo_gpipe.tasks import serving
from lingvo_gpipe.tasks.base_task import BaseTask, Metrics, vocabulary_bounds


def any_batch(t: tf.Tensor) -> tf.TensorShape:
  """t's shape with the batch dimension (axis 0) unknown: a loop's shape invariant."""
  return tf.TensorShape([None]).concatenate(t.shape[1:])


def token_metrics(logits: tf.Tensor, labels: tf.Tensor, paddings: tf.Tensor,
                  label_smoothing: float = 0.0) -> Metrics:
  """Per-token metrics over the non-padded positions, weighted by their count.

  logits [B, T, V], labels [B, T] int, paddings [B, T] (1.0 = padded) →
  loss (cross-entropy with label smoothing), log_pplx (without), token_accuracy.
  """
  weights = 1.0 - tf.cast(paddings, tf.float32)
  num_tokens = tf.reduce_sum(weights)
  denominator = tf.maximum(num_tokens, 1.0)
  labels = tf.cast(labels, tf.int32)
  logits = tf.cast(logits, tf.float32)
  xent = layers.softmax_cross_entropy(logits, labels)
  loss = xent if not label_smoothing else layers.softmax_cross_entropy(
      logits, labels, label_smoothing)
  correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels),
                    tf.float32)
  return {
      "loss": (tf.reduce_sum(loss * weights) / denominator, num_tokens),
      "log_pplx": (tf.reduce_sum(xent * weights) / denominator, num_tokens),
      "token_accuracy": (tf.reduce_sum(correct * weights) / denominator, num_tokens),
  }


class LanguageModelTask(BaseTask):
  """batch {'ids': [B, T] int, 'labels': [B, T] int, 'paddings': [B, T]} → metrics.

  `stack` maps (ids, paddings) to logits [B, T, V] (transformer.lm_stack); it is the
  task's pipelined stack.
  """

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("stack", None, "Params of the layer stack: (ids, paddings) → logits [B, T, V].")
    p.define("label_smoothing", 0.0, "Label smoothing of the training loss.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.stack is None:
      raise ParamsError(f"{self.path}: params.stack is not set")
    self.create_stack("stack", self.params.stack)

  @classmethod
  def id_bounds(cls, task_params) -> dict:
    return vocabulary_bounds(task_params, ("ids",), ("labels",))

  def stack_inputs(self, batch: dict[str, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    return batch["ids"], tf.cast(batch["paddings"], tf.float32)

  def head_inputs(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    return {"labels": batch["labels"], "paddings": batch["paddings"]}

  def head(self, logits: tf.Tensor, head_inputs: dict[str, tf.Tensor]) -> Metrics:
    with tf.device(self.output_device):
      return token_metrics(logits, head_inputs["labels"],
                           tf.cast(head_inputs["paddings"], tf.float32),
                           self.params.label_smoothing)

  # -- serving --------------------------------------------------------------------------

  def serving_functions(self, model, input_generator, options) -> dict:
    """score(ids [B, T] int32, paddings [B, T] float32) → token_log_probs [B, T] (log
    p(ids[t] | ids[<t]); 0 at t = 0 and where padded), log_prob [B] (their sum);
    generate(prefix_ids [B, P] int32, max_new_tokens, temperature, seed) → ids [B, N]
    (the new tokens), lengths [B] (new tokens before the first EOS); see
    `generate_tokens`."""
    del model  # no tables
    max_length = options.max_decode_length
    bound = self.id_bounds(self.params).get("ids")  # (None: a stack of no vocab_size)
    # Score takes generate's bound, or the eval input's length where that is longer (so
    # decode scores every eval batch): a model trained on short sequences scored 2000
    # positions without a word (a position table past its end is clamped by XLA).
    eval_length = input_generator.batch_spec()["ids"].shape[1] if "ids" in \
        input_generator.batch_spec() else None
    score_length = max(max_length, eval_length or 0)

    def score(ids, paddings):
      fits = tf.debugging.assert_less_equal(tf.shape(ids)[1], score_length, message=(
          f"score: ids has more positions than this export serves, {score_length} "
          f"(max_decode_length={max_length}: --max_decode_length at export, or the eval "
          "input's length if longer)"))
      with tf.control_dependencies([fits]):
        ids = tf.identity(ids)
      return self.score_tokens(serving.checked_ids(ids, bound, "score: ids"),
                               serving.checked_paddings(paddings, ids, "score: paddings"))

    compiled = options.compile_generate and self.pipeline is None

    def generate(prefix_ids, max_new_tokens, temperature, seed):
      prefix_ids = serving.checked_ids(prefix_ids, bound, "generate: prefix_ids")
      new = self.generate_tokens(prefix_ids, max_new_tokens, temperature, seed, max_length,
                                 compiled=compiled)
      before_eos = tf.cumsum(tf.cast(tf.equal(new, vocabulary.EOS_ID), tf.int32), axis=1) == 0
      return {"ids": new, "lengths": tf.reduce_sum(tf.cast(before_eos, tf.int32), axis=1)}

    ids = tf.TensorSpec([None, None], tf.int32)
    return {
        "score": serving.traced({"ids": ids, "paddings": tf.TensorSpec([None, None],
                                                                       tf.float32)})(score),
        "generate": serving.traced({
            "prefix_ids": ids, "max_new_tokens": tf.TensorSpec([], tf.int32),
            "temperature": tf.TensorSpec([], tf.float32),
            "seed": tf.TensorSpec([], tf.int64)})(generate),
    }

  def score_tokens(self, ids: tf.Tensor, paddings: tf.Tensor) -> dict[str, tf.Tensor]:
    """ids [B, T], paddings [B, T] → token_log_probs [B, T], log_prob [B] (see
    serving_functions)."""
    logits = self.serve_stack((ids, paddings))  # [B, T, V]
    with tf.device(self.output_device):
      log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
      # The logits at t − 1 predict the token at t.
      picked = tf.gather(log_probs[:, :-1], ids[:, 1:], batch_dims=2)  # [B, T − 1]
      picked *= 1.0 - tf.cast(paddings[:, 1:], tf.float32)
      # (T = 0: no position, not the pad's one.)
      token_log_probs = tf.pad(picked, [[0, 0], [1, 0]])[:, :tf.shape(ids)[1]]
      return {"token_log_probs": token_log_probs,
              "log_prob": tf.reduce_sum(token_log_probs, axis=1)}

  def generate_tokens(self, prefix_ids: tf.Tensor, max_new_tokens: tf.Tensor,
                      temperature: tf.Tensor, seed: tf.Tensor, max_length: int,
                      use_cache: bool = True, compiled: bool = False) -> tf.Tensor:
    """prefix_ids [B, P] (P >= 1, no padding) → the N = max_new_tokens tokens that
    follow, [B, N] int32; P + N <= max_length (else an InvalidArgumentError).

    Each new token is the argmax of the last position's logits (temperature 0) or
    drawn from softmax(logits / temperature) by a stateless draw keyed by (seed's low 32
    bits, its position). With `use_cache`, one step per position, prefix included: the stack
    runs on that one token as a token slice (core/token_slices.py) whose cache of
    keys and values, max_length positions per layer, is the loop's state. Without, each
    step runs the whole max_length buffer (causal attention keeps the later
    positions out) and reads its position's logits: the same tokens, O(max_length)
    work per step instead of O(1) + the attention's O(max_length) reads. A stack with
    a layer that cannot run on slices (`stack_runs_on_slices`) generates without.

    `compiled`: the loop is one XLA cluster (`jit_compile`; its shapes are all static
    for a given B and P: the slices read their whole cache, `TokenSlice.whole_reads`),
    compiled at the first call of each (B, P). A step of a small model is then a few
    fused kernels instead of ~750 graph nodes run one by one (docs/benchmarks.md,
    "Serving"). Only for a stack on one device.
    """
    total = (tf.cast(tf.shape(prefix_ids)[1], tf.int64)  # int64: 2^31 - 1 tokens asked
             + tf.cast(max_new_tokens, tf.int64))       # must not wrap past the check
    checks = [
        tf.debugging.assert_greater_equal(tf.shape(prefix_ids)[1], 1, message=(
            "generate: the prefix needs at least one token (e.g. BOS)")),
        tf.debugging.assert_non_negative(max_new_tokens, message=(
            "generate: max_new_tokens must be >= 0")),
        tf.debugging.assert_less_equal(total, tf.constant(max_length, tf.int64), message=(
            f"generate: prefix length + max_new_tokens must be <= {max_length}, the "
            "exported cache length (--max_decode_length)")),
        tf.debugging.assert_equal(
            tf.math.is_finite(temperature) & (temperature >= 0.0), True, message=(
                "generate: temperature must be a finite number >= 0 (0: greedy)")),
    ]
    with tf.control_dependencies(checks):  # (outside XLA, which has no Assert)
      prefix_ids = tf.identity(prefix_ids)
    use_cache = use_cache and self.stack_runs_on_slices()
    loop = functools.partial(self._generate_loop, max_length=max_length, use_cache=use_cache)
    if compiled:
      loop = tf.function(loop, jit_compile=True, autograph=False)
    return loop(prefix_ids, max_new_tokens, temperature, seed)

  def stack_runs_on_slices(self) -> bool:
    """Whether every layer of the stack declares that it runs on token slices (its
    class's `token_slicing`): the cache of `generate` needs it. A Keras layer does not
    (core/keras_layer.py): its stack generates without the cache."""
    return all(getattr(layer_params.cls, "token_slicing", None) in token_slices.SLICING
               for layer_params in self.main_stack.params.layers)

  def _generate_loop(self, prefix_ids: tf.Tensor, max_new_tokens: tf.Tensor,
                     temperature: tf.Tensor, seed: tf.Tensor, max_length: int,
                     use_cache: bool) -> tf.Tensor:
    """generate_tokens' loop (its inputs checked)."""
    batch, prefix_length = tf.shape(prefix_ids)[0], tf.shape(prefix_ids)[1]
    total = prefix_length + max_new_tokens
    buffer = tf.pad(prefix_ids, [[0, 0], [0, max_length - prefix_length]])
    positions = tf.range(max_length)

    def next_buffer(buffer, logits, t):
      """buffer with the token chosen from logits [B, V] written at t + 1 (past the
      prefix, before the end)."""
      logits = tf.cast(logits, tf.float32)
      greedy = tf.argmax(logits, axis=-1, output_type=tf.int32)
      sampled = tf.random.stateless_categorical(
          logits / tf.maximum(temperature, 1e-6), 1,
          seed=tf.stack([tf.cast(seed, tf.int32), tf.cast(t, tf.int32)]),
          dtype=tf.int32)[:, 0]
      token = tf.where(temperature > 0.0, sampled, greedy)
      at = (positions == t + 1) & (t + 1 >= prefix_length) & (t + 1 < total)
      return tf.where(at[None, :], token[:, None], buffer)

    if use_cache:
      def step(t, buffer, cache):
        token_slice = token_slices.slice_of(tf.cast(t, tf.int64), max_length, cache,
                                            whole_reads=True)
        with base_layer.step_context(token_slice=token_slice):
          logits = self.serve_stack((tf.slice(buffer, [0, t], [-1, 1]),
                                     tf.zeros([batch, 1], tf.float32)))
        return t + 1, next_buffer(buffer, logits[:, 0], t), token_slice.outgoing

      # The first step reads no cache (zeros); its entries start the loop's.
      t, buffer, cache = step(tf.constant(0), buffer, None)
      _, buffer, _ = tf.while_loop(
          lambda t, *_: t < total - 1, step, [t, buffer, cache],
          shape_invariants=[t.shape, any_batch(buffer), [any_batch(c) for c in cache]])
    else:
      def step(t, buffer):
        paddings = tf.cast(tf.broadcast_to(positions > t, [batch, max_length]), tf.float32)
        logits = self.serve_stack((buffer, paddings))  # [B, max_length, V]
        return t + 1, next_buffer(buffer, tf.gather(logits, t, axis=1), t)

      _, buffer = tf.while_loop(lambda t, *_: t < total - 1, step, [tf.constant(0), buffer],
                                shape_invariants=[tf.TensorShape([]), any_batch(buffer)])
    return buffer[:, prefix_length:total]

  def serving_examples(self, model, batch: dict, input_generator) -> list[dict]:
    """decode mode: one eval batch through `score`, each sequence BOS + its labels (so
    that its last token, EOS, is scored) → one record per example {text, log_prob,
    tokens (scored)}."""
    ids, labels = batch["ids"].numpy(), batch["labels"].numpy()
    paddings = batch["paddings"].numpy().astype(np.float32)
    sequences = np.concatenate([ids[:, :1], labels], axis=1)
    sequence_paddings = np.concatenate([np.zeros_like(paddings[:, :1]), paddings], axis=1)
    log_probs = model("score", ids=sequences, paddings=sequence_paddings)["log_prob"].numpy()
    tokens = (1.0 - paddings).sum(axis=1)
    vocab = getattr(input_generator, "vocab", None)
    return [{"text": vocab.decode(labels[i]) if vocab is not None else labels[i].tolist(),
             "log_prob": round(float(log_probs[i]), 6), "tokens": int(tokens[i])}
            for i in range(len(ids))]

  def serving_metrics(self, records, input_generator) -> dict[str, float]:
    """log_pplx: −Σ log p / Σ tokens over the records."""
    del input_generator
    tokens = sum(r["tokens"] for r in records)
    return {"log_pplx": -sum(r["log_prob"] for r in records) / max(tokens, 1)}
