"""The steps of a plan search, in the order search.py takes them: check the input (before JAX starts) ->
devices (real or simulated) -> the memory target -> stage 1 -> stage 2 -> measure -> the table and the choice ->
the plan file. Each does one thing and says what it did in a line (`say`).

Like planning/search.py, nothing here imports a model: search.py passes the model builder and attention's GPU
stand-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections

import errors
import partitioning
from configs import schema
from planning import candidates, plan_file, report, targets
from planning import search as search_lib
from training import flops

# The search's counts and their least values (flags of search.py).
LEAST = dict(top=1, measure=0, measure_steps=1, stage2=0, workers=1)


def say(msg: str) -> None:
  print(msg, flush=True)


# --- Check the input (before JAX starts) -----------------------------------------------------------------------


@dataclasses.dataclass
class Request:
  """What to search for, checked: the config, the chip and how many, the rule sets, the remat policies."""

  config: ml_collections.ConfigDict
  config_path: str
  config_arg: str | None
  chip: flops.Chip
  devices: int
  hosts: int
  rules: dict[str, Any]  # rule set name -> rules: the config file's presets and their variants ('preset-variant')
  axes: list[str]  # the mesh axes a candidate sizes
  remat: str  # --remat: 'staged', 'config' or a list of policies
  remats: list  # every remat policy of the model ([None] where it has none)
  first: list  # the remat policies of stage 1
  micro_batches: list[int]  # micro-batch counts a plan over the memory is tried in

  def source(self) -> str:
    """'configs/llama.py:tiny'."""
    return self.config_path + (f':{self.config_arg}' if self.config_arg else '')

  def target(self) -> str:
    """'64 x h100 over 8 hosts'."""
    return f'{self.devices} x {self.chip.name}' + (f' over {self.hosts} hosts' if self.hosts > 1 else '')


def check_input(
  config: ml_collections.ConfigDict,
  config_file: str,
  device_kind: str,
  devices: int,
  hosts: int,
  counts: Mapping[str, int],
  remat: str,
  micro_batches: Sequence[str],
  out: str | None,
  overwrite: bool,
) -> Request:
  """The request, every part of it checked (one ConfigError naming the flag otherwise). `config_file`: the
  --config flag's file and argument ('configs/llama.py:tiny'); `counts`: the values of LEAST's flags."""
  schema.check(config)
  chip = flops.chip(device_kind)
  if devices < 1 or hosts < 1 or devices % hosts:
    raise errors.ConfigError(
      f'--devices {devices} --hosts {hosts}: the device count must be a positive multiple of the host count'
    )
  for name, low in LEAST.items():
    if counts[name] < low:
      raise errors.ConfigError(f'--{name}={counts[name]}: must be >= {low}')
  bad = [m for m in micro_batches if not m.strip().lstrip('-').isdigit()]
  if bad:
    raise errors.ConfigError(f'--micro_batches={",".join(micro_batches)}: {bad} not whole numbers')
  micro = [int(m) for m in micro_batches]
  if small := [m for m in micro if m < 2]:
    raise errors.ConfigError(
      f'--micro_batches={",".join(micro_batches)}: {small} would split no batch (counts must be >= 2; '
      '--micro_batches= tries none)'
    )
  if config.grad_accum_steps > 1:  # each plan sets its own (candidates.Candidate.micro)
    say(
      f'WARNING config: config.grad_accum_steps={config.grad_accum_steps} is not searched from: every plan is tried '
      f'with 1 micro-batch, and those over the memory with --micro_batches={",".join(micro_batches) or "(none)"}'
    )
  config_path, _, config_arg = config_file.partition(':')
  if out:
    plan_file.check_out_path(out, overwrite=overwrite, config_file=config_path)
  rules = candidates.rule_variants(candidates.presets_of(config_path, config_arg or None, config))
  axes = candidates.mesh_axes_of(rules, list(config.mesh))
  has_remat = 'model' in config and 'remat' in config.model
  remats = list(schema.FIELDS['model.remat'].choices()) if has_remat else [None]
  if remat in ('staged', 'config'):
    first = [config.model.remat if has_remat else None]
  else:
    first = [r.strip() for r in remat.split(',') if r.strip()]
    bad = [r for r in first if r not in remats]
    if bad:
      raise errors.ConfigError(f'--remat {remat!r}: {bad} not remat policies; choose from {remats}')
  return Request(
    config, config_path, config_arg or None, chip, devices, hosts, rules, axes, remat, remats, first, micro
  )


# --- Devices: the real ones when there are as many as planned for, else simulated CPU devices -------------------


def start_devices(req: Request) -> list[jax.Device]:
  """The devices the plans compile on; simulated CPU devices are asked for before JAX starts its backends."""
  partitioning.simulate_cpu_devices(req.devices)
  n = req.devices
  devices = jax.devices() if jax.device_count() == n and jax.default_backend() != 'cpu' else jax.devices('cpu')
  say(
    f'plan search: {req.source()} for {req.target()} (compiling on {len(devices)} {devices[0].platform} '
    f'devices); mesh axes {req.axes}; rule sets {list(req.rules)}'
  )
  return devices


# --- The memory target: each plan's memory compiled for the chip itself where its compiler is here -------------


@dataclasses.dataclass
class Memory:
  target: str | None  # the chip's compile target (planning/targets.py), or None: memory modelled or compiled here
  devices: list[jax.Device] | None  # compile-only devices of the target


def memory_target(req: Request, devices: Sequence[jax.Device], choice: str) -> Memory:
  """Compiled on CPU for a GPU or a TPU: the target each plan's memory is compiled for where JAX's CUDA plugin or
  libtpu can (`choice`: --compile_target), else None and the memory modelled from what the backward keeps."""
  if devices[0].platform != 'cpu' or req.chip.platform not in ('gpu', 'tpu'):
    return Memory(None, None)
  n = req.devices
  target, why = targets.memory_target(req.chip.name, n, choice)
  if not target:
    say(f'memory: modelled from what the backward keeps (planning/residuals.py): {why}')
    return Memory(None, None)
  memory = Memory(target, targets.compile_devices(target, n))
  say(f"memory: compiled for {n} x {target}, the {req.chip.platform.upper()}'s own ({why})")
  return memory


def make_search(
  req: Request,
  devices: Sequence[jax.Device],
  memory: Memory,
  workers: int,
  create_fn: Callable[[Any, Any], Any],
  gpu_stand_in: Callable[[], contextlib.AbstractContextManager],
) -> search_lib.Search:
  """The search over `devices`. Compiled on CPU for a GPU, attention is traced as on the GPU, its fused kernels
  stood in for by `gpu_stand_in` (models/attention.py's: 'blockwise')."""
  return search_lib.Search(
    req.config,
    create_fn,
    req.chip,
    req.devices,
    req.hosts,
    devices,
    workers=workers,
    stand_in=gpu_stand_in if req.chip.platform == 'gpu' else None,
    memory_devices=memory.devices,
  )


# --- Stage 1: every mesh x preset, the config's remat (or the given ones) ---------------------------------------


def stage1(search: search_lib.Search, req: Request) -> search_lib.Result:
  presets = {k: v for k, v in req.rules.items() if '-' not in k}
  cands = candidates.generate(req.devices, req.axes, presets, req.first, req.hosts, req.config.batch_size)
  result = search.run(cands, req.micro_batches, announce=say)
  say(f'stage 1: {len(result.ranked)} plans scored ({result.compiled} compiled) in {result.wall_s:.0f} s')
  return result


# --- Stage 2: the best plans' meshes with their presets' variants and every remat policy -------------------------


def stage2(search: search_lib.Search, req: Request, result: search_lib.Result, best: int) -> None:
  """The `best` plans of stage 1 (--stage2) again with their presets' variants and, with --remat=staged, every
  remat policy; added to `result`."""
  if not result.ranked or not best:
    return
  remats = req.remats if req.remat == 'staged' else req.first
  more = [
    candidates.Candidate(c.mesh, name, r, remat, c.microbatches, c.micro)
    for c in (s.candidate for s in result.ranked[:best])
    for name, r in req.rules.items()
    if name.split('-')[0] == c.rules_name
    for remat in remats
  ]
  extra = search.run(more, req.micro_batches, announce=say)
  say(f'stage 2: {len(extra.ranked)} plans scored ({extra.compiled} compiled) in {extra.wall_s:.0f} s')
  result.add(extra)


def fitting(result: search_lib.Result, req: Request) -> list[search_lib.Scored]:
  """The plans within the device memory, fastest first; ShardingError with the commonest reasons if none is."""
  fits = [s for s in result.ranked if s.prediction.fits]
  if not fits:
    raise errors.ShardingError(
      f'no plan for {req.devices} x {req.chip.name} survived: '
      + '; '.join(f'{k} ({v}), e.g. {result.examples.get(k, "")[:200]}' for k, v in result.pruned.most_common(3))
    )
  return fits


# --- Measure the top K for real ---------------------------------------------------------------------------------


def measure(search: search_lib.Search, req: Request, fits: Sequence[search_lib.Scored], top: int, steps: int) -> None:
  if not top:
    return
  if jax.device_count() < req.devices:
    raise errors.ConfigError(f'--measure needs {req.devices} devices; this machine has {jax.device_count()}')
  say(f'measuring the top {top} plans ({steps} steps each) ...')
  search.measure(fits[:top], steps=steps)


# --- The table, the choice --------------------------------------------------------------------------------------


def table(result: search_lib.Result, req: Request, fits: Sequence[search_lib.Scored], rows: int) -> None:
  """The ranked table's first `rows`, why the rest were pruned, and which measured plan was fastest."""
  say('')
  say(report.table(result.ranked[:rows], req.chip))
  say('')
  say(report.pruning(result))
  measured = [s for s in fits if s.measured_s is not None]
  if measured:
    fastest = min(measured, key=lambda s: s.measured_s)
    say(
      f'measured: the fastest of the top {len(measured)} is {fastest.candidate.label()} '
      f'({report.seconds(fastest.measured_s)}); predicted winner {report.seconds(fits[0].measured_s)}'
    )


@dataclasses.dataclass
class Choice:
  plan: search_lib.Scored
  mfu: str  # ', predicted MFU 3.4%', or ''
  memory: str  # '5.52 MiB per device (...)'


def choose(fits: Sequence[search_lib.Scored], memory: Memory, t_start: float) -> Choice:
  """The fastest plan that fits, said with its predicted time, MFU and memory, and how long the search took."""
  win = fits[0]
  mfu = f', predicted MFU {100 * win.mfu:.1f}%' if win.mfu else ''
  gib = lambda g: partitioning.fmt_bytes(g * 2**30)
  mem = f'{gib(win.prediction.memory_gib)} per device'
  if memory.devices:
    mem += f' (compiled for {memory.target})'
  elif win.prediction.memory_range:
    low, high = win.prediction.memory_range
    mem += (
      f' (modelled from what the backward keeps, {gib(low)}-{gib(high)}; {gib(win.prediction.state_gib)} of it state)'
    )
  say(
    f'\nchoice: {win.candidate.label()}: {report.seconds(win.prediction.step_s)}/step predicted{mfu}, '
    f'{mem}. Search took {time.perf_counter() - t_start:.0f} s.'
  )
  return Choice(win, mfu, mem)


# --- The plan file ----------------------------------------------------------------------------------------------


def write_plan(req: Request, choice: Choice, out: str, overwrite: bool) -> None:
  """The chosen plan as a config file train.py --config accepts: the fields that differ from --config's."""
  win = choice.plan
  plan = search_lib.apply(req.config, win.candidate, req.hosts)
  base_config = candidates.load_module(req.config_path).get_config(req.config_arg)
  command = f'python train.py --config {out} --workdir /tmp/plan'
  header = (
    f'Plan chosen by search.py on {time.strftime("%Y-%m-%d")} for {req.target()}:\n  {win.candidate.label()}\n'
    f'  predicted {report.seconds(win.prediction.step_s)}/step{choice.mfu},\n  {choice.memory}.\n\n  {command}\n\n'
    f'Searched from {req.source()}; fields below differ from that config.'
  )
  text = plan_file.render(req.config_path, req.config_arg, base_config, plan, header)
  plan_file.write(out, text, overwrite=overwrite, config_file=req.config_path)
  say(f'wrote {out}; run it with:\n  {command}')
