"""Translation: an encoder-decoder Transformer; token metrics, and BLEU from greedy
decoding on eval, per source language.

BLEU is sacrebleu's corpus BLEU (a well-kept, standard implementation) on detokenized
text. Beside it, each language's copy baseline (BLEU of the untranslated source
against the reference) is reported, so that "the model translates" is a comparison
and not a bare number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core.hyperparams import ParamsError
from lingvo_gpipe.inputs import vocabulary
from lingvo_gpipe.tasks import serving
from lingvo_gpipe.tasks.base_task import BaseTask, Metrics, vocabulary_bounds
from lingvo_gpipe.tasks.language_model import token_metrics


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """sacrebleu corpus BLEU (0-100) of hypotheses against one reference each."""
  import sacrebleu

  if not hypotheses:
    return 0.0
  return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


class TranslationTask(BaseTask):
  """batch {'src_ids', 'src_paddings' [B, S]; 'tgt_ids', 'tgt_labels', 'tgt_paddings'
  [B, T]; 'language' [B]} → metrics. `stack` (transformer.encoder_decoder_stack) maps
  (src_ids, src_paddings, tgt_ids, tgt_paddings) to logits [B, T, V]."""

  has_decoder = True

  @classmethod
  def Params(cls):  # noqa: N802
    p = super().Params()
    p.define("stack", None, "Params of the encoder-decoder stack → logits [B, T, V].")
    p.define("label_smoothing", 0.1, "Label smoothing of the training loss.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.params.stack is None:
      raise ParamsError(f"{self.path}: params.stack is not set")
    self.create_stack("stack", self.params.stack)

  @classmethod
  def id_bounds(cls, task_params) -> dict:
    return vocabulary_bounds(task_params, ("src_ids", "tgt_ids"), ("tgt_labels",))

  def stack_inputs(self, batch: dict[str, tf.Tensor]) -> tuple:
    return (batch["src_ids"], tf.cast(batch["src_paddings"], tf.float32), batch["tgt_ids"],
            tf.cast(batch["tgt_paddings"], tf.float32))

  def head_inputs(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    return {"tgt_labels": batch["tgt_labels"], "tgt_paddings": batch["tgt_paddings"]}

  def head(self, logits: tf.Tensor, head_inputs: dict[str, tf.Tensor]) -> Metrics:
    with tf.device(self.output_device):
      return token_metrics(logits, head_inputs["tgt_labels"],
                           tf.cast(head_inputs["tgt_paddings"], tf.float32),
                           self.params.label_smoothing)

  def decode(self, batch: dict[str, tf.Tensor],
             full_spec: dict[str, tf.TensorSpec]) -> dict[str, tf.Tensor]:
    """Greedy decoding of an eval batch: hyp_ids [B, T] (`greedy_ids`) beside the
    references, sources and languages. T is the input's full target length
    (`full_spec`, its `full_batch_spec()`), not the batch's: a batch of a length bucket is
    cut to its bound, and a hypothesis may run past its reference, as a served model's
    does (`translate_ids` decodes to the full length)."""
    hyp = self.greedy_ids(batch["src_ids"], tf.cast(batch["src_paddings"], tf.float32),
                          full_spec["tgt_labels"].shape[1], self.stack)
    return {"hyp_ids": hyp, "ref_ids": batch["tgt_labels"], "src_ids": batch["src_ids"],
            "language": batch["language"]}

  def greedy_ids(self, src_ids: tf.Tensor, src_paddings: tf.Tensor, length: int,
                 run_stack) -> tf.Tensor:
    """Greedy decoding: hyp_ids [B, length] (B may be unknown), each position the
    argmax given the ones before, PAD after a row's first EOS; `run_stack(src_ids,
    src_paddings, tgt_ids, tgt_paddings)` → logits [B, length, V].

    Runs the stack on a growing target prefix (causal attention makes the unfilled
    positions irrelevant) until every row has emitted EOS or `length` positions are
    filled; no cache (cross-attention layers do not run on token slices), which is fine
    for eval-sized models.
    """
    batch_size = tf.shape(src_ids)[0]
    no_paddings = tf.zeros([batch_size, length], tf.float32)
    prefix = tf.pad(tf.fill([batch_size, 1], vocabulary.BOS_ID), [[0, 0], [0, length - 1]])
    hyp = tf.zeros([batch_size, length], tf.int32)
    ended = tf.zeros([batch_size], tf.bool)  # [B]: the row has emitted EOS

    def step(t, prefix, hyp, ended):
      logits = run_stack(src_ids, src_paddings, prefix, no_paddings)
      best = tf.argmax(logits[:, t], axis=-1, output_type=tf.int32)  # [B]
      best = tf.where(ended, vocabulary.PAD_ID, best)
      at_t = tf.one_hot(t, length, dtype=tf.int32)[None, :]
      hyp = hyp * (1 - at_t) + best[:, None] * at_t
      at_next = tf.one_hot(t + 1, length, dtype=tf.int32)[None, :]  # zeros past the end
      prefix = prefix * (1 - at_next) + best[:, None] * at_next
      return t + 1, prefix, hyp, ended | tf.equal(best, vocabulary.EOS_ID)

    def going(t, prefix, hyp, ended):
      del prefix, hyp
      return tf.logical_and(t < length, tf.logical_not(tf.reduce_all(ended)))

    _, _, hyp, _ = tf.while_loop(going, step, [tf.constant(0), prefix, hyp, ended])
    return hyp

  # -- serving --------------------------------------------------------------------------

  def serving_functions(self, model, input_generator, options) -> dict:
    """translate_ids(src_ids [B, S] int32, src_paddings [B, S] float32) → ids [B, T]
    (greedy; sources as the input makes them: the target tag, the tokens, EOS); and,
    where the vocabulary maps text in the graph (`WordVocabulary`), translate(sources
    [B] string, source text) → translations [B] string, ids [B, T], source_truncated [B]
    bool (the source had more than S − 2 words and only its first S − 2 were
    translated). S and T are the eval input's lengths; ids must lie in [0, V)."""
    del options
    spec = input_generator.full_batch_spec()  # (the full lengths, whatever the buckets)
    source_length, target_length = spec["src_ids"].shape[1], spec["tgt_ids"].shape[1]
    vocab = input_generator.vocab
    bound = self.id_bounds(self.params).get("src_ids")  # (None: a stack of no vocab_size)

    def run_stack(*inputs):
      return self.serve_stack(inputs)

    def translate_ids(src_ids, src_paddings):
      src_ids = serving.checked_ids(src_ids, bound, "translate_ids: src_ids")
      return {"ids": self.greedy_ids(src_ids, src_paddings, target_length, run_stack)}

    functions = {"translate_ids": serving.traced({
        "src_ids": tf.TensorSpec([None, source_length], tf.int32),
        "src_paddings": tf.TensorSpec([None, source_length], tf.float32)})(translate_ids)}
    if isinstance(vocab, vocabulary.WordVocabulary):
      model.vocabulary_table = vocab.lookup_table()
      tag = vocab.tag_id("en")

      def translate(sources):
        ids = vocab.encode_in_graph(model.vocabulary_table, sources)  # ragged [B, None]
        # The model was trained on sources of at most S − 2 tokens (the tag and EOS
        # take two): a longer one is cut there and says so in source_truncated.
        truncated = ids.row_lengths() > source_length - 2
        ids = tf.concat([tf.fill([ids.nrows(), 1], tag), ids[:, :source_length - 2],
                         tf.fill([ids.nrows(), 1], vocabulary.EOS_ID)], axis=1)
        src_ids = ids.to_tensor(vocabulary.PAD_ID, shape=[None, source_length])
        src_paddings = 1.0 - tf.sequence_mask(ids.row_lengths(), source_length, tf.float32)
        hyp = self.greedy_ids(src_ids, src_paddings, target_length, run_stack)
        return {"translations": vocab.decode_in_graph(hyp), "ids": hyp,
                "source_truncated": truncated}

      functions["translate"] = serving.traced(
          {"sources": tf.TensorSpec([None], tf.string)})(translate)
    return functions

  def serving_examples(self, model, batch: dict, input_generator) -> list[dict]:
    """decode mode: one eval batch through `translate_ids` (a length bucket's sources
    padded back to the signature's length) → one record per example
    {language, source, hypothesis, reference (texts), hypothesis_ids, reference_ids,
    source_ids}."""
    source_length = input_generator.full_batch_spec()["src_ids"].shape[1]
    cut = source_length - batch["src_ids"].shape[1]  # > 0: a length bucket's batch
    out = model("translate_ids",
                src_ids=tf.pad(batch["src_ids"], [[0, 0], [0, cut]],
                               constant_values=vocabulary.PAD_ID),
                src_paddings=tf.pad(tf.cast(batch["src_paddings"], tf.float32),
                                    [[0, 0], [0, cut]], constant_values=1.0))
    hyp, ref, src = (out["ids"].numpy(), batch["tgt_labels"].numpy(),
                     batch["src_ids"].numpy())
    language, vocab = batch["language"].numpy(), input_generator.vocab
    names = getattr(input_generator, "language_names", None)
    return [{"language": names[language[i]] if names else int(language[i]),
             "source": vocab.decode(src[i]), "hypothesis": vocab.decode(hyp[i]),
             "reference": vocab.decode(ref[i]), "source_ids": src[i].tolist(),
             "hypothesis_ids": hyp[i].tolist(), "reference_ids": ref[i].tolist()}
            for i in range(len(hyp))]

  def serving_metrics(self, records: Sequence[dict], input_generator) -> dict[str, float]:
    """BLEU overall and per source language, with the copy baselines (decode_metrics)."""
    names = list(getattr(input_generator, "language_names", None) or [])
    return self.decode_metrics([{
        "hyp_ids": [r["hypothesis_ids"]], "ref_ids": [r["reference_ids"]],
        "src_ids": [r["source_ids"]],
        "language": [names.index(r["language"]) if names else r["language"]]}
        for r in records], input_generator)

  def decode_metrics(self, decoded: Sequence[dict[str, np.ndarray]],
                     input_generator) -> dict[str, float]:
    """BLEU overall and per source language, with each language's copy baseline."""
    vocab = input_generator.vocab
    names = getattr(input_generator, "language_names", None)
    hyps: dict[int, list[str]] = {}
    refs: dict[int, list[str]] = {}
    copies: dict[int, list[str]] = {}
    for out in decoded:
      for i in range(len(out["hyp_ids"])):
        lang = int(out["language"][i])
        hyps.setdefault(lang, []).append(vocab.decode(out["hyp_ids"][i]))
        refs.setdefault(lang, []).append(vocab.decode(out["ref_ids"][i]))
        copies.setdefault(lang, []).append(vocab.decode(out["src_ids"][i]))
    every = sorted(hyps)
    results = {"bleu": corpus_bleu([h for k in every for h in hyps[k]],
                                   [r for k in every for r in refs[k]])}
    for lang in every:
      name = names[lang] if names else str(lang)
      results[f"bleu/{name}"] = corpus_bleu(hyps[lang], refs[lang])
      results[f"bleu_copy_baseline/{name}"] = corpus_bleu(copies[lang], refs[lang])
    return results
