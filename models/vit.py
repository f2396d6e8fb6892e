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

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models.layers import MLP, NORMAL_002, Attention, Conv, Dense, LayerNorm, Stack, axes, dtypes
from partitioning import ConfigError, shard_logical

ACT = ('batch', 'length', 'embed')
GELU_ERF = functools.partial(jax.nn.gelu, approximate=False)  # HF's "gelu"


class Block(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dict(**dtypes(cfg), rngs=rngs)
    self.ln1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.attn = Attention(cfg.embed_dim, cfg.num_heads, use_bias=True, **kw)
    self.ln2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, **kw)
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, activation=GELU_ERF, **kw)

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x_BLD = shard_logical(x_BLD + self.attn(self.ln1(x_BLD), causal=False), ACT)
    return shard_logical(x_BLD + self.mlp(self.ln2(x_BLD)), ACT)


def _num_patches(cfg: Any) -> int:
  if cfg.image_size % cfg.patch_size:
    raise ConfigError(f'config.model.image_size={cfg.image_size} is not divisible by '
                      f'config.model.patch_size={cfg.patch_size}')
  return (cfg.image_size // cfg.patch_size) ** 2


class ViT(nnx.Module):
  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    kw = dtypes(cfg)
    D, p, N = cfg.embed_dim, cfg.patch_size, _num_patches(cfg)
    self.patch = Conv(cfg.channels, D, p, strides=p, padding='VALID', in_axis='channels', out_axis='embed',
                      kernel_init=NORMAL_002, rngs=rngs, **kw)
    self.cls = nnx.Param(NORMAL_002(rngs.params(), (D,), kw['param_dtype']), **axes('embed'))
    self.pos = nnx.Param(NORMAL_002(rngs.params(), (N + 1, D), kw['param_dtype']), **axes('length', 'embed'))
    self.blocks = Stack(lambda r: Block(cfg, rngs=r), cfg.num_layers, scan=cfg.get('scan_layers', False),
                        remat=cfg.get('remat', False), rngs=rngs)
    self.ln = LayerNorm(D, eps=cfg.norm_eps, **kw, rngs=rngs)
    self.head = Dense('bd,dk->bk', (D, cfg.num_classes), ('embed', 'classes'), bias_axes=('classes',),
                      preferred_element_type=jnp.float32, rngs=rngs, **kw)
    self.image_size, self.dtype = cfg.image_size, kw['dtype']

  def __call__(self, image_BHWC: jax.Array) -> jax.Array:
    B, H, W, _ = image_BHWC.shape
    if (H, W) != (self.image_size, self.image_size):
      raise ConfigError(f'image of {H}x{W} pixels, but the model was built for image_size {self.image_size}')
    x_BHWD = shard_logical(self.patch(image_BHWC.astype(self.dtype)), ('batch', 'height', 'width', 'embed'))
    x_BND = x_BHWD.reshape(B, -1, x_BHWD.shape[-1])
    cls_B1D = jnp.broadcast_to(self.cls[...].astype(self.dtype), (B, 1, x_BND.shape[-1]))
    x_BLD = jnp.concatenate([cls_B1D, x_BND], axis=1) + self.pos[...].astype(self.dtype)
    x_BLD, _ = self.blocks(shard_logical(x_BLD, ACT))
    logits_BK = self.head(self.ln(x_BLD[:, 0]))
    return shard_logical(logits_BK, ('batch', 'classes'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  D, F, p, C, K = cfg.embed_dim, cfg.mlp_dim, cfg.patch_size, cfg.channels, cfg.num_classes
  block = 2 * 2 * D + 4 * (D * D + D) + (D * F + F) + (F * D + D)
  return (p * p * C * D + D) + D + (_num_patches(cfg) + 1) * D + cfg.num_layers * block + 2 * D + (D * K + K)
