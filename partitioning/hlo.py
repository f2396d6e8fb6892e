"""Collectives of a compiled (SPMD-partitioned) HLO module: which devices each one groups, how often it runs; and
the kernels a compiled GPU program launches per step with the bytes each reads and writes (`kernels`).

XLA prints a collective's groups in three forms; `replica_groups` reads them all into lists of partition ids:
  explicit   replica_groups={{0,1},{2,3}}                 (also source_target_pairs={{0,1},{1,0}})
  iota       replica_groups=[2,4]<=[8]  or  [2,4]<=[4,2]T(1,0): iota(8) reshaped to the dims after `<=`,
             transposed by T(...), flattened, then cut into 2 groups of 4
  mesh axes  replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, optionally with
             `, device_ids=([2,4]T(1,0))` after the mesh: the ids (iota, or iota reshaped and transposed)
             laid out row-major on the mesh; a group is the devices that differ only along the braced axes.
             A sub-axis 'a':(pre)size is the middle factor of axis a split major-to-minor as [pre, size, rest].
Partition i of an SPMD program runs on `mesh.devices.flat[i]`, so `mesh_axes` maps a group onto the mesh's
device grid (np.unravel_index) and names the mesh axes along which its members differ; `hosts_spanned` says how
many hosts (slices) a group reaches, the DCN question.

Counts: `collectives` multiplies each op by the trip counts of the while loops around it (XLA's
known_trip_count), so a scanned stack's per-layer all-gather counts once per layer. XLA's cost analysis counts a
loop's body once: `loop_dot_flops` gives the matmul FLOPs of the other runs, to add.
This module reads text only: it imports no JAX, no model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
ITEMSIZE = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
  'bf16': 2,
  'f16': 2,
  's16': 2,
  'u16': 2,
  'f32': 4,
  's32': 4,
  'u32': 4,
  'f64': 8,
  's64': 8,
  'u64': 8,
  'c64': 8,
  'c128': 16,
}
Groups = tuple[tuple[int, ...], ...]

INSTR = re.compile(
  r'^\s*(?:ROOT\s+)?%(?P<name>\S+)\s*=\s*(?P<shape>.+?)\s+(?P<op>'
  + '|'.join(COLLECTIVES)
  + r')(?P<start>-start)?\((?P<rest>.*)$',
  re.M,
)
ARRAY = re.compile(r'\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]')
_COMP_HEAD = re.compile(r'^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s.*\{\s*$')
_CALLS = re.compile(
  r'\b(?P<kind>body|condition|calls|to_apply|true_computation|false_computation)=%(?P<c>[\w.\-]+)'
  r'|branch_computations=\{(?P<branches>[^}]*)\}'
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(',') if d)) for dt, dims in ARRAY.findall(shape) if dt in ITEMSIZE]


def _tuple_elements(shape: str) -> list[str]:
  """'(a, (b, c), d)' -> ['a', '(b, c)', 'd']: a tuple shape's top-level elements ([shape] if not a tuple)."""
  shape = shape.strip()
  if not shape.startswith('('):
    return [shape]
  out, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 1:
      out.append(shape[start:i])
      start = i + 1
  out.append(shape[start : shape.rindex(')')])
  return [e for e in out if e.strip()]


def result_arrays(m: re.Match) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of each array a collective instruction (an INSTR match) returns, per device. An async
  all-reduce-start's shape is its results; the other starts' is (operands, results[, contexts]), one array or
  a tuple of them each (XLA's GPU combiners make one start of several collectives): the results are taken."""
  if not m['start'] or m['op'] == 'all-reduce':
    return _arrays(m['shape'])
  parts = _tuple_elements(m['shape'])
  return _arrays(parts[1] if len(parts) > 1 else parts[0])


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return (ids.transpose(perm) if perm else ids).reshape(-1)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(',') if x.strip()]


def _iota_spec(text: str) -> np.ndarray:
  """'[4,2]T(1,0)' or '[8]' -> the flattened ids."""
  m = re.fullmatch(r'\[([0-9,]*)\](?:T\(([0-9,]*)\))?', text.strip())
  if not m:
    raise ValueError(f'cannot read iota device list {text!r}')
  return _iota(_ints(m[1]), _ints(m[2]) if m[2] else None)


