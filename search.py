r"""Searches meshes x logical-axis rules x remat policies (x micro-batches where a plan does not fit) for a config,
ranks them by predicted step time.

  python search.py --config configs/llama.py --devices 8 --device_kind h100 --out /tmp/plan.py
  python search.py --config configs/llama.py:llama3_8b --devices 64 --hosts 8 --device_kind h100
  python search.py --config configs/gpt2.py:tiny --devices 8 --device_kind cpu --measure 3

Sections: check the input -> candidates (the config file's presets and variants of them, every mesh
factorisation, axis orders over hosts) -> stage 1: prune by validation, compile the survivors abstractly for
--devices simulated CPU devices (for an H100 with JAX's CUDA plugin installed, their memory for compile-only
H100s or TPU chips too: --compile_target), predict (planning/cost.py) -> stage 2: the other remat policies on the best
plans -> the table -> --measure: real steps of the top K -> --out: the winner as a config file.
"""

from __future__ import annotations

import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

import errors
import partitioning
from configs import schema
from planning import candidates, plan_file, report
from training import flops

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/llama.py[:preset,size].', lock_config=True)
flags.DEFINE_integer('devices', None, 'Devices to plan for (compiled on as many simulated CPU devices).')
flags.DEFINE_string('device_kind', None, f'The target chip: one of {sorted(flops.CHIPS)}.')
flags.DEFINE_integer('hosts', 1, 'Hosts (or slices) the devices are spread over: collectives across them use DCN.')
flags.DEFINE_integer('top', 10, 'Rows of the ranked table.')
flags.DEFINE_integer('measure', 0, 'Run the top K plans for real (needs --devices devices) and print measured times.')
flags.DEFINE_integer('measure_steps', 3, 'Timed steps per measured plan (after one warm-up step).')
flags.DEFINE_string('out', None, 'Write the winning plan here as a config file train.py --config accepts.')
flags.DEFINE_bool('overwrite', False, 'Let --out replace an existing file (never the --config file itself).')
flags.DEFINE_string(
  'remat',
  'staged',
  "'staged': the config's remat first, every policy on the best --stage2 plans; "
  "'config': the config's only; or a comma-separated list of policies.",
)
flags.DEFINE_integer(
  'stage2',
  3,
  "How many of stage 1's best plans (presets only) try their presets' variants "
  'and, with --remat=staged, every remat policy.',
)
flags.DEFINE_integer('workers', 2, 'Compilations run in parallel.')
flags.DEFINE_list(
  'micro_batches',
  ['2', '4', '8'],
  'A plan over the device memory is tried again with config.grad_accum_steps = each of these (smallest first) '
  'until it fits; empty: never.',
)
flags.DEFINE_string(
  'compile_target',
  'auto',
  "Planned on CPU for a GPU or TPU chip, each plan's memory: 'auto' "
  "compiles for the chip itself (its GPU target in planning/gpu_targets where JAX's CUDA plugin is "
  'installed; a TPU chip where libtpu is), exactly; '
  "'none' models it from what the backward keeps; or a target: a TPU chip (tpu_v5e, ...), a GPU "
  "target's name or .txtpb file.",
)
flags.DEFINE_alias('gpu_target', 'compile_target')  # its name before TPUs compiled too


def say(msg: str) -> None:
  print(msg, flush=True)


