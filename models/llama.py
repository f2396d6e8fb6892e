"""Llama: decoder-only LM with RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP.

Parameters follow Hugging Face's LlamaForCausalLM, so weights can be imported by renaming:
embed_tokens, blocks.layers.N.{input_layernorm, self_attn.{query, key, value, out} (q/k/v/o_proj),
post_attention_layernorm, mlp.{gate, up, down}_proj}, norm, lm_head (absent when tie_embeddings).
HF's Linear weights are (out, in); ours are (in, ...) with heads split out, e.g. q_proj (H*K, D) is
query (D, H, K). Rotary embeddings use HF's rotate_half convention, so no permutation is needed.
`rope_scaling` (None, or Llama 3.1+'s frequency scaling as (key, value) pairs: rope_type 'llama3',
factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) is read from config.json
by the Hugging Face importer (`HF` at the end of this file).
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
from flax import nnx

from errors import ConfigError
from models import hf_import as hf
from models.layers import (
  Attention,
  Dense,
  Embed,
  GatedMLP,
  RMSNorm,
  Stack,
  dtypes,
  logits_dtype,
  loss_chunks,
  rope_scaling_params,
  stack_options,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')


class Block(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.init_attention(cfg, rngs)
    self.mlp = GatedMLP(cfg.embed_dim, cfg.mlp_dim, **dtypes(cfg), rngs=rngs)

  def init_attention(self, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs) -> None:
    """The norms and attention of a Llama block (shared with the MoE block, which swaps the MLP)."""
    kw = dict(**dtypes(cfg), rngs=rngs)
    D = cfg.embed_dim
    self.input_layernorm = RMSNorm(D, eps=cfg.norm_eps, **kw)
    self.self_attn = Attention(
      D,
      cfg.num_heads,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      use_bias=False,
      rope_theta=cfg.rope_theta,
      rope_scaling=cfg.rope_scaling,
      impl=cfg.attention,
      **kw,
    )
    self.post_attention_layernorm = RMSNorm(D, eps=cfg.norm_eps, **kw)

  def attend(
    self,
    x_BLD: jax.Array,
    positions_BL: jax.Array | None,
    segment_ids_BL: jax.Array | None,
    cache: Any = None,
    decoding: Any = None,
  ) -> jax.Array | tuple[jax.Array, Any]:
    """x + attention(norm(x)); the feed-forward half follows on post_attention_layernorm. With a KV cache
    (decoding, Stack.decode): (x, the cache written)."""
    h_BLD = self.self_attn(
      self.input_layernorm(x_BLD),
      causal=True,
      positions_BL=positions_BL,
      segment_ids_BL=segment_ids_BL,
      cache=cache,
      decoding=decoding,
    )
    if cache is not None:
      h_BLD, cache = h_BLD
      return shard_logical(x_BLD + h_BLD, ACT), cache
    return shard_logical(x_BLD + h_BLD, ACT)

  def __call__(
    self,
    x_BLD: jax.Array,
    positions_BL: jax.Array | None,
    segment_ids_BL: jax.Array | None,
    *,
    cache: Any = None,
    decoding: Any = None,
  ) -> jax.Array | tuple[jax.Array, Any]:
    x_BLD = self.attend(x_BLD, positions_BL, segment_ids_BL, cache, decoding)
    if cache is not None:
      x_BLD, cache = x_BLD
    x_BLD = shard_logical(x_BLD + self.mlp(self.post_attention_layernorm(x_BLD)), ACT)
    return x_BLD if cache is None else (x_BLD, cache)


class Llama(nnx.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32. Packed rows: pass positions and segment_ids
  (rotary angles come from the positions, so each document starts at position 0). `hidden_states` and
  `head` are the two halves of `__call__` (the chunked LM loss runs the head per chunk)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    D, V = cfg.embed_dim, cfg.vocab_size
    self.embed_tokens = Embed(V, D, logits_dtype=logits_dtype(cfg), **kw, rngs=rngs)
    self.blocks = Stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, **stack_options(cfg), rngs=rngs)
    self.norm = RMSNorm(D, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.tied = cfg.tie_embeddings
    if not self.tied:
      self.lm_head = Dense(
        'bld,dv->blv', (D, V), ('embed', 'vocab'), preferred_element_type=logits_dtype(cfg), **kw, rngs=rngs
      )
    self.loss_chunks = loss_chunks(cfg)

  def __call__(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> jax.Array:
    return self.head(self.hidden_states(tokens_BL, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL))

  def hidden_states(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> jax.Array:
    """The last block's output after the final RMSNorm, (B, L, D)."""
    x_BLD = shard_logical(self.embed_tokens(tokens_BL), ACT)
    x_BLD, _ = self.blocks(x_BLD, positions_BL, segment_ids_BL)
    return self.norm(x_BLD)

  def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache: Any, decoding: Any) -> tuple[jax.Array, Any]:
    """The last token's logits (B, V) and the KV cache with tokens_BT written into it (generation/engine.py)."""
    x_BTD = shard_logical(self.embed_tokens(tokens_BT), ACT)
    x_BTD, cache = self.blocks.decode(x_BTD, cache, decoding, positions_BT, None)
    return self.head(self.norm(x_BTD[:, -1:]))[:, 0], cache

  def head(self, x_BLD: jax.Array) -> jax.Array:
    """Hidden states (B, L, D) -> logits (B, L, V): the tied embedding or lm_head."""
    logits_BLV = self.embed_tokens.attend(x_BLD) if self.tied else self.lm_head(x_BLD)
    return shard_logical(logits_BLV, ('batch', 'length', 'vocab'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, V, N, H = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.num_layers, cfg.num_heads
  G = cfg.num_kv_heads or H  # None: as many as the heads
  K = cfg.head_dim or D // H
  block = 2 * D + 2 * D * H * K + 2 * D * G * K + 3 * D * F  # 2 RMSNorms, q+o, k+v, gate+up+down
  head = 0 if cfg.tie_embeddings else D * V
  return V * D + N * block + D + head


# --- Hugging Face import (models/hf_import.py): LlamaForCausalLM / LlamaModel ----------------------


def _unsupported(c: dict, field: str, value: Any, why: str) -> hf.HFImportError:
  return hf.HFImportError(f'config.json {field}={value!r}: {why}')


def _hf_rope(c: dict) -> tuple[float, tuple | None]:
  """(rope_theta, rope_scaling) from config.json: transformers 5.x writes `rope_parameters`
  {rope_type, rope_theta, ...}; older files have top-level `rope_theta` and `rope_scaling` {type|rope_type, ...}."""
  params = dict(c.get('rope_parameters') or c.get('rope_scaling') or {})
  field = 'rope_parameters' if c.get('rope_parameters') else 'rope_scaling'
  if params and not all(isinstance(v, (int, float, str, type(None))) for v in params.values()):
    raise _unsupported(c, field, params, 'per-layer-type rope parameters are not supported')
  theta = float(params.get('rope_theta') or c.get('rope_theta') or 10_000.0)
  kind = params.get('rope_type', params.get('type', 'default'))
  if float(params.get('partial_rotary_factor', c.get('partial_rotary_factor')) or 1.0) != 1.0:
    raise _unsupported(
      c,
      'partial_rotary_factor',
      params.get('partial_rotary_factor', c.get('partial_rotary_factor')),
      "the zoo's Llama rotates the whole head_dim",
    )
  if kind == 'default':
    return theta, None
  if kind != 'llama3':
    raise _unsupported(c, f'{field}.rope_type', kind, "the zoo's Llama implements 'default' and 'llama3' RoPE")
  params.setdefault('original_max_position_embeddings', c.get('max_position_embeddings'))
  try:
    return theta, rope_scaling_params({**params, 'rope_type': 'llama3'})
  except ConfigError as e:
    raise hf.HFImportError(f'config.json {field}: {e}') from None


def _hf_config(c: dict) -> dict:
  """config.json -> config.model. Every architectural field is adopted (the head is part of the
  architecture: untied configs get their own lm_head)."""
  for field, want, why in (
    ('hidden_act', 'silu', "the zoo's Llama MLP is SwiGLU (silu)"),
    ('attention_bias', False, "the zoo's Llama projections have no biases"),
    ('mlp_bias', False, "the zoo's Llama MLP has no biases"),
  ):
    if c.get(field, want) != want:
      raise _unsupported(c, field, c[field], why)
  H = c['num_attention_heads']
  theta, scaling = _hf_rope(c)
  return dict(
    vocab_size=c['vocab_size'],
    embed_dim=c['hidden_size'],
    mlp_dim=c['intermediate_size'],
    num_layers=c['num_hidden_layers'],
    num_heads=H,
    num_kv_heads=c.get('num_key_value_heads') or H,
    head_dim=c.get('head_dim') or c['hidden_size'] // H,
    rope_theta=theta,
    rope_scaling=scaling,
    norm_eps=c.get('rms_norm_eps', 1e-6),
    tie_embeddings=bool(c.get('tie_word_embeddings', False)),
    max_len=c.get('max_position_embeddings', 2048),
  )


def hf_rope_parameters(cfg: Any) -> dict:
  """config.model's rope_theta / rope_scaling as transformers 5's `rope_parameters` (shared with MoE)."""
  theta = float(cfg.rope_theta)
  scaling = rope_scaling_params(cfg.rope_scaling)
  if scaling is None:
    return dict(rope_type='default', rope_theta=theta)
  s = dict(scaling)
  return dict(s, rope_theta=theta, original_max_position_embeddings=int(s['original_max_position_embeddings']))


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same LlamaForCausalLM (the inverse of _hf_config); without a max_len,
  transformers' default length."""
  H = cfg.num_heads
  out = dict(
    model_type='llama',
    architectures=['LlamaForCausalLM'],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=H,
    num_key_value_heads=cfg.num_kv_heads or H,
    head_dim=cfg.head_dim or cfg.embed_dim // H,
    hidden_act='silu',
    rms_norm_eps=cfg.norm_eps,
    rope_parameters=hf_rope_parameters(cfg),
    tie_word_embeddings=cfg.tie_embeddings,
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
  )
  return dict(out, max_position_embeddings=cfg.max_len) if cfg.max_len else out


def hf_params(mlp: bool = True) -> list[hf.Param]:
  """HF Linear weights are (out, in): transpose, then split the heads out. mlp=False: all but the MLP rows
  (the MoE family adds its experts)."""

  def dims(cfg):  # D, H, G, K
    H = cfg.num_heads
    return cfg.embed_dim, H, cfg.num_kv_heads or H, cfg.head_dim or cfg.embed_dim // H

  def heads(heads_dim):  # (D, H*K) -> (D, H, K) after the transpose (heads_dim 1: query; 2: key/value)
    def ops(cfg):
      D, n, K = dims(cfg)[0], dims(cfg)[heads_dim], dims(cfg)[3]
      return [hf.T((1, 0)), hf.R((D, n, K), (D, n * K))]

    return ops

  q, kv = heads(1), heads(2)
  out = lambda cfg: [
    hf.T((1, 0)),
    hf.R((dims(cfg)[1], dims(cfg)[3], dims(cfg)[0]), (dims(cfg)[1] * dims(cfg)[3], dims(cfg)[0])),
  ]
  b = 'blocks/layers/{i}'
  rows = [
    hf.Param('embed_tokens/embed/embedding', 'embed_tokens.weight'),
    hf.Param('norm/scale', 'norm.weight'),
    hf.Param('lm_head/layer/kernel', 'lm_head.weight', [hf.T((1, 0))]),  # untied only
    hf.Param(f'{b}/input_layernorm/scale', 'layers.{i}.input_layernorm.weight'),
    hf.Param(f'{b}/post_attention_layernorm/scale', 'layers.{i}.post_attention_layernorm.weight'),
    hf.Param(f'{b}/self_attn/query/layer/kernel', 'layers.{i}.self_attn.q_proj.weight', q),
    hf.Param(f'{b}/self_attn/key/layer/kernel', 'layers.{i}.self_attn.k_proj.weight', kv),
    hf.Param(f'{b}/self_attn/value/layer/kernel', 'layers.{i}.self_attn.v_proj.weight', kv),
    hf.Param(f'{b}/self_attn/out/layer/kernel', 'layers.{i}.self_attn.o_proj.weight', out),
  ]
  rows += [
    hf.Param(f'{b}/mlp/{n}/layer/kernel', f'layers.{{i}}.mlp.{n}_proj.weight', [hf.T((1, 0))])
    for n in ('gate', 'up', 'down')
    if mlp
  ]
  return rows


# Keys are 'model.'-prefixed in LlamaForCausalLM files, bare in LlamaModel ones; lm_head.weight is never
# prefixed. Ignored: rotary inv_freq buffers (older files). A tied model (tie_embeddings follows config.json;
# an untied one always reads lm_head.weight) accepts a file's lm_head.weight only as a copy of the embedding.
def _fits_positions(ours: int, theirs: int) -> str | None:
  """max_len: rotary positions have no table, so a shorter (or equal) length works with any checkpoint."""
  return (
    None
    if 0 < ours <= theirs
    else (
      f'longer than the {theirs} positions the checkpoint was trained for; '
      'extend the context with rope_scaling, or leave config.model.max_len unset (it follows config.json)'
    )
  )


HF = hf.Family(
  model_types=('llama',),
  config=_hf_config,
  params=hf_params(),
  prefixes=('model.', ''),
  keep={'max_len': _fits_positions},
  base_keeps=('max_position_embeddings',),
  ignore=(r'rotary_emb\.inv_freq$',),
  tied=(('lm_head.weight', 'embed_tokens.weight'),),
  to_config=to_hf_config,
  unprefixed=(r'^lm_head\.',),
)
