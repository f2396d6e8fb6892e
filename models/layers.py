"""Layers shared by the zoo. Every parameter carries logical axis names; nothing names a mesh axis.

Shape suffixes: B batch, L length, D embed, H heads, K head dim (kv), F mlp, V vocab.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from partitioning import ConfigError, shard_logical

Initializer = Callable[..., jax.Array]
NORMAL_002 = nnx.initializers.normal(0.02)  # GPT-2's initialiser for kernels and embeddings


def axes(*names: str) -> Mapping[str, Any]:
  """Variable metadata naming logical axes. Eager sharding is off: names are resolved by our rules."""
  return {'out_sharding': tuple(names), 'eager_sharding': False}


class Dense(nnx.Module):
  """y = einsum(x, kernel) + bias over named axes, e.g. Dense('bld,dhk->blhk', (D,H,K), ('embed','heads','kv'))."""

  def __init__(self, einsum: str, kernel_shape: Sequence[int], kernel_axes: Sequence[str], *,
               bias_axes: Sequence[str] | None = None, kernel_init: Initializer = NORMAL_002,
               dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    bias_shape = None
    if bias_axes is not None:
      out = einsum.split('->')[1]
      w = einsum.split('->')[0].split(',')[1]
      bias_shape = tuple(kernel_shape[w.index(c)] for c in out if c in w)
      assert len(bias_shape) == len(bias_axes), (einsum, bias_axes)
    self.layer = nnx.Einsum(
        einsum, tuple(kernel_shape), bias_shape, dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=nnx.initializers.zeros, rngs=rngs,
        kernel_metadata=axes(*kernel_axes), bias_metadata=axes(*(bias_axes or ())))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.layer(x)


class LayerNorm(nnx.LayerNorm):
  def __init__(self, dim: int, *, eps: float = 1e-5, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    super().__init__(dim, epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                     scale_metadata=axes('norm'), bias_metadata=axes('norm'))


class Embed(nnx.Module):
  """Token embedding ('vocab', 'embed'); `attend` gives float32 logits (tied output head)."""

  def __init__(self, vocab: int, dim: int, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=NORMAL_002, rngs=rngs,
                           embedding_metadata=axes('vocab', 'embed'))
    self.dtype = dtype

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    # Gather the table's embed dim first (as FSDP does for every weight): a lookup into a table
    # sharded on embed cannot produce batch-sharded rows without a full rematerialisation.
    w_VD = shard_logical(self.embed.embedding[...], ('vocab', None))
    return jnp.take(w_VD, tokens_BL, axis=0).astype(self.dtype)

  def attend(self, x_BLD: jax.Array) -> jax.Array:
    w_VD = self.embed.embedding[...].astype(self.dtype)
    return jnp.einsum('bld,vd->blv', x_BLD.astype(self.dtype), w_VD, preferred_element_type=jnp.float32)


class Attention(nnx.Module):
  """Multi-head self-attention with (embed, heads, kv) projections."""

  def __init__(self, dim: int, num_heads: int, *, out_init_scale: float = 1.0, use_bias: bool = True,
               dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    if dim % num_heads:
      raise ConfigError(f'embed_dim {dim} is not divisible by num_heads {num_heads}')
    k = dim // num_heads
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bias = ('heads', 'kv') if use_bias else None
    self.query = Dense('bld,dhk->blhk', (dim, num_heads, k), ('embed', 'heads', 'kv'), bias_axes=bias, **kw)
    self.key = Dense('bld,dhk->blhk', (dim, num_heads, k), ('embed', 'heads', 'kv'), bias_axes=bias, **kw)
    self.value = Dense('bld,dhk->blhk', (dim, num_heads, k), ('embed', 'heads', 'kv'), bias_axes=bias, **kw)
    self.out = Dense('blhk,hkd->bld', (num_heads, k, dim), ('heads', 'kv', 'embed'),
                     bias_axes=('embed',) if use_bias else None,
                     kernel_init=nnx.initializers.normal(0.02 * out_init_scale), **kw)

  def __call__(self, x_BLD: jax.Array, *, causal: bool) -> jax.Array:
    names = ('batch', 'length', 'heads', 'kv')
    q_BLHK = shard_logical(self.query(x_BLD), names)
    k_BLHK = shard_logical(self.key(x_BLD), names)
    v_BLHK = shard_logical(self.value(x_BLD), names)
    o_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, is_causal=causal)
    o_BLHK = shard_logical(o_BLHK, names)
    return self.out(o_BLHK)


class MLP(nnx.Module):
  """Two-layer feed-forward block, D -> F -> D."""

  def __init__(self, dim: int, hidden: int, *, activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
               out_init_scale: float = 1.0, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.up = Dense('bld,df->blf', (dim, hidden), ('embed', 'mlp'), bias_axes=('mlp',), **kw)
    self.down = Dense('blf,fd->bld', (hidden, dim), ('mlp', 'embed'), bias_axes=('embed',),
                      kernel_init=nnx.initializers.normal(0.02 * out_init_scale), **kw)
    self.activation = activation

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    h_BLF = shard_logical(self.activation(self.up(x_BLD)), ('batch', 'length', 'mlp'))
    return self.down(h_BLF)
