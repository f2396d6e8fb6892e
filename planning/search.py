"""The plan search: validate every candidate for free, compile the survivors abstractly, score, rank.

    search = Search(config, create_fn, chip, num_devices, hosts)
    result = search.run(candidates)          # Result: ranked Scored plans, pruned reasons counted
    search.measure(result.ranked[:3])        # optional: real steps on the devices present

Per candidate, cheapest check first: (1) a mesh axis of size > 1 that no rule names (every device would
repeat the same work); (2) training.build on the full config: every parameter, optimizer leaf and batch
field validated against the rules (indivisible, conflicting, unknown axes: the ShardingError's kind is the
pruning reason); (3) parameters + optimizer state alone over the device memory; (4) the step traced on a
one-layer proxy: every activation constraint validated, and the resolved shardings recorded; a plan whose
shardings (size-1 axes dropped) equal an earlier one's is a duplicate. Orders of one mesh's axes over
hosts differ only in which devices sit on which host, not in what each device computes: one of them is
validated and compiled for all, and each order's collectives are placed on hosts from the compiled
program's groups (`_on_hosts`). Survivors are compiled abstractly
(nothing allocated) for `num_devices` devices as two proxies, 1 and 2 unrolled layers, and their figures
extrapolated to the config's layer count: X(L) = X1 + (L - 1)(X2 - X1) (exact for FLOPs, bytes and
collectives of identical layers; memory approximately). On CPU the proxies compile with LLVM optimisation
off (same partitioned HLO, memory and cost analysis; 3 s instead of 10-50 s). Compilations are cached by
that fingerprint and run on a thread pool. Plans over the chip's memory are kept in the result, marked.

This module imports no model: the caller passes `create_fn(model_config, rngs)`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import math
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec

import partitioning
import training
from errors import ConfigError, ShardingError, out_of_device_memory
from partitioning import AxisRules, hlo
from partitioning.rules import entry_axes
from planning import cost, residuals
from planning.candidates import Candidate, split_over_hosts
from training import flops, profiling

# Pruning reasons, from a ShardingError's or ConfigError's message (partitioning/rules.py, plan.py, mesh.py,
# training/xent.py wordings).
_REASONS = (
  ('global batch size', 'batch not divisible by its mesh axes'),
  ('not divisible by mesh axes', 'dimension not divisible by its mesh axes'),
  ('already taken', 'conflicting rules (no free mesh axis)'),
  ('has no rule', 'logical name without a rule'),
  ('which is not in the mesh', 'rule names an axis not in the mesh'),
  ('mirrors no parameter', 'optimizer state the rules cannot place'),
  ('loss_chunks', 'loss chunks the context shards do not divide'),
  ('grad_accum_steps', 'micro-batches do not split over the batch shards'),
)
# The search reads a compiled step's partitioned HLO, buffer assignment and cost analysis, never runs it: on CPU
# the code generation behind them is done cheaply. LLVM optimisation off and the older (loop) fusion emitters
# instead of the MLIR ones: the same collectives, memory and FLOPs, one Llama-3-8B proxy on 64 devices in
# 0.8 s instead of 2.5 s (10-50 s with the defaults).
FAST_CPU_COMPILE = {
  'xla_backend_optimization_level': 0,
  'xla_llvm_disable_expensive_passes': True,
  'xla_cpu_use_fusion_emitters': False,
}


def reason_of(err: Exception) -> str:
  text = str(err)
  return next((r for key, r in _REASONS if key in text), f'other sharding error: {text[:60]}')


def _required_bytes(line: str, memory_gib: float) -> float:
  """The temporaries a compiler's out-of-memory line says a program needs ('... required for HLO temporaries
  (25.33G) exceeds available HBM (15.75G)', TPU), else more than the whole device."""
  found = re.search(r'required for HLO temporaries \(([0-9.]+)([KMGT])\)', line)
  if not found:
    return 2.0 * memory_gib * 2**30
  return float(found.group(1)) * 2.0 ** (10 * 'KMGT'.index(found.group(2)) + 10)


SCATTERED_ROWS = 'a host would hold scattered batch rows (the data loader reads one block per host)'