def _mesh_groups(text: str) -> list[list[int]]:
  m = re.fullmatch(
    r'mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<grouped>[^}]*)\}', text.strip()
  )
  if not m:
    raise ValueError(f'cannot read mesh-axes replica groups {text!r}')
  names, sizes = [], []
  for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", m['axes']):
    names.append(name)
    sizes.append(int(size))
  n = math.prod(sizes)
  ids = (
    np.arange(n)
    if not m['ids']
    else (_iota_spec(m['ids']) if m['ids'].lstrip().startswith('[') else np.array(_ints(m['ids'])))
  )
  # Split every axis at the breakpoints its grouped sub-axes name (major to minor); group along the chosen factors.
  refs = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m['grouped'])
  cuts = {a: {1, s} for a, s in enumerate(sizes)}
  for name, pre, size in refs:
    if pre:
      cuts[names.index(name)] |= {int(pre), int(pre) * int(size)}
  factors = [[b / a for a, b in zip(sorted(c), sorted(c)[1:])] or [1] for c in cuts.values()]
  factors = [[int(f) for f in fs] for fs in factors]
  chosen = []  # (axis, factor index)
  for name, pre, _size in refs:
    a = names.index(name)
    if pre:
      chosen.append((a, sorted(cuts[a]).index(int(pre))))
    else:
      chosen.extend((a, i) for i in range(len(factors[a])))
  flat_dims = [f for fs in factors for f in fs]
  offset = np.cumsum([0] + [len(fs) for fs in factors])
  grouped = sorted({int(offset[a] + i) for a, i in chosen})
  rest = [d for d in range(len(flat_dims)) if d not in grouped]
  grid = ids.reshape(flat_dims).transpose(rest + grouped)
  return grid.reshape(-1, math.prod(flat_dims[d] for d in grouped) if grouped else 1).tolist()


def replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
  """The groups of partition ids one `replica_groups=` value names (any of the three forms). An empty
  list `{}` means every device in one group (needs `num_devices`)."""
  text = text.strip()
  if text.startswith('mesh['):
    return _mesh_groups(text)
  m = re.fullmatch(r'\[(\d+),(\d+)\]<=(\[[0-9,]*\](?:T\([0-9,]*\))?)', text)
  if m:
    return _iota_spec(m[3]).reshape(int(m[1]), int(m[2])).tolist()
  if text.startswith('{'):
    groups = [_ints(g) for g in re.findall(r'\{([0-9,\s]*)\}', text[1:-1])]
    if not groups:
      if num_devices is None:
        raise ValueError('replica_groups={} means all devices: give num_devices')
      return [list(range(num_devices))]
    return groups
  raise ValueError(f'cannot read replica groups {text!r}')


def _attr(rest: str, key: str) -> str | None:
  """The value of `key=` in an instruction's attribute text, up to the next comma outside brackets."""
  i = rest.find(f'{key}=')
  if i < 0:
    return None
  j, depth = i + len(key) + 1, 0
  for k in range(j, len(rest)):
    c = rest[k]
    if c in '[{(':
      depth += 1
    elif c in ']})':
      depth -= 1
    elif c == ',' and depth == 0:
      return rest[j:k].strip()
  return rest[j:].strip()


def _mesh_value(rest: str) -> str | None:
  m = re.search(r'replica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)?\))?\s*\{[^}]*\})', rest)
  return m[1] if m else None


def computation_counts(hlo_text: str) -> dict[str, int]:
  """How many times each computation of a module runs per execution of its entry: while bodies times their
  known trip count (1 where XLA does not know it), called computations as often as their caller."""
  calls: dict[str, list[tuple[str, int]]] = {}  # caller -> [(callee, times per caller run)]
  entry, current = None, None
  for line in hlo_text.splitlines():
    head = _COMP_HEAD.match(line)
    if head and not line.startswith(' '):
      current = head['name']
      calls.setdefault(current, [])
      if line.startswith('ENTRY'):
        entry = current
      continue
    if current is None or '=' not in line:
      continue
    trip = _TRIP.search(line)
    for m in _CALLS.finditer(line):
      if m['branches']:
        for b in re.findall(r'%([\w.\-]+)', m['branches']):
          calls[current].append((b, 1))
      else:
        times = int(trip[1]) if trip and m['kind'] in ('body', 'condition') else 1
        calls[current].append((m['c'], times))
  counts: dict[str, int] = {}

  def visit(comp: str, times: int, depth: int = 0) -> None:
    if depth > 64:
      return
    counts[comp] = counts.get(comp, 0) + times
    for callee, k in calls.get(comp, []):
      visit(callee, times * k, depth + 1)

  if entry is not None:
    visit(entry, 1)
  return counts


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str  # 'all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute'
  bytes: int  # result bytes per device, as audit.collective_stats counts them
  groups: Groups  # partition ids of each group (collective-permute: each source -> target pair)
  times: int  # runs per step (trip counts of the loops around it)
  name: str

  @property
  def group_size(self) -> int:
    return len(self.groups[0]) if self.groups else 1


