"""The ranked table the plan search prints (docs/plan_search.md explains its columns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partitioning import fmt_bytes
from planning.cost import summarize
from planning.search import Result, Scored


def seconds(s: float | None) -> str:
  """A time in the unit that fits it: '1.23 s', '45.6 ms', '7.89 us'."""
  if s is None:
    return '-'
  for unit, scale in (('s', 1.0), ('ms', 1e-3), ('us', 1e-6)):
    if abs(s) >= scale or unit == 'us':
      return f'{s / scale:.3g} {unit}'
  raise AssertionError


def _where(s: Scored, k: int = 2) -> str:
  """The costliest collective groups: 'fsdp 12.1 ms, data+fsdp 402 us'."""
  parts = sorted(s.prediction.by_axes.items(), key=lambda kv: -kv[1])[:k]
  return ', '.join(f'{name} {seconds(t)}' for name, t in parts) or 'none'


def _what(s: Scored) -> str:
  """Collective kinds by bytes: 'AG 2.10 GiB RS 1.00 GiB'."""
  short = {
    'all-gather': 'AG',
    'all-reduce': 'AR',
    'reduce-scatter': 'RS',
    'all-to-all': 'A2A',
    'collective-permute': 'CP',
  }
  by_op: dict[str, float] = {}
  for name, (_, nbytes) in summarize(s.profile).items():
    op = short[name.split()[0]]
    by_op[op] = by_op.get(op, 0.0) + nbytes
  return ' '.join(f'{op} {fmt_bytes(b)}' for op, b in sorted(by_op.items(), key=lambda kv: -kv[1])) or '-'


def table(plans: Sequence[Scored], chip: Any) -> str:
  rows = [
    (
      '#',
      'plan (mesh | rules | remat | micro-batches)',
      'step',
      'MFU',
      'compute',
      'collect.',
      'costliest groups',
      'collective bytes/dev',
      'memory/dev (state)',
      'measured',
    )
  ]
  for i, s in enumerate(plans, 1):
    p = s.prediction
    rows.append(
      (
        str(i),
        s.candidate.label(),
        seconds(p.step_s),
        '-' if s.mfu is None else f'{100 * s.mfu:.1f}%',
        seconds(p.compute_s),
        seconds(p.collective_s),
        _where(s),
        _what(s),
        f'{fmt_bytes(p.memory_gib * 2**30)} ({fmt_bytes(p.state_gib * 2**30)})' + ('' if p.fits else ' OVER'),
        seconds(s.measured_s),
      )
    )
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  return '\n'.join(
    '  '.join(c.ljust(w) if j in (1, 6, 7) else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in rows
  )


def pruning(result: Result) -> str:
  lines = [
    f'{result.considered} candidates: {len(result.ranked)} scored from {result.compiled} compiled programs '
    '(the orders of one mesh over hosts share one), '
    f'{sum(result.pruned.values())} pruned or dropped:'
  ]
  for reason, n in result.pruned.most_common():
    lines.append(f'  {n:5d}  {reason}   e.g. {result.examples.get(reason, "")[:160]}')
  return '\n'.join(lines)
