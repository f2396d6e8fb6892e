"""GPT-2: decoder-only LM with learned positions, pre-LayerNorm blocks, GELU MLP and tied embeddings.

Parameters map one-to-one onto Hugging Face's GPT2LMHeadModel (wte, wpe, h.N.{ln_1, attn.c_attn
(q|k|v fused there, separate here), attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from errors import ConfigError
from models import hf_import as hf
from models.layers import (
  MLP,
  Attention,
  Embed,
  LayerNorm,
  Stack,
  axes,
  dtypes,
  gelu_new,
  logits_dtype,
  loss_chunks,
  padded_vocab,
  stack_options,
  table_rows,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')


class Block(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dict(**dtypes(cfg), rngs=rngs)
    scale = (2 * cfg.num_layers) ** -0.5  # GPT-2's scaled init of residual projections
    self.ln1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.attn = Attention(cfg.embed_dim, cfg.num_heads, out_init_scale=scale, impl=cfg.attention, **kw)
    self.ln2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    # HF's "gelu_new" is the tanh approximation.
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, activation=gelu_new, out_init_scale=scale, **kw)

  def __call__(
    self, x_BLD: jax.Array, segment_ids_BL: jax.Array | None, *, cache: Any = None, decoding: Any = None
  ) -> jax.Array | tuple[jax.Array, Any]:
    h_BLD = self.attn(self.ln1(x_BLD), causal=True, segment_ids_BL=segment_ids_BL, cache=cache, decoding=decoding)
    if cache is not None:  # decoding (Stack.decode): the attention wrote this layer's KV cache
      h_BLD, cache = h_BLD
    x_BLD = shard_logical(x_BLD + h_BLD, ACT)
    x_BLD = shard_logical(x_BLD + self.mlp(self.ln2(x_BLD)), ACT)
    return x_BLD if cache is None else (x_BLD, cache)


class GPT2(nnx.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32. Packed rows: pass positions and segment_ids.
  `hidden_states` and `head` are the two halves of `__call__` (the chunked LM loss runs the head per chunk)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    self.tok = Embed(
      cfg.vocab_size, cfg.embed_dim, pad_to=cfg.pad_vocab_to, logits_dtype=logits_dtype(cfg), **kw, rngs=rngs
    )
    self.pos = nnx.Param(
      nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_len, cfg.embed_dim), kw['param_dtype']),
      **axes('length', 'embed'),
    )
    self.blocks = Stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, **stack_options(cfg), rngs=rngs)
    self.ln_f = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.max_len = cfg.max_len
    self.dtype = kw['dtype']
    self.loss_chunks = loss_chunks(cfg)

  def __call__(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> jax.Array:
    return self.head(self.hidden_states(tokens_BL, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL))

  def hidden_states(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> jax.Array:
    """The last block's output after the final LayerNorm, (B, L, D)."""
    L = tokens_BL.shape[1]
    if L > self.max_len:
      raise ConfigError(f'sequence length {L} exceeds the model max_len {self.max_len}')
    pos_LD = shard_logical(self.pos[...], (None, None))
    pos_BLD = pos_LD[:L][None] if positions_BL is None else jnp.take(pos_LD, positions_BL, axis=0)
    x_BLD = shard_logical(self.tok(tokens_BL) + pos_BLD.astype(self.dtype), ACT)
    x_BLD, _ = self.blocks(x_BLD, segment_ids_BL)
    return self.ln_f(x_BLD)

  def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache: Any, decoding: Any) -> tuple[jax.Array, Any]:
    """The last token's logits (B, V) and the KV cache with tokens_BT written into it (generation/engine.py)."""
    pos_BTD = table_rows(shard_logical(self.pos[...], (None, None)), positions_BT)
    x_BTD = shard_logical(self.tok(tokens_BT) + pos_BTD.astype(self.dtype), ACT)
    x_BTD, cache = self.blocks.decode(x_BTD, cache, decoding, None)
    return self.head(self.ln_f(x_BTD[:, -1:]))[:, 0], cache

  def head(self, x_BLD: jax.Array) -> jax.Array:
    """Hidden states (B, L, D) -> logits (B, L, V): the tied embedding, padded rows masked."""
    return shard_logical(self.tok.attend(x_BLD), ('batch', 'length', 'vocab'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, L, N = cfg.embed_dim, cfg.mlp_dim, cfg.max_len, cfg.num_layers
  V = padded_vocab(cfg)
  block = 2 * 2 * D + 4 * (D * D + D) + (D * F + F) + (F * D + D)
  return V * D + L * D + N * block + 2 * D


def _hf_config(c: dict) -> dict:
  """config.json -> config.model; settings the zoo's GPT-2 does not implement are an HFImportError naming them."""
  if c.get('activation_function', 'gelu_new') not in ('gelu_new', 'gelu_pytorch_tanh'):
    raise hf.HFImportError(
      f"config.json activation_function={c['activation_function']!r}: the zoo's GPT-2 uses the "
      'tanh-approximated GELU (gelu_new)'
    )
  for field, want, why in (
    ('scale_attn_weights', True, "the zoo's GPT-2 scales attention scores by 1 / sqrt(head_dim) only"),
    ('scale_attn_by_inverse_layer_idx', False, "the zoo's GPT-2 scales attention scores by 1 / sqrt(head_dim) only"),
    ('add_cross_attention', False, "the zoo's GPT-2 is a decoder without cross-attention"),
    (
      'tie_word_embeddings',
      True,
      "the zoo's GPT-2 ties its head to the token embedding (wte); an untied lm_head cannot be imported",
    ),
  ):
    if c.get(field, want) != want:
      raise hf.HFImportError(f'config.json {field}={c[field]!r}: {why}')
  return dict(
    vocab_size=c['vocab_size'],
    max_len=c['n_positions'],
    num_layers=c['n_layer'],
    num_heads=c['n_head'],
    embed_dim=c['n_embd'],
    mlp_dim=c.get('n_inner') or 4 * c['n_embd'],
    norm_eps=c['layer_norm_epsilon'],
  )


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same GPT2LMHeadModel (the inverse of _hf_config): the real
  vocabulary (not the padded rows), the tied head, and no dropout (the zoo has none)."""
  return dict(
    model_type='gpt2',
    architectures=['GPT2LMHeadModel'],
    vocab_size=cfg.vocab_size,
    n_positions=cfg.max_len,
    n_layer=cfg.num_layers,
    n_head=cfg.num_heads,
    n_embd=cfg.embed_dim,
    n_inner=cfg.mlp_dim,
    activation_function='gelu_new',
    layer_norm_epsilon=cfg.norm_eps,
    tie_word_embeddings=True,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=None,
    eos_token_id=None,
  )  # the tokenizer's business (GPT2Config's 50256 may not exist)


def _hf_params() -> list[hf.Param]:
  """GPT-2's Conv1D weights are stored (in, out); c_attn fuses q|k|v along out."""

  def qkv(part: int, bias: bool):
    def ops(cfg):
      D, H = cfg.embed_dim, cfg.num_heads
      return [
        hf.Slice(0 if bias else 1, part * D, (part + 1) * D),
        hf.R((H, D // H), (D,)) if bias else hf.R((D, H, D // H), (D, D)),
      ]

    return ops

  rows = [
    hf.Param('tok/embed/embedding', 'wte.weight', lambda cfg: [hf.Pad(0, padded_vocab(cfg), cfg.vocab_size)]),
    hf.Param('pos', 'wpe.weight'),
    hf.Param('ln_f/scale', 'ln_f.weight'),
    hf.Param('ln_f/bias', 'ln_f.bias'),
    hf.Param(
      'blocks/layers/{i}/attn/out/layer/kernel',
      'h.{i}.attn.c_proj.weight',
      lambda cfg: [hf.R((cfg.num_heads, cfg.embed_dim // cfg.num_heads, cfg.embed_dim), (cfg.embed_dim,) * 2)],
    ),
    hf.Param('blocks/layers/{i}/attn/out/layer/bias', 'h.{i}.attn.c_proj.bias'),
    hf.Param('blocks/layers/{i}/mlp/up/layer/kernel', 'h.{i}.mlp.c_fc.weight'),
    hf.Param('blocks/layers/{i}/mlp/up/layer/bias', 'h.{i}.mlp.c_fc.bias'),
    hf.Param('blocks/layers/{i}/mlp/down/layer/kernel', 'h.{i}.mlp.c_proj.weight'),
    hf.Param('blocks/layers/{i}/mlp/down/layer/bias', 'h.{i}.mlp.c_proj.bias'),
  ]
  for ours, theirs in (('ln1', 'ln_1'), ('ln2', 'ln_2')):
    rows += [
      hf.Param(f'blocks/layers/{{i}}/{ours}/scale', f'h.{{i}}.{theirs}.weight'),
      hf.Param(f'blocks/layers/{{i}}/{ours}/bias', f'h.{{i}}.{theirs}.bias'),
    ]
  for part, name in enumerate(('query', 'key', 'value')):
    rows += [
      hf.Param(f'blocks/layers/{{i}}/attn/{name}/layer/kernel', 'h.{i}.attn.c_attn.weight', qkv(part, False)),
      hf.Param(f'blocks/layers/{{i}}/attn/{name}/layer/bias', 'h.{i}.attn.c_attn.bias', qkv(part, True)),
    ]
  return rows


# Ignored: the causal-mask buffers. A file's lm_head.weight (GPT2LMHeadModel leaves it out) must be a copy of wte.
HF = hf.Family(
  model_types=('gpt2',),
  config=_hf_config,
  params=_hf_params(),
  prefixes=('transformer.', ''),
  ignore=(r'\.attn\.(masked_)?bias$',),
  tied=(('lm_head.weight', 'wte.weight'),),
  to_config=to_hf_config,
)
