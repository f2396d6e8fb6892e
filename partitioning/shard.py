"""Placing pytrees on the mesh, and logical activation constraints for model code."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from partitioning.rules import AxisRules


def shard(tree: Any, shardings: Any) -> Any:
  """Puts every leaf of `tree` on its sharding; `shardings` is a matching tree (or one sharding).

  Inside `jax.jit` this is a sharding constraint; outside it places the data: a `jax.Array` is
  resharded with `device_put`, a host value (numpy, scalar) is cut into per-device slices with
  `make_array_from_callback`, so each device (and each process) only copies its own slice.
  """

  def one(x, s):
    if isinstance(x, jax.core.Tracer):
      return jax.lax.with_sharding_constraint(x, s)
    if isinstance(x, jax.Array):
      return jax.device_put(x, s)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: one(x, shardings), tree)
  return jax.tree.map(one, tree, shardings)


@dataclasses.dataclass
class RulesContext:
  """What an enclosing `use_rules` holds for the code traced inside it."""

  rules: AxisRules
  mesh: Mesh
  seen: set[str]  # logical names used by activations while this context was active
  balance: bool = False  # causal load balancing of a sharded 'length' (partitioning/context.py)
  pipeline: Any = None  # the pipeline.Schedule scanned layer stacks run as (partitioning/pipeline.py), or None


_CTX: contextvars.ContextVar[RulesContext | None] = contextvars.ContextVar('shardzoo_rules', default=None)


@contextlib.contextmanager
def use_rules(
  rules: AxisRules, mesh: Mesh, seen: set[str] | None = None, balance: bool = False, pipeline: Any = None
) -> Iterator[RulesContext]:
  """Activates `rules` on `mesh` for `shard_logical` calls made while tracing model code.

  Logical names used by activations are added to `seen` (for the unused-rule warning). `balance`: causal
  load balancing of a sharded sequence (config.context_load_balance; partitioning/context.py). `pipeline`: the
  schedule (partitioning/pipeline.py) scanned layer stacks run as where the rules map 'layers' to 'stage'.
  """
  ctx = RulesContext(rules, mesh, set() if seen is None else seen, balance, pipeline)
  token = _CTX.set(ctx)
  try:
    yield ctx
  finally:
    _CTX.reset(token)


@contextlib.contextmanager
def suspend_rules() -> Iterator[None]:
  """`shard_logical` does nothing inside (sharding comes from propagation): for model code run under a vmap
  whose mapped dimension carries mesh axes the rules would give an inner dimension (training.tasks)."""
  token = _CTX.set(None)
  try:
    yield
  finally:
    _CTX.reset(token)


def active_context() -> RulesContext | None:
  """The enclosing `use_rules`'s rules, mesh and options (load balancing, pipeline), or None outside it."""
  return _CTX.get()


def active_mesh() -> Mesh | None:
  """The mesh of the enclosing `use_rules`, or None outside it."""
  ctx = _CTX.get()
  return None if ctx is None else ctx.mesh


def logical_spec(
  logical_axes: Sequence[str | None], shape: Sequence[int], _depth: int = 2
) -> jax.sharding.PartitionSpec | None:
  """The PartitionSpec the active rules give an activation of this shape, or None outside `use_rules`.
  Errors name the code `_depth` frames up from the message's maker (default: this function's caller)."""
  ctx = _CTX.get()
  if ctx is None:
    return None
  ctx.seen.update(a for a in logical_axes if a is not None)
  return ctx.rules.spec(
    logical_axes,
    shape,
    ctx.mesh.shape,
    what=f'activation {tuple(logical_axes)} of shape {tuple(shape)} at {_caller(_depth)}',
  )


def _caller(depth: int) -> str:
  """file:line of the code `depth` frames above this one (2: logical_spec's caller), for error messages."""
  f = sys._getframe(depth)
  return f'{"/".join(f.f_code.co_filename.rsplit("/", 2)[-2:])}:{f.f_lineno} ({f.f_code.co_name})'


def shard_logical(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation by logical axis names; a no-op outside `use_rules`.

  Model code calls this at block boundaries, e.g. `shard_logical(x_BLD, ('batch', 'length', 'embed'))`.
  A logical name without a rule raises here, at trace time, before anything compiles.
  """
  spec = logical_spec(logical_axes, x.shape, _depth=3)  # errors name shard_logical's caller
  return x if spec is None else jax.lax.with_sharding_constraint(x, NamedSharding(active_mesh(), spec))
