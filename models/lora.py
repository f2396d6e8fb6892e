"""LoRA adapters on chosen Dense layers of any zoo model (config.lora: rank, alpha, targets regex).

`apply(model, rank, alpha, targets, rngs)` replaces every `layers.Dense` whose module path matches
`targets` (e.g. 'attn/(query|value)$') with a LoRADense that keeps the base layer (same parameter
paths, so pretrained weights load unchanged) and adds y += (alpha / rank) * (x A) B. A takes the
kernel's input logical axes plus 'lora_rank', B 'lora_rank' plus its output axes, so adapters are
sharded by the same rules as the layer. B starts at zero: the adapted model starts equal to the base.
In a scanned stack the adapters get the leading 'layers' axis like every other parameter.
`merge(model)` folds the adapters into the base kernels (for export) and removes them.
`nnx.view(model, adapters=False)` is the base model, the adapters switched off, sharing every array: preference
tuning's reference (training/preference.py) without a second copy of the weights.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from errors import ConfigError
from models.layers import Dense, axes
from partitioning import path_str

LORA_PARAM = re.compile(r'(^|/)lora_[ab]$')  # paths of adapter parameters


def _spec(dense: Dense) -> tuple[str, str, str]:
  """(input spec, kernel spec, output spec) of the dense layer's einsum, e.g. ('bld', 'dhk', 'blhk')."""
  lhs, out = dense.layer.einsum_str.replace(' ', '').split('->')
  x_spec, k_spec = lhs.split(',')
  return x_spec, k_spec, out


class LoRADense(Dense):
  """A Dense layer plus a low-rank update; the base kernel and bias are unchanged."""

  def __init__(self, base: Dense, rank: int, alpha: float, *, rngs: nnx.Rngs):
    self.layer = base.layer
    x_spec, k_spec, out_spec = _spec(base)
    kernel = base.layer.kernel
    names = kernel.get_metadata()['out_sharding']
    lead = kernel.ndim - len(k_spec)  # a leading 'layers' axis in scanned stacks
    k_names, k_shape = names[lead:], kernel.shape[lead:]
    contract = [i for i, c in enumerate(k_spec) if c in x_spec]
    outs = [i for i, c in enumerate(k_spec) if c not in x_spec]
    r = 'z' if 'z' not in x_spec + k_spec + out_spec else 'Z'
    batch_in = ''.join(c for c in x_spec if c not in k_spec)
    self.down_einsum = f'{x_spec},{"".join(k_spec[i] for i in contract)}{r}->{batch_in}{r}'
    self.up_einsum = f'{batch_in}{r},{r}{"".join(k_spec[i] for i in outs)}->{out_spec}'
    self.delta_einsum = (
      f'...{"".join(k_spec[i] for i in contract)}{r},...{r}{"".join(k_spec[i] for i in outs)}->...{k_spec}'
    )
    a_shape = kernel.shape[:lead] + tuple(k_shape[i] for i in contract) + (rank,)
    b_shape = kernel.shape[:lead] + (rank,) + tuple(k_shape[i] for i in outs)
    fan_in = math.prod(k_shape[i] for i in contract)
    a_init = nnx.initializers.normal(fan_in**-0.5)
    self.lora_a = nnx.Param(
      a_init(rngs.params(), a_shape, kernel.dtype), **axes(*names[:lead], *(k_names[i] for i in contract), 'lora_rank')
    )
    self.lora_b = nnx.Param(
      jnp.zeros(b_shape, kernel.dtype), **axes(*names[:lead], 'lora_rank', *(k_names[i] for i in outs))
    )
    self.scale = alpha / rank
    self.dtype = base.layer.dtype or jnp.float32
    self.adapters = True

  def set_view(self, adapters: bool | None = None) -> None:
    """nnx.view(model, adapters=False): the base layer alone."""
    if adapters is not None:
      self.adapters = adapters

  def __call__(self, x: jax.Array) -> jax.Array:
    if not self.adapters:
      return self.layer(x)
    a = self.lora_a[...].astype(self.dtype)
    b = self.lora_b[...].astype(self.dtype)
    low = jnp.einsum(self.down_einsum, x.astype(self.dtype), a)
    return self.layer(x) + (self.scale * jnp.einsum(self.up_einsum, low, b)).astype(self.dtype)

  def merged(self) -> Dense:
    """The base layer with W + scale * A B folded in."""
    kernel = self.layer.kernel
    delta = jnp.einsum(self.delta_einsum, self.lora_a[...], self.lora_b[...])
    kernel[...] = kernel[...] + (self.scale * delta).astype(kernel.dtype)
    return _Merged(self.layer)


class _Merged(Dense):
  """A Dense layer built around an existing (merged) nnx.Einsum."""

  def __init__(self, layer: nnx.Einsum):
    self.layer = layer


def _targets(model: nnx.Module, pattern: str, kind: type) -> list[tuple[tuple, nnx.Module]]:
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ConfigError(f'config.lora.targets={pattern!r} is not a valid regex: {e}') from None
  return [
    (path, node)
    for path, node in nnx.iter_graph(model)
    if isinstance(node, kind) and path and regex.search(path_str(path))
  ]


def _replace(model: nnx.Module, path: tuple, node: nnx.Module) -> None:
  parent = model
  for k in path[:-1]:
    parent = parent[k] if isinstance(k, int) else getattr(parent, k)
  if isinstance(path[-1], int):
    parent[path[-1]] = node
  else:
    setattr(parent, path[-1], node)


def apply(model: nnx.Module, rank: int, alpha: float, targets: str, rngs: nnx.Rngs) -> nnx.Module:
  if rank <= 0:
    raise ConfigError(f'config.lora.rank={rank} must be positive')
  found = [(p, n) for p, n in _targets(model, targets, Dense) if not isinstance(n, LoRADense)]
  if not found:
    dense = [path_str(p) for p, n in nnx.iter_graph(model) if isinstance(n, Dense)]
    raise ConfigError(f'config.lora.targets={targets!r} matches no Dense layer; Dense layers are e.g. {dense[:6]}')
  for path, node in found:
    _replace(model, path, LoRADense(node, rank, alpha, rngs=rngs))
  return model


def merge(model: nnx.Module) -> nnx.Module:
  """Folds every adapter into its base kernel (in place) and removes the adapters."""
  for path, node in _targets(model, '', LoRADense):
    _replace(model, path, node.merged())
  return model
