"""Model FLOPs of a train step, chip peaks, and MFU.

FLOPs are counted from the model's own forward pass (its jaxpr, traced on abstract inputs): every
matmul (dot_general) and convolution, times the trip count of the loops they sit in, once for the forward
and once more for each operand that a trained parameter feeds (the backward's gradient for it: an
activation's, or a weight's own). Attention is traced on the XLA path for counting, so its score and value
matmuls are counted over the full L x L square. For a transformer every matmul counts 3x: exactly PaLM's
count, 6 N + 12 layers d_attn L per token (N = parameters of the matmuls, the output head included; lookups
are not matmuls). A first convolution over images counts 2x (no gradient reaches the image), and frozen
weights (LoRA, config.train_only, config.freeze) get no weight gradient: an adapter fine-tune counts what it
computes. `causal` halves the matmuls of causal attention (a causal mask leaves half of the square), the
figure MFU is reported in. Recomputation under remat is not counted: MFU is model FLOPs over time, not
hardware FLOPs. A mixture of experts counts the experts of each token's top-k assignments (6 N_active per
token, as dropless MoEs report), not its experts' empty capacity slots, and not the one-hot matmuls that
dispatch and combine tokens (models/layers.py NOT_MODEL_FLOPS, active_scope).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
from flax import nnx
from jax.extend import core as jcore

from errors import ConfigError
from models import attention, layers

_ACTIVE = re.compile(layers.active_scope(r'(\d+)', r'(\d+)'))

# Dense bf16 peak TFLOP/s per chip (no sparsity), matched against jax's device_kind in order.
PEAK_TFLOPS: list[tuple[str, float]] = [
  (r'H100.*PCIe|H800.*PCIe', 756.0),
  (r'H100.*NVL|H200.*NVL', 835.0),
  (r'H100|H200|H800', 989.0),
  (r'B200', 2250.0),
  (r'A100', 312.0),
  (r'L40S', 362.0),
  (r'L4\b', 121.0),
  (r'A10\b|A10G', 125.0),
  (r'TPU v6', 918.0),
  (r'TPU v5p', 459.0),
  (r'TPU v5 ?lite|TPU v5e', 197.0),
  (r'TPU v5', 459.0),
  (r'TPU v4', 275.0),
  (r'TPU v3', 123.0),
  (r'TPU v2', 45.0),
]


def peak_tflops(device_kind: str) -> float | None:
  """Dense bf16 peak of one chip, or None when the kind is not in PEAK_TFLOPS (e.g. CPUs)."""
  for pattern, tflops in PEAK_TFLOPS:
    if re.search(pattern, device_kind):
      return tflops
  return None


@dataclasses.dataclass(frozen=True)
class StepFlops:
  palm: float  # 3 x forward matmul FLOPs, attention over the full square (PaLM's 6N + 12 l d L per token)
  causal: float  # the same with causal attention's matmuls halved

  def per_device_tflops(self, step_seconds: float, num_devices: int, causal: bool = True) -> float:
    return (self.causal if causal else self.palm) / step_seconds / num_devices / 1e12


def _closed(q: Any) -> Any:
  return q.jaxpr if isinstance(q, jcore.ClosedJaxpr) else q


def _matmul_flops(eqn) -> float:
  """One run's FLOPs of a dot_general or convolution (0 for anything else), 0 where the model does no math
  (models/layers.NOT_MODEL_FLOPS) and scaled to its active share under models/layers.active_scope."""
  name = eqn.primitive.name
  if name == 'dot_general':
    (lhs_contract, _), _ = eqn.params['dimension_numbers']
    lhs = eqn.invars[0].aval.shape
    f = 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
  elif name == 'conv_general_dilated':
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[eqn.params['dimension_numbers'].rhs_spec[0]]
    f = 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) / out_features
  else:
    return 0.0
  scopes = str(eqn.source_info.name_stack)
  if layers.NOT_MODEL_FLOPS in scopes:  # data movement (MoE dispatch, combine, routing)
    return 0.0
  if active := _ACTIVE.search(scopes):  # MoE experts: their top-k assignments of all capacity slots
    f *= int(active[1]) / int(active[2])
  return f


def _count(jaxpr, grads: list[bool]) -> tuple[float, float, list[bool]]:
  """(train-step FLOPs of one run of `jaxpr`, of which causal attention's, which outputs depend on a trained
  parameter) given which inputs do (`grads`). A matmul counts its forward once, and once more in the backward
  for each operand that depends on a trained parameter (the gradient reaching it, or its weight gradient):
  3x for a transformer's, 2x for a first convolution over images or a frozen weight's matmul, 1x where nothing
  before it trains."""
  needs = {v: g for v, g in zip(jaxpr.invars, grads)}
  on = lambda v: isinstance(v, jcore.Var) and needs.get(v, False)
  total = causal = 0.0
  for eqn in jaxpr.eqns:
    ins = [on(v) for v in eqn.invars]
    f = _matmul_flops(eqn)
    if f:
      f *= 1 + ins[0] + ins[1]
      total += f
      if 'causal_attention' in str(eqn.source_info.name_stack):
        causal += f
    t, c, outs = _count_sub(eqn, ins)
    total, causal = total + t, causal + c
    for v, g in zip(eqn.outvars, outs):
      needs[v] = g
  return total, causal, [on(v) for v in jaxpr.outvars]


def _loop_body(body, flags: list[bool], carry: slice) -> tuple[float, float, list[bool]]:
  """_count of one trip of a loop body whose inputs `carry` come back as its first outputs: the carry's flags
  raised until they hold (a later trip sees what an earlier one made depend on a trained parameter)."""
  while True:
    t, c, outs = _count(body, flags)
    raised = [a or b for a, b in zip(flags[carry], outs)]
    if raised == flags[carry]:
      return t, c, outs
    flags[carry] = raised


def _scan_split(eqn, body, length: int) -> tuple[int, int]:
  """(constants, carry) among a scan's operands, for JAX versions whose scan no longer records the counts (0.11
  keeps tree structures instead): the scanned operands are the trailing ones that are the body's inputs with a
  leading `length` axis, and the carry is the longest run before them that the body returns first, shape for shape."""
  xs = 0
  for outer, inner in zip(reversed(eqn.invars), reversed(body.invars)):
    if tuple(outer.aval.shape) != (length, *inner.aval.shape):
      break
    xs += 1
  rest = len(body.invars) - xs
  kind = lambda v: (tuple(v.aval.shape), v.aval.dtype)  # noqa: E731
  for carry in range(min(rest, len(body.outvars)), -1, -1):
    if [kind(v) for v in body.outvars[:carry]] == [kind(v) for v in body.invars[rest - carry : rest]]:
      return rest - carry, carry
  return rest, 0


def _count_sub(eqn, ins: list[bool]) -> tuple[float, float, list[bool]]:
  """FLOPs of the jaxprs inside an equation (loops times their trips, calls, remat, the costliest cond branch)
  and which of its outputs depend on a trained parameter."""
  name, p = eqn.primitive.name, eqn.params
  anything = [any(ins)] * len(eqn.outvars)
  if name == 'scan':  # invars: consts, carry, xs; outvars: carry, ys
    body = _closed(p['jaxpr'])
    consts, carry = (p['num_consts'], p['num_carry']) if 'num_carry' in p else _scan_split(eqn, body, p['length'])
    t, c, outs = _loop_body(body, list(ins), slice(consts, consts + carry))
    return p['length'] * t, p['length'] * c, outs
  if name == 'while':  # invars: cond consts, body consts, carry; outvars: carry (trips unknown: counted once)
    return _loop_body(_closed(p['body_jaxpr']), ins[p['cond_nconsts'] :], slice(p['body_nconsts'], None))
  if name == 'cond':  # invars: the index, then the branches' operands; one branch runs: the costliest
    runs = [_count(_closed(b), ins[1:]) for b in p['branches']]
    t, c, _ = max(runs, key=lambda r: r[0])
    return t, c, [any(o) for o in zip(*(r[2] for r in runs))] if runs else anything
  total = causal = 0.0
  outs = None
  for q in (x for v in p.values() for x in (v if isinstance(v, (tuple, list)) else [v])):
    sub = _closed(q)
    if not isinstance(sub, jcore.Jaxpr):
      continue
    mapped = len(sub.invars) == len(ins)  # calls, remat, custom_vjp/jvp, shard_map: operands one to one
    t, c, sub_outs = _count(sub, ins if mapped else [any(ins)] * len(sub.invars))
    total, causal = total + t, causal + c
    if mapped and len(sub_outs) == len(eqn.outvars) and outs is None:
      outs = sub_outs
  return total, causal, outs if outs is not None else anything


def matmul_flops(jaxpr) -> float:
  """Matmul and convolution FLOPs of one run of a jaxpr (a gradient program, say), each counted once."""
  return _count(jaxpr, [False] * len(jaxpr.invars))[0]


def step_flops(trainer: Any) -> StepFlops:
  """Model FLOPs of one train step on the trainer's global batch (abstract: nothing is computed)."""

  def forward(params, model_state, batch):
    model = nnx.merge(trainer.graphdef, params, model_state)
    return trainer.task.loss(model, batch)[0]

  with attention.forced('xla'):
    jaxpr = jax.make_jaxpr(forward)(trainer.abstract.params, trainer.abstract.model_state, trainer.batch_abstract)
  labels = (
    jax.tree.leaves(trainer.labels)
    if trainer.labels is not None
    else ['train'] * len(jax.tree.leaves(trainer.abstract.params))
  )
  others = len(jaxpr.jaxpr.invars) - len(labels)  # model state and batch: nothing trains them
  total, causal, _ = _count(jaxpr.jaxpr, [label == 'train' for label in labels] + [False] * others)
  return StepFlops(palm=total, causal=total - causal / 2)


