"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

  q = q_b(norm(q_a(x)))  (or q_proj(x) without q_lora_rank)   -> per head [nope (qk_nope_head_dim) | rope]
  c = norm(kv_a(x))      the latent, kv_lora_rank wide, shared by every head
  k_rope = rope(k_rope_proj(x))   one rotary key (qk_rope_head_dim) shared by every head
  [k_nope | v] = kv_b(c) per head;  k = [k_nope | k_rope],  q = [q_nope | rope(q_rope)]

Training and the prompt run ordinary attention over the expanded keys and values (attention.attend: v padded to
the q/k head dim, so every kernel takes it, and cut after). Decoding caches what the layer needs and no more: the
latent c and the rotary key, (B, 1, S, kv_lora_rank) and (B, 1, S, qk_rope_head_dim), in place of H full keys
and values; each step absorbs kv_b into the query and the output (DeepSeek's `attn_impl="absorb"`):
scores = (q_nope W_uk) . c + q_rope . k_rope, out = (p . c) W_uv, so nothing H-wide over S is ever built.

Logical axes: 'q_lora' and 'kv_lora' name the latent dims (rules may shard them like 'mlp'); 'heads' and 'kv' as
in models/layers.Attention. Parameter names follow DeepSeek's checkpoints (q_a_proj, q_a_layernorm, q_b_proj or
q_proj, kv_a_proj, k_rope_proj, kv_a_layernorm, kv_b_proj, o_proj); kv_a_proj_with_mqa is the first two
side by side in the checkpoint (models/moe.py's table slices it).

Shape suffixes: B batch, L length, T new tokens, S cache slots, H heads, R kv_lora_rank, Q q_lora_rank,
N qk_nope_head_dim, P qk_rope_head_dim, K N + P, V v_head_dim, D embed.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models import attention
from models.layers import CACHE_AXES, Decoding, Dense, RMSNorm, rope, rope_scaling_params, write_slots
from partitioning import shard_logical

CACHE_NAMES = ('latent', 'rope_key')  # a layer's cache: the normed latent c and the rotary key
LATENT_NORM_EPS = 1e-6  # the latents' RMSNorms take DeepSeek's default, not config.json's rms_norm_eps


def _mscale(factor: float, mscale: float) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: Any) -> float:
  """(qk_nope_head_dim + qk_rope_head_dim)^-1/2, times yarn's mscale(mscale_all_dim)^2 where the rotary scaling
  is yarn with mscale_all_dim (DeepSeek-V3's yarn_apply_mscale)."""
  scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
  s = dict(rope_scaling_params(cfg.rope_scaling) or ())
  if s.get('rope_type') == 'yarn' and s.get('mscale_all_dim'):
    scale *= _mscale(s['factor'], s['mscale_all_dim']) ** 2
  return scale


