"""Logical-axis rules: parsing, resolution to PartitionSpecs, and validation.

See the package docstring (`partitioning/__init__.py`) for the semantics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from errors import ShardingError

LogicalAxes = tuple[str | None, ...]
MeshAxes = tuple[str, ...]


def entry_axes(entry: Any) -> MeshAxes:
  """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names) as a tuple."""
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def entry_size(entry: Any, mesh_shape: Mapping[str, int]) -> int:
  """How many devices one PartitionSpec entry splits its dimension over."""
  return math.prod(mesh_shape[a] for a in entry_axes(entry))


def fmt_mesh(mesh_shape: Mapping[str, int]) -> str:
  """A mesh shape as errors name it: 'data=2 x fsdp=4'."""
  return ' x '.join(f'{k}={v}' for k, v in mesh_shape.items()) or '(empty mesh)'


def _fmt_target(axes: MeshAxes) -> str:
  if not axes:
    return 'None'
  return repr(axes[0]) if len(axes) == 1 else repr(axes)


@dataclasses.dataclass(frozen=True)
class Rule:
  index: int  # position in the user's list, for error messages
  logical: str
  mesh_axes: MeshAxes  # () means replicate

  def __str__(self) -> str:
    return f'rule #{self.index} ({self.logical!r}, {_fmt_target(self.mesh_axes)})'


def rule_problem(rule: Any) -> str:
  """What is wrong with one logical-axis rule ('' if nothing): the one check of a rule's shape (AxisRules parses
  with it; configs/schema.py names a config's bad rule by its index with it)."""
  if not isinstance(rule, (tuple, list)):
    return f'not a pair but a {type(rule).__name__}'
  if len(rule) != 2:
    return f'{len(rule)} items, not 2'
  logical, target = rule
  if not isinstance(logical, str):
    return f'the logical name {logical!r} is not a string'
  if not logical:
    return 'the logical name must be a non-empty string'
  if not (
    target is None
    or isinstance(target, str)
    or (isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target))
  ):
    return f'the target {target!r} is not a mesh axis name, a tuple of them or None'
  axes = entry_axes(tuple(target) if isinstance(target, list) else target)
  if len(set(axes)) != len(axes):
    return f'a mesh axis appears twice in the target {target!r}'
  return ''


def _parse_rule(i: int, rule: Any) -> Rule:
  if why := rule_problem(rule):
    shown = tuple(rule) if isinstance(rule, list) else rule
    raise ShardingError(
      f'logical_axis_rules[{i}] = {shown!r}: must be a pair (logical name, mesh axis | tuple of mesh axes | None); '
      f'{why}'
    )
  logical, target = rule
  return Rule(i, logical, entry_axes(tuple(target) if isinstance(target, list) else target))


