"""What a compiled step costs per device: memory, and the collectives the sharding rules imply."""
from __future__ import annotations

import re
from typing import Any

from partitioning.table import fmt_bytes

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
_ITEMSIZE = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
             'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8, 'c64': 8, 'c128': 16}
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>' + '|'.join(COLLECTIVES) +
                    r')(?P<start>-start)?\(', re.M)
_ARRAY = re.compile(r'\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]')


def _bytes(shape: str, start: bool) -> int:
  arrays = [(dt, dims) for dt, dims in _ARRAY.findall(shape) if dt in _ITEMSIZE]
  if start and len(arrays) > 1:  # async start: (operand, result[, ...]); count the result
    arrays = arrays[1:2]
  total = 0
  for dt, dims in arrays:
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += n * _ITEMSIZE[dt]
  return total


def collective_stats(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{op: (count, result bytes per device)} over a compiled (SPMD-partitioned) HLO module's text.

  Counts are static (an op in a loop body counts once); shapes in partitioned HLO are per device.
  """
  stats: dict[str, list[int]] = {}
  for m in _INSTR.finditer(hlo_text):
    s = stats.setdefault(m['op'], [0, 0])
    s[0] += 1
    s[1] += _bytes(m['shape'], bool(m['start']))
  return {op: (c, b) for op, (c, b) in sorted(stats.items())}


def audit(compiled: Any) -> str:
  """One line: per-device memory of a compiled step and its collectives."""
  mem = compiled.memory_analysis()
  coll = collective_stats(compiled.as_text())
  coll_s = ', '.join(f'{op} x{c} ({fmt_bytes(b)})' for op, (c, b) in coll.items()) or 'none'
  return (f'arguments {fmt_bytes(mem.argument_size_in_bytes)}, outputs {fmt_bytes(mem.output_size_in_bytes)}, '
          f'temporaries {fmt_bytes(mem.temp_size_in_bytes)}; collectives: {coll_s}')
