"""What a compiled step costs per device: memory, and the collectives the sharding rules imply (and, on a hybrid
mesh, which of them cross the slower network between slices: DCN)."""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioning.table import fmt_bytes

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
_ITEMSIZE = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
             'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8, 'c64': 8, 'c128': 16}
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>' + '|'.join(COLLECTIVES) +
                    r')(?P<start>-start)?\(', re.M)
_GROUPS = re.compile(r'(?:replica_groups|source_target_pairs)=(\{[{}0-9,\s]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?'
                     r"|mesh\[[^\]]*\],\s*device_ids=\(\[[0-9,]+\](?:T\([0-9,]+\))?\)\s*\{[^}]*\})")
_ARRAY = re.compile(r'\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]')


def _ints(text: str) -> list[int]:
  return [int(x) for x in re.findall(r'\d+', text)]


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return (ids.transpose(perm) if perm else ids).reshape(dims)


def replica_groups(attr: str, num_partitions: int) -> list[list[int]]:
  """The groups of partition ids a collective runs over, from its `replica_groups=` / `source_target_pairs=`
  value in compiled HLO text: explicit ({{0,1},{2,3}}; a permute's pairs are groups of 2; {} is everyone),
  iota ([2,4]<=[4,2]T(1,0): iota reshaped, transposed, its rows the groups) or mesh form
  (mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}: the devices of the named axes, the others
  fixed)."""
  if attr.startswith('{'):
    groups = [_ints(g) for g in re.findall(r'\{([0-9,\s]*)\}', attr[1:-1])]
    return [g for g in groups if g] or [list(range(num_partitions))]
  if attr.startswith('['):
    m = re.fullmatch(r'\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?', attr)
    dims = _ints(m[1])
    ids = _iota([-1, dims[-1]], _ints(m[2]), _ints(m[3]) if m[3] else None)
    return ids.tolist()
  m = re.fullmatch(r"mesh\[([^\]]*)\],\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?)\)\s*\{([^}]*)\}", attr)
  axes = re.findall(r"'([^']+)'=(\d+)", m[1])
  names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
  d = re.fullmatch(r'\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*', m[2])
  ids = _iota(sizes, _ints(d[1]), _ints(d[2]) if d[2] else None)
  over = [names.index(a) for a in re.findall(r"'([^']+)'", m[3])]
  rest = [i for i in range(len(names)) if i not in over]
  return ids.transpose(rest + over).reshape(-1, math.prod(sizes[i] for i in over)).tolist()


def _collectives(hlo_text: str, num_partitions: int = 0):
  """(op, [(dtype, dims), ...] of its result, its groups of partition ids or None) for every collective of an
  HLO module's text. An async start's shape is (operand, result[, ...]): its result is taken. Groups are parsed
  when num_partitions is given."""
  for m in _INSTR.finditer(hlo_text):
    arrays = [(dt, tuple(int(d) for d in dims.split(',') if d)) for dt, dims in _ARRAY.findall(m['shape'])
              if dt in _ITEMSIZE]
    if m['start'] and len(arrays) > 1:
      arrays = arrays[1:2]
    groups = None
    if num_partitions:
      line = hlo_text[m.end():hlo_text.find('\n', m.end())]
      g = _GROUPS.search(line)
      groups = replica_groups(g[1], num_partitions) if g else [list(range(num_partitions))]
    yield m['op'], arrays, groups


def collective_shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
  """The per-device result shapes of every `op` (e.g. 'all-gather') in a compiled HLO module's text."""
  return [dims for o, arrays, _ in _collectives(hlo_text) if o == op for _, dims in arrays]


def collective_stats(hlo_text: str, slice_of: Sequence[int] | None = None) -> dict[str, tuple[int, int]]:
  """{op: (count, result bytes per device)} over a compiled (SPMD-partitioned) HLO module's text.

  Counts are static (an op in a loop body counts once); shapes in partitioned HLO are per device.
  With `slice_of` (the DCN slice of each partition id: partitioning.dcn_coordinates), only the collectives
  with a group (or a permute pair) spanning slices are counted: what crosses DCN.
  """
  stats: dict[str, list[int]] = {}
  for op, arrays, groups in _collectives(hlo_text, len(slice_of) if slice_of is not None else 0):
    if groups is not None and all(len({slice_of[i] for i in g}) == 1 for g in groups):
      continue
    s = stats.setdefault(op, [0, 0])
    s[0] += 1
    s[1] += sum(math.prod(dims) * _ITEMSIZE[dt] for dt, dims in arrays)
  return {op: (c, b) for op, (c, b) in sorted(stats.items())}


def _fmt_stats(stats: dict[str, tuple[int, int]]) -> str:
  return ', '.join(f'{op} x{c} ({fmt_bytes(b)})' for op, (c, b) in stats.items()) or 'none'


def audit(compiled: Any, slice_of: Sequence[int] | None = None) -> str:
  """One line: per-device memory of a compiled step and its collectives; with `slice_of` (several DCN slices),
  also those that cross DCN."""
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  dcn = f'; over DCN: {_fmt_stats(collective_stats(text, slice_of))}' if slice_of is not None else ''
  return (f'arguments {fmt_bytes(mem.argument_size_in_bytes)}, outputs {fmt_bytes(mem.output_size_in_bytes)}, '
          f'temporaries {fmt_bytes(mem.temp_size_in_bytes)}; collectives: {_fmt_stats(collective_stats(text))}{dcn}')
