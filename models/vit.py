"""Vision Transformer (Dosovitskiy et al. 2020): image (B, H, W, C) -> logits (B, classes) float32.

Patch embedding (a p x p, stride p conv: kernel (height, width, channels, embed)), a class token,
learned position embeddings (the class token's position included), pre-LayerNorm blocks (attention
with biased q/k/v/out, exact-erf GELU MLP), a final LayerNorm, a linear classifier on the class token.

Parameters map one-to-one onto Hugging Face's ViTForImageClassification: embeddings.{cls_token,
position_embeddings, patch_embeddings.projection} = cls, pos, patch; encoder.layer.N.{layernorm_before,
attention.attention.{query,key,value}, attention.output.dense, layernorm_after, intermediate.dense,
output.dense} = blocks/layers/N/{ln1, attn.{query,key,value}, attn.out, ln2, mlp.up, mlp.down};
layernorm = ln; classifier = head. (HF's LayerNorm eps is 1e-12: config.model.norm_eps.)

Shape suffixes: B batch, H/W rows/columns (of patches after the embedding), C channels, N patches,
L tokens (N + 1), D embed, K classes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from errors import ConfigError
from models import attention
from models import hf_import as hf
from models.layers import (
  MLP,
  NORMAL_002,
  Attention,
  Conv,
  Dense,
  LayerNorm,
  Stack,
  axes,
  dtypes,
  gelu_erf,
  stack_options,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')


class Block(nnx.Module):
  """Pre-LN encoder block. `tokens`: the real tokens of a row; longer inputs are padded (keys masked)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, tokens: int | None = None, rngs: nnx.Rngs):
    self.tokens = tokens
    kw = dict(**dtypes(cfg), rngs=rngs)
    self.ln1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.attn = Attention(cfg.embed_dim, cfg.num_heads, use_bias=True, impl=cfg.attention, **kw)
    self.ln2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, activation=gelu_erf, **kw)

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    kv_length = self.tokens if self.tokens is not None and x_BLD.shape[1] > self.tokens else None
    x_BLD = shard_logical(x_BLD + self.attn(self.ln1(x_BLD), causal=False, kv_length=kv_length), ACT)
    return shard_logical(x_BLD + self.mlp(self.ln2(x_BLD)), ACT)


