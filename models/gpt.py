"""GPT-style decoder-only language model (pre-norm, learned positions, GELU MLP, tied embeddings)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models.layers import MLP, Attention, Embed, LayerNorm, axes
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')


class Block(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
    scale = (2 * cfg.num_layers) ** -0.5  # GPT-2's scaled init of residual projections
    self.ln1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.attn = Attention(cfg.embed_dim, cfg.num_heads, out_init_scale=scale, **kw)
    self.ln2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, out_init_scale=scale, **kw)

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x_BLD = shard_logical(x_BLD + self.attn(self.ln1(x_BLD), causal=True), ACT)
    return shard_logical(x_BLD + self.mlp(self.ln2(x_BLD)), ACT)


class GPT(nnx.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.tok = Embed(cfg.vocab_size, cfg.embed_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.pos = nnx.Param(nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_len, cfg.embed_dim), param_dtype),
                         **axes('length', 'embed'))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.ln_f = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.max_len = cfg.max_len
    self.dtype = dtype

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    L = tokens_BL.shape[1]
    if L > self.max_len:
      raise ValueError(f'sequence length {L} exceeds the model max_len {self.max_len}')
    x_BLD = self.tok(tokens_BL) + self.pos[:L].astype(self.dtype)
    x_BLD = shard_logical(x_BLD, ACT)
    for block in self.blocks:
      x_BLD = block(x_BLD)
    logits_BLV = self.tok.attend(self.ln_f(x_BLD))
    return shard_logical(logits_BLV, ('batch', 'length', 'vocab'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, V, L, N = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.max_len, cfg.num_layers
  block = 2 * 2 * D + 4 * (D * D + D) + (D * F + F) + (F * D + D)
  return V * D + L * D + N * block + 2 * D
