"""ResNet (He et al. 2015) in torchvision's layout (v1.5: a bottleneck's stride is on its 3x3 conv; with
config.model.stride_in_1x1, v1: on its first 1x1 conv, transformers' `downsample_in_bottleneck`).

image (B, H, W, C) -> logits (B, classes) float32. Stem: 7x7/2 conv, BatchNorm, ReLU, 3x3/2 max pool;
stages of basic blocks (ResNet-18/34: two 3x3 convs) or bottlenecks (ResNet-50/101: 1x1, 3x3, 1x1 with
4x expansion), widths `width * 2**i`, stride 2 from the second stage on, a 1x1 projection (conv + BN)
where the shortcut changes shape; global average pool; linear classifier. Convs have no bias
and torch's symmetric padding (k // 2). Parameters map onto torchvision's names: conv1/bn1 (stem),
layer{i}.{j} = stages/{i-1}/first (j = 0) or stages/{i-1}/rest/layers/{j-1}, conv{n}/bn{n} = convs/{n-1}
and bns/{n-1}, downsample.{0,1} = downsample_conv/downsample_bn, fc = head; and onto transformers'
ResNetForImageClassification, whose checkpoints the Hugging Face importer reads (`HF` at the end).

BatchNorm (layers.BatchNorm): train mode normalises with the statistics of the global batch (under
jit with the batch sharded, XLA all-reduces them) and updates the running averages, which live in
nnx.BatchStat variables (the trainer's `model_state`, named 'norm', placed by the rules); eval mode
(training.tasks.eval_view) uses the running averages. Momentum 0.9 is torch's 0.1.

Shape suffixes: B batch, H/W rows/columns, C channels, K classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from configs import schema
from errors import ConfigError
from models import hf_import as hf
from models.layers import BatchNorm, Conv, Dense, Stack, dtypes, max_pool, stack_options
from partitioning import shard_logical

ACT = ('batch', 'height', 'width', 'conv_out')
KAIMING_OUT = nnx.initializers.variance_scaling(2.0, 'fan_out', 'normal')  # torchvision's conv init
BLOCKS = {'basic': 1, 'bottleneck': 4}  # block type -> expansion (output width / block width)
schema.register('model.block', sorted(BLOCKS))


def _conv(cfg: Any, c_in: int, c_out: int, k: int, stride: int, rngs: nnx.Rngs, in_axis: str = 'conv_in') -> Conv:
  return Conv(
    c_in,
    c_out,
    k,
    strides=stride,
    padding=[(k // 2, k // 2)] * 2,
    use_bias=False,
    in_axis=in_axis,
    kernel_init=KAIMING_OUT,
    rngs=rngs,
    **dtypes(cfg),
  )


def _bn(cfg: Any, c: int, rngs: nnx.Rngs) -> BatchNorm:
  return BatchNorm(
    c,
    momentum=cfg.bn_momentum,
    eps=cfg.bn_eps,
    fast_variance=cfg.bn_fast_variance,
    fused=cfg.bn_fused,
    rngs=rngs,
    **dtypes(cfg),
  )


class Block(nnx.Module):
  """Basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1 x4) residual block; `c_in` -> `width * expansion`."""

  def __init__(self, cfg: ml_collections.ConfigDict, c_in: int, width: int, stride: int, *, rngs: nnx.Rngs):
    c_out = width * BLOCKS[cfg.block]
    if cfg.block == 'basic':
      self.convs = nnx.List([_conv(cfg, c_in, width, 3, stride, rngs), _conv(cfg, width, width, 3, 1, rngs)])
    else:  # v1.5 strides on the 3x3 conv; v1 (stride_in_1x1) on the first 1x1
      s1, s3 = (stride, 1) if cfg.stride_in_1x1 else (1, stride)
      self.convs = nnx.List(
        [
          _conv(cfg, c_in, width, 1, s1, rngs),
          _conv(cfg, width, width, 3, s3, rngs),
          _conv(cfg, width, c_out, 1, 1, rngs),
        ]
      )
    self.bns = nnx.List([_bn(cfg, conv.out_features, rngs) for conv in self.convs])
    project = stride != 1 or c_in != c_out
    self.downsample_conv = _conv(cfg, c_in, c_out, 1, stride, rngs) if project else None
    self.downsample_bn = _bn(cfg, c_out, rngs) if project else None

  def __call__(self, x_BHWC: jax.Array) -> jax.Array:
    h_BHWC = x_BHWC
    for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
      h_BHWC = bn(conv(h_BHWC))
      if i < len(self.convs) - 1:
        h_BHWC = shard_logical(jax.nn.relu(h_BHWC), ACT)
    if self.downsample_conv is not None:
      x_BHWC = self.downsample_bn(self.downsample_conv(x_BHWC))
    return shard_logical(jax.nn.relu(h_BHWC + x_BHWC), ACT)


class Stage(nnx.Module):
  """`num` blocks: the first may change width and stride, the rest are identical (a layers.Stack)."""

  def __init__(self, cfg: ml_collections.ConfigDict, num: int, c_in: int, width: int, stride: int, *, rngs: nnx.Rngs):
    self.first = Block(cfg, c_in, width, stride, rngs=rngs)
    c_out = width * BLOCKS[cfg.block]
    self.rest = (
      Stack(lambda r: Block(cfg, c_out, width, 1, rngs=r), num - 1, **stack_options(cfg), rngs=rngs)
      if num > 1
      else None
    )

  def __call__(self, x_BHWC: jax.Array) -> jax.Array:
    x_BHWC = self.first(x_BHWC)
    return x_BHWC if self.rest is None else self.rest(x_BHWC)[0]


def _relu_max_pool(x_BHWC: jax.Array) -> jax.Array:
  """The stem after its BatchNorm: ReLU, 3x3/2 max pool. Under the fused BatchNorm its full-resolution input is
  recomputed in the backward pass instead of kept (layers.batch_norm_train's `then`)."""
  return max_pool(jax.nn.relu(x_BHWC), 3, stride=2, pad=1)


def _check(cfg: Any) -> None:
  if cfg.block not in BLOCKS:
    raise ConfigError(f'config.model.block={cfg.block!r} is not a ResNet block; choose one of {sorted(BLOCKS)}')
  if not cfg.stage_sizes or min(cfg.stage_sizes) < 1:
    raise ConfigError(f'config.model.stage_sizes={tuple(cfg.stage_sizes)}: need one or more stages of >= 1 block')


class ResNet(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    _check(cfg)
    self.conv1 = _conv(cfg, cfg.channels, cfg.width, 7, 2, rngs, in_axis='channels')
    self.bn1 = _bn(cfg, cfg.width, rngs)
    stages, c = [], cfg.width
    for i, num in enumerate(cfg.stage_sizes):
      width = cfg.width * 2**i
      stages.append(Stage(cfg, num, c, width, 1 if i == 0 else 2, rngs=rngs))
      c = width * BLOCKS[cfg.block]
    self.stages = nnx.List(stages)
    self.head = Dense(
      'bc,ck->bk',
      (c, cfg.num_classes),
      ('conv_in', 'classes'),
      bias_axes=('classes',),
      kernel_init=nnx.initializers.lecun_normal(),
      preferred_element_type=jnp.float32,
      rngs=rngs,
      **dtypes(cfg),
    )
    self.dtype = dtypes(cfg)['dtype']

  def __call__(self, image_BHWC: jax.Array) -> jax.Array:
    x_BHWC = self.bn1(self.conv1(image_BHWC.astype(self.dtype)), then=_relu_max_pool)
    x_BHWC = shard_logical(x_BHWC, ACT)
    for stage in self.stages:
      x_BHWC = stage(x_BHWC)
    x_BC = shard_logical(x_BHWC.mean(axis=(1, 2)), ('batch', 'conv_out'))
    return shard_logical(self.head(x_BC), ('batch', 'classes'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count: conv kernels, BatchNorm scale + bias (2 per channel), classifier.

  The running mean/var are state, not parameters (torchvision counts them neither).
  """
  _check(cfg)
  conv_bn = lambda k, a, b: k * k * a * b + 2 * b
  n, c = conv_bn(7, cfg.channels, cfg.width), cfg.width
  for i, num in enumerate(cfg.stage_sizes):
    w = cfg.width * 2**i
    out = w * BLOCKS[cfg.block]
    for j in range(num):
      c_in, stride = (c, 1 if i == 0 else 2) if j == 0 else (out, 1)
      if cfg.block == 'basic':
        n += conv_bn(3, c_in, w) + conv_bn(3, w, w)
      else:
        n += conv_bn(1, c_in, w) + conv_bn(3, w, w) + conv_bn(1, w, out)
      n += conv_bn(1, c_in, out) if stride != 1 or c_in != out else 0
    c = out
  return n + (c + 1) * cfg.num_classes


# --- Hugging Face import (models/hf_import.py): ResNetForImageClassification / ResNetModel -----------
#
# transformers' ResNet is this one by construction: stem 7x7/2 conv + BN + ReLU + 3x3/2 max pool (padding
# 1), stages of basic or bottleneck layers (reduction 4) whose first layer strides 2 from the second stage
# on (downsample_in_first_stage=False), the stride of a bottleneck on its 3x3 conv unless
# downsample_in_bottleneck (then on its first 1x1: config.model.stride_in_1x1), a 1x1 conv + BN shortcut
# where the shape changes, global average pool, linear classifier; torch's BatchNorm eps 1e-5.
# config.json's num_labels (and id2label) is not adopted: the classifier's size follows the dataset, as
# for ViT (a checkpoint with another number of classes needs config.dont_load='^head/').

MAX_STAGES = 8  # the table has rows for stages 0..7 (rows for stages the model lacks are skipped)


def _hf_config(c: dict) -> dict:
  """config.json (model_type 'resnet') -> config.model's architecture fields (the inverse of to_hf_config)."""

  def refuse(field, why):
    return hf.HFImportError(f'config.json {field}={c.get(field)!r}: {why}')

  for field, want, why in (
    ('hidden_act', 'relu', "the zoo's ResNet uses ReLU"),
    ('downsample_in_first_stage', False, "the zoo's ResNet first stage has stride 1"),
  ):
    if c.get(field, want) != want:
      raise refuse(field, why)
  block = c.get('layer_type', 'bottleneck')
  if block not in BLOCKS:
    raise refuse('layer_type', f'the zoo builds {sorted(BLOCKS)} blocks')
  depths, sizes, width = list(c['depths']), list(c['hidden_sizes']), c['embedding_size']
  if not 1 <= len(depths) <= MAX_STAGES or min(depths) < 1:
    raise refuse('depths', f'the zoo builds 1 to {MAX_STAGES} stages of >= 1 layer')
  want = [width * 2**i * BLOCKS[block] for i in range(len(depths))]
  if sizes != want:
    raise refuse(
      'hidden_sizes',
      f"the zoo's stage widths double from embedding_size={width}: a {block} ResNet "
      f'with {len(depths)} stages has hidden_sizes {want}',
    )
  return dict(
    channels=c.get('num_channels', 3),
    width=width,
    block=block,
    stage_sizes=tuple(depths),
    stride_in_1x1=block == 'bottleneck' and bool(c.get('downsample_in_bottleneck', False)),
    bn_eps=1e-5,
  )


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same ResNetForImageClassification (the inverse of _hf_config, plus
  num_labels = num_classes). Only bn_eps=1e-5 exists there (torch's BatchNorm2d default)."""
  return dict(
    model_type='resnet',
    architectures=['ResNetForImageClassification'],
    num_channels=cfg.channels,
    embedding_size=cfg.width,
    hidden_sizes=[cfg.width * 2**i * BLOCKS[cfg.block] for i in range(len(cfg.stage_sizes))],
    depths=list(cfg.stage_sizes),
    layer_type=cfg.block,
    hidden_act='relu',
    downsample_in_first_stage=False,
    downsample_in_bottleneck=cfg.stride_in_1x1,
    num_labels=cfg.num_classes,
  )


def _hf_params() -> list[hf.Param]:
  """Torch conv weights (out, in, kh, kw) -> (kh, kw, in, out); BatchNorm weight/bias -> scale/bias and
  running_mean/var -> the model state's mean/var. A stage's layer 0 is the zoo's `first` block, layers
  1.. its `rest` stack (first_layer=1)."""
  conv = [hf.T((2, 3, 1, 0))]

  def conv_bn(zoo_conv, zoo_bn, theirs):
    return [
      hf.Param(f'{zoo_conv}/kernel', f'{theirs}.convolution.weight', conv),
      hf.Param(f'{zoo_bn}/scale', f'{theirs}.normalization.weight'),
      hf.Param(f'{zoo_bn}/bias', f'{theirs}.normalization.bias'),
      hf.Param(f'{zoo_bn}/mean', f'{theirs}.normalization.running_mean', state=True),
      hf.Param(f'{zoo_bn}/var', f'{theirs}.normalization.running_var', state=True),
    ]

  def block(zoo, theirs):
    rows = [r for n in range(3) for r in conv_bn(f'{zoo}/convs/{n}', f'{zoo}/bns/{n}', f'{theirs}.layer.{n}')]
    return rows + conv_bn(f'{zoo}/downsample_conv', f'{zoo}/downsample_bn', f'{theirs}.shortcut')

  rows = conv_bn('conv1', 'bn1', 'embedder.embedder')
  for s in range(MAX_STAGES):
    rows += block(f'stages/{s}/first', f'encoder.stages.{s}.layers.0')
    rows += [
      dataclasses.replace(r, first_layer=1)
      for r in block(f'stages/{s}/rest/layers/{{i}}', f'encoder.stages.{s}.layers.{{i}}')
    ]
  return rows + [
    hf.Param('head/layer/kernel', 'classifier.1.weight', [hf.T((1, 0))]),
    hf.Param('head/layer/bias', 'classifier.1.bias'),
  ]


# Keys are 'resnet.'-prefixed in ResNetForImageClassification files, bare in ResNetModel ones (no
# classifier: load it with config.dont_load='^head/'); the classifier is never prefixed. Ignored: BatchNorm's
# num_batches_tracked counters (the zoo's running averages use a fixed momentum). The export writes them as 0
# beside each running_mean, so that the file has every buffer transformers expects (torch reads the counter only
# for momentum=None, a cumulative average).
def _batches_tracked(keys: Sequence[str]) -> dict[str, np.ndarray]:
  return {
    k.removesuffix('running_mean') + 'num_batches_tracked': np.zeros((), np.int64)
    for k in keys
    if k.endswith('.running_mean')
  }


HF = hf.Family(
  model_types=('resnet',),
  config=_hf_config,
  params=_hf_params(),
  prefixes=('resnet.', ''),
  ignore=(r'\.num_batches_tracked$',),
  to_config=to_hf_config,
  unprefixed=(r'^classifier\.',),
  constants=_batches_tracked,
)