def main(argv) -> None:
  del argv  # schema.parse_flags refused stray arguments
  config = FLAGS.config
  if config is None or FLAGS.devices is None or FLAGS.device_kind is None:
    raise errors.usage(
      '--config, --devices and --device_kind are required, e.g. --config configs/llama.py '
      '--devices 8 --device_kind h100'
    )
  logging.set_verbosity(logging.WARNING)
  t_start = time.perf_counter()
  with errors.one_line():  # bad input: one line, no traceback
    # --- Check the input (before JAX starts) ---------------------------------------------------------------
    schema.check(config)
    chip = flops.chip(FLAGS.device_kind)
    n, hosts = FLAGS.devices, FLAGS.hosts
    if n < 1 or hosts < 1 or n % hosts:
      raise errors.ConfigError(
        f'--devices {n} --hosts {hosts}: the device count must be a positive multiple of the host count'
      )
    least = dict(top=1, measure=0, measure_steps=1, stage2=0, workers=1)
    for name, low in least.items():
      if FLAGS[name].value < low:
        raise errors.ConfigError(f'--{name}={FLAGS[name].value}: must be >= {low}')
    config_path, _, config_arg = config_flags.get_config_filename(FLAGS['config']).partition(':')
    config_arg = config_arg or None
    if FLAGS.out:
      plan_file.check_out_path(FLAGS.out, overwrite=FLAGS.overwrite, config_file=config_path)
    rules = candidates.rule_variants(candidates.presets_of(config_path, config_arg, config))
    axes = candidates.mesh_axes_of(rules, list(config.mesh))
    has_remat = 'model' in config and 'remat' in config.model
    own_remat = config.model.remat if has_remat else None
    choices = list(schema.FIELDS['model.remat'].choices()) if has_remat else [None]
    if FLAGS.remat in ('staged', 'config'):
      first = [own_remat]
    else:
      first = [r.strip() for r in FLAGS.remat.split(',') if r.strip()]
      bad = [r for r in first if r not in choices]
      if bad:
        raise errors.ConfigError(f'--remat {FLAGS.remat!r}: {bad} not remat policies; choose from {choices}')

    # --- Devices: the real ones when there are --devices of them, else simulated CPU devices -------------
    partitioning.simulate_cpu_devices(n)
    import jax

    import models
    from planning import search as search_lib

    devices = jax.devices() if jax.device_count() == n and jax.default_backend() != 'cpu' else jax.devices('cpu')
    say(
      f'plan search: {config_path}{":" + config_arg if config_arg else ""} for {n} x {chip.name}'
      + (f' over {hosts} hosts' if hosts > 1 else '')
      + f' (compiling on {len(devices)} {devices[0].platform} '
      f'devices); mesh axes {axes}; rule sets {list(rules)}'
    )
    from models import attention
    from planning import targets

    # compiled on CPU for a GPU: attention traced as on the GPU, its fused kernels stood in for by 'blockwise'
    stand_in = attention.gpu_stand_in if chip.platform == 'gpu' else None
    # ... and its memory compiled for the chip itself where JAX's CUDA plugin or libtpu can (planning/targets.py)
    memory_devices = None
    if devices[0].platform == 'cpu' and chip.platform in ('gpu', 'tpu'):
      target, why = targets.memory_target(chip.name, n, FLAGS.compile_target)
      if target:
        memory_devices = targets.compile_devices(target, n)
        say(f"memory: compiled for {n} x {target}, the {chip.platform.upper()}'s own ({why})")
      else:
        say(f'memory: modelled from what the backward keeps (planning/residuals.py): {why}')
    search = search_lib.Search(
      config,
      lambda m, r: models.create(m, r, config.get('lora')),
      chip,
      n,
      hosts,
      devices,
      workers=FLAGS.workers,
      stand_in=stand_in,
      memory_devices=memory_devices,
    )

    # --- Stage 1: every mesh x preset, the config's remat (or the given ones) ------------------------------
    presets = {k: v for k, v in rules.items() if '-' not in k}
    micro = [int(m) for m in FLAGS.micro_batches]
    result = search.run(candidates.generate(n, axes, presets, first, hosts, config.batch_size), micro, announce=say)
    say(f'stage 1: {len(result.ranked)} plans scored ({result.compiled} compiled) in {result.wall_s:.0f} s')
    # --- Stage 2: the best plans' meshes with their presets' variants and every remat policy -------------
    if result.ranked and FLAGS.stage2:
      remats = choices if FLAGS.remat == 'staged' else first
      more = [
        candidates.Candidate(c.mesh, name, r, remat, c.microbatches, c.micro)
        for c in (s.candidate for s in result.ranked[: FLAGS.stage2])
        for name, r in rules.items()
        if name.split('-')[0] == c.rules_name
        for remat in remats
      ]
      extra = search.run(more, micro, announce=say)
      say(f'stage 2: {len(extra.ranked)} plans scored ({extra.compiled} compiled) in {extra.wall_s:.0f} s')
      result.ranked = sorted(result.ranked + extra.ranked, key=lambda s: (not s.prediction.fits, s.prediction.step_s))
      result.pruned.update(extra.pruned)
      for k, v in extra.examples.items():
        result.examples.setdefault(k, v)
      result.considered += extra.considered
      result.compiled += extra.compiled
    fitting = [s for s in result.ranked if s.prediction.fits]
    if not fitting:
      raise errors.ShardingError(
        f'no plan for {n} x {chip.name} survived: '
        + '; '.join(f'{k} ({v}), e.g. {result.examples.get(k, "")[:200]}' for k, v in result.pruned.most_common(3))
      )

    # --- Measure the top K for real -----------------------------------------------------------------------
    if FLAGS.measure:
      if jax.device_count() < n:
        raise errors.ConfigError(f'--measure needs {n} devices; this machine has {jax.device_count()}')
      say(f'measuring the top {FLAGS.measure} plans ({FLAGS.measure_steps} steps each) ...')
      search.measure(fitting[: FLAGS.measure], steps=FLAGS.measure_steps)

    # --- The table, the winner ----------------------------------------------------------------------------
    say('')
    say(report.table(result.ranked[: FLAGS.top], chip))
    say('')
    say(report.pruning(result))
    win = fitting[0]
    if FLAGS.measure:
      measured = [s for s in fitting if s.measured_s is not None]
      fastest = min(measured, key=lambda s: s.measured_s)
      say(
        f'measured: the fastest of the top {len(measured)} is {fastest.candidate.label()} '
        f'({report.seconds(fastest.measured_s)}); predicted winner {report.seconds(win.measured_s)}'
      )
    wall = time.perf_counter() - t_start
    mfu = f', predicted MFU {100 * win.mfu:.1f}%' if win.mfu else ''
    gib = lambda g: partitioning.fmt_bytes(g * 2**30)
    mem = f'{gib(win.prediction.memory_gib)} per device'
    if memory_devices:
      mem += f' (compiled for {target})'
    elif win.prediction.memory_range:
      low, high = win.prediction.memory_range
      mem += (
        f' (modelled from what the backward keeps, {gib(low)}-{gib(high)}; {gib(win.prediction.state_gib)} of it state)'
      )
    say(
      f'\nchoice: {win.candidate.label()}: {report.seconds(win.prediction.step_s)}/step predicted{mfu}, '
      f'{mem}. Search took {wall:.0f} s.'
    )
    if FLAGS.out:
      plan = search_lib.apply(config, win.candidate, hosts)
      base_config = candidates.load_module(config_path).get_config(config_arg)
      command = f'python train.py --config {FLAGS.out} --workdir /tmp/plan'
      header = (
        f'Plan chosen by search.py on {time.strftime("%Y-%m-%d")} for {n} x {chip.name}'
        + (f' over {hosts} hosts' if hosts > 1 else '')
        + f':\n  {win.candidate.label()}\n'
        f'  predicted {report.seconds(win.prediction.step_s)}/step{mfu},\n  {mem}.\n\n  {command}\n\n'
        f'Searched from {config_path}'
        + (f':{config_arg}' if config_arg else '')
        + '; fields below differ from that config.'
      )
      plan_file.write(
        FLAGS.out,
        plan_file.render(config_path, config_arg, base_config, plan, header),
        overwrite=FLAGS.overwrite,
        config_file=config_path,
      )
      say(f'wrote {FLAGS.out}; run it with:\n  {command}')


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  app.run(main, flags_parser=schema.parse_flags)
