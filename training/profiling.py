"""Measuring a compiled step: step times, device memory, profiles (jax.profiler) with a top-ops summary, and the
loss curve of a few train steps (the fast paths' loss parity)."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import time
from typing import Any

import jax
import numpy as np

import errors
import models
import partitioning
from training import trainer as trainer_lib

TIMINGS = ('pipelined', 'blocking')


def time_steps(
  step: Any, state: Any, batch: Any, *, warmup: int, steps: int, timing: str = 'pipelined'
) -> tuple[Any, list[float], list[float]]:
  """Runs `warmup` untimed then `steps` timed calls of a (donating) train step on one batch. Returns the final
  state, the step times and the host's dispatch times (how long each call took to return), in seconds.

  'pipelined' (the default) times steps as train.py runs them: the host dispatches step i+1 while the device
  runs step i, and a step's time is the interval between its metrics and the previous step's becoming ready, so
  the host's dispatch overlaps the device's work, as it does in training (and as the torch peer's CUDA events,
  recorded on a stream the host runs ahead of, time its steps). 'blocking' waits for the whole new state after
  each step before dispatching the next: the device idles while the host dispatches, which counts in the step."""
  if timing not in TIMINGS:
    raise ValueError(f'time_steps(timing={timing!r}): one of {TIMINGS}')
  for _ in range(warmup):
    state, _ = step(state, batch)
  jax.block_until_ready(state)
  times, dispatch = [], []
  if timing == 'blocking':
    for _ in range(steps):
      t0 = time.perf_counter()
      state, _ = step(state, batch)
      dispatch.append(time.perf_counter() - t0)
      jax.block_until_ready(state)
      times.append(time.perf_counter() - t0)
    return state, times, dispatch
  in_flight, last = [], time.perf_counter()
  for i in range(steps + 1):
    if i < steps:  # step i is queued before step i - 1 is waited for
      t0 = time.perf_counter()
      state, metrics = step(state, batch)
      dispatch.append(time.perf_counter() - t0)
      in_flight.append(metrics)
    if i > 0:
      jax.block_until_ready(in_flight.pop(0))  # outputs of one execution are ready together
      now = time.perf_counter()
      times.append(now - last)
      last = now
  jax.block_until_ready(state)
  return state, times, dispatch


def peak_memory(device: jax.Device) -> int | None:
  """Peak bytes the device allocator has held in this process (GPU/TPU); None where unknown (CPU)."""
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  return None if not stats else stats.get('peak_bytes_in_use')


def compiled_memory(compiled: Any) -> int:
  """Per-device bytes a compiled step needs: arguments + outputs + temporaries, minus donated aliases."""
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def memory_limit(device: Any) -> int | None:
  """Bytes the device's allocator may hand out (GPUs, TPUs: memory_stats' bytes_limit; on GPUs the share JAX
  took, 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise); None where unknown (CPUs)."""
  try:
    stats = device.memory_stats()
  except Exception:  # compile-only and some plugin devices have none
    return None
  return int(stats['bytes_limit']) if stats and stats.get('bytes_limit') else None


# How far over the device's limit a compiled program's memory may be before check_fits refuses it: the compiled
# figure can overstate a measured peak by a few percent (docs/performance.md), and a run that would fit must not
# be refused. A program between the two fails at allocation, in XLA's own words.
FIT_MARGIN = 1.05


def check_fits(programs: dict[str, Any], device: Any, config: Any, limit: int | None = None) -> None:
  """DeviceMemoryError naming the figures when a compiled program (name -> compiled) needs more per device than
  `device` holds (`limit`, default memory_limit(device); by more than FIT_MARGIN), before anything is allocated;
  nothing where the limit is unknown (CPUs)."""
  limit = memory_limit(device) if limit is None else limit
  if not limit:
    return
  gib = partitioning.fmt_bytes
  for name, compiled in programs.items():
    need = compiled_memory(compiled)
    if need <= limit * FIT_MARGIN:
      continue
    m = compiled.memory_analysis()
    remat = config.model.get('remat')  # a family without a layer stack has none
    change = [f'lower config.batch_size={config.batch_size}']
    if remat is not None and remat not in ('full', True):
      change.append(f"recompute more in the backward pass (config.model.remat={remat!r}; 'full' keeps least)")
    if config.model.get('loss_chunks') == 0 and config.task == 'lm':
      change.append('compute the loss in chunks (config.model.loss_chunks)')
    change.append('shard the state and activations over more devices (config.mesh, config.logical_axis_rules)')
    raise errors.DeviceMemoryError(
      f'the {name} needs {gib(need)} per device (arguments {gib(m.argument_size_in_bytes)}, temporaries '
      f'{gib(m.temp_size_in_bytes)}, outputs {gib(m.output_size_in_bytes - m.alias_size_in_bytes)} beyond the '
      f'donated state), more than the {gib(limit)} a {device.device_kind} holds for it: ' + ', or '.join(change)
    )


class StepProfiler:
  """Captures a jax.profiler trace of steps [first, first + num) into `logdir` (TensorBoard's profile
  plugin reads it; a perfetto_trace.json.gz beside it opens in ui.perfetto.dev). first <= 0: off."""

  def __init__(self, logdir: str, first: int, num: int):
    self.logdir, self.first, self.last = logdir, first, first + max(num, 1) - 1
    self.active = False

  def before(self, step: int) -> None:
    if self.first > 0 and step == self.first:
      jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, state: Any) -> str | None:
    """Stops after the last profiled step (waiting for it); returns the trace's directory then."""
    if self.active and step >= self.last:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False
      return self.logdir
    return None

  def close(self) -> None:
    """Stops a trace still running (e.g. after an exception)."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False


def _device_events(logdir: str) -> list[dict]:
  """The complete ('X') events of device ops in the newest perfetto trace under `logdir` (device streams only
  when the trace has them, e.g. GPU kernels; every op otherwise)."""
  files = sorted(glob.glob(os.path.join(logdir, '**', '*perfetto_trace.json.gz'), recursive=True), key=os.path.getmtime)
  if not files:
    return []
  with gzip.open(files[-1], 'rt') as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  names = {
    e['pid']: e.get('args', {}).get('name', '')
    for e in events
    if e.get('ph') == 'M' and e.get('name') == 'process_name'
  }
  device_pids = {pid for pid, name in names.items() if '/device:' in name and 'CPU' not in name.upper()}
  return [e for e in events if e.get('ph') == 'X' and (not device_pids or e.get('pid') in device_pids)]


def top_ops(logdir: str, k: int | None = 15) -> list[tuple[str, float, int]]:
  """(name, total ms, count) of the k (None: all) costliest device ops in the newest perfetto trace under
  `logdir` (device streams only when the trace has them, e.g. GPU kernels; every op otherwise)."""
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in _device_events(logdir):
    t = totals[e.get('name', '?')]
    t[0] += e.get('dur', 0) / 1e3
    t[1] += 1
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:k]
  return [(name, ms, int(n)) for name, (ms, n) in ranked]


def device_time(logdir: str, short_us: float = 5.0) -> dict[str, float]:
  """Where a profile's device time went, in ms over the whole trace: `span` (first op's start to last op's end),
  `busy` (the union of the ops' intervals over every stream, so overlapping streams count once), `idle` (span -
  busy: gaps between kernels, host work, launches), and `ops` / `short` / `short_ms`: how many ops ran, how many
  were shorter than `short_us` and their time. Many short ops with much idle time between them point at launch
  overhead rather than at the kernels."""
  spans = sorted((e.get('ts', 0.0), e.get('ts', 0.0) + e.get('dur', 0.0)) for e in _device_events(logdir))
  blocks: list[list[float]] = []  # the union of the ops' intervals: disjoint [start, end] blocks
  for start, stop in spans:
    if blocks and start <= blocks[-1][1]:
      blocks[-1][1] = max(blocks[-1][1], stop)
    else:
      blocks.append([start, stop])
  span = (blocks[-1][1] - blocks[0][0]) if blocks else 0.0
  # Each block's length once (not piece by piece, whose rounding let a back-to-back trace's busy exceed its
  # span); the union of intervals inside the span is never longer than it.
  busy = min(sum(b - a for a, b in blocks), span)
  short = [b - a for a, b in spans if b - a < short_us]
  return dict(
    span=span / 1e3,
    busy=busy / 1e3,
    idle=(span - busy) / 1e3,
    ops=len(spans),
    short=len(short),
    short_ms=sum(short) / 1e3,
  )


OP_KINDS = (  # (kind, name fragments), first match wins; names as GPU traces show kernels
  ('attention', ('fmha', 'flash', 'attention', 'sdpa', 'mha')),
  ('convolution', ('conv', 'fprop', 'dgrad', 'wgrad')),
  ('matmul', ('gemm', 'nvjet', 'cublas', 'cutlass', 'matmul', 'dot')),
  ('copy', ('memcpy', 'memset', 'copy', 'dynamic_update_slice', 'dynamic-update-slice')),
  ('reduction', ('reduce',)),
  ('elementwise fusion', ('fusion', 'loop_', 'input_')),
)


def op_kinds(ops: list[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
  """(kind, total ms, count) of `ops` (top_ops(..., k=None)) grouped by OP_KINDS, costliest first."""
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for name, ms, n in ops:
    low = name.lower()
    kind = next((k for k, frags in OP_KINDS if any(f in low for f in frags)), 'other')
    totals[kind][0] += ms
    totals[kind][1] += n
  return sorted(((k, ms, int(n)) for k, (ms, n) in totals.items()), key=lambda r: -r[1])


def config_overrides(config: Any, spec: str) -> dict[str, Any]:
  """'a.b=v,c=w' -> {'a.b': v, ...} for the keys `config` has, each value parsed as its field's type (bools
  from 'True'/'False'); keys it lacks are skipped (one reference spec serves every family)."""
  out = {}
  for item in filter(None, spec.split(',')):
    key, value = item.split('=', 1)
    *holders, field = key.split('.')
    node = config
    for h in holders:
      node = node.get(h) if hasattr(node, 'get') else None
    if node is None or not hasattr(node, 'get') or field not in node:
      continue
    old = node[field]
    out[key] = (value == 'True') if isinstance(old, bool) else value if old is None else type(old)(value)
  return out


def train_losses(config: Any, mesh: Any, batches: list[dict]) -> Any:
  """The loss of each of len(batches) train steps of `config` from its initial state (numpy float64)."""
  trainer = trainer_lib.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))
  step = trainer_lib.compile_step(trainer, trainer_lib.jit_train_step(trainer))
  state = trainer_lib.init_state(trainer)
  out = []
  for batch in batches:
    state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
    out.append(metrics['loss'])
  return np.asarray(jax.device_get(out), np.float64)