def _num_patches(cfg: Any) -> int:
  if cfg.image_size % cfg.patch_size:
    raise ConfigError(
      f'config.model.image_size={cfg.image_size} is not divisible by config.model.patch_size={cfg.patch_size}'
    )
  return (cfg.image_size // cfg.patch_size) ** 2


class ViT(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    D, p, N = cfg.embed_dim, cfg.patch_size, _num_patches(cfg)
    self.patch = Conv(
      cfg.channels,
      D,
      p,
      strides=p,
      padding='VALID',
      in_axis='channels',
      out_axis='embed',
      kernel_init=NORMAL_002,
      rngs=rngs,
      **kw,
    )
    self.cls = nnx.Param(NORMAL_002(rngs.params(), (D,), kw['param_dtype']), **axes('embed'))
    self.pos = nnx.Param(NORMAL_002(rngs.params(), (N + 1, D), kw['param_dtype']), **axes('length', 'embed'))
    self.blocks = Stack(lambda r: Block(cfg, tokens=N + 1, rngs=r), cfg.num_layers, **stack_options(cfg), rngs=rngs)
    self.ln = LayerNorm(D, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.head = Dense(
      'bd,dk->bk',
      (D, cfg.num_classes),
      ('embed', 'classes'),
      bias_axes=('classes',),
      preferred_element_type=jnp.float32,
      rngs=rngs,
      **kw,
    )
    self.image_size, self.dtype = cfg.image_size, kw['dtype']
    self.attention_impl, self.head_dim = cfg.attention, D // cfg.num_heads

  def __call__(self, image_BHWC: jax.Array) -> jax.Array:
    B, H, W, _ = image_BHWC.shape
    if (H, W) != (self.image_size, self.image_size):
      raise ConfigError(f'image of {H}x{W} pixels, but the model was built for image_size {self.image_size}')
    x_BHWD = shard_logical(self.patch(image_BHWC.astype(self.dtype)), ('batch', 'height', 'width', 'embed'))
    x_BND = x_BHWD.reshape(B, -1, x_BHWD.shape[-1])
    cls_B1D = jnp.broadcast_to(self.cls[...].astype(self.dtype), (B, 1, x_BND.shape[-1]))
    x_BLD = jnp.concatenate([cls_B1D, x_BND], axis=1) + self.pos[...].astype(self.dtype)
    # Where the attention kernel wants another length (cuDNN: a multiple of 8; ViT-B/16 has 197 tokens), the
    # rows are padded here once, not in every layer; the padded keys are masked, the padded queries unused.
    pad = -x_BLD.shape[1] % attention.length_multiple(self.attention_impl, self.dtype, self.head_dim)
    if pad:
      x_BLD = jnp.pad(x_BLD, ((0, 0), (0, pad), (0, 0)))
    x_BLD, _ = self.blocks(shard_logical(x_BLD, ACT))
    logits_BK = self.head(self.ln(x_BLD[:, 0]))
    return shard_logical(logits_BK, ('batch', 'classes'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, p, C, K = cfg.embed_dim, cfg.mlp_dim, cfg.patch_size, cfg.channels, cfg.num_classes
  block = 2 * 2 * D + 4 * (D * D + D) + (D * F + F) + (F * D + D)
  return (p * p * C * D + D) + D + (_num_patches(cfg) + 1) * D + cfg.num_layers * block + 2 * D + (D * K + K)


# --- Hugging Face import (models/hf_import.py): ViTForImageClassification / ViTModel ---------------
#
# config.json's num_labels is not adopted: the classifier's size follows the dataset
# (config.model.num_classes = config.dataset.num_classes). A checkpoint with as many labels loads
# completely; one with another number is an error naming the classifier's shapes until
# config.dont_load='^head/' initialises a new head (fine-tuning on new classes).


def _hf_config(c: dict) -> dict:
  for field, want, why in (
    ('hidden_act', 'gelu', "the zoo's ViT MLP uses the exact erf GELU ('gelu')"),
    ('qkv_bias', True, "the zoo's ViT attention has q/k/v biases"),
  ):
    if c.get(field, want) != want:
      raise hf.HFImportError(f'config.json {field}={c[field]!r}: {why}')
  return dict(
    embed_dim=c['hidden_size'],
    num_layers=c['num_hidden_layers'],
    num_heads=c['num_attention_heads'],
    mlp_dim=c['intermediate_size'],
    image_size=c['image_size'],
    patch_size=c['patch_size'],
    channels=c.get('num_channels', 3),
    norm_eps=c.get('layer_norm_eps', 1e-12),
  )


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same ViTForImageClassification (the inverse of _hf_config, plus
  num_labels = num_classes), without dropout (the zoo has none)."""
  return dict(
    model_type='vit',
    architectures=['ViTForImageClassification'],
    hidden_size=cfg.embed_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    intermediate_size=cfg.mlp_dim,
    hidden_act='gelu',
    image_size=cfg.image_size,
    patch_size=cfg.patch_size,
    num_channels=cfg.channels,
    layer_norm_eps=cfg.norm_eps,
    qkv_bias=True,
    num_labels=cfg.num_classes,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
  )


def _hf_params() -> list[hf.Param]:
  """HF Linear weights are (out, in): transpose, then split the heads out. The patch embedding is a
  torch conv weight (E, C, P, P) -> (P, P, C, E); cls_token (1, 1, E) -> (E,); position_embeddings
  (1, N+1, E) -> (N+1, E)."""

  def dims(cfg):  # D, H, K
    return cfg.embed_dim, cfg.num_heads, cfg.embed_dim // cfg.num_heads

  lin = [hf.T((1, 0))]

  def dense(zoo, theirs, kernel_ops=lin, bias_ops=()):
    return [
      hf.Param(f'{zoo}/layer/kernel', f'{theirs}.weight', kernel_ops),
      hf.Param(f'{zoo}/layer/bias', f'{theirs}.bias', bias_ops),
    ]

  def ln(zoo, theirs):
    return [hf.Param(f'{zoo}/scale', f'{theirs}.weight'), hf.Param(f'{zoo}/bias', f'{theirs}.bias')]

  b, h = 'blocks/layers/{i}', 'encoder.layer.{i}'
  rows = [
    hf.Param('patch/kernel', 'embeddings.patch_embeddings.projection.weight', [hf.T((2, 3, 1, 0))]),
    hf.Param('patch/bias', 'embeddings.patch_embeddings.projection.bias'),
    hf.Param('cls', 'embeddings.cls_token', lambda cfg: [hf.R((cfg.embed_dim,), (1, 1, cfg.embed_dim))]),
    hf.Param('pos', 'embeddings.position_embeddings', lambda cfg: [hf.R((-1, cfg.embed_dim), (1, -1, cfg.embed_dim))]),
    *ln(f'{b}/ln1', f'{h}.layernorm_before'),
    *dense(
      f'{b}/attn/out',
      f'{h}.attention.output.dense',
      lambda cfg: [hf.T((1, 0)), hf.R((*dims(cfg)[1:], dims(cfg)[0]), (cfg.embed_dim,) * 2)],
    ),
    *ln(f'{b}/ln2', f'{h}.layernorm_after'),
    *dense(f'{b}/mlp/up', f'{h}.intermediate.dense'),
    *dense(f'{b}/mlp/down', f'{h}.output.dense'),
    *ln('ln', 'layernorm'),
    *dense('head', 'classifier'),
  ]
  for n in ('query', 'key', 'value'):
    rows += dense(
      f'{b}/attn/{n}',
      f'{h}.attention.attention.{n}',
      lambda cfg: [hf.T((1, 0)), hf.R(dims(cfg), (cfg.embed_dim,) * 2)],
      lambda cfg: [hf.R(dims(cfg)[1:], (cfg.embed_dim,))],
    )
  return rows


# Keys are 'vit.'-prefixed in ViTForImageClassification files, bare in ViTModel ones (whose pooler,
# unused by classification, is ignored); the classifier is never prefixed.
HF = hf.Family(
  model_types=('vit',),
  config=_hf_config,
  params=_hf_params(),
  prefixes=('vit.', ''),
  ignore=(r'^(vit\.)?pooler\.',),
  to_config=to_hf_config,
  unprefixed=(r'^classifier\.',),
)