def describe_peak(device: Any, override: float | None = None) -> tuple[float | None, str]:
  """(peak TFLOP/s per device, where it came from) for MFU; override wins, CPUs have none."""
  if override:
    return float(override), f'{override:g} TFLOP/s (given)'
  peak = peak_tflops(device.device_kind)
  if peak is None:
    return None, f'no known peak for {device.device_kind!r}'
  return peak, f'{peak:g} TFLOP/s dense bf16 ({device.device_kind})'


# --- Chips, for the plan search's cost model (planning/cost.py) ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Chip:
  """One device kind's figures, per device. Bandwidths in GB/s, one direction. `shared`: the figures are
  the whole host's, shared by all its devices (simulated CPU devices run on the same cores).
  The last four fields are the cost model's calibration (planning/cost.py says how each is used)."""

  name: str
  peak_tflops: float  # dense bf16 (cpu: fp32) FLOP/s
  hbm_gbps: float  # memory bandwidth
  memory_gib: float  # device memory a step may use
  ici_gbps: float  # NVLink / ICI bandwidth within a host or slice
  dcn_gbps: float  # bandwidth across hosts / slices (the network card's share per device)
  shared: bool = False
  compute_eff: float = 0.5  # fraction of peak FLOP/s a step's FLOPs run at
  link_eff: float = 0.7  # fraction of link bandwidth a collective reaches
  latency_us: float = 10.0  # fixed cost of one collective within a host
  dcn_latency_us: float = 30.0  # fixed cost of one collective that crosses hosts
  step_overhead_us: float = 0.0  # fixed cost of a step whatever the plan (dispatch, host work): fitted for 'cpu'

  @property
  def platform(self) -> str:
    """'cpu', 'tpu' or 'gpu': the JAX platform this chip is."""
    return 'cpu' if self.shared else 'tpu' if self.name.startswith('tpu') else 'gpu'


