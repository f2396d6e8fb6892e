"""The sharding table printed at start-up: where every parameter lives and what it costs per device."""

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
  n_params = 0
  for (path, leaf), spec in zip(flat, flat_specs, strict=True):
    b = bytes_per_device(leaf.shape, leaf.dtype, spec, mesh_shape)
    total += b
    n_params += math.prod(leaf.shape)
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
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ['  '.join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
  lines.insert(1, '-' * len(lines[0]))
  mesh_s = ' x '.join(f'{k}={v}' for k, v in mesh_shape.items())
  lines.append('-' * len(lines[0]))
  in_all = fmt_bytes(sum(math.prod(l.shape) * np.dtype(l.dtype).itemsize for _, l in flat))
  label = 'parameters' if what == 'parameter' else what
  lines.append(f'{label}: {n_params:,} ({in_all} in all); per device on mesh {mesh_s}: {fmt_bytes(total)}')
  if opt_shapes is not None:
    opt_b = tree_bytes_per_device(opt_shapes, opt_specs, mesh_shape)
    lines.append(
      f'optimizer state per device: {fmt_bytes(opt_b)}; params + optimizer per device: {fmt_bytes(total + opt_b)}'
    )
  return '\n'.join(lines)
