"""The ranked table the plan search prints (docs/plan_search.md explains its columns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planning.cost import summarize
from planning.search import Result, Scored


def _ms(s: float | None) -> str:
  return '-' if s is None else f'{1e3 * s:.1f}'


def _where(s: Scored, k: int = 2) -> str:
  """The costliest collective groups: 'fsdp 12.1 ms, data+fsdp 0.4 ms'."""
  parts = sorted(s.prediction.by_axes.items(), key=lambda kv: -kv[1])[:k]
  return ', '.join(f'{name} {1e3 * t:.1f}' for name, t in parts) or 'none'


def _what(s: Scored) -> str:
  """Collective kinds by bytes: 'AG 2.1G RS 1.0G'."""
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
  return ' '.join(f'{op} {b / 2**30:.2g}G' for op, b in sorted(by_op.items(), key=lambda kv: -kv[1])) or '-'


def table(plans: Sequence[Scored], chip: Any) -> str:
  rows = [
    (
      '#',
      'plan (mesh | rules | remat | micro-batches)',
      'step ms',
      'MFU',
      'compute',
      'collect.',
      'costliest groups (ms)',
      'collective bytes/dev',
      'mem GiB (state)',
      'measured',
    )
  ]
  for i, s in enumerate(plans, 1):
    p = s.prediction
    rows.append(
      (
        str(i),
        s.candidate.label(),
        _ms(p.step_s),
        '-' if s.mfu is None else f'{100 * s.mfu:.1f}%',
        _ms(p.compute_s),
        _ms(p.collective_s),
        _where(s),
        _what(s),
        f'{p.memory_gib:.1f} ({p.state_gib:.1f})' + ('' if p.fits else ' OVER'),
        _ms(s.measured_s),
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