class Pruned(Exception):
  def __init__(self, reason: str, detail: str = ''):
    super().__init__(reason)
    self.reason, self.detail = reason, detail


class _RecordingRules(AxisRules):
  """AxisRules that remember every activation resolution made while a step is traced."""

  def __init__(self, rules: Sequence[Any], log: set):
    super().__init__(rules)
    self.log = log

  def spec(self, logical_axes, shape=None, mesh_shape=None, *, what='array') -> PartitionSpec:
    s = super().spec(logical_axes, shape, mesh_shape, what=what)
    self.log.add((tuple(logical_axes), tuple(shape or ()), s))
    return s


def effective(spec: PartitionSpec, mesh_shape) -> tuple:
  """A spec with its size-1 mesh axes dropped (what the devices see)."""
  out = []
  for e in spec:
    out.append(tuple(a for a in entry_axes(e) if mesh_shape[a] > 1))
  while out and not out[-1]:
    out.pop()
  return tuple(out)


@dataclasses.dataclass
class _Compiled:
  """One plan's compiled proxies, before its devices are placed on hosts: each proxy's figures (collectives
  left out) and its collectives (groups as partition ids), each with the mesh axes its groups vary along.
  `mesh`: the order of mesh axes it was compiled with (partition i at that mesh's flat position i)."""

  profiles: list[cost.Profile]
  collectives: list[list[tuple[hlo.Collective, tuple[str, ...]]]]
  mesh: tuple[tuple[str, int], ...]


@dataclasses.dataclass
class Scored:
  candidate: Candidate
  profile: cost.Profile
  prediction: cost.Prediction
  mfu: float | None
  compile_s: float
  measured_s: float | None = None
  measured_times: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Result:
  ranked: list[Scored]  # fitting plans by predicted step time, then the ones over memory
  pruned: collections.Counter  # reason -> count
  examples: dict[str, str]  # reason -> one candidate and message
  considered: int
  compiled: int  # programs compiled (a mesh's orders over hosts share one)
  wall_s: float
  model_flops: float | None

  def add(self, other: Result) -> None:
    """Takes in another run's plans (ranked among these), pruning counts and programs compiled."""
    self.ranked = sorted(self.ranked + other.ranked, key=lambda s: (not s.prediction.fits, s.prediction.step_s))
    self.pruned.update(other.pruned)
    for k, v in other.examples.items():
      self.examples.setdefault(k, v)
    self.considered += other.considered
    self.compiled += other.compiled


def apply(config: ml_collections.ConfigDict, cand: Candidate, hosts: int = 1) -> ml_collections.ConfigDict:
  """A copy of the config with the candidate's mesh, rules and remat. Over several hosts the mesh is written
  as config.mesh (each host's part) x config.dcn_mesh (across hosts: split_over_hosts), which
  train.py builds as a hybrid mesh; with one host config.mesh alone, in the candidate's order.

  Over hosts, the 'batch' rules list their mesh axes hosts first: the axes wholly across hosts, then one split
  across and within them, then those within a host. Each host then holds one block of rows of the global batch,
  as train.py's data loader needs (data.local_rows); every device computes the same as in the candidate's
  order, only on other rows. (fsdp across 2 hosts x data within them, batch over ('data', 'fsdp'), would give
  host 0 rows 0-1 and 4-5 of 8.)"""
  c = copy.deepcopy(config)
  rules = [tuple(r) for r in cand.rules]
  with c.unlocked():
    if hosts > 1:
      ici, dcn = split_over_hosts(cand.mesh, hosts)
      c.mesh = ml_collections.ConfigDict(ici, sort_keys=False)
      c.dcn_mesh = ml_collections.ConfigDict(dcn, sort_keys=False)
      within = lambda a: 0 if ici.get(a, 1) == 1 else (1 if dcn.get(a, 1) > 1 else 2)
      rules = [
        (name, tuple(sorted(t, key=within)), *rest) if name == 'batch' and isinstance(t, tuple) else (name, t, *rest)
        for name, t, *rest in rules
      ]
    else:
      c.mesh = ml_collections.ConfigDict(dict(cand.mesh), sort_keys=False)
    c.logical_axis_rules = rules
    c.preset = cand.rules_name
    c.grad_accum_steps = cand.micro
    if cand.remat is not None:
      c.model.remat = cand.remat
    if cand.microbatches:  # a pipeline: its micro-batches, over the scanned stack its stages cut
      c.pipeline.microbatches = cand.microbatches
      c.model.scan_layers = True
    if 'context_load_balance' in c:  # as the cp presets: causal rows split over devices are load-balanced,
      shards = _length_shards(cand)  # where the rows cut into 2 x shards chunks (else natural order)
      c.context_load_balance = c.task == 'lm' and shards > 1 and c.dataset.seq_len % (2 * shards) == 0
  return c


