"""Checksums of a checkpoint's arrays: computed on the devices when it is saved (its item 'checksums': one uint32 per
array, their paths in the item's custom metadata) and checked against what any load reads back: the Checkpointer's
resume (the whole train state) and weights.py's loads (a fine-tune's init_from, decoding, export: parameters and
model state only)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from partitioning import path_str

# Each array's checksum is the sum, modulo 2**32, of its 32-bit words (one per element; two per 64-bit element;
# 8- and 16-bit elements widened) each times an odd weight derived from the word's position in the whole array. A
# sum is the same however the array is split: every device sums its own shard inside one jitted program (no copy to
# the host, so the save stays asynchronous) and XLA adds the partial sums; the figure is independent of the mesh,
# rules and process count, so a checkpoint restored onto another layout is checked all the same. An odd weight makes
# any change to a single word change the sum; several changes escape with odds of about 2**-32.
_WEIGHT = 0x9E3779B1  # odd; Knuth's multiplicative hash constant spreads neighbouring positions apart


def _words(x: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[np.dtype(x.dtype).itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
  w = _words(x)
  index, stride = jnp.zeros(w.shape, jnp.uint32), 1
  for d in reversed(range(w.ndim)):  # the word's flat position, from per-dimension iotas (each device makes its own)
    index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
    stride *= w.shape[d]
  return jnp.sum(w * (index * jnp.uint32(_WEIGHT) | jnp.uint32(1)), dtype=jnp.uint32)


@functools.cache
def _checksums_on(mesh: Any) -> Any:
  replicated = jax.sharding.NamedSharding(mesh, jax.P()) if mesh is not None else None
  return jax.jit(lambda tree: jnp.stack([_checksum(x) for x in jax.tree.leaves(tree)]), out_shardings=replicated)


def checksums(tree: Any) -> jax.Array:
  """One uint32 per leaf of `tree` (jax.Arrays, in jax.tree.leaves order), computed on the devices that hold them;
  the result is replicated. Dispatched asynchronously like any jitted call."""
  sharding = jax.tree.leaves(tree)[0].sharding
  return _checksums_on(getattr(sharding, 'mesh', None))(tree)


def paths(tree: Any) -> list[str]:
  return [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def save_args(tree: Any) -> ocp.args.StandardSave:
  """The 'checksums' item of a checkpoint of `tree`: the arrays' checksums (dispatched now, on the devices) and
  their paths, so that a load of any part of the tree finds its own."""
  return ocp.args.StandardSave({'sums': checksums(tree)}, custom_metadata={'paths': paths(tree)})


def replicated(target: Any) -> jax.sharding.NamedSharding:
  """The checksums' sharding: replicated on the mesh the target's arrays live on."""
  return jax.sharding.NamedSharding(jax.tree.leaves(target)[0].sharding.mesh, jax.P())


def sums_target(count: int, target: Any) -> dict[str, jax.ShapeDtypeStruct]:
  return {'sums': jax.ShapeDtypeStruct((count,), jnp.uint32, sharding=replicated(target))}


def saved_order(state: Any) -> list[str]:
  """The paths of a saved state's arrays in the order its checksums were computed (jax.tree.leaves of the tree
  saved), from orbax's metadata tree of it: for checksums saved without their paths. Orbax keeps every dict key
  as a string, where JAX had sorted integer keys (layer indices) as numbers."""

  def walk(node: Any, prefix: tuple[str, ...]) -> list[str]:
    if isinstance(node, Mapping):
      keys = sorted(node, key=int) if node and all(str(k).isdigit() for k in node) else sorted(node)
      return [p for k in keys for p in walk(node[k], (*prefix, str(k)))]
    if isinstance(node, (list, tuple)):
      return [p for i, v in enumerate(node) for p in walk(v, (*prefix, str(i)))]
    return ['/'.join(prefix)] if hasattr(node, 'shape') else []  # empty states are saved as None

  return walk(state, ())


def differing(tree: Any, step_dir: str, state_metadata: Any) -> tuple[list[str], int] | None:
  """The paths of `tree`'s arrays (read from the step directory `step_dir`: any part of the state saved there, the
  same paths) whose checksums differ from those saved with them, and how many were checked; None for a checkpoint
  written before checksums existed. Raises whatever reading the saved checksums raises (damage to the caller)."""
  item = epath.Path(step_dir) / 'checksums'
  if not item.exists():
    return None
  handler = ocp.StandardCheckpointHandler()
  md = handler.metadata(item)
  count = md.tree['sums'].shape[0]
  order = (md.custom_metadata or {}).get('paths') or saved_order(state_metadata)
  if len(order) != count:
    raise ValueError(f'{count} checksums saved for {len(order)} arrays')
  sums = handler.restore(item, args=ocp.args.StandardRestore(sums_target(count, tree)))['sums']
  sums = np.asarray(jax.device_get(sums))
  index = {p: i for i, p in enumerate(order)}
  mine = paths(tree)
  if missing := [p for p in mine if p not in index]:
    raise ValueError(f'no checksum saved for {missing[0]}')
  found = np.asarray(jax.device_get(checksums(tree)))
  return [p for p, f in zip(mine, found, strict=True) if f != sums[index[p]]], len(mine)


def named(bad: Sequence[str], limit: int = 3) -> str:
  return ', '.join(bad[:limit]) + (f' and {len(bad) - limit} more' if len(bad) > limit else '')