# Spec sheets: NVIDIA H100 / H200 / A100 / B200 datasheets (SXM: dense bf16 without sparsity, HBM bandwidth,
# NVLink 900 / 600 / 1800 GB/s bidirectional, halved here for one direction); DCN: one 400 Gb/s (A100: 200 Gb/s)
# ConnectX NIC per GPU (DGX H100 / A100 system specs), i.e. 50 (25) GB/s. TPUs: cloud.google.com/tpu/docs
# system-architecture pages (v4, v5e, v5p, v6e: peak bf16, HBM capacity and bandwidth, ICI bandwidth per chip);
# their DCN share per chip is a rough 12.5 GB/s (no public per-chip figure). compute_eff on H100/H200: calibrated
# on one H100 so that the search's compute term for Llama 1.24B (configs/llama.py, 8 x 2048 tokens, one device)
# equals benchmarks/throughput.py's measured step; models whose non-matmul work (norms, softmax, BatchNorm) is a
# larger share run slower than it predicts, which a FLOPs-only term does not see (docs/performance.md, "Plan
# search"). H200: the H100's compute (same die), not measured. Others: 0.45-0.55 by analogy, not measured.
# cpu: this project's 2-core test machine, whose simulated devices share both cores; its efficiencies and latency
# are fitted by benchmarks/search_accuracy.py: a step of a tiny model there is dominated by per-op and
# per-collective overheads, not by FLOPs.
CHIPS: dict[str, Chip] = {
  c.name: c
  for c in (
    Chip('h100', 989.0, 3350.0, 80.0, 450.0, 50.0, compute_eff=0.54),
    Chip('h200', 989.0, 4800.0, 141.0, 450.0, 50.0, compute_eff=0.54),
    Chip('a100', 312.0, 2039.0, 80.0, 300.0, 25.0, compute_eff=0.5),
    Chip('b200', 2250.0, 8000.0, 180.0, 900.0, 50.0, compute_eff=0.45),
    Chip('tpu_v4', 275.0, 1200.0, 32.0, 300.0, 12.5, compute_eff=0.55),
    Chip('tpu_v5e', 197.0, 819.0, 16.0, 200.0, 12.5, compute_eff=0.55),
    Chip('tpu_v5p', 459.0, 2765.0, 95.0, 600.0, 12.5, compute_eff=0.55),
    Chip('tpu_v6e', 918.0, 1640.0, 32.0, 448.0, 12.5, compute_eff=0.55),
    # cpu: fitted on Llama tiny's plans measured on a quiet machine (benchmarks/search_accuracy.py --fit): shape
    # constants for the ranking, then a scale and the per-step overhead for the times; its bandwidths are nominal
    # (simulated devices share memory), so the fitted efficiencies are not fractions of a real link. GPT-2 and
    # ViT are held out (docs/performance.md, "Plan search").
    Chip(
      'cpu',
      0.16,
      78.6,
      16.0,
      5.0,
      5.0,
      shared=True,
      compute_eff=0.93,
      link_eff=1.28,
      latency_us=153.0,
      dcn_latency_us=153.0,
      step_overhead_us=18725.0,
    ),
  )
}


def chip(name: str) -> Chip:
  """A device kind of CHIPS by name ('h100', 'tpu_v5p', 'cpu', ...); ConfigError names the known ones."""
  found = CHIPS.get(name.lower().replace('-', '_').replace(' ', '_'))
  if found is None:
    raise ConfigError(f'unknown device kind {name!r}; known: {sorted(CHIPS)} (add one to training/flops.py CHIPS)')
  return found
