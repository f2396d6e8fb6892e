"""What a compiled step costs per device: memory, and the collectives the sharding rules imply."""
from __future__ import annotations

import math
import re
from typing import Any

from partitioning.table import fmt_bytes

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
_ITEMSIZE = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
             'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8, 'c64': 8, 'c128': 16}
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>' + '|'.join(COLLECTIVES) +
                    r')(?P<start>-start)?\(', re.M)
_ARRAY = re.compile(r'\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]')


def _collectives(hlo_text: str):
  """(op, [(dtype, dims), ...] of its result) for every collective of an HLO module's text. An async start's
  shape is (operand, result[, ...]): its result is taken."""
  for m in _INSTR.finditer(hlo_text):
    arrays = [(dt, tuple(int(d) for d in dims.split(',') if d)) for dt, dims in _ARRAY.findall(m['shape'])
              if dt in _ITEMSIZE]
    if m['start'] and len(arrays) > 1:
      arrays = arrays[1:2]
    yield m['op'], arrays


def collective_shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
  """The per-device result shapes of every `op` (e.g. 'all-gather') in a compiled HLO module's text."""
  return [dims for o, arrays in _collectives(hlo_text) if o == op for _, dims in arrays]


def collective_stats(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{op: (count, result bytes per device)} over a compiled (SPMD-partitioned) HLO module's text.

  Counts are static (an op in a loop body counts once); shapes in partitioned HLO are per device.
  """
  stats: dict[str, list[int]] = {}
  for op, arrays in _collectives(hlo_text):
    s = stats.setdefault(op, [0, 0])
    s[0] += 1
    s[1] += sum(math.prod(dims) * _ITEMSIZE[dt] for dt, dims in arrays)
  return {op: (c, b) for op, (c, b) in sorted(stats.items())}


def audit(compiled: Any) -> str:
  """One line: per-device memory of a compiled step and its collectives."""
  mem = compiled.memory_analysis()
  coll = collective_stats(compiled.as_text())
  coll_s = ', '.join(f'{op} x{c} ({fmt_bytes(b)})' for op, (c, b) in coll.items()) or 'none'
  return (f'arguments {fmt_bytes(mem.argument_size_in_bytes)}, outputs {fmt_bytes(mem.output_size_in_bytes)}, '
          f'temporaries {fmt_bytes(mem.temp_size_in_bytes)}; collectives: {coll_s}')
