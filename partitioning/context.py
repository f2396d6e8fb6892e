"""Causal load balancing for context parallelism: the zigzag order of a sequence sharded along 'length'.

Split contiguously over c context shards, a causal row gives shard i's queries (i + 1/2) / c of the keys: the
last shard has 2c - 1 times the first one's attention work, and a kernel that skips masked blocks (splash on
TPUs) waits on it. `config.context_load_balance = True` stores each row in zigzag order instead: the row is cut
into 2c chunks of L / 2c tokens, and shard i holds chunks i and 2c - 1 - i, so every shard's queries see the same
number of keys. Chunks of c = 4 shards, shard by shard: [0 7] [1 6] [2 5] [3 4].

Who does what: the language-model task (training/tasks.py) permutes its batch fields to this order inside the
step (integer fields only: the activations are born in it, no activation is ever moved) and passes every
token's natural position, for learned and rotary position embeddings; the loss is a sum over tokens and does not
care. It runs the model under `zigzag(c)`, and attention (models/attention.py) reads `zigzag_shards()` to build
its causal masks from natural positions: per shard, the all-gathered keys are put back in natural order
(`from_zigzag`) and the shard's queries carry their positions (`zigzag_positions`).

With one context shard the order is the natural one. This module never imports a model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from errors import ConfigError
from partitioning.rules import entry_axes, entry_size
from partitioning.shard import active_context

_ZIGZAG: contextvars.ContextVar[int] = contextvars.ContextVar('shardzoo_zigzag_shards', default=1)


def balanced_shards(batch: int, length: int) -> int:
  """The number of context shards to balance a (batch, length) row over: how many devices the active rules
  split 'length' into, when the active `use_rules` asks for balancing (`balance=True`); 1 otherwise."""
  ctx = active_context()
  if ctx is None or not ctx.balance:
    return 1
  spec = ctx.rules.spec(
    ('batch', 'length'),
    (batch, length),
    ctx.mesh.shape,
    what=f'batch field of shape {(batch, length)} (context_load_balance)',
  )
  entry = spec[1] if len(spec) > 1 else None
  names, shards = entry_axes(entry), entry_size(entry, ctx.mesh.shape)
  if shards > 1 and length % (2 * shards):
    raise ConfigError(
      f'config.context_load_balance cuts each row of {length} tokens into 2 x {shards} chunks (the '
      f"context shards of 'length', mesh axes {names}), and {length} is not divisible by "
      f'{2 * shards}: make the sequence length a multiple of {2 * shards}'
    )
  return shards


def zigzag_positions(length: int, shards: int) -> np.ndarray:
  """(length,) int32: the natural position of each slot of a row in zigzag order over `shards`."""
  chunk = length // (2 * shards)
  pairs = [(i, 2 * shards - 1 - i) for i in range(shards)]
  return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for pair in pairs for c in pair]).astype(np.int32)


def to_zigzag(x: Any, shards: int, axis: int = 1) -> Any:
  """A row in natural order along `axis` -> zigzag order (chunk i, then chunk 2c - 1 - i, for each shard i)."""
  if shards == 1:
    return x
  chunks = _chunks(x, 2 * shards, axis)  # (..., 2c, L / 2c, ...)
  first = jax.lax.slice_in_dim(chunks, 0, shards, axis=axis)
  last = jnp.flip(jax.lax.slice_in_dim(chunks, shards, 2 * shards, axis=axis), axis=axis)
  return jnp.stack([first, last], axis=axis + 1).reshape(x.shape)  # (..., c, 2, L / 2c, ...)


def from_zigzag(x: Any, shards: int, axis: int = 1) -> Any:
  """The inverse of `to_zigzag`: a row in zigzag order along `axis` -> natural order."""
  if shards == 1:
    return x
  pairs = _chunks(x, shards, axis)  # (..., c, 2 L / 2c, ...): shard i's chunks i and 2c - 1 - i
  pairs = pairs.reshape(*pairs.shape[: axis + 1], 2, -1, *pairs.shape[axis + 2 :])
  first = jax.lax.index_in_dim(pairs, 0, axis=axis + 1, keepdims=False)
  last = jnp.flip(jax.lax.index_in_dim(pairs, 1, axis=axis + 1, keepdims=False), axis=axis)
  return jnp.concatenate([first, last], axis=axis).reshape(x.shape)


def _chunks(x: Any, n: int, axis: int) -> Any:
  return x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1 :])


@contextlib.contextmanager
def zigzag(shards: int) -> Iterator[None]:
  """Model code traced inside sees rows in zigzag order over `shards` context shards (1: natural order)."""
  token = _ZIGZAG.set(shards)
  try:
    yield
  finally:
    _ZIGZAG.reset(token)


def zigzag_shards() -> int:
  """The context shards the rows being traced are in zigzag order over; 1 for natural order."""
  return _ZIGZAG.get()
