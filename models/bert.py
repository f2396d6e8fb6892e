"""BERT: bidirectional encoder with post-LayerNorm blocks, learned positions and token types.

Parameters follow Hugging Face's BertForMaskedLM / BertForSequenceClassification, so weights can be
imported by renaming (HF Linear weights are (out, in); ours are (in, ...) with heads split out):
  word_embeddings, position_embeddings, token_type_embeddings, embeddings_ln  (embeddings.*, .LayerNorm)
  encoder.layers.N.attention.{query, key, value}   (encoder.layer.N.attention.self.*)
  encoder.layers.N.attention.out, .attention_ln    (attention.output.dense, attention.output.LayerNorm)
  encoder.layers.N.mlp.{up, down}, .output_ln      (intermediate.dense, output.dense, output.LayerNorm)
  head 'mlm':      transform, transform_ln, decoder_bias  (cls.predictions.transform.dense,
                   .transform.LayerNorm, cls.predictions.bias; the decoder is tied to word_embeddings)
  head 'classify': pooler, classifier                     (bert.pooler.dense, classifier)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from configs import schema
from errors import ConfigError
from models import hf_import as hf
from models.layers import (
  MLP,
  Attention,
  Dense,
  Embed,
  LayerNorm,
  Stack,
  axes,
  dtypes,
  gelu_erf,
  padded_vocab,
  stack_options,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')
HEADS = ('mlm', 'classify')
schema.register('model.head', HEADS)


class Block(nnx.Module):
  """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dict(**dtypes(cfg), rngs=rngs)
    D = cfg.embed_dim
    self.attention = Attention(D, cfg.num_heads, impl=cfg.attention, **kw)
    self.attention_ln = LayerNorm(D, eps=cfg.norm_eps, **kw)
    self.mlp = MLP(D, cfg.mlp_dim, activation=gelu_erf, **kw)  # BERT's exact erf GELU
    self.output_ln = LayerNorm(D, eps=cfg.norm_eps, **kw)

  def __call__(self, x_BLD: jax.Array, valid_BL: jax.Array | None) -> jax.Array:
    x_BLD = shard_logical(self.attention_ln(x_BLD + self.attention(x_BLD, causal=False, valid_BL=valid_BL)), ACT)
    return shard_logical(self.output_ln(x_BLD + self.mlp(x_BLD)), ACT)