def _lines(hlo_text: str) -> Iterator[tuple[str | None, str]]:
  """(the computation it belongs to, line) for every line of a module's text but the computations' heads."""
  current = None
  for line in hlo_text.splitlines():
    head = _COMP_HEAD.match(line)
    if head and not line.startswith(' '):
      current = head['name']
      continue
    yield current, line


def collectives(hlo_text: str, num_devices: int, counts: Mapping[str, int] | None = None) -> list[Collective]:
  """Every collective of a compiled module's text, with its groups and its runs per step (`counts`: the
  module's computation_counts, when the caller has them)."""
  counts = computation_counts(hlo_text) if counts is None else counts
  out = []
  for current, line in _lines(hlo_text):
    m = INSTR.match(line)
    if not m:
      continue
    nbytes = sum(math.prod(dims) * ITEMSIZE[dt] for dt, dims in result_arrays(m))
    rest = m['rest']
    if m['op'] == 'collective-permute':
      pairs = _attr(rest, 'source_target_pairs')
      groups = tuple(tuple(g) for g in replica_groups(pairs or '{}', num_devices)) if pairs else ()
    else:
      value = _mesh_value(rest) or _attr(rest, 'replica_groups') or '{}'
      groups = tuple(tuple(g) for g in replica_groups(value, num_devices))
    out.append(Collective(m['op'], nbytes, groups, counts.get(current, 1), m['name']))
  return out


