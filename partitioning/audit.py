"""What a compiled step costs per device: memory, and the collectives the sharding rules imply (and, on a hybrid
mesh, which of them cross the slower network between slices: DCN)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from partitioning import hlo
from partitioning.hlo import INSTR, ITEMSIZE
from partitioning.table import fmt_bytes


def _collectives(hlo_text: str):
  """(op, [(dtype, dims), ...] of its result) for every collective of an HLO module's text."""
  for m in INSTR.finditer(hlo_text):
    yield m['op'], hlo.result_arrays(m)


def collective_shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
  """The per-device result shapes of every `op` (e.g. 'all-gather') in a compiled HLO module's text."""
  return [dims for o, arrays in _collectives(hlo_text) if o == op for _, dims in arrays]


def collective_stats(hlo_text: str, slice_of: Sequence[int] | None = None) -> dict[str, tuple[int, int]]:
  """{op: (count, result bytes per device)} over a compiled (SPMD-partitioned) HLO module's text.

  Counts are static (an op in a loop body counts once); shapes in partitioned HLO are per device.
  With `slice_of` (the DCN slice of each partition id: partitioning.dcn_coordinates), only the collectives
  with a group (or a permute pair) spanning slices are counted: what crosses DCN.
  """
  stats: dict[str, list[int]] = {}
  if slice_of is not None:  # groups from partitioning/hlo.py (every replica-group form XLA prints)
    for c in hlo.collectives(hlo_text, len(slice_of)):
      if hlo.hosts_spanned(c.groups, lambda i: slice_of[i]) > 1:
        s = stats.setdefault(c.op, [0, 0])
        s[0], s[1] = s[0] + 1, s[1] + c.bytes
    return {op: (c, b) for op, (c, b) in sorted(stats.items())}
  for op, arrays in _collectives(hlo_text):
    s = stats.setdefault(op, [0, 0])
    s[0] += 1
    s[1] += sum(math.prod(dims) * ITEMSIZE[dt] for dt, dims in arrays)
  return {op: (c, b) for op, (c, b) in sorted(stats.items())}


def _fmt_stats(stats: dict[str, tuple[int, int]]) -> str:
  return ', '.join(f'{op} x{c} ({fmt_bytes(b)})' for op, (c, b) in stats.items()) or 'none'


def audit(compiled: Any, slice_of: Sequence[int] | None = None, schedule: Any = None) -> str:
  """One line: per-device memory of a compiled step and its collectives; with `slice_of` (several DCN slices),
  also those that cross DCN; with a pipeline `schedule` (partitioning.pipeline.Schedule), its stages,
  micro-batches and bubble."""
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  dcn = f'; over DCN: {_fmt_stats(collective_stats(text, slice_of))}' if slice_of is not None else ''
  return (
    f'arguments {fmt_bytes(mem.argument_size_in_bytes)}, outputs {fmt_bytes(mem.output_size_in_bytes)}, '
    f'temporaries {fmt_bytes(mem.temp_size_in_bytes)}; collectives: {_fmt_stats(collective_stats(text))}{dcn}'
    + (f'; {schedule.describe()}' if schedule is not None else '')
  )