def _length_shards(cand: Candidate) -> int:
  """How many devices the candidate's first 'length' rule splits a row over."""
  mesh = cand.mesh_dict
  entry = next((r[1] for r in cand.rules if r[0] == 'length'), None)
  return math.prod(mesh.get(a, 1) for a in entry_axes(entry))


def _proxy(config: ml_collections.ConfigDict, layers: int, pipelined: bool = False) -> ml_collections.ConfigDict:
  """The config with `layers` layers, unrolled (a pipeline's stay scanned: the stages cut the stack)."""
  c = copy.deepcopy(config)
  with c.unlocked():
    c.model.num_layers = layers
    if 'scan_layers' in c.model and not pipelined:
      c.model.scan_layers = False
  return c


class Search:
  def __init__(
    self,
    config: ml_collections.ConfigDict,
    create_fn: Callable[[Any, Any], Any],
    chip: Any,
    num_devices: int,
    hosts: int = 1,
    devices: Sequence[Any] | None = None,
    workers: int = 2,
    log: Callable[[str], None] = lambda s: None,
    stand_in: Callable[[], contextlib.AbstractContextManager] | None = None,
    memory_devices: Sequence[Any] | None = None,
  ):
    """`stand_in`: a context the steps are traced in when the devices here are not the target's, making them
    trace closer to the target (models/attention.gpu_stand_in for a GPU compiled on CPU: no L x L scores).
    `memory_devices`: `num_devices` compile-only devices of the target chip, a GPU or a TPU (planning/targets.py):
    each plan's proxies are compiled for them as well, and their memory is the chip's own (exact, where the
    CPU's temporaries are not and the residual model is an estimate); FLOPs, bytes and collectives are still
    read from the CPU compile (a compile-only GPU executable has no cost analysis)."""
    self.config, self.create_fn, self.chip, self.hosts, self.log = config, create_fn, chip, hosts, log
    self.devices = list(jax.devices() if devices is None else devices)[:num_devices]
    if len(self.devices) != num_devices:
      raise ShardingError(
        f'the search needs {num_devices} devices to compile for; JAX has {len(self.devices)} '
        '(simulated CPU devices: partitioning.simulate_cpu_devices before JAX starts)'
      )
    self.num_devices = num_devices
    on_target = chip.shared or self.devices[0].platform != 'cpu'
    self.stand_in = None if on_target else stand_in
    # Compiled on CPU for a GPU/TPU, the temporaries are no guide: several times a GPU's even with attention's
    # stand-in, and blind to remat. The memory is then modelled from what JAX's backward keeps
    # (planning/residuals.py). The bytes accessed are the CPU's fusion's.
    self.temporaries_known = self.bytes_known = on_target
    self.memory_devices = None
    if memory_devices is not None and not on_target:
      self.memory_devices = list(memory_devices)[:num_devices]
      if len(self.memory_devices) != num_devices:
        raise ShardingError(f'{len(self.memory_devices)} devices to compile the memory for; the plan has {num_devices}')
      self.temporaries_known = True
    self.layers = config.model.get('num_layers') if 'model' in config else None
    self.workers = workers
    self._cache: dict[Any, Any] = {}  # fingerprint -> Future of (_Compiled, compile seconds)
    self._validated: dict[Any, Any] = {}  # (mesh sizes, rules, remat) -> fingerprint, or Pruned
    self._placed: set = set()  # (fingerprint, layout over hosts as written) scored
    self._lock = threading.Lock()
    self.model_flops: float | None = None

  # --- validation (free) -------------------------------------------------------------------------
  def _trainer(self, config, cand: Candidate, devices: Sequence[Any] | None = None):
    mesh = partitioning.make_mesh(dict(cand.mesh), devices or self.devices)
    return training.build(config, mesh, lambda rngs: self.create_fn(config.model, rngs))

  def _memory_steps(self, trainers: list, cand: Candidate) -> list:
    """The proxies' steps traced over the target chip's compile-only devices (their attention chosen as there)."""
    return [
      training.trace(t, training.jit_train_step(t))
      for t in (self._trainer(tr.config, cand, self.memory_devices) for tr in trainers)
    ]

  def validate(self, cand: Candidate) -> tuple[Any, list, list]:
    """(fingerprint, traced proxy steps, the proxies' trainers) or Pruned."""
    used = {a for _, t in cand.rules for a in ((t,) if isinstance(t, str) else (t or ()))}
    idle = [f'{a}={s}' for a, s in cand.mesh if s > 1 and a not in used]
    if idle:
      raise Pruned('mesh axis of size > 1 that no rule uses (repeated work)', ', '.join(idle))
    config = apply(self.config, cand)
    try:
      full = self._trainer(config, cand)
      state_bytes = partitioning.tree_bytes_per_device(
        full.abstract.params, full.specs.params, full.mesh.shape
      ) + partitioning.tree_bytes_per_device(full.abstract.opt_state, full.specs.opt_state, full.mesh.shape)
      if state_bytes > self.chip.memory_gib * 2**30 * 0.9:
        raise Pruned(
          'parameters + optimizer state over device memory',
          f'{state_bytes / 2**30:.1f} GiB > 0.9 x {self.chip.memory_gib:g} GiB',
        )
      if self.model_flops is None:
        self.model_flops = flops.step_flops(full).causal
      traced, trainers, fps = [], [], []
      for layers in self._proxy_layers(cand):
        pc = _proxy(config, layers, cand.microbatches > 0) if layers else config
        tr = self._trainer(pc, cand)
        log: set = set()
        tr.rules = _RecordingRules(pc.logical_axis_rules, log)
        with self.stand_in() if self.stand_in else contextlib.nullcontext():
          traced.append(training.trace(tr, training.jit_train_step(tr)))
        trainers.append(tr)
        idle = [w for w in tr.warnings() if w.startswith('mesh axis')]
        if idle:
          raise Pruned('mesh axis of size > 1 that no rule uses (repeated work)', idle[0])
        shape = tr.mesh.shape
        eff = lambda specs: tuple(
          effective(s, shape) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        )
        fps.append(
          (
            eff(tr.specs),
            eff({k: v.spec for k, v in tr.batch_shardings.items()}),
            tuple(sorted(((n, sh, effective(s, shape)) for n, sh, s in log), key=repr)),
          )
        )
    except ConfigError as e:  # ShardingError, and what a model or loss option refuses under this plan
      raise Pruned(reason_of(e), str(e)) from None
    mesh_eff = tuple(sorted((a, s) for a, s in cand.mesh if s > 1))  # any order: placed on hosts later
    return (mesh_eff, cand.remat, cand.microbatches, cand.micro, tuple(fps)), traced, trainers

  def _scattered_rows(self, cand: Candidate) -> str | None:
    """Over several hosts, which rows of the global batch a host would hold if they are not one contiguous
    block under the plan as written (config.mesh x config.dcn_mesh): train.py's data loader refuses that
    (data.local_rows); None where every host's rows are one block."""
    plan = apply(self.config, cand, self.hosts)
    mesh = partitioning.make_mesh(dict(plan.mesh), self.devices, dict(plan.dcn_mesh))
    B = self.config.batch_size
    spec = AxisRules(plan.logical_axis_rules).spec(('batch',), (B,), mesh.shape)
    index = jax.sharding.NamedSharding(mesh, spec).devices_indices_map((B,))
    hosts = partitioning.dcn_coordinates(mesh, dict(plan.dcn_mesh))
    for host in range(self.hosts):
      spans, one_block = partitioning.leading_rows((index[d] for d, h in zip(mesh.devices.flat, hosts) if h == host), B)
      if not one_block:
        return f'host {host} would hold rows {spans} of {B}'
    return None

  def _proxy_layers(self, cand: Candidate) -> list[int | None]:
    """The proxies' layer counts: 1 and 2, or for a pipeline of S stages S and 2 S (one and two layers per stage)."""
    if not self.layers:
      return [None]
    unit = cand.stages if cand.microbatches else 1
    return [unit] if self.layers == unit else [unit, 2 * unit]

  # --- scoring (compiles) ------------------------------------------------------------------------
  def _read(self, compiled) -> tuple[cost.Profile, list[hlo.Collective]]:
    """A compiled proxy's figures (collectives apart, their groups as partition ids)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    counts = hlo.computation_counts(text)  # runs per step of each computation (loop trips), read once
    colls = hlo.collectives(text, self.num_devices, counts)
    # loops (blockwise attention's key blocks, a chunked loss) count once in the cost analysis: add the rest
    profile = cost.Profile(
      float(ca.get('flops', 0.0)) + hlo.loop_dot_flops(text, counts),
      float(ca.get('bytes accessed', 0.0)),
      float(profiling.compiled_memory(compiled)),
      float(mem.argument_size_in_bytes),
      float(mem.temp_size_in_bytes),
      {},
    )
    return profile, colls

  def _on_hosts(self, compiled: _Compiled, mesh: Sequence[tuple[str, int]], unit: int = 1) -> cost.Profile:
    """The plan's profile with the devices laid out as `mesh` orders its axes (the same axes and sizes as
    the compiled order): each collective keyed by the mesh axes its groups vary along and the hosts one
    group reaches, the hosts laid out as the plan is written (split_over_hosts: each axis's outer part across
    hosts, the hybrid mesh train.py builds)."""
    names, sizes = [a for a, _ in compiled.mesh], [s for _, s in compiled.mesh]
    coords = np.unravel_index(np.arange(self.num_devices), sizes)  # partition -> compiled mesh coordinates
    ici, dcn = split_over_hosts(mesh, self.hosts) if self.hosts > 1 else (dict(mesh), {a: 1 for a, _ in mesh})
    host_of = np.ravel_multi_index(
      [coords[names.index(a)] // ici[a] for a, _ in mesh], [dcn[a] for a, _ in mesh]
    )  # partition -> host, in this order
    rank = {a: i for i, (a, _) in enumerate(mesh)}
    profiles = []
    for base, colls in zip(compiled.profiles, compiled.collectives):
      coll: dict[cost.CollectiveKey, list[float]] = {}
      for c, axes in colls:
        key = cost.CollectiveKey(
          c.op, tuple(sorted(axes, key=rank.get)), c.group_size, hlo.hosts_spanned(c.groups, host_of.__getitem__)
        )
        v = coll.setdefault(key, [0.0, 0.0])
        v[0] += c.times
        v[1] += c.times * c.bytes
      profiles.append(dataclasses.replace(base, collectives={k: (v[0], v[1]) for k, v in coll.items()}))
    if len(profiles) == 2:  # X(L) = X1 + (L - 1)(X2 - X1), in units of `unit` layers (a pipeline's stages)
      n = self.layers / unit
      return profiles[0].combine(profiles[1], 2 - n, n - 1)
    return profiles[0]

  def _compile(self, traced: list, kept: list, on_target: list, mesh) -> tuple[_Compiled, float]:
    """`kept`: per proxy, the residual model's function (targets not compiled on); `on_target`: per proxy, the step
    traced over the target chip's devices, whose memory replaces the CPU compile's. At most one is given."""
    t0 = time.perf_counter()
    options = FAST_CPU_COMPILE if self.devices[0].platform == 'cpu' else None
    read = [self._read(t.lower().compile(compiler_options=options)) for t in traced]
    profiles = [p for p, _ in read]
    colls = [[(c, hlo.mesh_axes(c.groups, dict(mesh))) for c in cs] for _, cs in read]
    for i, (fn, num_fused) in enumerate(kept):
      est = residuals.from_compiled(fn.lower().compile(compiler_options=options), num_fused)
      profiles[i] = dataclasses.replace(
        profiles[i], kept_fused=est.fused, kept_written=est.written, kept_largest=est.largest
      )
    for i, step in enumerate(on_target):
      try:
        compiled = step.lower().compile()
      except Exception as e:  # the TPU compiler refuses a program over the chip's memory: the plan is over it
        if (line := out_of_device_memory(e)) is None:
          raise
        temp = _required_bytes(line, self.chip.memory_gib)
        profiles[i] = dataclasses.replace(profiles[i], memory=profiles[i].argument_bytes + temp, temp_bytes=temp)
        continue
      mem = compiled.memory_analysis()
      profiles[i] = dataclasses.replace(
        profiles[i],
        memory=float(profiling.compiled_memory(compiled)),
        argument_bytes=float(mem.argument_size_in_bytes),
        temp_bytes=float(mem.temp_size_in_bytes),
      )
    return _Compiled(profiles, colls, tuple(mesh)), time.perf_counter() - t0

  def run(
    self,
    candidates: Iterable[Candidate],
    micro_batches: Sequence[int] = (),
    announce: Callable[[str], None] | None = None,
  ) -> Result:
    """Ranks `candidates`; the plans over the device memory are tried again in each of `micro_batches` micro-batches
    (config.grad_accum_steps, smallest first) until they fit: the same global batch, fewer activations at once,
    scored with what the loop adds (per-micro-batch collectives, counted per trip). `announce`, if given, is told
    how many candidates there are and, once the first program has compiled, about how long they will take."""
    t0 = time.perf_counter()
    pruned: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    scored, considered, compiled = self._score(candidates, pruned, examples, announce)
    over = [s.candidate for s in scored if not s.prediction.fits]
    for micro in sorted(m for m in micro_batches if m > 1):
      if not over:
        break
      more, n, k = self._score([dataclasses.replace(c, micro=micro) for c in over], pruned, examples)
      scored, considered, compiled = scored + more, considered + n, compiled + k
      over = [s.candidate for s in more if not s.prediction.fits]
    for s in scored:
      if not s.prediction.fits:
        pruned['over device memory (compiled)'] += 1
        examples.setdefault(
          'over device memory (compiled)',
          f'{s.candidate.label()}: {s.prediction.memory_gib:.1f} GiB ({s.prediction.state_gib:.1f} GiB of state)',
        )
    ranked = sorted(scored, key=lambda s: (not s.prediction.fits, s.prediction.step_s))
    return Result(ranked, pruned, examples, considered, compiled, time.perf_counter() - t0, self.model_flops)

  def _score(
    self,
    candidates: Iterable[Candidate],
    pruned: collections.Counter,
    examples: dict[str, str],
    announce: Callable[[str], None] | None = None,
  ) -> tuple[list[Scored], int, int]:
    """(scored plans, candidates considered, programs compiled); pruning reasons counted into `pruned`."""
    pending: list[tuple[Candidate, Any]] = []
    considered, compiled = 0, 0
    dup = 'same shardings as an earlier plan (compiled once)'
    candidates = list(candidates)
    # another order of a mesh already validated: the same devices' work, on other hosts
    group_of = lambda c: (tuple(sorted(c.mesh)), c.rules, c.remat, c.microbatches, c.micro)
    todo = len({group_of(c) for c in candidates} - self._validated.keys())
    if announce:
      announce(f'{len(candidates)} candidates: {todo} programs at most to trace and compile ({self.workers} workers)')
    with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
      for cand in candidates:
        considered += 1
        group = group_of(cand)
        if group not in self._validated:
          try:
            t_trace = time.perf_counter()
            fp, traced, trainers = self.validate(cand)
            self._validated[group] = fp
            if fp not in self._cache:
              # the memory, per proxy: compiled for the target chip, or (no such devices) the residual model;
              # traced here, where the stand-in is set
              on_target = self._memory_steps(trainers, cand) if self.memory_devices else []
              kept = [] if self.temporaries_known else [residuals.trace(tr, self.stand_in) for tr in trainers]
              trace_s = time.perf_counter() - t_trace
              self._cache[fp] = pool.submit(self._compile, traced, kept, on_target, cand.mesh)
              compiled += 1
              first = self._cache[fp]
              if announce and compiled == 1 and first.exception() is None:  # waits; an error surfaces below
                compile_s = first.result()[1]  # tracing is serial, compiling runs on the workers
                total = todo * (trace_s + compile_s / min(self.workers, todo))
                announce(
                  f'the first took {trace_s:.1f} s to trace, {compile_s:.1f} s to compile: at most about '
                  f'{_duration(total)} for all {todo} (pruned ones take less)'
                )
          except Pruned as p:
            self._validated[group] = p
        fp = self._validated[group]
        if isinstance(fp, Pruned):
          pruned[fp.reason] += 1
          examples.setdefault(fp.reason, f'{cand.label()}: {fp.detail}'[:300])
          continue
        if self.hosts > 1 and (rows := self._scattered_rows(cand)):
          pruned[SCATTERED_ROWS] += 1
          examples.setdefault(SCATTERED_ROWS, f'{cand.label()}: {rows}')
          continue
        # over hosts, one score per layout as written (orders the host split lays out alike are one plan)
        placed = (
          fp,
          tuple(tuple((a, n) for a, n in d.items() if n > 1) for d in split_over_hosts(cand.mesh, self.hosts))
          if self.hosts > 1
          else (),
        )
        if placed in self._placed:
          pruned[dup] += 1
          examples.setdefault(dup, cand.label())
          continue
        self._placed.add(placed)
        pending.append((cand, self._cache[fp]))
      scored = []
      for cand, fut in pending:
        out, secs = fut.result()
        profile = self._on_hosts(out, cand.mesh, cand.stages if cand.microbatches else 1)
        if cand.microbatches:  # its idle iterations are in the compiled FLOPs already (every stage runs each one)
          profile.bubble = (cand.stages - 1) / (cand.microbatches + cand.stages - 1)
        pred = cost.predict(
          profile, self.chip, self.num_devices, temporaries_known=self.temporaries_known, bytes_known=self.bytes_known
        )
        m = cost.mfu(self.model_flops, pred.step_s, self.num_devices, self.chip) if self.model_flops else None
        scored.append(Scored(cand, profile, pred, m, secs))
        self.log(f'  {cand.label()}: {1e3 * pred.step_s:.1f} ms predicted ({secs:.1f} s to compile)')
    return scored, considered, compiled

  # --- measuring (real steps) --------------------------------------------------------------------
  def measure(self, plans: Sequence[Scored], steps: int = 3, rounds: int = 1, warmup: int = 1) -> None:
    """Runs each plan's real train step on the devices present: `rounds` rounds of `steps` steps each,
    round-robin over the plans (load changes hit all alike); sets measured_s to the median step time.
    With one round the plans run one after another, each state freed before the next is made (accelerator
    memory holds one model at a time); with more, every plan's state is alive at once."""
    if rounds == 1 and len(plans) > 1:
      for s in plans:
        self.measure([s], steps, 1, warmup)
      return
    runs = []
    for s in plans:
      config = apply(self.config, s.candidate)
      tr = self._trainer(config, s.candidate)
      step = training.compile_step(tr, training.jit_train_step(tr))
      state = training.init_state(tr)
      batch = partitioning.shard(tr.task.synthetic_batch(config, seed=config.seed), tr.batch_shardings)
      for _ in range(warmup):
        state, _ = step(state, batch)
      jax.block_until_ready(state)
      runs.append([s, step, state, batch])
    for _ in range(rounds):
      for run in runs:
        s, step, state, batch = run
        for _ in range(steps):
          t = time.perf_counter()
          state, _ = step(state, batch)
          jax.block_until_ready(state)
          s.measured_times.append(time.perf_counter() - t)
        run[2] = state
    for s, *_ in runs:
      s.measured_s = statistics.median(s.measured_times)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
  """Spearman's rank correlation (average ranks for ties)."""

  def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):
      j = i
      while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
        j += 1
      for k in range(i, j + 1):
        r[order[k]] = (i + j) / 2
      i = j + 1
    return r

  rx, ry = ranks(xs), ranks(ys)
  mx, my = statistics.fmean(rx), statistics.fmean(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
  return cov / den if den else float('nan')


def _duration(s: float) -> str:
  """'45 s', '3.2 min', '1.5 h'."""
  return f'{s:.0f} s' if s < 120 else f'{s / 60:.1f} min' if s < 7200 else f'{s / 3600:.1f} h'
