"""Small image classifiers for MNIST-sized inputs: an MLP and a CNN. image (B, H, W, C) -> logits (B, classes).

MLP: the image is the first layer's input as is (kernel (height, width, channels, F), no reshape), then
ReLU layers whose widths alternate the names 'mlp' and 'embed' (Megatron's column/row-parallel pairs
under a ('mlp', 'tensor') rule), then the classifier.
CNN (Flax's MNIST example): [3x3 conv, ReLU, 2x2 average pool] per entry of `features`, a ReLU dense
layer over the flattened map (kernel (height, width, conv_in, mlp)), the classifier.

Shape suffixes: B batch, H/W image rows/columns, C channels, F hidden width, K classes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from errors import ConfigError
from models.layers import Conv, Dense, dtypes
from partitioning import shard_logical

HE = nnx.initializers.he_normal()  # fan-in scaled, for ReLU layers (fan-in of (H, W, C, F) is H*W*C)
LECUN = nnx.initializers.lecun_normal()  # classifier


def _hidden_names(n: int) -> list[str]:
  return ['mlp' if i % 2 == 0 else 'embed' for i in range(n)]


def _classifier(dim: int, axis: str, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs) -> Dense:
  """(B, dim) -> float32 logits (B, classes), also under bf16 compute."""
  return Dense(
    'bf,fk->bk',
    (dim, cfg.num_classes),
    (axis, 'classes'),
    bias_axes=('classes',),
    kernel_init=LECUN,
    dtype=dtypes(cfg)['dtype'],
    param_dtype=dtypes(cfg)['param_dtype'],
    preferred_element_type=jnp.float32,
    rngs=rngs,
  )


class MLP(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    dims = tuple(cfg.hidden_dims)
    if not dims:
      raise ConfigError('config.model.hidden_dims is empty: the MLP needs at least one hidden layer')
    kw = dict(**dtypes(cfg), kernel_init=HE, rngs=rngs)
    S, C, names = cfg.image_size, cfg.channels, _hidden_names(len(dims))
    self.input = Dense(
      'bhwc,hwcf->bf', (S, S, C, dims[0]), ('height', 'width', 'channels', names[0]), bias_axes=(names[0],), **kw
    )
    self.hidden = nnx.List(
      [
        Dense('bf,fg->bg', (dims[i - 1], dims[i]), (names[i - 1], names[i]), bias_axes=(names[i],), **kw)
        for i in range(1, len(dims))
      ]
    )
    self.head = _classifier(dims[-1], names[-1], cfg, rngs)
    self.names = tuple(names)
    self.dtype = kw['dtype']

  def __call__(self, image_BHWC: jax.Array) -> jax.Array:
    x_BF = shard_logical(jax.nn.relu(self.input(image_BHWC.astype(self.dtype))), ('batch', self.names[0]))
    for layer, name in zip(self.hidden, self.names[1:]):
      x_BF = shard_logical(jax.nn.relu(layer(x_BF)), ('batch', name))
    return shard_logical(self.head(x_BF), ('batch', 'classes'))


class CNN(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    feats = tuple(cfg.features)
    S = cfg.image_size // 2 ** len(feats)
    if not feats or S < 1:
      raise ConfigError(
        f'config.model.features={feats}: need 1 to {cfg.image_size.bit_length() - 1} conv layers '
        f'for image_size {cfg.image_size} (each halves the image)'
      )
    kw = dict(**dtypes(cfg), kernel_init=HE, rngs=rngs)
    self.convs = nnx.List(
      [
        Conv(c_in, c_out, 3, in_axis='conv_in' if i else 'channels', **kw)
        for i, (c_in, c_out) in enumerate(zip((cfg.channels,) + feats, feats))
      ]
    )
    self.dense = Dense(
      'bhwc,hwcf->bf', (S, S, feats[-1], cfg.mlp_dim), ('height', 'width', 'conv_in', 'mlp'), bias_axes=('mlp',), **kw
    )
    self.head = _classifier(cfg.mlp_dim, 'mlp', cfg, rngs)
    self.dtype = kw['dtype']

  def __call__(self, image_BHWC: jax.Array) -> jax.Array:
    x_BHWC = image_BHWC.astype(self.dtype)
    for conv in self.convs:
      x_BHWC = nnx.avg_pool(jax.nn.relu(conv(x_BHWC)), (2, 2), strides=(2, 2))
      x_BHWC = shard_logical(x_BHWC, ('batch', 'height', 'width', 'conv_out'))
    x_BF = shard_logical(jax.nn.relu(self.dense(x_BHWC)), ('batch', 'mlp'))
    return shard_logical(self.head(x_BF), ('batch', 'classes'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  K, C, S = cfg.num_classes, cfg.channels, cfg.image_size
  if cfg.name == 'mlp':
    dims = (S * S * C,) + tuple(cfg.hidden_dims) + (K,)
    return sum((a + 1) * b for a, b in zip(dims, dims[1:]))
  feats = (C,) + tuple(cfg.features)
  side = S // 2 ** len(cfg.features)
  convs = sum((9 * a + 1) * b for a, b in zip(feats, feats[1:]))
  return convs + (side * side * feats[-1] + 1) * cfg.mlp_dim + (cfg.mlp_dim + 1) * K