def deinterleave(x: jax.Array) -> jax.Array:
  """DeepSeek's rotary dims come in (x0, x1) pairs: evens then odds, so rotate_half's rope rotates each pair (what
  transformers' apply_rotary_pos_emb_interleave computes; q and k are permuted alike, so their products are not)."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLA(nnx.Module):
  """Multi-head latent attention; called like models/layers.Attention (a decoder block's self_attn)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    D, H = cfg.embed_dim, cfg.num_heads
    R, P, N, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm = lambda n, name: RMSNorm(n, eps=LATENT_NORM_EPS, names=(name,), **kw)
    Q = cfg.q_lora_rank
    if Q is None:
      self.q_proj = Dense('bld,dhk->blhk', (D, H, N + P), ('embed', 'heads', 'kv'), **kw)
    else:
      self.q_a_proj = Dense('bld,dq->blq', (D, Q), ('embed', 'q_lora'), **kw)
      self.q_a_layernorm = norm(Q, 'q_lora')
      self.q_b_proj = Dense('blq,qhk->blhk', (Q, H, N + P), ('q_lora', 'heads', 'kv'), **kw)
    self.kv_a_proj = Dense('bld,dr->blr', (D, R), ('embed', 'kv_lora'), **kw)
    self.k_rope_proj = Dense('bld,dp->blp', (D, P), ('embed', 'kv'), **kw)
    self.kv_a_layernorm = norm(R, 'kv_lora')
    self.kv_b_proj = Dense('blr,rhk->blhk', (R, H, N + V), ('kv_lora', 'heads', 'kv'), **kw)
    self.o_proj = Dense('blhv,hvd->bld', (H, V, D), ('heads', 'kv', 'embed'), **kw)
    self.dims = (H, R, N, P, V)
    self.rope_theta, self.rope_scaling = cfg.rope_theta, rope_scaling_params(cfg.rope_scaling)
    self.interleave, self.impl, self.dtype = cfg.rope_interleave, cfg.attention, dtype
    self.logits = attention.Logits(scale=softmax_scale(cfg))

  def _rope(self, x: jax.Array, positions_BL: jax.Array) -> jax.Array:
    return rope(deinterleave(x) if self.interleave else x, positions_BL, self.rope_theta, self.rope_scaling)

  def __call__(
    self,
    x_BLD: jax.Array,
    *,
    causal: bool,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    window: int | None = None,
    rotary: Any = None,
    cache: tuple[jax.Array, jax.Array] | None = None,
    decoding: Decoding | None = None,
  ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """x (B, L, D) -> (B, L, D); with `cache` (this layer's latent and rotary key, (B, 1, S, R) and (B, 1, S, P))
    and `decoding`: the new tokens' written into it, and (output, cache) returned."""
    if window is not None or rotary is not None:
      raise ValueError('multi-head latent attention has no sliding window or per-layer rotary base')
    H, R, N, P, V = self.dims
    B, L, _ = x_BLD.shape
    if positions_BL is None:
      positions_BL = jnp.arange(L)[None]
    if hasattr(self, 'q_proj'):
      q_BLHK = self.q_proj(x_BLD)
    else:
      q_BLHK = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BLD)))
    q_BLHK = shard_logical(q_BLHK, ('batch', 'length', 'heads', 'kv'))
    q_nope_BLHN, q_rope_BLHP = q_BLHK[..., :N], self._rope(q_BLHK[..., N:], positions_BL)
    c_BLR = shard_logical(self.kv_a_layernorm(self.kv_a_proj(x_BLD)), ('batch', 'length', 'kv_lora'))
    k_rope_BL1P = self._rope(self.k_rope_proj(x_BLD)[:, :, None, :], positions_BL)
    if cache is not None and not decoding.prefill:
      return self._absorbed(q_nope_BLHN, q_rope_BLHP, c_BLR, k_rope_BL1P, cache, decoding)
    kv_BLHK = shard_logical(self.kv_b_proj(c_BLR), ('batch', 'length', 'heads', 'kv'))
    k_BLHK = jnp.concatenate([kv_BLHK[..., :N], jnp.broadcast_to(k_rope_BL1P, (B, L, H, P))], axis=-1)
    v_BLHK = jnp.pad(kv_BLHK[..., N:], ((0, 0), (0, 0), (0, 0), (0, N + P - V)))  # one head dim for the kernels
    q_BLHK = jnp.concatenate([q_nope_BLHN, q_rope_BLHP], axis=-1)
    valid_BL = None if cache is None else decoding.valid_BS[:, :L]
    o_BLHK = attention.attend(
      q_BLHK,
      k_BLHK,
      v_BLHK,
      causal=causal,
      impl=self.impl,
      segment_ids_BL=segment_ids_BL,
      valid_BL=valid_BL,
      logits=self.logits,
    )
    out_BLD = self.o_proj(shard_logical(o_BLHK[..., :V], ('batch', 'length', 'heads', 'kv')))
    if cache is None:
      return out_BLD
    return out_BLD, self._write(cache, c_BLR, k_rope_BL1P, decoding)

  def _write(self, cache, c_BTR, k_rope_BT1P, d: Decoding) -> tuple[jax.Array, jax.Array]:
    """The new tokens' latents and rotary keys into their slots [index, index + T) (every row the same slots)."""
    put = lambda c, x: shard_logical(write_slots(c, x.astype(c.dtype), d.index, axis=2), CACHE_AXES)
    return put(cache[0], c_BTR[:, None]), put(cache[1], k_rope_BT1P.transpose(0, 2, 1, 3))

  def _absorbed(self, q_nope_BTHN, q_rope_BTHP, c_BTR, k_rope_BT1P, cache, d: Decoding):
    """A decode step against the cached latents: kv_b absorbed into the query (q_nope W_uk: R wide per head) and
    the output (p . c, then W_uv); softmax in float32 over the real slots up to each query."""
    H, R, N, P, V = self.dims
    T = q_nope_BTHN.shape[1]
    c_cache, k_cache = self._write(cache, c_BTR, k_rope_BT1P, d)
    S = c_cache.shape[2]
    dt = q_nope_BTHN.dtype
    w_RHK = self.kv_b_proj.layer.kernel[...].astype(dt)
    q_lat_BTHR = jnp.einsum('bthn,rhn->bthr', q_nope_BTHN, w_RHK[..., :N])
    with jax.named_scope('attention'):
      s_BHTS = jnp.einsum('bthr,bsr->bhts', q_lat_BTHR, c_cache[:, 0].astype(dt), preferred_element_type=jnp.float32)
      s_BHTS += jnp.einsum(
        'bthp,bsp->bhts', q_rope_BTHP.astype(dt), k_cache[:, 0].astype(dt), preferred_element_type=jnp.float32
      )
      s_BHTS = s_BHTS * self.logits.scale_for(N + P)
      seen_TS = jnp.arange(S)[None, :] <= (d.index + jnp.arange(T))[:, None]
      mask_BTS = d.valid_BS[:, None, :] & seen_TS[None]
      s_BHTS = jnp.where(mask_BTS[:, None], s_BHTS, jnp.finfo(jnp.float32).min)
      p_BHTS = jax.nn.softmax(s_BHTS, axis=-1).astype(dt)
      o_lat_BTHR = jnp.einsum('bhts,bsr->bthr', p_BHTS, c_cache[:, 0].astype(dt))
    o_BTHV = jnp.einsum('bthr,rhv->bthv', o_lat_BTHR, w_RHK[..., N:])
    return self.o_proj(shard_logical(o_BTHV, ('batch', 'length', 'heads', 'kv'))), (c_cache, k_cache)


def num_params(cfg: Any) -> int:
  """One MLA layer's parameters (with its norms)."""
  D, H = cfg.embed_dim, cfg.num_heads
  R, P, N, V, Q = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
  q = D * H * (N + P) if Q is None else D * Q + Q + Q * H * (N + P)
  return q + D * (R + P) + R + R * H * (N + V) + H * V * D