class Bert(nnx.Module):
  """tokens (B, L) int32 -> MLM logits (B, L, V) or class logits (B, num_classes), float32.

  valid_BL (1 = real token, 0 = padding) keeps padded keys out of every attention; token_types_BL
  (segment A/B) defaults to all zeros.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    D, head = cfg.embed_dim, cfg.head
    if head not in HEADS:
      raise ConfigError(f'config.model.head={head!r} is not a BERT head; choose one of {list(HEADS)}')
    param = lambda shape, names: nnx.Param(
      nnx.initializers.normal(0.02)(rngs.params(), shape, kw['param_dtype']), **axes(*names)
    )
    self.word_embeddings = Embed(cfg.vocab_size, D, pad_to=cfg.pad_vocab_to, **kw, rngs=rngs)
    self.position_embeddings = param((cfg.max_len, D), ('length', 'embed'))
    self.token_type_embeddings = param((cfg.type_vocab_size, D), ('token_types', 'embed'))
    self.embeddings_ln = LayerNorm(D, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.encoder = Stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, **stack_options(cfg), rngs=rngs)
    self.head = head
    if head == 'mlm':
      self.transform = Dense('bld,de->ble', (D, D), ('embed', 'embed'), bias_axes=('embed',), **kw, rngs=rngs)
      self.transform_ln = LayerNorm(D, eps=cfg.norm_eps, **kw, rngs=rngs)
      rows = self.word_embeddings.embed.embedding.shape[0]
      self.decoder_bias = nnx.Param(jnp.zeros((rows,), kw['param_dtype']), **axes('vocab'))
    else:
      self.pooler = Dense('bd,de->be', (D, D), ('embed', 'embed'), bias_axes=('embed',), **kw, rngs=rngs)
      self.classifier = Dense(
        'bd,dc->bc',
        (D, cfg.num_classes),
        ('embed', 'classes'),
        bias_axes=('classes',),
        preferred_element_type=jnp.float32,
        **kw,
        rngs=rngs,
      )
    self.max_len, self.dtype = cfg.max_len, kw['dtype']

  def __call__(
    self, tokens_BL: jax.Array, *, valid_BL: jax.Array | None = None, token_types_BL: jax.Array | None = None
  ) -> jax.Array:
    L = tokens_BL.shape[1]
    if L > self.max_len:
      raise ConfigError(f'sequence length {L} exceeds the model max_len {self.max_len}')
    if token_types_BL is None:
      token_types_BL = jnp.zeros_like(tokens_BL)
    pos_LD = shard_logical(self.position_embeddings[...], (None, None))[:L]
    types_BLD = jnp.take(shard_logical(self.token_type_embeddings[...], (None, None)), token_types_BL, axis=0)
    x_BLD = self.word_embeddings(tokens_BL) + (pos_LD[None] + types_BLD).astype(self.dtype)
    x_BLD = shard_logical(self.embeddings_ln(x_BLD), ACT)
    x_BLD, _ = self.encoder(x_BLD, valid_BL)
    if self.head == 'mlm':
      h_BLD = self.transform_ln(gelu_erf(self.transform(x_BLD)))
      logits_BLV = self.word_embeddings.attend(h_BLD) + self.decoder_bias[...].astype(jnp.float32)
      return shard_logical(logits_BLV, ('batch', 'length', 'vocab'))
    pooled_BD = jnp.tanh(self.pooler(x_BLD[:, 0]))  # the [CLS] position
    return shard_logical(self.classifier(pooled_BD), ('batch', 'classes'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, N, T = cfg.embed_dim, cfg.mlp_dim, cfg.num_layers, cfg.type_vocab_size
  V = padded_vocab(cfg)
  embeddings = (V + cfg.max_len + T) * D + 2 * D
  block = 4 * (D * D + D) + (D * F + F) + (F * D + D) + 2 * 2 * D
  if cfg.head == 'mlm':
    head = (D * D + D) + 2 * D + V  # transform dense, its LayerNorm, decoder bias
  else:
    head = (D * D + D) + (D * cfg.num_classes + cfg.num_classes)  # pooler, classifier
  return embeddings + N * block + head


# --- Hugging Face import (models/hf_import.py): BertForMaskedLM / BertForSequenceClassification ----
#
# The head is the zoo config's choice, not config.json's: config.model.head follows config.task
# (mlm or text_classification), and num_classes follows the dataset. So config.json's architectures,
# num_labels and id2label are not adopted: a checkpoint whose head matches (BertForMaskedLM into 'mlm',
# BertForSequenceClassification with num_labels == num_classes into 'classify') loads completely;
# another head is one clear error (missing/unused tensors, or the classifier's shapes) until
# config.dont_load names it, e.g. bert-base-uncased (BertForPreTraining: encoder + pooler + MLM head)
# fine-tuned on 2 classes: head 'classify', dont_load='^classifier/'. Tensors of the head the zoo
# model does not build (cls.predictions.* under 'classify'; the pooler and the next-sentence head
# cls.seq_relationship.* under 'mlm') are ignored, as transformers ignores them.


def _hf_config(c: dict) -> dict:
  for field, ok, why in (
    ('hidden_act', ('gelu',), "the zoo's BERT uses the exact erf GELU ('gelu')"),
    ('position_embedding_type', ('absolute',), "the zoo's BERT has learned absolute positions"),
    ('is_decoder', (False,), "the zoo's BERT is a bidirectional encoder"),
    ('add_cross_attention', (False,), "the zoo's BERT has no cross-attention"),
    ('tie_word_embeddings', (True,), "the zoo's MLM decoder is tied to the word embeddings"),
  ):
    if c.get(field, ok[0]) not in ok:
      raise hf.HFImportError(f'config.json {field}={c[field]!r}: {why}')
  return dict(
    vocab_size=c['vocab_size'],
    embed_dim=c['hidden_size'],
    num_layers=c['num_hidden_layers'],
    num_heads=c['num_attention_heads'],
    mlp_dim=c['intermediate_size'],
    max_len=c['max_position_embeddings'],
    type_vocab_size=c.get('type_vocab_size', 2),
    norm_eps=c.get('layer_norm_eps', 1e-12),
  )


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same BertForMaskedLM (head 'mlm') or BertForSequenceClassification
  (head 'classify', num_labels = num_classes): the inverse of _hf_config, with the real vocabulary (not the
  padded rows) and no dropout (the zoo has none)."""
  head = cfg.head
  arch = {'mlm': 'BertForMaskedLM', 'classify': 'BertForSequenceClassification'}
  if head not in arch:
    raise ConfigError(f'config.model.head={head!r} is not a BERT head; choose one of {list(HEADS)}')
  out = dict(
    model_type='bert',
    architectures=[arch[head]],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    intermediate_size=cfg.mlp_dim,
    hidden_act='gelu',
    max_position_embeddings=cfg.max_len,
    type_vocab_size=cfg.type_vocab_size,
    layer_norm_eps=cfg.norm_eps,
    position_embedding_type='absolute',
    tie_word_embeddings=True,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
  )
  return dict(out, num_labels=cfg.num_classes, classifier_dropout=0.0) if head == 'classify' else out