def mesh_axes(groups: Groups, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
  """The mesh axes along which the members of the groups differ (partition i sits at flat position i)."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  varies = [False] * len(names)
  for g in groups:
    coords = np.array(np.unravel_index(np.asarray(g), sizes)).T  # (members, axes)
    varies = [v or bool((coords[:, a] != coords[0, a]).any()) for a, v in enumerate(varies)]
  return tuple(n for n, v in zip(names, varies) if v)


def hosts_spanned(groups: Groups, host_of: Callable[[int], int]) -> int:
  """The most hosts (or slices) one group reaches: 1 means the collective stays on ICI / NVLink."""
  return max((len({host_of(i) for i in g}) for g in groups), default=1)


_DEFINE = re.compile(
  r'^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>[a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)'
  r'\[(?P<dims>[0-9,]*)\]\S*\s+(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$'
)


def loop_dot_flops(hlo_text: str, counts: Mapping[str, int] | None = None) -> float:
  """The FLOPs of the dots that run more than once per step (inside while loops with a known trip count),
  counted for every run after the first: what XLA's cost analysis, which counts a loop's body once, leaves
  out. A dot's FLOPs: 2 x its result's elements x the product of the left operand's contracting dims."""
  counts = computation_counts(hlo_text) if counts is None else counts
  dims: dict[str, list[int]] = {}
  dots: list[tuple[str, list[int], str, str]] = []  # (computation, result dims, lhs name, attributes)
  for current, line in _lines(hlo_text):
    m = _DEFINE.match(line)
    if not m:
      continue
    shape = _ints(m['dims'])
    dims[m['name']] = shape
    if m['op'] == 'dot' and counts.get(current, 1) > 1:
      lhs = m['args'].split(',')[0].strip().lstrip('%')
      dots.append((current, shape, lhs, m['rest']))
  total = 0.0
  for comp, out, lhs, rest in dots:
    contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', rest)
    k = math.prod(dims[lhs][d] for d in _ints(contracting[1])) if contracting and lhs in dims else 1
    total += (counts[comp] - 1) * 2.0 * math.prod(out) * k
  return total


# --- Kernels of a compiled GPU program and the bytes they move -------------------------------------------

NOT_KERNELS = frozenset(
  {
    'parameter',
    'constant',
    'get-tuple-element',
    'tuple',
    'bitcast',
    'while',
    'call',
    'conditional',
    'after-all',
    'add-dependency',
    'opt-barrier',
    'partition-id',
    'replica-id',
    'async-update',
  }
)
_INSTR_ANY = re.compile(
  r'^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s+'
  r'(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<rest>.*)$'
)
_KERNEL_CALLS = re.compile(
  r'\b(?:body|condition)=%(?P<c>[\w.\-]+)|branch_computations=\{(?P<branches>[^}]*)\}'
  r'|\bto_apply=%(?P<call>[\w.\-]+)'
)


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  kind: str  # matmul, convolution, attention, pallas, reduction, elementwise, copy, collective, or the HLO op
  bytes: int  # its operands' and results' bytes: what one run reads and writes, at most (per device)
  times: int  # runs per step (trip counts of the loops around it)
  op_name: str  # the JAX operation it came from (metadata op_name), '' if none


def _kind(op: str, rest: str) -> str:
  if op == 'fusion':
    fusion_kind = re.search(r'kind=(k\w+)', rest)
    backend = re.search(r'"kind":"([^"]+)"', rest)
    if fusion_kind and fusion_kind[1] == 'kCustom':
      what = backend[1] if backend else ''
      return (
        'convolution'
        if 'conv' in what
        else 'matmul'
        if 'gemm' in what or 'cublas' in what or 'cudnn' in what
        else 'fusion ' + what.strip('_')
      )
    return {'kInput': 'reduction', 'kLoop': 'elementwise', 'kOutput': 'matmul'}.get(
      fusion_kind[1] if fusion_kind else '', 'fusion'
    )
  if op == 'custom-call':
    target = (re.search(r'custom_call_target="([^"]+)"', rest) or [None, ''])[1]
    return (
      'attention'
      if 'fmha' in target
      else 'convolution'
      if 'conv' in target
      else 'matmul'
      if 'gemm' in target or 'cublas' in target or 'matmul' in target
      else 'pallas'
      if 'triton' in target or target == 'tpu_custom_call'
      else 'custom-call ' + target
    )
  if op in ('copy', 'copy-start', 'transpose'):
    return 'copy'
  if op == 'dot':
    return 'matmul'
  if op == 'convolution':
    return 'convolution'
  if op.endswith('-start') or op in COLLECTIVES:
    return 'collective'
  return op


_PASS_THROUGH = frozenset(
  {
    'bitcast',
    'reshape',
    'convert',
    'copy',
    'select',
    'add',
    'subtract',
    'multiply',
    'divide',
    'maximum',
    'minimum',
    'compare',
    'negate',
    'exponential',
    'log',
    'abs',
    'and',
    'or',
    'not',
  }
)


def _elements(shape: str, itemsize: bool = False) -> int:
  """The elements (or, with `itemsize`, the bytes) of the arrays an instruction's shape text names."""
  return sum(
    math.prod(int(d) for d in dims.split(',') if d) * (ITEMSIZE[dt] if itemsize else 1)
    for dt, dims in ARRAY.findall(shape)
    if dt in ITEMSIZE
  )


def _fused_traffic(
  body: list[re.Match], sizes: Mapping[str, int], reads: list[int], writes: int
) -> tuple[list[int], int]:
  """A fusion's bytes read per operand and written, from its fused computation: an operand reached only through
  gathers or slices (past elementwise ops) is read where they read it, not whole; a root dynamic-update-slice or
  scatter writes its update in place (its operand 0 is neither read nor written whole)."""
  by_name = {m['name']: m for m in body}
  users: dict[str, list[re.Match]] = {}
  for m in body:
    for a in m['args'].split(','):
      if a.strip().startswith('%'):
        users.setdefault(a.strip().lstrip('%'), []).append(m)

  def demand(name: str, elements: int, itemsize: float, depth: int = 0) -> float | None:
    """Bytes of the operand read through `name` (None: all of it)."""
    if not users.get(name):
      return None  # the root: what it computes is written from all of it
    total = 0.0
    for u in users[name]:
      first = u['args'].split(',')[0].strip().lstrip('%')
      if u['op'] in ('gather', 'slice', 'dynamic-slice') and first == name:
        total += _elements(u['shape']) * itemsize
      elif u['op'] in _PASS_THROUGH and _elements(u['shape']) == elements and depth < 32:
        d = demand(u['name'], elements, itemsize, depth + 1)
        if d is None:
          return None
        total += d
      else:
        return None
    return total

  reads = list(reads)
  for m in body:
    if m['op'] == 'parameter' and (i := int(m['args'] or -1)) < len(reads) and reads[i]:
      n = _elements(m['shape'])
      d = demand(m['name'], n, reads[i] / max(n, 1))
      reads[i] = reads[i] if d is None else min(reads[i], int(d))
  root = next((m for m in body if m.string.lstrip().startswith('ROOT')), None)
  roots = (
    [root]
    if root is not None and root['op'] != 'tuple'
    else [by_name.get(a.strip().lstrip('%')) for a in (root['args'].split(',') if root is not None else [])]
  )
  for r in roots:
    if r is not None and r['op'] in ('dynamic-update-slice', 'scatter'):
      args = [a.strip().lstrip('%') for a in r['args'].split(',')]
      target, update = args[0], args[1] if r['op'] == 'dynamic-update-slice' else args[-1]
      whole, part = sizes.get(target, 0), sizes.get(update, 0)
      param = by_name.get(target)
      if param is not None and param['op'] == 'parameter' and int(param['args']) < len(reads):
        reads[int(param['args'])] = part if r['op'] == 'scatter' else 0  # a scatter adds to what is there
      writes -= whole - part
  return reads, max(writes, 0)


def kernels(hlo_text: str) -> list[Kernel]:
  """The kernels one step of a compiled (GPU) module launches, each with the bytes of its operands and results:
  every instruction of the entry computation, of while loops' bodies and conditions, of conditionals' branches and
  of called computations, but the bookkeeping ones (parameters, tuples, bitcasts, ...); fused computations' insides
  and reducers are not kernels. Bytes count an operand as read once and a result as written once, except what a
  fusion reads through gathers and slices or updates in place (`_fused_traffic`). A GPU kernel count: XLA
  launches each fusion, library call (cuBLAS, cuDNN) and copy as one or a few kernels."""
  entry = re.search(r'^ENTRY\s+%([^\s(]+)', hlo_text, re.M)
  parsed: dict[str, list[re.Match]] = {}
  for comp, line in _lines(hlo_text):
    if comp is not None and (m := _INSTR_ANY.match(line)):
      parsed.setdefault(comp, []).append(m)
  sizes = {m['name']: _elements(m['shape'], itemsize=True) for body in parsed.values() for m in body}
  out: list[Kernel] = []

  def visit(comp: str, times: int, depth: int = 0) -> None:
    if comp not in parsed or depth > 64:
      return
    for m in parsed[comp]:
      op, rest = m['op'], m['rest']
      trip = _TRIP.search(rest)
      for c in _KERNEL_CALLS.finditer(rest):
        if c['call'] is not None and op != 'call':
          continue  # a reducer or a scatter's combiner: part of its kernel
        callees = re.findall(r'%([\w.\-]+)', c['branches']) if c['branches'] else [c['c'] or c['call']]
        for callee in callees:
          visit(callee, times * (int(trip[1]) if trip and op == 'while' else 1), depth + 1)
      if op in NOT_KERNELS or op.endswith('-done'):
        continue  # an async op's -done waits for the kernel its -start launched
      args = [a.strip().lstrip('%') for a in m['args'].split(',') if a.strip().startswith('%')]
      fused = re.search(r'\bcalls=%([\w.\-]+)', rest) if op == 'fusion' else None
      reads, writes = [sizes.get(a, 0) for a in args], sizes[m['name']]
      if fused and fused[1] in parsed:
        reads, writes = _fused_traffic(parsed[fused[1]], sizes, reads, writes)
      elif op.endswith('-start'):
        writes = max(writes - sum(reads), 0)  # its shape is (operands, results[, ...])
      op_name = re.search(r'op_name="([^"]*)"', rest)
      out.append(Kernel(m['name'], _kind(op, rest), sum(reads) + writes, times, op_name[1] if op_name else ''))

  if entry is not None:
    visit(entry[1], 1)
  return out


def kernel_summary(ks: Sequence[Kernel]) -> dict[str, tuple[int, int]]:
  """kind -> (kernels per step, bytes per step), the largest traffic first, and 'total'."""
  by: dict[str, list[int]] = {}
  for k in ks:
    n_b = by.setdefault(k.kind, [0, 0])
    n_b[0] += k.times
    n_b[1] += k.times * k.bytes
  table = {kind: (n, b) for kind, (n, b) in sorted(by.items(), key=lambda kv: -kv[1][1])}
  table['total'] = (sum(n for n, _ in table.values()), sum(b for _, b in table.values()))
  return table