class AxisRules:
  """An ordered list of (logical_name, mesh_axes) rules with first-free-match semantics."""

  def __init__(self, rules: Sequence[Any]):
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
      raise ShardingError(f'logical_axis_rules must be a list of pairs, got {type(rules).__name__}')
    self.rules: tuple[Rule, ...] = tuple(_parse_rule(i, r) for i, r in enumerate(rules))
    self._by_name: dict[str, list[Rule]] = {}
    for r in self.rules:
      self._by_name.setdefault(r.logical, []).append(r)

  def __repr__(self) -> str:
    return 'AxisRules([' + ', '.join(f'({r.logical!r}, {_fmt_target(r.mesh_axes)})' for r in self.rules) + '])'

  def without(self, mesh_axis: str) -> AxisRules:
    """The same rules with `mesh_axis` taken out of every target (a pipeline's stage dimension is vmapped over
    it: inside, nothing else may use it)."""
    out = AxisRules([])
    out.rules = tuple(
      dataclasses.replace(r, mesh_axes=tuple(a for a in r.mesh_axes if a != mesh_axis)) for r in self.rules
    )
    for r in out.rules:
      out._by_name.setdefault(r.logical, []).append(r)
    return out

  @property
  def logical_names(self) -> set[str]:
    return set(self._by_name)

  def check_mesh(self, mesh_shape: Mapping[str, int]) -> None:
    """Every mesh axis named by a rule must exist in the mesh."""
    for r in self.rules:
      for a in r.mesh_axes:
        if a not in mesh_shape:
          raise ShardingError(f'{r} names mesh axis {a!r}, which is not in the mesh ({fmt_mesh(mesh_shape)})')

  def spec(
    self,
    logical_axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh_shape: Mapping[str, int] | None = None,
    *,
    what: str = 'array',
  ) -> PartitionSpec:
    """Resolves one array's logical axes to a PartitionSpec.

    For each dimension, the first rule for its logical name whose mesh axes are not already
    taken by another dimension of the same array wins; later rules are fallbacks. A logical
    name of `None` (only allowed for activations) leaves the dimension unsharded.
    With `shape` and `mesh_shape`, also checks divisibility.
    """
    logical_axes = tuple(logical_axes)
    if shape is not None and len(shape) != len(logical_axes):
      raise ShardingError(
        f'{what}: has {len(shape)} dimensions (shape {tuple(shape)}) but {len(logical_axes)} '
        f'logical axis names {logical_axes}'
      )
    used: dict[str, int] = {}  # mesh axis -> dim that took it
    out: list[Any] = []
    for dim, name in enumerate(logical_axes):
      if name is None:
        out.append(None)
        continue
      candidates = self._by_name.get(name)
      if not candidates:
        raise ShardingError(
          f'{what}: logical axis {name!r} (dim {dim}) has no rule; add ({name!r}, <mesh axis>) '
          f'to logical_axis_rules, or ({name!r}, None) to replicate it'
        )
      chosen = next((r for r in candidates if not any(a in used for a in r.mesh_axes)), None)
      if chosen is None:
        taken = {a: used[a] for r in candidates for a in r.mesh_axes if a in used}
        taken_s = ', '.join(f'{a!r} by dim {d} ({logical_axes[d]!r})' for a, d in taken.items())
        raise ShardingError(
          f'{what}: logical axis {name!r} (dim {dim}): every rule for it names a mesh axis '
          f'already taken ({taken_s}); add a fallback rule ({name!r}, None) to replicate this dim'
        )
      for a in chosen.mesh_axes:
        used[a] = dim
      if shape is not None and mesh_shape is not None and chosen.mesh_axes:
        missing = [a for a in chosen.mesh_axes if a not in mesh_shape]
        if missing:
          raise ShardingError(
            f'{chosen} names mesh axis {missing[0]!r}, which is not in the mesh ({fmt_mesh(mesh_shape)})'
          )
        size = math.prod(mesh_shape[a] for a in chosen.mesh_axes)
        if shape[dim] % size:
          parts = ' x '.join(f'{a}={mesh_shape[a]}' for a in chosen.mesh_axes)
          raise ShardingError(
            f'{what}: dim {dim} ({name!r}) has size {shape[dim]}, not divisible by mesh axes '
            f'{parts} = {size} (from {chosen})'
          )
      if not chosen.mesh_axes:
        out.append(None)
      elif len(chosen.mesh_axes) == 1:
        out.append(chosen.mesh_axes[0])
      else:
        out.append(chosen.mesh_axes)
    # Drop trailing Nones so specs compare equal to the canonical short form.
    while out and out[-1] is None:
      out.pop()
    return PartitionSpec(*out)

  def unused(self, names_seen: set[str]) -> list[Rule]:
    """Rules whose logical name no parameter or activation used."""
    return [r for r in self.rules if r.logical not in names_seen]


def bytes_per_device(shape: Sequence[int], dtype: Any, spec: PartitionSpec, mesh_shape: Mapping[str, int]) -> int:
  """Bytes one device holds of an array with this spec (dims assumed divisible)."""
  n = math.prod(shape) * np.dtype(dtype).itemsize
  for entry in spec:
    n //= entry_size(entry, mesh_shape)
  return n