def _hf_params() -> list[hf.Param]:
  """HF Linear weights are (out, in): transpose, then split the heads out. The vocabulary rows
  (word embeddings, MLM decoder bias) are zero-padded to config.model.pad_vocab_to."""

  def dims(cfg):  # D, H, K
    return cfg.embed_dim, cfg.num_heads, cfg.embed_dim // cfg.num_heads

  pad = lambda cfg: [hf.Pad(0, padded_vocab(cfg), cfg.vocab_size)]
  qkv = lambda cfg: [hf.T((1, 0)), hf.R(dims(cfg), (cfg.embed_dim,) * 2)]
  qkv_bias = lambda cfg: [hf.R(dims(cfg)[1:], (cfg.embed_dim,))]
  out = lambda cfg: [hf.T((1, 0)), hf.R((*dims(cfg)[1:], dims(cfg)[0]), (cfg.embed_dim,) * 2)]
  lin = [hf.T((1, 0))]

  def ln(zoo, theirs):  # older files name LayerNorm parameters gamma/beta (whichever the file has is read)
    return [
      hf.Param(f'{zoo}/scale', f'{theirs}.weight'),
      hf.Param(f'{zoo}/bias', f'{theirs}.bias'),
      hf.Param(f'{zoo}/scale', f'{theirs}.gamma'),
      hf.Param(f'{zoo}/bias', f'{theirs}.beta'),
    ]

  def dense(zoo, theirs, kernel_ops=lin, bias_ops=()):
    return [
      hf.Param(f'{zoo}/layer/kernel', f'{theirs}.weight', kernel_ops),
      hf.Param(f'{zoo}/layer/bias', f'{theirs}.bias', bias_ops),
    ]

  b, h = 'encoder/layers/{i}', 'encoder.layer.{i}'
  rows = [
    hf.Param('word_embeddings/embed/embedding', 'embeddings.word_embeddings.weight', pad),
    hf.Param('position_embeddings', 'embeddings.position_embeddings.weight'),
    hf.Param('token_type_embeddings', 'embeddings.token_type_embeddings.weight'),
    *ln('embeddings_ln', 'embeddings.LayerNorm'),
    *dense(f'{b}/attention/out', f'{h}.attention.output.dense', out),
    *ln(f'{b}/attention_ln', f'{h}.attention.output.LayerNorm'),
    *dense(f'{b}/mlp/up', f'{h}.intermediate.dense'),
    *dense(f'{b}/mlp/down', f'{h}.output.dense'),
    *ln(f'{b}/output_ln', f'{h}.output.LayerNorm'),
    # head 'mlm' (the decoder weight is the word embedding table)
    *dense('transform', 'cls.predictions.transform.dense'),
    *ln('transform_ln', 'cls.predictions.transform.LayerNorm'),
    hf.Param('decoder_bias', 'cls.predictions.bias', pad),
    hf.Param('decoder_bias', 'cls.predictions.decoder.bias', pad),  # files with only the decoder's copy
    # head 'classify'
    *dense('pooler', 'pooler.dense'),
    *dense('classifier', 'classifier'),
  ]
  for n in ('query', 'key', 'value'):
    rows += dense(f'{b}/attention/{n}', f'{h}.attention.self.{n}', qkv, qkv_bias)
  return rows


# Keys are 'bert.'-prefixed in BertFor* files, bare in BertModel ones; the heads (cls.*, classifier)
# are never prefixed. Ignored when nothing reads them (checked by the importer): position_ids and
# token_type_ids buffers, the tied decoder (cls.predictions.decoder.*: copies of the word embeddings and
# cls.predictions.bias), the next-sentence head, and the tensors of the head the zoo model does not build.
HF = hf.Family(
  model_types=('bert',),
  config=_hf_config,
  params=_hf_params(),
  prefixes=('bert.', ''),
  ignore=(r'embeddings\.(position_ids|token_type_ids)$', r'^cls\.', r'^(bert\.)?pooler\.'),
  to_config=to_hf_config,
  unprefixed=(r'^cls\.', r'^classifier\.'),
)
