"""Resolving whole pytrees (a model's parameters and state, optimizer state, batches) to shardings, with
validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from errors import ShardingError
from partitioning.rules import AxisRules, entry_axes, entry_size


def path_str(path: tuple[Any, ...]) -> str:
  """'blocks/0/attn/query/kernel' from a jax key path."""
  return jax.tree_util.keystr(path, simple=True, separator='/')


def _key_tuple(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(path_str((k,)) for k in path)


def nnx_logical_axes(state: nnx.State) -> dict:
  """Pure-dict tree of the logical axis names (`out_sharding` metadata) of an NNX state.

  A variable without names maps to None; `tree_specs` reports it (scalars are fine unnamed).
  """

  def axes(v):
    names = v.get_metadata().get('out_sharding')
    return tuple(names) if names is not None else None

  return nnx.to_pure_dict(jax.tree.map(axes, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def tree_specs(
  shapes: Any,
  axes: Any,
  rules: AxisRules,
  mesh_shape: Mapping[str, int],
  *,
  kind: str = 'parameter',
  seen: set[str] | None = None,
) -> Any:
  """PartitionSpecs for a tree of arrays/ShapeDtypeStructs given a matching tree of logical axes.

  Raises ShardingError naming the first offending leaf (path, logical axis, mesh axes, sizes).
  `seen` collects the logical names used, for the unused-rule warning.
  """

  def one(path, leaf, names):
    what = f'{kind} {path_str(path)!r}'
    if names is None:
      if len(leaf.shape) == 0:
        return PartitionSpec()
      raise ShardingError(
        f'{what} of shape {tuple(leaf.shape)} has no logical axis names; declare them in the model '
        "(e.g. nnx.with_partitioning(init, ('embed', 'mlp')))"
      )
    names = tuple(names)
    if None in names:  # only activations may leave a dim unnamed; stored arrays name every dim
      dim = names.index(None)
      raise ShardingError(
        f'{what} of shape {tuple(leaf.shape)}: dim {dim} has no logical axis name ({names}); name it in the '
        "model and give the name a rule (('name', None) replicates it)"
      )
    if seen is not None:
      seen.update(n for n in names if n is not None)
    return rules.spec(names, leaf.shape, mesh_shape, what=what)

  return jax.tree_util.tree_map_with_path(one, shapes, axes)


def opt_state_axes(opt_shapes: Any, param_shapes: Any, param_axes: Any) -> Any:
  """Logical axes for an optax state: each leaf that mirrors a parameter gets that parameter's axes.

  A leaf mirrors a parameter when its key path ends with the parameter's path and the shapes match
  (mu/nu of Adam, momentum, ...). Scalars (step counts) are replicated. Anything else is an error,
  rather than a silent replication.
  """
  by_path: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(param_shapes):
    by_path[_key_tuple(path)] = (tuple(leaf.shape), None)
  for path, names in jax.tree_util.tree_leaves_with_path(param_axes, is_leaf=lambda x: isinstance(x, tuple)):
    key = _key_tuple(path)
    by_path[key] = (by_path[key][0], names)
  lengths = sorted({len(k) for k in by_path}, reverse=True)

  def one(path, leaf):
    if len(leaf.shape) == 0:
      return ()
    key = _key_tuple(path)
    for n in lengths:
      hit = by_path.get(key[-n:]) if len(key) >= n else None
      if hit is not None and hit[0] == tuple(leaf.shape):
        return hit[1]
    raise ShardingError(
      f'optimizer state {path_str(path)!r} of shape {tuple(leaf.shape)} mirrors no parameter; '
      'this optimizer keeps state the sharding rules cannot place'
    )

  return jax.tree_util.tree_map_with_path(one, opt_shapes)


def named_shardings(specs: Any, mesh: Mesh) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def sharded_abstract(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying their NamedShardings: targets that orbax (and jax.jit) fill shard by shard."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


@dataclasses.dataclass(frozen=True)
class PlacedModel:
  """A model built abstractly and placed by the rules. Each tree is a dict {'params', 'model_state'} of pure dicts
  (model_state: the non-parameter variables, e.g. BatchNorm statistics; often {})."""

  graphdef: Any
  abstract: dict[str, Any]  # ShapeDtypeStructs
  axes: dict[str, Any]  # logical axis names per leaf
  specs: dict[str, Any]  # PartitionSpec per leaf
  shardings: dict[str, Any]  # NamedSharding per leaf

  def targets(self, kind: str) -> Any:
    """`kind`'s ('params' or 'model_state') ShapeDtypeStructs carrying their shardings, for a weight loader."""
    return sharded_abstract(self.abstract[kind], self.shardings[kind])


def place_model(
  make_model: Callable[[nnx.Rngs], nnx.Module],
  rules: AxisRules,
  mesh: Mesh,
  *,
  seed: int = 0,
  seen: set[str] | None = None,
) -> PlacedModel:
  """The one model builder (training and decoding alike): `make_model` traced abstractly (nothing allocated),
  every parameter and model-state leaf resolved by the rules; ShardingError naming the first that fails."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(seed))), nnx.Param, ...)
  abstract = {'params': nnx.to_pure_dict(params), 'model_state': nnx.to_pure_dict(rest)}
  axes = {'params': nnx_logical_axes(params), 'model_state': nnx_logical_axes(rest)}
  kinds = {'params': 'parameter', 'model_state': 'model state'}
  specs = {k: tree_specs(abstract[k], axes[k], rules, mesh.shape, kind=kinds[k], seen=seen) for k in kinds}
  return PlacedModel(graphdef, abstract, axes, specs, named_shardings(specs, mesh))


def leading_rows(indices: Iterable[tuple[slice, ...]], size: int) -> tuple[list[tuple[int, int]], bool]:
  """The distinct (start, stop) ranges of the leading axis (of length `size`) that these shards hold
  (`devices_indices_map` values), sorted, and whether together they are one contiguous block."""
  spans = sorted({(i[0].start or 0, i[0].stop if i[0].stop is not None else size) for i in indices})
  return spans, sum(b - a for a, b in spans) == spans[-1][1] - spans[0][0]


def check_batch(global_batch_size: int, batch_spec: PartitionSpec, mesh_shape: Mapping[str, int]) -> None:
  """The global batch must split evenly over the mesh axes that the 'batch' rule shards it on."""
  entry = batch_spec[0] if len(batch_spec) else None
  axes = entry_axes(entry)
  size = entry_size(entry, mesh_shape)
  if global_batch_size % size:
    parts = ' x '.join(f'{a}={mesh_shape[a]}' for a in axes)
    raise ShardingError(
      f'global batch size {global_batch_size} is not divisible by the mesh axes of logical axis '
      f"'batch' ({parts} = {size}); use a multiple of {size}"
    )
