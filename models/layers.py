"""Layers shared by the zoo. Every parameter carries logical axis names; nothing names a mesh axis.

Shape suffixes: B batch, L length, D embed, H heads, K head dim (kv), F mlp, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from configs import schema
from errors import ConfigError
from models import attention, kernels
from partitioning import pipeline, rule_problem, shard_logical

Initializer = Callable[..., jax.Array]
NORMAL_002 = nnx.initializers.normal(0.02)  # GPT-2's initialiser for kernels and embeddings


def axes(*names: str) -> Mapping[str, Any]:
  """Variable metadata naming logical axes. Eager sharding is off: names are resolved by our rules."""
  return {'out_sharding': tuple(names), 'eager_sharding': False}


def wide_einsum(
  spec: str,
  x: jax.Array,
  w: jax.Array,
  *,
  preferred_element_type: Any = None,
  precision: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  """jnp.einsum of two operands; where `preferred_element_type` is wider than the operands (bf16 compute with
  float32 output heads) the forward returns the wide type but the backward pass stays in the operands' dtype.

  Plain autodiff would transpose the einsum with the float32 cotangent against a bf16 operand, which XLA
  upcasts: two float32 (TF32) GEMMs, a large share of a big-vocabulary head's step. In bf16 (float32 accumulation
  inside the GEMM, as torch autocast runs it) they are several times faster. The cotangent is rounded to bf16
  first; the gradients were rounded to the operands' dtype before anyway."""
  if out_sharding is None and precision is None:  # a decode step's matmul on one CPU device (models/kernels)
    fast = kernels.matmul(spec, x, w, preferred_element_type or jnp.result_type(x, w))
    if fast is not None:
      return fast
  wide = preferred_element_type is not None and jnp.dtype(preferred_element_type).itemsize > max(
    jnp.dtype(x.dtype).itemsize, jnp.dtype(w.dtype).itemsize
  )
  if not wide or out_sharding is not None or precision is not None:
    kw = {} if out_sharding is None else {'out_sharding': out_sharding}
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type, precision=precision, **kw)
  return _narrow_grad_einsum(spec, jnp.dtype(preferred_element_type), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _narrow_grad_einsum(spec: str, out_dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _narrow_grad_einsum_fwd(spec, out_dtype, x, w):
  return _narrow_grad_einsum(spec, out_dtype, x, w), (x, w)


def _narrow_grad_einsum_bwd(spec, out_dtype, residuals, g):
  x, w = residuals
  _, vjp = jax.vjp(functools.partial(jnp.einsum, spec), x, w)
  return vjp(g.astype(jnp.result_type(x, w)))


_narrow_grad_einsum.defvjp(_narrow_grad_einsum_fwd, _narrow_grad_einsum_bwd)


class Dense(nnx.Module):
  """y = einsum(x, kernel) + bias over named axes, e.g. Dense('bld,dhk->blhk', (D,H,K), ('embed','heads','kv')).

  preferred_element_type=jnp.float32 accumulates and returns float32 under bf16 compute (output heads); its
  backward pass runs in the compute dtype (wide_einsum).
  """

  def __init__(
    self,
    einsum: str,
    kernel_shape: Sequence[int],
    kernel_axes: Sequence[str],
    *,
    bias_axes: Sequence[str] | None = None,
    kernel_init: Initializer = NORMAL_002,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    preferred_element_type: Any = None,
    rngs: nnx.Rngs,
  ):
    bias_shape = None
    if bias_axes is not None:
      out = einsum.split('->')[1]
      w = einsum.split('->')[0].split(',')[1]
      bias_shape = tuple(kernel_shape[w.index(c)] for c in out if c in w)
      assert len(bias_shape) == len(bias_axes), (einsum, bias_axes)
    self.layer = nnx.Einsum(
      einsum,
      tuple(kernel_shape),
      bias_shape,
      dtype=dtype,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      bias_init=nnx.initializers.zeros,
      preferred_element_type=preferred_element_type,
      einsum_op=wide_einsum,
      rngs=rngs,
      kernel_metadata=axes(*kernel_axes),
      bias_metadata=axes(*(bias_axes or ())),
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.layer(x)


def project(denses: Sequence[Dense], x: jax.Array) -> list[jax.Array]:
  """[d(x) for d in denses]; in a decode step of a few rows on one CPU device (models/kernels), plain Dense layers of
  one einsum and dtype take one kernel call between them (kernels.matmuls), with the same values. A subclass (LoRA's)
  runs its own call."""
  if not kernels.active():
    return [d(x) for d in denses]
  layers = [d.layer for d in denses]
  same = {(e.einsum_str.replace(' ', ''), e.dtype, e.preferred_element_type, e.precision) for e in layers}
  if all(type(d) is Dense for d in denses) and len(same) == 1 and layers[0].precision is None:
    spec = next(iter(same))[0]
    promoted = [
      e.promote_dtype((x, e.kernel[...], e.bias[...] if e.bias is not None else None), dtype=e.dtype) for e in layers
    ]
    xp, w0 = promoted[0][:2]
    out_dtype = layers[0].preferred_element_type or jnp.result_type(xp, w0)
    if (ys := kernels.matmuls(spec, xp, [w for _, w, _ in promoted], out_dtype)) is not None:
      # each bias added as nnx.Einsum adds it
      return [
        y if b is None else y + jnp.reshape(b, e._infer_broadcasted_bias_shape(spec, xp, w))
        for e, y, (_, w, b) in zip(layers, ys, promoted)
      ]
  return [d(x) for d in denses]


class LayerNorm(nnx.LayerNorm):
  def __init__(
    self, dim: int, *, eps: float = 1e-5, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs
  ):
    super().__init__(
      dim,
      epsilon=eps,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      scale_metadata=axes('norm'),
      bias_metadata=axes('norm'),
    )


class BatchNorm(nnx.BatchNorm):
  """BatchNorm over the last (feature) axis; scale, bias and the running mean/var (nnx.BatchStat) are named
  'norm'. Under jit with the batch sharded, the batch statistics are global: XLA all-reduces them.
  The variance is two-pass, E[(x - mean)^2], unless `fast_variance` (one pass over x: E[x^2] - mean^2, which
  cancels badly when |mean| >> std; fine after a conv of normalised inputs, and one read of x fewer).

  `fused` (train mode): statistics, normalisation and the gradient by `batch_norm_train`'s own VJP, which
  reads the input and the output gradient once for both gradient sums; autodiff of flax's BatchNorm
  (`fused=False`) runs ~15 reductions per layer per step. Both give the same values.

  Train mode (the default) normalises with the batch statistics and updates the running averages;
  `nnx.view(model, use_running_average=True)` (training.tasks.eval_view) normalises with the averages.
  """

  def __init__(
    self,
    dim: int,
    *,
    momentum: float = 0.9,
    eps: float = 1e-5,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    fast_variance: bool = False,
    fused: bool = False,
    rngs: nnx.Rngs,
  ):
    super().__init__(
      dim,
      momentum=momentum,
      epsilon=eps,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      use_fast_variance=fast_variance,
      scale_metadata=axes('norm'),
      bias_metadata=axes('norm'),
    )
    for stat in (self.mean, self.var):
      stat.set_metadata(**axes('norm'))
    self.fused = fused

  def __call__(
    self,
    x: jax.Array,
    use_running_average: bool | None = None,
    *,
    mask: Any = None,
    then: Callable[[jax.Array], jax.Array] | None = None,
  ) -> jax.Array:
    """`then` (elementwise or pooling, e.g. ReLU and a max pool) is applied to the normalised output; fused, its
    input is not kept for the backward pass but recomputed from x (batch_norm_train)."""
    use_average = self.use_running_average if use_running_average is None else use_running_average
    if use_average or not self.fused or mask is not None or self.scale is None or self.bias is None:
      y = super().__call__(x, use_running_average=use_running_average, mask=mask)
      return y if then is None else then(y)
    y, mean, var = batch_norm_train(
      x,
      self.scale[...],
      self.bias[...],
      eps=self.epsilon,
      fast_variance=self.use_fast_variance,
      out_dtype=self.dtype or x.dtype,
      then=then,
    )
    m = self.momentum
    self.mean[...] = jax.lax.stop_gradient(m * self.mean[...] + (1 - m) * mean)
    self.var[...] = jax.lax.stop_gradient(m * self.var[...] + (1 - m) * var)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _batch_norm_train(x, scale, bias, eps, fast_variance, out_dtype, then):
  return _batch_norm_train_fwd(x, scale, bias, eps, fast_variance, out_dtype, then)[0]


def _normalise(x, mean, inv, scale, bias, out_dtype):
  return ((x.astype(jnp.float32) - mean) * (inv * scale.astype(jnp.float32)) + bias.astype(jnp.float32)).astype(
    out_dtype
  )


def _batch_norm_train_fwd(x, scale, bias, eps, fast_variance, out_dtype, then):
  axes_ = tuple(range(x.ndim - 1))
  x32 = x.astype(jnp.float32)
  mean = x32.mean(axes_)
  if fast_variance:  # one fusion reads x once for both sums
    var = jnp.maximum(0.0, jnp.square(x32).mean(axes_) - jnp.square(mean))
  else:
    var = jnp.square(x32 - mean).mean(axes_)
  inv = jax.lax.rsqrt(var + eps)
  y = _normalise(x, mean, inv, scale, bias, out_dtype)
  return (y if then is None else then(y), mean, var), (x, mean, inv, scale, bias)


def _batch_norm_train_bwd(eps, fast_variance, out_dtype, then, residuals, cotangents):
  """d/dx of (x - mean) * inv * scale + bias with the batch's mean and inv: with xhat = (x - mean) * inv and
  N rows, dx = scale * inv * (dy - (sum(dy) + xhat * sum(dy * xhat)) / N); both sums in one read of (x, dy).
  With `then`, dy is then's vjp at the normalised output, recomputed from x; an optimization barrier ties the
  recomputation to the cotangent, or XLA merges it into the forward pass (and keeps what it was to spare).
  The statistics outputs feed only the running averages (stop_gradient): their cotangents are zero."""
  x, mean, inv, scale, bias = residuals
  dy = cotangents[0]
  if then is not None:
    (x_, mean_, inv_), dy = jax.lax.optimization_barrier(((x, mean, inv), dy))
    dy = jax.vjp(then, _normalise(x_, mean_, inv_, scale, bias, out_dtype))[1](dy)[0]
  dy = dy.astype(jnp.float32)
  axes_ = tuple(range(x.ndim - 1))
  n = x.size // x.shape[-1]
  xhat = (x.astype(jnp.float32) - mean) * inv
  sum_dy, sum_dy_xhat = dy.sum(axes_), (dy * xhat).sum(axes_)
  dx = (scale.astype(jnp.float32) * inv) * (dy - (sum_dy + xhat * sum_dy_xhat) / n)
  return dx.astype(x.dtype), sum_dy_xhat.astype(scale.dtype), sum_dy.astype(bias.dtype)


_batch_norm_train.defvjp(_batch_norm_train_fwd, _batch_norm_train_bwd)


def batch_norm_train(
  x: jax.Array,
  scale: jax.Array,
  bias: jax.Array,
  *,
  eps: float,
  fast_variance: bool,
  out_dtype: Any,
  then: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Train-mode BatchNorm over every axis but the last: (y in out_dtype, batch mean, batch variance), the
  statistics in float32. Its VJP is written out (BatchNorm's docstring); the statistics carry no gradient.

  `then(y)` is returned instead of y when given, and only x and the statistics are kept for the backward
  pass, which recomputes y: for ResNet's stem (ReLU then max pool), whose normalised output at full resolution
  is otherwise kept for the pool's gradient alone."""
  return _batch_norm_train(x, scale, bias, float(eps), bool(fast_variance), jnp.dtype(out_dtype), then)


def max_pool(x_BHWC: jax.Array, window: int, stride: int, pad: int) -> jax.Array:
  """Max pooling as the maximum of window**2 strided slices of the (-inf) padded input, equal to
  nnx.max_pool's values. Its gradient is written out from the input and the output alone: each window's
  output gradient goes to the inputs equal to its maximum, split evenly between ties, all in one elementwise
  pass that XLA fuses. reduce_window's gradient is a select_and_scatter (slow on GPUs), and autodiff of the
  slices' running maximum keeps every partial maximum and makes two masks per slice, written and read back.
  After a ReLU, ties are zeros, whose gradient the ReLU
  drops either way."""
  return _max_pool(x_BHWC, int(window), int(stride), int(pad))


def _pool_slices(x_BHWC, window, stride, pad):
  """(the padded input's shape, [((i, j), the window**2 strided slices of the padded input)])."""
  x = jnp.pad(x_BHWC, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=-jnp.inf)
  H = (x.shape[1] - window) // stride + 1
  W = (x.shape[2] - window) // stride + 1
  return x.shape, [
    ((i, j), x[:, i : i + stride * (H - 1) + 1 : stride, j : j + stride * (W - 1) + 1 : stride])
    for i in range(window)
    for j in range(window)
  ]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _max_pool(x_BHWC, window, stride, pad):
  _, slices = _pool_slices(x_BHWC, window, stride, pad)
  out = slices[0][1]
  for _, s in slices[1:]:
    out = jnp.maximum(out, s)
  return out


def _max_pool_fwd(x_BHWC, window, stride, pad):
  out = _max_pool(x_BHWC, window, stride, pad)
  return out, (x_BHWC, out)


def _max_pool_bwd(window, stride, pad, residuals, g_BHWC):
  x_BHWC, out = residuals
  H, W = out.shape[1:3]
  shape, slices = _pool_slices(x_BHWC, window, stride, pad)
  hits = [(at, s == out) for at, s in slices]
  g = g_BHWC.astype(jnp.float32) / sum(hit.astype(jnp.float32) for _, hit in hits)
  zero = jnp.zeros((), jnp.float32)
  dx = sum(
    jax.lax.pad(
      jnp.where(hit, g, zero),
      zero,
      (
        (0, 0, 0),
        (i, shape[1] - i - stride * (H - 1) - 1, stride - 1),
        (j, shape[2] - j - stride * (W - 1) - 1, stride - 1),
        (0, 0, 0),
      ),
    )
    for (i, j), hit in hits
  )
  return (dx[:, pad : shape[1] - pad, pad : shape[2] - pad].astype(x_BHWC.dtype),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


class Conv(nnx.Conv):
  """2-D convolution of NHWC images; kernel (height, width, in_axis, out_axis), bias (out_axis,)."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int,
    *,
    strides: int = 1,
    padding: Any = 'SAME',
    use_bias: bool = True,
    in_axis: str = 'conv_in',
    out_axis: str = 'conv_out',
    kernel_init: Initializer = nnx.initializers.he_normal(),
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    super().__init__(
      in_features,
      out_features,
      (kernel_size, kernel_size),
      strides=strides,
      padding=padding,
      use_bias=use_bias,
      kernel_init=kernel_init,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      kernel_metadata=axes('height', 'width', in_axis, out_axis),
      bias_metadata=axes(out_axis),
    )


def table_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """table[ids] (rows; an id outside the table: NaNs): inside models/kernels' decode_matmuls (a decode step, where
  nothing differentiates it) a 16-bit table's bytes are copied (kernels.take_rows says why); elsewhere jnp.take."""
  rows = kernels.take_rows(table, ids)
  return jnp.take(table, ids, axis=0) if rows is None else rows


class Embed(nnx.Module):
  """Token embedding ('vocab', 'embed'); `attend` gives logits (tied output head) in `logits_dtype`:
  float32 (default), or bfloat16 to halve the largest activation of a language model (the loss is still
  computed in float32, inside the fused softmax).

  `pad_to` rounds the table's rows up to a multiple (e.g. 128, so 'vocab' can be sharded: GPT-2's
  50257 is prime to every mesh size); padded rows are never looked up and their logits are masked.
  """

  def __init__(
    self,
    vocab: int,
    dim: int,
    *,
    pad_to: int = 1,
    embedding_init: Initializer = NORMAL_002,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    logits_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    rows = -(-vocab // pad_to) * pad_to
    self.embed = nnx.Embed(
      rows,
      dim,
      dtype=dtype,
      param_dtype=param_dtype,
      embedding_init=embedding_init,
      rngs=rngs,
      embedding_metadata=axes('vocab', 'embed'),
    )
    self.vocab_size = vocab
    self.dtype, self.logits_dtype = dtype, jnp.dtype(logits_dtype)

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    # Gather the table's embed dim first (as FSDP does for every weight): a lookup into a table
    # sharded on embed cannot produce batch-sharded rows without a full rematerialisation.
    w_VD = shard_logical(self.embed.embedding[...], ('vocab', None))
    return table_rows(w_VD, tokens_BL).astype(self.dtype)

  def attend(self, x_BLD: jax.Array, softcap: float | None = None) -> jax.Array:
    """Logits against the table (a tied head); `softcap`: softcap * tanh(logits / softcap) before the padded rows
    are masked (Gemma 2's final soft cap)."""
    w_VD = self.embed.embedding[...].astype(self.dtype)
    logits_BLV = wide_einsum('bld,vd->blv', x_BLD.astype(self.dtype), w_VD, preferred_element_type=self.logits_dtype)
    if softcap is not None:
      logits_BLV = softcap * jnp.tanh(logits_BLV / softcap)
    return mask_padded_vocab(logits_BLV, self.vocab_size)


def mask_padded_vocab(logits_BLV: jax.Array, vocab: int) -> jax.Array:
  """Padded vocabulary rows get -1e9 logits: no probability mass, no gradient."""
  if logits_BLV.shape[-1] == vocab:
    return logits_BLV
  if (masked := kernels.mask_columns(logits_BLV, vocab, -1e9)) is not None:  # a decode on one CPU device
    return masked
  return jnp.where(jnp.arange(logits_BLV.shape[-1]) < vocab, logits_BLV, -1e9)


# Rotary scalings (transformers' rope_type, and the keys of each): `rope_scaling_params` checks a setting against
# these and makes it hashable; `rope_frequencies` computes them as transformers' ROPE_INIT_FUNCTIONS do.
ROPE_SCALINGS = {
  'linear': (('factor',), ()),
  'llama3': (('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'), ()),
  'yarn': (
    ('factor', 'original_max_position_embeddings'),
    ('beta_fast', 'beta_slow', 'mscale', 'mscale_all_dim', 'attention_factor', 'truncate'),
  ),
  'longrope': (('short_factor', 'long_factor', 'original_max_position_embeddings'), ('factor', 'attention_factor')),
}
ROPE_SCALING_KEYS = ROPE_SCALINGS['llama3'][0]  # Llama 3's, the first the zoo took


def rope_scaling_params(scaling: Any) -> tuple[tuple[str, Any], ...] | None:
  """A rope scaling setting (None, a mapping, or a tuple of (key, value) pairs as configs hold it) checked and
  made hashable: (('rope_type', kind), (key, value), ...) with kind one of ROPE_SCALINGS ('linear', 'llama3',
  'yarn', 'longrope'), its required keys then the optional ones given, in ROPE_SCALINGS' order; numbers as floats,
  longrope's per-frequency factors as tuples. None (or rope_type 'default'): plain RoPE."""
  if scaling is None:
    return None
  items = dict(scaling.items() if hasattr(scaling, 'items') else scaling)
  kind = items.get('rope_type', items.get('type'))
  if kind in (None, 'default'):
    return None
  if kind not in ROPE_SCALINGS:
    raise ConfigError(f'rope_scaling rope_type={kind!r} is not supported; the zoo implements {sorted(ROPE_SCALINGS)}')
  required, optional = ROPE_SCALINGS[kind]
  missing = [k for k in required if items.get(k) is None]
  if missing:
    raise ConfigError(f'rope_scaling of type {kind!r} needs {list(required)}; missing {missing}')
  unknown = sorted(set(items) - {'rope_type', 'type', *required, *optional})
  if unknown:
    raise ConfigError(f'rope_scaling of type {kind!r} takes {list(required + optional)}; not {unknown}')
  if kind == 'llama3' and not items['high_freq_factor'] > items['low_freq_factor']:
    raise ConfigError(
      f'rope_scaling: high_freq_factor ({items["high_freq_factor"]}) must exceed low_freq_factor '
      f'({items["low_freq_factor"]})'
    )

  def value(k):
    v = items[k]
    if k == 'truncate':
      return bool(v)
    if isinstance(v, (list, tuple)):
      return tuple(float(x) for x in v)
    return float(v)

  return (('rope_type', kind),) + tuple((k, value(k)) for k in required + optional if items.get(k) is not None)


def rope_scaling_problem(scaling: Any) -> str:
  """What is wrong with a config.model.rope_scaling ('' if nothing): the schema's check of the field."""
  try:
    rope_scaling_params(scaling)
  except (ConfigError, TypeError, ValueError, AttributeError) as e:
    return str(e) or type(e).__name__
  return ''


schema.register_kind('rope', rope_scaling_problem)
# config.logical_axis_rules map the logical axes these layers name onto the mesh: partitioning's check of one rule's
# shape (AxisRules parses with it; partitioning never imports configs) is the schema's too, which names a bad rule
# of a config by its index.
schema.register_kind('rules', rule_problem)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: Any) -> float:
  """What yarn and longrope scale cos and sin by (so the logits by its square); 1 for the others. A given
  attention_factor is used as is; else yarn's from factor (and mscale / mscale_all_dim), longrope's
  sqrt(1 + ln factor / ln original_max_position_embeddings), as transformers computes them."""
  s = dict(rope_scaling_params(scaling) or ())
  if s.get('rope_type') not in ('yarn', 'longrope'):
    return 1.0
  if s.get('attention_factor') is not None:
    return s['attention_factor']
  factor = s.get('factor', 1.0)
  if s['rope_type'] == 'yarn':
    if s.get('mscale') and s.get('mscale_all_dim'):
      return _yarn_mscale(factor, s['mscale']) / _yarn_mscale(factor, s['mscale_all_dim'])
    return _yarn_mscale(factor)
  return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(s['original_max_position_embeddings']))


def rope_frequencies(head_dim: int, theta: float, scaling: Any = None, *, long: bool = False) -> jax.Array:
  """The (head_dim/2,) inverse frequencies, in float32 as transformers' ROPE_INIT_FUNCTIONS compute them:
  plain 1 / theta^(2i/K); 'linear' divides them by factor; 'llama3' stretches wavelengths longer than
  original_max_position_embeddings / low_freq_factor by factor, keeps those shorter than .../high_freq_factor and
  interpolates in between; 'yarn' blends interpolated (/ factor) and extrapolated frequencies over a ramp between
  the dims that turn beta_fast and beta_slow times in the original length; 'longrope' divides each frequency by
  its own factor, long_factor (`long`) or short_factor."""
  K = head_dim
  exponent_k = jnp.arange(0, K, 2, dtype=jnp.float32) / K
  inv_freq_k = 1.0 / (theta**exponent_k)
  scaling = rope_scaling_params(scaling)
  if scaling is None:
    return inv_freq_k
  s = dict(scaling)
  kind = s['rope_type']
  if kind == 'linear':
    return inv_freq_k / s['factor']
  if kind == 'longrope':
    factors_k = jnp.asarray(s['long_factor' if long else 'short_factor'], jnp.float32)
    if factors_k.shape != inv_freq_k.shape:
      raise ConfigError(f'rope_scaling longrope: {len(factors_k)} factors for a head_dim of {K} ({K // 2} frequencies)')
    return 1.0 / (factors_k * theta**exponent_k)
  if kind == 'yarn':
    factor, old_len = s['factor'], s['original_max_position_embeddings']
    beta_fast, beta_slow = s.get('beta_fast') or 32.0, s.get('beta_slow') or 1.0
    # the dim that turns `turns` times over the original length, as transformers' find_correction_dim
    dim_of = lambda turns: K * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get('truncate', True):
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, K - 1)
    high = high + 0.001 if low == high else high
    ramp_k = jnp.clip((jnp.arange(K // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolated_k = 1 - ramp_k
    pos_freqs_k = theta**exponent_k
    return (1.0 / (factor * pos_freqs_k)) * (1 - extrapolated_k) + (1.0 / pos_freqs_k) * extrapolated_k
  factor, low, high, old_len = (s[k] for k in ROPE_SCALING_KEYS)  # llama3
  wavelen_k = 2 * jnp.pi / inv_freq_k
  scaled_k = jnp.where(wavelen_k > old_len / low, inv_freq_k / factor, inv_freq_k)
  smooth_k = (old_len / wavelen_k - low) / (high - low)
  smoothed_k = (1 - smooth_k) * scaled_k / factor + smooth_k * scaled_k
  medium_k = (wavelen_k >= old_len / high) & (wavelen_k <= old_len / low)
  return jnp.where(medium_k, smoothed_k, scaled_k)


def rope(x_BLHK: jax.Array, positions_BL: jax.Array, theta: float, scaling: Any = None) -> jax.Array:
  """Rotary position embedding in the Hugging Face convention (rotate_half: pairs dims i and i + K/2).
  `scaling`: None (plain RoPE) or a rope scaling (rope_frequencies); yarn and longrope also scale cos and sin
  (rope_attention_factor). Longrope takes its long factors where the positions reach past
  original_max_position_embeddings (the largest position + 1 of the batch, as transformers decides per forward)."""
  K = x_BLHK.shape[-1]
  scaling = rope_scaling_params(scaling)
  inv_freq_k = rope_frequencies(K, theta, scaling)
  if scaling is not None and dict(scaling)['rope_type'] == 'longrope':
    long = jnp.max(positions_BL) + 1 > dict(scaling)['original_max_position_embeddings']
    inv_freq_k = jnp.where(long, rope_frequencies(K, theta, scaling, long=True), inv_freq_k)
  angles_BLk = positions_BL.astype(jnp.float32)[..., None] * inv_freq_k
  angles_BLK = jnp.concatenate([angles_BLk, angles_BLk], axis=-1)[:, :, None, :]
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  cos, sin = jnp.cos(angles_BLK), jnp.sin(angles_BLK)
  if (factor := rope_attention_factor(scaling)) != 1.0:
    cos, sin = cos * factor, sin * factor
  return (x * cos + rotated * sin).astype(x_BLHK.dtype)


# A layer's KV cache: keys and values (B, G, S, K) of every position decoded so far, in S slots; heads before slots:
# the layout a decode step's two attention matmuls take as operands (batch dims b, g leading), as transformers' cache.
# Its own logical names, so a rule set can place it apart from the projections' activations (generation/engine.py).
CACHE_AXES = ('cache_batch', 'cache_heads', 'cache_length', 'cache_kv')


@flax.struct.dataclass
class Decoding:
  """What every layer's cached attention shares at one decoding step (generation/engine.py): the tokens fed
  fill cache slots [index, index + T); `valid_BS` marks the slots of real tokens (a left-padded prompt's pads
  are not); `prefill`: the prompt, written from slot 0, attends to itself alone."""

  index: jax.Array  # int32 scalar
  valid_BS: jax.Array  # bool (B, S)
  prefill: bool = flax.struct.field(pytree_node=False, default=False)


def write_slots(cache: jax.Array, x: jax.Array, at: jax.Array | int, axis: int) -> jax.Array:
  """cache with x written from slot `at` along `axis`. A bfloat16 cache is written as its 16-bit patterns: XLA's CPU
  compiler runs a bfloat16 dynamic_update_slice in float32, widening and narrowing the whole cache (each layer's
  keys and values, every decode step: 226 MB a step for GPT-2 at batch 32). Inside a decode on one CPU device the
  decode kernel writes it in place (kernels.write_slots): XLA runs the bit-pattern write as a copy of the cache."""
  if (written := kernels.write_slots(cache, x, at, axis)) is not None:
    return written
  if cache.dtype != jnp.bfloat16 or jax.default_backend() != 'cpu':
    return jax.lax.dynamic_update_slice_in_dim(cache, x, at, axis=axis)
  bits = jax.lax.dynamic_update_slice_in_dim(
    jax.lax.bitcast_convert_type(cache, jnp.uint16), jax.lax.bitcast_convert_type(x, jnp.uint16), at, axis=axis
  )
  return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


class Attention(nnx.Module):
  """Multi-head self-attention; grouped-query when num_kv_heads < num_heads; optional rotary (rope_theta),
  optionally scaled (rope_scaling, see rope_frequencies). `impl` picks the kernel (models/attention.py: 'auto' =
  cuDNN flash attention where it applies).

  Options of the decoder families (models/decoder.py): `qk_norm` 'head' (RMSNorm of each head's q and k before the
  rotary embedding: Qwen3, Gemma 3) or 'whole' (of the whole q and k projections: OLMo-2), with `norm_eps` and
  `norm_plus_one` (Gemma's (1 + w) scale); `logits`: another scale than 1 / sqrt(head_dim) and a soft cap
  (attention.Logits; the window is a layer's, given per call).

  Projections: query (embed, heads, kv), key/value (embed, kv_heads, kv), out (heads, kv, embed).
  """

  def __init__(
    self,
    dim: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    use_bias: bool = True,
    out_bias: bool | None = None,
    rope_theta: float | None = None,
    rope_scaling: Any = None,
    qk_norm: str = '',
    norm_eps: float = 1e-6,
    norm_plus_one: bool = False,
    logits: attention.Logits = attention.PLAIN,
    sinks: bool = False,
    out_init_scale: float = 1.0,
    kernel_init: Initializer = NORMAL_002,
    impl: str = 'auto',
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    num_kv_heads = num_kv_heads or num_heads
    if head_dim is None:
      if dim % num_heads:
        raise ConfigError(f'embed_dim {dim} is not divisible by num_heads {num_heads}')
      head_dim = dim // num_heads
    if num_heads % num_kv_heads:
      raise ConfigError(f'num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}')
    if rope_theta is not None and head_dim % 2:
      raise ConfigError(f'rotary embeddings need an even head_dim, got {head_dim}')
    K = head_dim
    kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
    q_bias = ('heads', 'kv') if use_bias else None
    kv_bias = ('kv_heads', 'kv') if use_bias else None
    self.query = Dense('bld,dhk->blhk', (dim, num_heads, K), ('embed', 'heads', 'kv'), bias_axes=q_bias, **kw)
    self.key = Dense('bld,dhk->blhk', (dim, num_kv_heads, K), ('embed', 'kv_heads', 'kv'), bias_axes=kv_bias, **kw)
    self.value = Dense('bld,dhk->blhk', (dim, num_kv_heads, K), ('embed', 'kv_heads', 'kv'), bias_axes=kv_bias, **kw)
    kw['kernel_init'] = _scaled(kernel_init, out_init_scale)
    self.out = Dense(
      'blhk,hkd->bld',
      (num_heads, K, dim),
      ('heads', 'kv', 'embed'),
      bias_axes=('embed',) if (use_bias if out_bias is None else out_bias) else None,
      **kw,
    )
    norm = dict(eps=norm_eps, plus_one=norm_plus_one, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if qk_norm == 'head':
      self.q_norm, self.k_norm = RMSNorm(K, **norm), RMSNorm(K, **norm)
    elif qk_norm == 'whole':
      self.q_norm = RMSNorm(num_heads * K, shape=(num_heads, K), names=('heads', 'kv'), **norm)
      self.k_norm = RMSNorm(num_kv_heads * K, shape=(num_kv_heads, K), names=('kv_heads', 'kv'), **norm)
    elif qk_norm:
      raise ConfigError(f"qk_norm={qk_norm!r}: 'head', 'whole' or ''")
    if sinks:  # GPT-OSS: one learned logit per head in every softmax's denominator
      self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype), **axes('heads'))
    self.qk_norm, self.logits = qk_norm, logits
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling_params(rope_scaling)  # hashable (static): None or (key, value) pairs
    self.impl = impl  # 'auto' | 'xla' | 'cudnn' (models/attention.py)
    self.kv_heads, self.head_dim, self.dtype = num_kv_heads, K, dtype  # a KV cache's shape (generation/engine.py)

  def __call__(
    self,
    x_BLD: jax.Array,
    *,
    causal: bool,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    valid_BL: jax.Array | None = None,
    kv_length: int | None = None,
    window: int | None = None,
    rotary: tuple[float, Any] | None = None,
    cache: tuple[jax.Array, jax.Array] | None = None,
    decoding: Decoding | None = None,
  ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`window`: this layer's sliding window (each query sees its last `window` keys); `rotary`: this layer's
    (theta, scaling) in place of the module's (Gemma 3's local layers). With `cache` (this layer's keys and values,
    (B, G, C, K) each; C < the decode's slots: a ring of the window's last keys) and `decoding`: the new keys and
    values are written into it, and (output, cache) returned."""
    q_BLHK, k_BLGK, v_BLGK = project((self.query, self.key, self.value), x_BLD)
    q_BLHK = shard_logical(q_BLHK, ('batch', 'length', 'heads', 'kv'))
    k_BLGK = shard_logical(k_BLGK, ('batch', 'length', 'kv_heads', 'kv'))
    v_BLGK = shard_logical(v_BLGK, ('batch', 'length', 'kv_heads', 'kv'))
    if self.qk_norm:
      q_BLHK, k_BLGK = self.q_norm(q_BLHK), self.k_norm(k_BLGK)
    theta, scaling = rotary if rotary is not None else (self.rope_theta, self.rope_scaling)
    if theta is not None:
      if positions_BL is None:
        positions_BL = jnp.arange(x_BLD.shape[1])[None]
      q_BLHK = rope(q_BLHK, positions_BL, theta, scaling)
      k_BLGK = rope(k_BLGK, positions_BL, theta, scaling)
    logits = dataclasses.replace(self.logits, window=window)
    sinks_H = self.sinks[...] if hasattr(self, 'sinks') else None
    if cache is not None:
      o_BLHK, cache = self._cached(q_BLHK, k_BLGK, v_BLGK, cache, decoding, logits, sinks_H)
      return self.out(shard_logical(o_BLHK, ('batch', 'length', 'heads', 'kv'))), cache
    o_BLHK = attention.attend(
      q_BLHK,
      k_BLGK,
      v_BLGK,
      causal=causal,
      impl=self.impl,
      segment_ids_BL=segment_ids_BL,
      valid_BL=valid_BL,
      kv_length=kv_length,
      logits=logits,
      sinks_H=sinks_H,
    )
    o_BLHK = shard_logical(o_BLHK, ('batch', 'length', 'heads', 'kv'))
    return self.out(o_BLHK)

  @staticmethod
  def _decode_mask(d: Decoding, T: int, C: int, S: int, ring: bool, logits: attention.Logits) -> jax.Array:
    """(B, T, C): the slots each of T new queries sees, the real ones up to its own (within its window)."""
    q_T = d.index + jnp.arange(T)
    if ring:  # slot c holds token index - ((index - c) mod C): the last C tokens, the query's window
      token_C = d.index - jnp.mod(d.index - jnp.arange(C), C)
      valid_BC = jnp.take(d.valid_BS, jnp.maximum(token_C, 0), axis=1) & (token_C >= 0)[None]
      return valid_BC[:, None, :] & (token_C[None, :] <= q_T[:, None])[None]
    seen_TS = jnp.arange(S)[None, :] <= q_T[:, None]
    if logits.window is not None:
      seen_TS = seen_TS & (q_T[:, None] - jnp.arange(S)[None, :] < logits.window)
    return d.valid_BS[:, None, :] & seen_TS[None]

  def _cached(self, q_BTHK, k_BTGK, v_BTGK, cache, d: Decoding, logits: attention.Logits, sinks_H: Any = None):
    """Attention of T new queries with the KV cache. Every row writes the same slots (prompts are left-padded),
    so the write is one dynamic_update_slice on the unsharded slot axis, not a per-row scatter (which SPMD
    partitions poorly; T5X's decoder writes per-row slots with a one-hot sum instead).

    A cache of C slots, fewer than the decode's S, is a sliding window's ring: token i sits in slot i mod C, so
    the C slots hold exactly the last C tokens, what a query at i can see with a window of C. The prefill writes
    the prompt's last C tokens rotated into place; a decode step overwrites the slot of the token leaving the
    window. Memory per such layer is the window's, however long the decode (transformers' sliding window cache
    shifts its buffer each step instead)."""
    B, T, H, K = q_BTHK.shape
    C, S = cache[0].shape[2], d.valid_BS.shape[1]
    ring = C < S
    # A decode step of one row runs without the batch axis (b: '' in the einsums below). XLA's CPU compiler drops a
    # size-1 batch axis from the attention's matmuls itself, and around a 4-d cache it then copies each layer's
    # keys and values up to three times a step; generation/engine.py carries such a cache without it too.
    one = B == 1 and not d.prefill
    lead, b, slot = ((lambda x: x[0]), '', 1) if one else ((lambda x: x), 'b', 2)
    to_cache = lambda x: lead(x.transpose(0, 2, 1, 3).astype(cache[0].dtype))  # (B, T, G, K) -> (B, G, T, K)
    cache = tuple(lead(c) for c in cache)
    axes = CACHE_AXES[1:] if one else CACHE_AXES
    back = lambda k, v: (k[None], v[None]) if one else (k, v)  # the batch axis back for the caller
    if T == 1 and not d.prefill:  # models/kernels' attention, which writes the step's slot itself, on one CPU device
      fused = kernels.decode_attention(
        q_BTHK[:, 0],
        *cache,  # (G, C, K) where `one`: with its batch axis added back, XLA copied the cache to write it
        *(to_cache(x) for x in (k_BTGK, v_BTGK)),
        d.index % C if ring else d.index,
        self._decode_mask(d, T, C, S, ring, logits)[:, 0],
        jnp.minimum(d.index + 1, C),
        scale=logits.scale_for(K),
        softcap=logits.softcap,
        sinks_H=sinks_H,
      )
      if fused is not None:
        o_BHK, *kv = fused
        return o_BHK[:, None].astype(q_BTHK.dtype), back(*(shard_logical(c, axes) for c in kv))
    if ring and d.prefill:
      if logits.window is None or C != logits.window:
        raise ValueError(f'a ring of {C} slots for a window of {logits.window}')
      k_BGCK, v_BGCK = (  # prompt token T - C + j (the j-th of the last C) to slot (T - C + j) mod C
        jnp.roll(to_cache(x)[:, :, T - C :], T % C, axis=2) if T >= C else write_slots(c, to_cache(x), 0, axis=2)
        for c, x in zip(cache, (k_BTGK, v_BTGK))
      )
    elif ring:
      if T != 1:
        raise ValueError(f'a ring cache takes one token per decode step, not {T}')
      k_BGCK, v_BGCK = (write_slots(c, to_cache(x), d.index % C, axis=slot) for c, x in zip(cache, (k_BTGK, v_BTGK)))
    else:
      k_BGCK, v_BGCK = (write_slots(c, to_cache(x), d.index, axis=slot) for c, x in zip(cache, (k_BTGK, v_BTGK)))
    k_BGCK, v_BGCK = (shard_logical(c, axes) for c in (k_BGCK, v_BGCK))
    if d.prefill:  # the prompt alone, causal with its pads masked: no S-long keys
      o_BTHK = kernels.prefill_attention(  # models/kernels' on one CPU device, else attend's kernel choice
        q_BTHK,
        k_BTGK,
        v_BTGK,
        d.valid_BS[:, :T],
        scale=logits.scale_for(K),
        softcap=logits.softcap,
        window=logits.window,
        sinks_H=sinks_H,
      )
      if o_BTHK is None:
        o_BTHK = attention.attend(
          q_BTHK,
          k_BTGK,
          v_BTGK,
          causal=True,
          impl=self.impl,
          valid_BL=d.valid_BS[:, :T],
          logits=logits,
          sinks_H=sinks_H,
        )
      return o_BTHK.astype(q_BTHK.dtype), (k_BGCK, v_BGCK)
    mask_BTC = self._decode_mask(d, T, C, S, ring, logits)  # softmax in float32, as jax.nn.dot_product_attention's
    G = k_BGCK.shape[-3]
    q_BTGRK = lead(q_BTHK.reshape(B, T, G, H // G, K))
    with jax.named_scope('attention'):
      s_BGRTC = jnp.einsum(
        f'{b}tgrk,{b}gck->{b}grtc', q_BTGRK, k_BGCK.astype(q_BTHK.dtype), preferred_element_type=jnp.float32
      )
      s_BGRTC = logits.cap(s_BGRTC * logits.scale_for(K))
      s_BGRTC = jnp.where(lead(mask_BTC)[..., None, None, :, :], s_BGRTC, jnp.finfo(jnp.float32).min)
      sinks_GR = None if sinks_H is None else sinks_H.reshape(G, H // G)
      s_BGRTC = s_BGRTC[None] if one else s_BGRTC  # softmax_with_sinks takes the batch axis
      p_BGRTC = lead(attention.softmax_with_sinks(s_BGRTC, sinks_GR)).astype(q_BTHK.dtype)
      o_BTGRK = jnp.einsum(f'{b}grtc,{b}gck->{b}tgrk', p_BGRTC, v_BGCK.astype(q_BTHK.dtype))
    return (o_BTGRK[None] if one else o_BTGRK).reshape(B, T, H, K), back(k_BGCK, v_BGCK)


def activation_then(down: Callable[..., jax.Array], *pre: jax.Array) -> jax.Array:
  """`down(*pre)`: an MLP's activation and second matmul, with only the pre-activations `pre` kept for the
  backward pass, which recomputes the activation (elementwise) before the matmul's weight gradient.

  Plain autodiff keeps what the activation's derivative reads as well: for the exact GELU, the GELU output,
  erfc(-x/sqrt 2) and -x/sqrt 2, three (B, L, F) arrays per layer where one suffices; for SwiGLU, silu(gate) and
  the product beside gate and up. The second matmul is not recomputed (its output is not needed for the
  gradients), so this costs elementwise work only."""
  return jax.checkpoint(down, policy=jax.checkpoint_policies.nothing_saveable)(*pre)


def with_derivative(
  f: Callable[[jax.Array], jax.Array], df: Callable[[jax.Array], jax.Array], name: str
) -> Callable[[jax.Array], jax.Array]:
  """The elementwise `f` whose backward keeps only its input x and returns cotangent * df(x), with df written
  out as one expression, evaluated in at least float32 and cast back to x's dtype.

  What autodiff makes of jax.nn.gelu's derivative shares subexpressions (tanh(...) for the tanh form; erf and
  exp for the exact one) with the forward that `activation_then` recomputes in the backward, and XLA's GPU
  fusion writes those shared arrays out rather than compute them twice: an extra (B, L, F) kernel per layer. With
  the derivative written out, the recomputed activation, its derivative and the bias gradient are one pass over
  the pre-activation and the incoming gradient (docs/performance.md). Gradients equal autodiff's in float32, and
  in bf16 are closer to float32's than autodiff's (tests/test_speed_paths.py)."""

  @jax.custom_vjp
  def g(x):
    return f(x)

  def fwd(x):
    return f(x), x

  def bwd(x, ct):
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return ((ct.astype(wide) * df(x.astype(wide))).astype(x.dtype),)

  g.defvjp(fwd, bwd)
  g.__name__ = g.__qualname__ = name
  return g


_SQRT_2_OVER_PI, _GELU_CUBIC = math.sqrt(2 / math.pi), 0.044715


def _gelu_tanh_derivative(x: jax.Array) -> jax.Array:
  t = jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_CUBIC * x * x)


def _gelu_erf_derivative(x: jax.Array) -> jax.Array:  # Phi(x) + x phi(x)
  return 0.5 * (1 + jax.lax.erf(x * (1 / math.sqrt(2)))) + x * jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))


# Each family's activation computes in 16-bit dtypes as its transformers peer does, so that a bfloat16 model's MLP
# agrees with the checkpoint's reference (tests/test_activations.py: all but at most 0.05% of the bfloat16 inputs in
# [-4, 4] bit for bit). torch's fused kernels (F.silu, F.gelu) compute in float32 and round once; a Python formula
# (transformers' "gelu_new", GPT-OSS's clamped SwiGLU) rounds after each torch operation, its constants kept in
# float32. jax on CPU rounds after each operation too, but in its own order and with the constants first rounded to
# bfloat16: 0.27-3.4% of those inputs came out apart from the peer's.


def in_float32(f: Callable[[jax.Array], jax.Array], name: str) -> Callable[[jax.Array], jax.Array]:
  """`f` computed in (at least) float32 and rounded once to x's dtype, as torch's fused activation kernels do."""

  def g(x: jax.Array) -> jax.Array:
    if (fast := kernels.elementwise16(g, x)) is not None:  # a decode on one CPU device (models/kernels)
      return fast
    return f(x.astype(eager_rounding(x.dtype)[0])).astype(x.dtype)

  g.__name__ = g.__qualname__ = name
  return g


def eager_rounding(dtype: Any) -> tuple[Any, Callable[[jax.Array], jax.Array]]:
  """(the float32-or-wider dtype torch computes a `dtype` operation in, r) where r(a) rounds a wide result to `dtype`
  and widens it again: one eager torch operation on `dtype` tensors. A no-op for float32 and wider."""
  wide = jnp.promote_types(dtype, jnp.float32)
  return wide, (lambda a: a) if wide == jnp.dtype(dtype) else (lambda a: a.astype(dtype).astype(wide))


def _gelu_new(x: jax.Array) -> jax.Array:
  """transformers' "gelu_new" (GPT-2): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in its order of torch
  operations, each rounded to x's dtype."""
  if (fast := kernels.elementwise16(_gelu_new, x)) is not None:  # a decode on one CPU device (models/kernels)
    return fast
  wide, r = eager_rounding(x.dtype)
  w = x.astype(wide)
  t = r(jnp.tanh(r(_SQRT_2_OVER_PI * r(w + r(_GELU_CUBIC * r(w * w * w))))))
  return (r(0.5 * w) * r(1.0 + t)).astype(x.dtype)


silu = in_float32(jax.nn.silu, 'silu')  # F.silu: Llama, Qwen, Mistral, Phi-3, OLMo-2, Mixtral, DeepSeek
gelu_new = with_derivative(_gelu_new, _gelu_tanh_derivative, 'gelu_new')  # GPT-2
gelu_tanh = with_derivative(  # "gelu_pytorch_tanh", F.gelu(approximate='tanh'): Gemma
  in_float32(functools.partial(jax.nn.gelu, approximate=True), 'gelu_tanh'), _gelu_tanh_derivative, 'gelu_tanh'
)
gelu_erf = with_derivative(  # "gelu", F.gelu: BERT, ViT
  in_float32(functools.partial(jax.nn.gelu, approximate=False), 'gelu_erf'), _gelu_erf_derivative, 'gelu_erf'
)


def _scaled(init: Initializer, scale: float) -> Initializer:
  if scale == 1.0:
    return init
  return lambda key, shape, dtype=jnp.float32: init(key, shape, dtype) * jnp.asarray(scale, dtype)


class MLP(nnx.Module):
  """Two-layer feed-forward block, D -> F -> D."""

  def __init__(
    self,
    dim: int,
    hidden: int,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    use_bias: bool = True,
    out_init_scale: float = 1.0,
    kernel_init: Initializer = NORMAL_002,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.up = Dense(
      'bld,df->blf',
      (dim, hidden),
      ('embed', 'mlp'),
      bias_axes=('mlp',) if use_bias else None,
      kernel_init=kernel_init,
      **kw,
    )
    self.down = Dense(
      'blf,fd->bld',
      (hidden, dim),
      ('mlp', 'embed'),
      bias_axes=('embed',) if use_bias else None,
      kernel_init=_scaled(kernel_init, out_init_scale),
      **kw,
    )
    self.activation = activation

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    return activation_then(
      lambda u_BLF: self.down(shard_logical(self.activation(u_BLF), ('batch', 'length', 'mlp'))), self.up(x_BLD)
    )


class GatedMLP(nnx.Module):
  """SwiGLU feed-forward (Llama): down(silu(gate(x)) * up(x)), no biases."""

  def __init__(
    self,
    dim: int,
    hidden: int,
    *,
    activation: Callable[[jax.Array], jax.Array] = silu,
    out_init_scale: float = 1.0,
    kernel_init: Initializer = NORMAL_002,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = Dense('bld,df->blf', (dim, hidden), ('embed', 'mlp'), kernel_init=kernel_init, **kw)
    self.up = Dense('bld,df->blf', (dim, hidden), ('embed', 'mlp'), kernel_init=kernel_init, **kw)
    self.down = Dense(
      'blf,fd->bld', (hidden, dim), ('mlp', 'embed'), kernel_init=_scaled(kernel_init, out_init_scale), **kw
    )
    self.activation = activation

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    return activation_then(
      lambda g_BLF, u_BLF: self.down(shard_logical(self.activation(g_BLF) * u_BLF, ('batch', 'length', 'mlp'))),
      self.gate(x_BLD),
      self.up(x_BLD),
    )


class RMSNorm(nnx.RMSNorm):
  """x / rms(x) * scale, computed in float32 (as Llama does), cast back to the compute dtype. `plus_one`: Gemma's
  x / rms(x) * (1 + scale), the scale initialised to 0 (checkpoints store w, not 1 + w). `shape`: a scale over
  several trailing dims normalised together (OLMo-2's q/k norm over every head: (heads, kv)), named `names`."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    plus_one: bool = False,
    shape: tuple[int, ...] | None = None,
    names: tuple[str, ...] = ('norm',),
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    init = nnx.initializers.zeros if plus_one else nnx.initializers.ones
    super().__init__(
      dim,
      epsilon=eps,
      dtype=jnp.float32,
      param_dtype=param_dtype,
      scale_init=init,
      rngs=rngs,
      scale_metadata=axes(*names),
    )
    if shape is not None:
      self.scale = nnx.Param(init(rngs.params(), shape, param_dtype), **axes(*names))
    self.out_dtype, self.plus_one, self.dims = dtype, plus_one, len(shape or (dim,))

  def __call__(self, x: jax.Array, mask: Any = None) -> jax.Array:
    if not self.plus_one and self.dims == 1:
      return super().__call__(x.astype(jnp.float32)).astype(self.out_dtype)
    x = x.astype(jnp.float32)
    over = tuple(range(x.ndim - self.dims, x.ndim))
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=over, keepdims=True) + self.epsilon)
    scale = self.scale[...].astype(jnp.float32)
    return (y * (1 + scale if self.plus_one else scale)).astype(self.out_dtype)


# cuDNN flash attention's forward (jax.nn.dot_product_attention(implementation='cudnn')): its output and
# softmax statistics are what its backward kernel reads.
CUDNN_ATTENTION_FORWARD = 'dot_product_attention_fwd_wrapper'


# Weight matmuls with a batch dimension, which `dots_with_no_batch_dims_saveable` passes over (it must: XLA
# attention's scores are batched matmuls too), named where they are made so 'dots' keeps them: the mixture of
# experts' tokens dispatched to the experts (after the all-to-all), its expert gate and up projections, and the
# experts' outputs back in their groups (after the all-to-all back). Kept, the backward reruns neither the
# expert matmuls nor the all-to-alls.
MOE_DISPATCHED, MOE_GATE, MOE_UP, MOE_RETURNED = 'moe_dispatched', 'moe_gate', 'moe_up', 'moe_returned'
_KEPT_BY_DOTS = frozenset(
  (MOE_DISPATCHED, MOE_GATE, MOE_UP, MOE_RETURNED, attention.SPLASH_FORWARD, *attention.BLOCKWISE_FORWARD)
)

# Model FLOPs (training/flops.py) count the matmuls a model's math needs. Under NOT_MODEL_FLOPS, matmuls that only
# move data (a mixture of experts' one-hot dispatch and combine, its routing's bookkeeping) are not counted; under
# active_scope(a, n), matmuls over n slots of which a hold real work count a / n of their FLOPs (the experts' E x C
# capacity slots, of which k x S are a group's top-k assignments: 6 N_active per token, as dropless MoEs report).
NOT_MODEL_FLOPS = 'not_model_flops'


def active_scope(active: int, slots: int) -> str:
  return f'active_{active}_of_{slots}'


def _dots_and_fused_attention(prim: Any, *args: Any, **params: Any) -> bool:
  """Keep weight matmuls' outputs (convolutions' too, and the batched ones named in _KEPT_BY_DOTS) and the
  fused attention kernel's (output + softmax statistics, ~1/30 of what a layer keeps): its backward then reads
  them instead of rerunning the forward kernel. Splash's and the 'blockwise' stand-in's are kept by name."""
  return (
    prim.name == CUDNN_ATTENTION_FORWARD
    or prim.name == 'conv_general_dilated'
    or (prim.name == 'name' and params.get('name') in _KEPT_BY_DOTS)
    or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
  )


REMAT_POLICIES = {
  'none': None,  # keep every activation for the backward pass (fastest, most memory)
  'full': jax.checkpoint_policies.nothing_saveable,  # keep only each block's input; recompute the block
  # keep the outputs of weight matmuls (q/k/v/out projections, MLP layers, experts, convolutions) and of fused
  # attention (cuDNN's forward kernel, splash's and 'blockwise' attention's output and log-sum-exp); recompute
  # norms, activations and XLA's attention core (whose L x L scores are too large to keep):
  'dots': _dots_and_fused_attention,
  # keep attention's q, k, v and output (models/attention.py names them); recompute the MLPs:
  'attention': jax.checkpoint_policies.save_only_these_names('attn_q', 'attn_k', 'attn_v', 'attn_out'),
}
schema.register('model.remat', REMAT_POLICIES)


def remat_policy(remat: Any) -> str:
  """config.model.remat -> a REMAT_POLICIES name (True/False are 'full'/'none', for older configs)."""
  name = {True: 'full', False: 'none', None: 'none', '': 'none'}.get(remat, remat)
  if name not in REMAT_POLICIES:
    raise ConfigError(f'config.model.remat={remat!r} is not a remat policy; choose one of {list(REMAT_POLICIES)}')
  return name


def _add_aux(totals: dict[str, Any], aux: dict[str, Any]) -> dict[str, Any]:
  """A stack's per-layer losses summed: totals so far plus one layer's (or group's) aux."""
  return {k: totals.get(k, 0.0) + v for k, v in aux.items()}


class Stack(nnx.Module):
  """`num` identical blocks, unrolled or stacked on a leading 'layers' axis and run with `nnx.scan`.

  Scanned: parameters at <stack>/layers/..., each with a leading dimension named 'layers' (so rules can
  shard or replicate it like any other axis); the step compiles one block instead of `num`.
  Unrolled: an nnx.List, parameters at <stack>/layers/<i>/... . Both give the same outputs.
  A block maps (x, *args) -> x, or -> (x, aux) with aux a dict of scalars, summed over layers.
  `remat` names what each block keeps for the backward pass (REMAT_POLICIES); the rest is recomputed.

  `axis`: the logical name of the stacked dimension. The pipeline (partitioning/pipeline.py) cuts the 'layers'
  axis only; a stack on another axis (a mixture of experts' dense layers first: 'dense_layers') runs whole, before
  the pipelined one, wherever its rule puts its weights.

  `period` > 1: the blocks differ by their place in a repeating pattern of that many layers (a decoder's local and
  global attention layers: Gemma 3's five local to one global), told to each block as `layer=i % period`. Stored
  as before (one stacked 'layers' axis, so checkpoints and rules do not change); a scanned stack runs in groups of
  `period` layers, one compiled group (its blocks unrolled inside) scanned num // period times, as MaxText scans
  Gemma 3, and the remaining num % period layers after it.
  """

  def __init__(
    self,
    make_block: Callable[[nnx.Rngs], nnx.Module],
    num: int,
    *,
    scan: bool,
    rngs: nnx.Rngs,
    remat: Any = 'none',
    period: int = 1,
    axis: str = 'layers',
  ):
    self.scan, self.remat, self.num, self.period, self.axis = scan, remat_policy(remat), num, period, axis
    # Both layouts come from one vmapped initialiser (same values): unrolled blocks are split from it, since
    # num separate initialisers compile far more slowly.
    metadata = {nnx.PARTITION_NAME: axis} if scan else {}  # unrolled: each block keeps its own axes
    stacked = nnx.vmap(make_block, in_axes=0, out_axes=0, transform_metadata=metadata)(rngs.split(num))
    if scan:
      self.layers = stacked
    else:
      graphdef, state = nnx.split(stacked)
      # The stack sharded as each layer's parameter is (under the trainer's rules), then a barrier: without it
      # XLA fuses the initialisers into every slice (num copies again: 42 s). The stacked copy costs init
      # memory: temporaries ~1.3x the per-device state (0.5x with one initialiser per layer).
      state = jax.tree.map(_shard_stacked, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
      state = jax.lax.optimization_barrier(state)
      self.layers = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state)) for i in range(num)])

  def place(self, i: int) -> dict[str, int]:
    """The keyword a block at layer i is called with: its place in the pattern (none without one)."""
    return {'layer': i % self.period} if self.period > 1 else {}

  def __call__(self, x: jax.Array, *args: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    def apply(block, x, *args, **place):
      out = block(x, *args, **place)
      return out if isinstance(out, tuple) else (out, {})

    if self.scan and self.axis == 'layers' and pipeline.active() is not None:  # the rules cut it into stages
      return self._pipelined(apply, x, *args)
    remat = (lambda f: nnx.remat(f, policy=REMAT_POLICIES[self.remat])) if self.remat != 'none' else (lambda f: f)
    if not self.scan:
      # One jitted call per place in the pattern, made afresh for this trace: identical blocks hit its trace cache,
      # so tracing (and differentiating) a deep unrolled stack costs one block per place, not one per layer.
      calls = {j: nnx.jit(remat(functools.partial(apply, **self.place(j)))) for j in range(self.period)}
      totals: dict[str, jax.Array] = {}
      for i, block in enumerate(self.layers):
        x, aux = calls[i % self.period](block, x, *args)
        totals = _add_aux(totals, aux)
      return x, totals
    if self.period > 1:
      return self._grouped([remat(functools.partial(apply, layer=j)) for j in range(self.period)], x, *args)
    apply = remat(apply)

    @nnx.scan(
      in_axes=(nnx.Carry, 0) + (None,) * len(args),
      out_axes=(nnx.Carry, 0),
      transform_metadata={nnx.PARTITION_NAME: self.axis},
    )
    def body(x, block, *args):
      return apply(block, x, *args)

    x, aux = body(x, self.layers, *args)
    return x, {k: v.sum() for k, v in aux.items()}

  def _groups(self) -> tuple[Any, Any, Any]:
    """(graphdef of one block, its weights in groups (num // period, period, ...), the rest's (num % period, ...))."""
    graphdef, weights = nnx.split(self.layers)
    n = self.num // self.period * self.period
    groups = jax.tree.map(lambda w: w[:n].reshape(self.num // self.period, self.period, *w.shape[1:]), weights)
    return graphdef, groups, jax.tree.map(lambda w: w[n:], weights)

  def _grouped(self, applies: list[Callable[..., Any]], x: jax.Array, *args: Any) -> tuple[jax.Array, dict]:
    """A scanned stack with a pattern: a lax.scan over the groups of `period` layers, then the rest one by one."""
    graphdef, groups, rest = self._groups()
    at = lambda w, j: nnx.merge(graphdef, jax.tree.map(lambda v: v[j], w))

    def group(x, w):
      totals: dict[str, jax.Array] = {}
      for j, apply in enumerate(applies):
        x, aux = apply(at(w, j), x, *args)
        totals = _add_aux(totals, aux)
      return x, totals

    x, aux = jax.lax.scan(group, x, groups)
    totals = {k: v.sum() for k, v in aux.items()}
    for j in range(self.num % self.period):
      x, aux = applies[j](at(rest, j), x, *args)
      totals = _add_aux(totals, aux)
    return x, totals

  def _pipelined(self, apply: Callable[..., Any], x: jax.Array, *args: Any) -> tuple[jax.Array, dict]:
    """The scanned stack as the active pipeline (partitioning/pipeline.py), remat per stage iteration: (x, aux),
    aux summed over the layers and averaged over the pipeline's micro-batches. With a pattern, a pipeline 'layer'
    is a group of `period` layers, so the stages must hold whole groups."""
    if self.period > 1:
      if self.num % self.period:
        raise ConfigError(
          f"config.model.num_layers={self.num} is not a whole number of the layer pattern's {self.period}-layer "
          "groups, which a pipeline cuts into stages: choose a multiple, or map 'layers' to None"
        )
      graphdef, weights, _ = self._groups()
    else:
      graphdef, weights = nnx.split(self.layers)

    def layer(w, x, *args):
      if self.period == 1:
        return apply(nnx.merge(graphdef, w), x, *args)
      totals: dict[str, jax.Array] = {}
      for j in range(self.period):
        x, aux = apply(nnx.merge(graphdef, jax.tree.map(lambda v: v[j], w)), x, *args, layer=j)
        totals = _add_aux(totals, aux)
      return x, totals

    return pipeline.run(layer, weights, x, *args, x_axes=('batch',), policy=REMAT_POLICIES[self.remat])

  def decode(self, x: jax.Array, cache: Any, decoding: Decoding, *args: Any) -> tuple[jax.Array, Any]:
    """x through the blocks, each reading and writing its layer's KV cache: (x, cache). `cache`: unrolled, a list of
    per-layer (keys, values) pairs; scanned, (groups, rest): `groups` a (keys, values) pair per place in the pattern
    (one, without a pattern), each stacked over the num // period groups on a leading 'layers' axis, `rest` the
    pairs of the num % period layers after them (generation/engine.CacheLayout). A block takes
    (x, *args, cache=, decoding=[, layer=]) and returns (x, its cache)."""
    if not self.scan:
      out = []
      for i, (block, c) in enumerate(zip(self.layers, cache, strict=True)):
        x, c = block(x, *args, cache=c, decoding=decoding, **self.place(i))
        out.append(c)
      return x, out
    caches, rest_caches = cache
    graphdef, groups, rest = self._groups()
    at = lambda w, j: nnx.merge(graphdef, jax.tree.map(lambda v: v[j], w))

    def group(x, w_and_c):
      w, c = w_and_c
      out = []
      for j in range(self.period):
        x, cj = at(w, j)(x, *args, cache=c[j], decoding=decoding, **self.place(j))
        out.append(cj)
      return x, tuple(out)

    x, caches = jax.lax.scan(group, x, (groups, caches))
    caches = tuple(tuple(shard_logical(c, ('layers', *CACHE_AXES)) for c in pair) for pair in caches)
    out = []
    for j, c in enumerate(rest_caches):
      x, c = at(rest, j)(x, *args, cache=c, decoding=decoding, **self.place(j))
      out.append(c)
    return x, (caches, tuple(out))


def _shard_stacked(v: Any) -> Any:
  names = v.get_metadata().get('out_sharding') if isinstance(v, nnx.Variable) else None
  return v if names is None else v.replace(shard_logical(v.get_value(), (None, *names)))


def stack_options(cfg: Any) -> dict[str, Any]:
  """Stack keyword arguments from a model config: scan_layers and remat."""
  return dict(scan=cfg.scan_layers, remat=cfg.remat)


def dtypes(cfg: Any) -> dict[str, Any]:
  """Compute and parameter dtypes from a model config (e.g. dtype='bfloat16', param_dtype='float32')."""
  return dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))


def logits_dtype(cfg: Any) -> Any:
  """The dtype of a language model's logits (config.model.logits_dtype)."""
  return jnp.dtype(cfg.logits_dtype)


def padded_vocab(cfg: Any) -> int:
  """A language model's vocabulary rows: config.model.vocab_size rounded up to pad_vocab_to (Embed's `pad_to`)."""
  return -(-cfg.vocab_size // cfg.pad_vocab_to) * cfg.pad_vocab_to


def loss_chunks(cfg: Any) -> int:
  """config.model.loss_chunks of a language model: the LM loss computed in that many chunks along the length,
  each chunk's gradients made as it is scored (training/xent.py); 0 or 1: the whole (B, L, V) at once."""
  return cfg.loss_chunks
