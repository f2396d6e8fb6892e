"""Llama: decoder-only LM with RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP.

Parameters follow Hugging Face's LlamaForCausalLM, so weights can be imported by renaming:
embed_tokens, blocks.layers.N.{input_layernorm, self_attn.{query, key, value, out} (q/k/v/o_proj),
post_attention_layernorm, mlp.{gate, up, down}_proj}, norm, lm_head (absent when tie_embeddings).
HF's Linear weights are (out, in); ours are (in, ...) with heads split out, e.g. q_proj (H*K, D) is
query (D, H, K). Rotary embeddings use HF's rotate_half convention, so no permutation is needed.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models.layers import Attention, Dense, Embed, GatedMLP, RMSNorm, Stack, dtypes
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')


class Block(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dict(**dtypes(cfg), rngs=rngs)
    D = cfg.embed_dim
    self.input_layernorm = RMSNorm(D, eps=cfg.norm_eps, **kw)
    self.self_attn = Attention(D, cfg.num_heads, num_kv_heads=cfg.get('num_kv_heads'), head_dim=cfg.get('head_dim'),
                               use_bias=False, rope_theta=cfg.get('rope_theta', 10_000.0), **kw)
    self.post_attention_layernorm = RMSNorm(D, eps=cfg.norm_eps, **kw)
    self.mlp = GatedMLP(D, cfg.mlp_dim, **kw)

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array | None,
               segment_ids_BL: jax.Array | None) -> jax.Array:
    h_BLD = self.self_attn(self.input_layernorm(x_BLD), causal=True, positions_BL=positions_BL,
                           segment_ids_BL=segment_ids_BL)
    x_BLD = shard_logical(x_BLD + h_BLD, ACT)
    return shard_logical(x_BLD + self.mlp(self.post_attention_layernorm(x_BLD)), ACT)


class Llama(nnx.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32. Packed rows: pass positions and segment_ids
  (rotary angles come from the positions, so each document starts at position 0)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    D, V = cfg.embed_dim, cfg.vocab_size
    self.embed_tokens = Embed(V, D, **kw, rngs=rngs)
    self.blocks = Stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, scan=cfg.get('scan_layers', False),
                        remat=cfg.get('remat', False), rngs=rngs)
    self.norm = RMSNorm(D, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.tied = cfg.get('tie_embeddings', True)
    if not self.tied:
      self.lm_head = Dense('bld,dv->blv', (D, V), ('embed', 'vocab'), preferred_element_type=jnp.float32,
                           **kw, rngs=rngs)

  def __call__(self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None,
               segment_ids_BL: jax.Array | None = None) -> jax.Array:
    x_BLD = shard_logical(self.embed_tokens(tokens_BL), ACT)
    x_BLD, _ = self.blocks(x_BLD, positions_BL, segment_ids_BL)
    x_BLD = self.norm(x_BLD)
    logits_BLV = self.embed_tokens.attend(x_BLD) if self.tied else self.lm_head(x_BLD)
    return shard_logical(logits_BLV, ('batch', 'length', 'vocab'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, V, N, H = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.num_layers, cfg.num_heads
  G = getattr(cfg, 'num_kv_heads', None) or H
  K = getattr(cfg, 'head_dim', None) or D // H
  block = 2 * D + 2 * D * H * K + 2 * D * G * K + 3 * D * F  # 2 RMSNorms, q+o, k+v, gate+up+down
  head = 0 if getattr(cfg, 'tie_embeddings', True) else D * V
  return V * D + N * block + D + head
