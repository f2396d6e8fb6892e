"""The sharding tables printed at start-up: where every parameter lives and what it costs per device, in full
(one row per parameter) or summarised (one row per module)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from partitioning.plan import path_str
from partitioning.rules import bytes_per_device


def fmt_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.2f} {unit}'
    n /= 1024
  raise AssertionError


def _spec_str(spec: PartitionSpec) -> str:
  return 'P(' + ', '.join('None' if e is None else (repr(e) if isinstance(e, str) else str(e)) for e in spec) + ')'


def tree_bytes_per_device(shapes: Any, specs: Any, mesh_shape: Mapping[str, int]) -> int:
  leaves = jax.tree.leaves(shapes)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return sum(bytes_per_device(l.shape, l.dtype, s, mesh_shape) for l, s in zip(leaves, spec_leaves, strict=True))


def sharding_table(
  param_shapes: Any,
  param_axes: Any,
  param_specs: Any,
  mesh_shape: Mapping[str, int],
  opt_shapes: Any = None,
  opt_specs: Any = None,
  what: str = 'parameter',
) -> str:
  """A text table: path, shape, dtype, logical axes, PartitionSpec, bytes per device; then totals. `what` names
  the arrays (parameters; 'KV cache' for generation's)."""
  rows = [(what, 'shape', 'dtype', 'logical axes', 'spec', 'bytes/device')]
  total = 0
  flat_axes = dict(jax.tree_util.tree_leaves_with_path(param_axes, is_leaf=lambda x: isinstance(x, tuple)))
  flat_specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  flat = jax.tree_util.tree_leaves_with_path(param_shapes)
  for (path, leaf), spec in zip(flat, flat_specs, strict=True):
    b = bytes_per_device(leaf.shape, leaf.dtype, spec, mesh_shape)
    total += b
    names = flat_axes.get(path)
    rows.append(
      (
        path_str(path),
        str(tuple(leaf.shape)),
        str(leaf.dtype),
        '(' + ', '.join(str(n) for n in names) + ')' if names is not None else '-',
        _spec_str(spec),
        fmt_bytes(b),
      )
    )
  label = 'parameters' if what == 'parameter' else what
  return '\n'.join(_layout(rows, 5) + _totals(param_shapes, total, mesh_shape, opt_shapes, opt_specs, label))


OTHER = '(optimizer)'  # optimizer state that belongs to no parameter (step counts)


def module_of(path: str) -> str:
  """The module a parameter belongs to, for the summary: its path without the leaf name, at most three names
  deep, with layer indices as '*' ('blocks/layers/3/mlp/up/layer/kernel' -> 'blocks/layers/*/mlp')."""
  names, kept = path.split('/')[:-1] or path.split('/'), []
  for name in names:
    if len([n for n in kept if n != '*']) == 3:
      break
    kept.append('*' if name.isdigit() else name)
  return '/'.join(kept)


def sharding_summary(
  param_shapes: Any,
  param_specs: Any,
  mesh_shape: Mapping[str, int],
  opt_shapes: Any = None,
  opt_specs: Any = None,
) -> str:
  """The sharding table in a few lines: per module (`module_of`), its parameters, the mesh axes they are sharded
  over, and the parameter and optimizer-state bytes each device holds; then the totals of the full table."""
  flat = [(path_str(p), leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(param_shapes)]
  specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  groups: dict[str, dict[str, Any]] = {}
  module = {}
  for (path, leaf), spec in zip(flat, specs, strict=True):
    g = groups.setdefault(module_of(path), {'tensors': 0, 'params': 0, 'axes': set(), 'bytes': 0, 'opt': 0})
    module[path] = module_of(path)
    g['tensors'] += 1
    g['params'] += math.prod(leaf.shape)
    g['axes'].update(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))
    g['bytes'] += bytes_per_device(leaf.shape, leaf.dtype, spec, mesh_shape)
  total = sum(g['bytes'] for g in groups.values())
  if opt_shapes is not None:  # an optimizer leaf counts for the module of the parameter its path ends with
    opt_leaves = jax.tree_util.tree_leaves_with_path(opt_shapes)
    opt_spec_leaves = jax.tree.leaves(opt_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (p, leaf), spec in zip(opt_leaves, opt_spec_leaves, strict=True):
      names = path_str(p).split('/')
      owner = next((module['/'.join(names[i:])] for i in range(len(names)) if '/'.join(names[i:]) in module), None)
      g = groups.setdefault(owner or OTHER, {'tensors': 0, 'params': 0, 'axes': set(), 'bytes': 0, 'opt': 0})
      g['opt'] += bytes_per_device(leaf.shape, leaf.dtype, spec, mesh_shape)
  rows = [('module', 'tensors', 'parameters', 'sharded over', 'params/device', 'optimizer/device')]
  for name, g in groups.items():
    own = name != OTHER
    rows.append(
      (
        name,
        str(g['tensors']) if own else '-',
        f'{g["params"]:,}' if own else '-',
        (', '.join(sorted(g['axes'])) or 'replicated') if own else '-',
        fmt_bytes(g['bytes']),
        fmt_bytes(g['opt']) if opt_shapes is not None else '-',
      )
    )
  lines = _layout(rows, 1, right=(1, 2, 4, 5))
  return '\n'.join(lines + _totals(param_shapes, total, mesh_shape, opt_shapes, opt_specs))


def _layout(rows: list[tuple[str, ...]], left: int, right: tuple[int, ...] | None = None) -> list[str]:
  """Rows as aligned columns (the first `left` ones, or all but `right`, flush left) under a rule."""
  right = tuple(range(left, len(rows[0]))) if right is None else right
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ['  '.join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
  lines = [line.rstrip() for line in lines]
  width = max(len(line) for line in lines)
  return [lines[0], '-' * width, *lines[1:], '-' * width]


def _totals(
  param_shapes: Any,
  per_device: int,
  mesh_shape: Mapping[str, int],
  opt_shapes: Any,
  opt_specs: Any,
  label: str = 'parameters',
) -> list[str]:
  leaves = jax.tree.leaves(param_shapes)
  mesh_s = ' x '.join(f'{k}={v}' for k, v in mesh_shape.items())
  in_all = fmt_bytes(sum(math.prod(l.shape) * np.dtype(l.dtype).itemsize for l in leaves))
  count = sum(math.prod(l.shape) for l in leaves)
  out = [f'{label}: {count:,} ({in_all} in all); per device on mesh {mesh_s}: {fmt_bytes(per_device)}']
  if opt_shapes is not None:
    opt_b = tree_bytes_per_device(opt_shapes, opt_specs, mesh_shape)
    out.append(
      f'optimizer state per device: {fmt_bytes(opt_b)}; params + optimizer per device: {fmt_bytes(per_device + opt_b)}'
    )
  return out
