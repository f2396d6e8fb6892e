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

from models.layers import MLP, Attention, Embed, LayerNorm, Stack, axes, dtypes
from partitioning import ConfigError, shard_logical

ACT = ('batch', 'length', 'embed')


class Block(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dict(**dtypes(cfg), rngs=rngs)
    scale = (2 * cfg.num_layers) ** -0.5  # GPT-2's scaled init of residual projections
    self.ln1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.attn = Attention(cfg.embed_dim, cfg.num_heads, out_init_scale=scale, **kw)
    self.ln2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    # HF's "gelu_new" is the tanh approximation, jax.nn.gelu's default.
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, activation=jax.nn.gelu, out_init_scale=scale, **kw)

  def __call__(self, x_BLD: jax.Array, segment_ids_BL: jax.Array | None) -> jax.Array:
    h_BLD = self.attn(self.ln1(x_BLD), causal=True, segment_ids_BL=segment_ids_BL)
    x_BLD = shard_logical(x_BLD + h_BLD, ACT)
    return shard_logical(x_BLD + self.mlp(self.ln2(x_BLD)), ACT)


class GPT2(nnx.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32. Packed rows: pass positions and segment_ids."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    self.tok = Embed(cfg.vocab_size, cfg.embed_dim, pad_to=cfg.get('pad_vocab_to', 1), **kw, rngs=rngs)
    self.pos = nnx.Param(nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_len, cfg.embed_dim),
                                                       kw['param_dtype']), **axes('length', 'embed'))
    self.blocks = Stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, scan=cfg.get('scan_layers', False),
                        remat=cfg.get('remat', False), rngs=rngs)
    self.ln_f = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.max_len = cfg.max_len
    self.dtype = kw['dtype']

  def __call__(self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None,
               segment_ids_BL: jax.Array | None = None) -> jax.Array:
    L = tokens_BL.shape[1]
    if L > self.max_len:
      raise ConfigError(f'sequence length {L} exceeds the model max_len {self.max_len}')
    pos_LD = shard_logical(self.pos[...], (None, None))
    pos_BLD = pos_LD[:L][None] if positions_BL is None else jnp.take(pos_LD, positions_BL, axis=0)
    x_BLD = shard_logical(self.tok(tokens_BL) + pos_BLD.astype(self.dtype), ACT)
    x_BLD, _ = self.blocks(x_BLD, segment_ids_BL)
    logits_BLV = self.tok.attend(self.ln_f(x_BLD))
    return shard_logical(logits_BLV, ('batch', 'length', 'vocab'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, L, N = cfg.embed_dim, cfg.mlp_dim, cfg.max_len, cfg.num_layers
  pad = getattr(cfg, 'pad_vocab_to', 1) or 1
  V = -(-cfg.vocab_size // pad) * pad
  block = 2 * 2 * D + 4 * (D * D + D) + (D * F + F) + (F * D + D)
  return V * D + L * D + N * block + 2 * D
