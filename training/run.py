"""The steps of a training run, in the order train.py calls them: mesh, build, input, starting point, compile,
starting state, loop, finish. Each builds one thing, checks it before anything costly follows, and says what it
built in a line (`say`); warnings go through `warn`, once each."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

import data
import errors
import models
import partitioning
import training
from checkpointing import checkpointer, hf_config, run_config, storage
from configs import schema
from models import attention, hf_import
from training import accumulate, cluster, export, flops, preference, pretrained, profiling
from training import rollout as rollout_lib
from training.preemption import Preemption
from training.trainer import state_tree, train_state

TABLE_FILE = 'sharding_table.txt'  # the full per-parameter table, in the workdir


def say(msg: str) -> None:
  """Progress for humans, printed once (by process 0), line and newline in one write: with an unbuffered
  stdout (PYTHONUNBUFFERED, usual in containers) print() writes them apart, and a logging thread writing
  between them would glue its line onto ours."""
  if jax.process_index() == 0:
    sys.stdout.write(f'{msg}\n')
    sys.stdout.flush()


def warn(topic: str, msg: str) -> None:
  """A warning, shown once: 'WARNING <topic>: <msg>' among process 0's progress lines; the other processes log
  it, so every process's output says what happened (e.g. which checkpoint all of them fell back from)."""
  if jax.process_index() == 0:
    say(f'WARNING {topic}: {msg}')
  else:
    logging.warning('%s: %s', topic, msg)


# --- Mesh ------------------------------------------------------------------------------------------------------


def make_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The device mesh of config.mesh (fitted to the devices there are), with config.dcn_mesh's slices outermost."""
  dcn = config.dcn_mesh  # slices over the slower network (hosts): the outer factor of each mesh axis
  note = partitioning.fit_mesh(config.mesh, dcn)  # a mesh for more (or fewer) accelerators than there are is fitted
  if note:
    warn('mesh', note)
  mesh = partitioning.make_mesh(config.mesh, dcn_cfg=dcn)
  slices = partitioning.num_slices(mesh, dcn)
  platform = jax.devices()[0].platform
  say(
    f'mesh: {dict(mesh.shape)} on {jax.device_count()} {platform} devices'
    + (f' ({partitioning.cpu_devices_note()})' if platform == 'cpu' else '')
    + f', {jax.process_count()} process(es)'
    + (f', {slices} DCN slices ({partitioning.describe_dcn(mesh, dcn)})' if slices > 1 else '')
  )
  return mesh


# --- Model, optimizer and their shardings (validated; nothing allocated yet) -----------------------------------


@dataclasses.dataclass
class Built:
  trainer: training.Trainer
  traced_train: Any
  traced_eval: Any


def adopt_pretrained(config: ml_collections.ConfigDict, dry_run: bool) -> None:
  """config.init_from resolved (a hub id becomes its directory in the Hugging Face cache, downloaded if need be)
  and checked to exist, at once; a Hugging Face directory's config.json gives the architecture and, where the
  config leaves them unset, the lengths; a vocabulary left unset is the tokenizer's."""
  fallback = None
  if config.init_from:
    config.init_from = hf_import.resolve(config.init_from, download=not dry_run)
    schema.derive(config)  # the fields that follow init_from (the fine-tune configs' tokenizer) follow its directory
    if not dry_run:
      pretrained.check_path(config.init_from)
    elif not os.path.exists(config.init_from):
      fallback = pretrained.LONGEST_DERIVED_SEQ_LEN
      warn(
        'init_from', f'{config.init_from!r} is neither a directory nor a cached hub id: the dry run uses config.model'
      )
    if hf_import.is_hf_dir(config.init_from):
      taken, kept = hf_config.adopt(config, models.HF_FAMILIES)
      say(
        f'init_from {config.init_from}: from config.json: '
        + ', '.join(f'{k}={v!r}' for k, v in taken.items())
        + ''.join(f'; kept config.model.{k}={ours!r} (config.json: {theirs!r})' for k, (ours, theirs) in kept.items())
      )
  pretrained.derive_lengths(config, fallback)
  if vocab := data.vocabulary(config):  # the tiny sizes leave the vocabulary to the data: the tokenizer's
    say(f'model: {vocab}')


def build(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> Built:
  """The abstract model, optimizer and shardings, and both steps traced: tracing runs the model code on abstract
  inputs, so every rule and activation constraint is validated here."""
  trainer = training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))
  built = Built(
    trainer,
    training.trace(trainer, training.jit_train_step(trainer)),
    training.trace(trainer, training.jit_eval_step(trainer)),
  )
  for decision in attention.decisions():  # the kernel each attention runs on, and why
    say(f'attention: {decision}')
  return built


def show_shardings(trainer: training.Trainer, workdir: str | None, full: bool) -> str:
  """The sharding table: summarised per module (or in full); then the rules' warnings. Returns the full table,
  which `write_table` puts in the workdir once the run is known to start (a refused rerun leaves the run's own)."""
  t = trainer
  shapes = (t.abstract.params, t.specs.params, t.mesh.shape, t.abstract.opt_state, t.specs.opt_state)
  table = partitioning.sharding_table(
    t.abstract.params, t.axes.params, t.specs.params, t.mesh.shape, t.abstract.opt_state, t.specs.opt_state
  )
  if full:
    say(table)
  else:
    say(partitioning.sharding_summary(*shapes) + (f'\nper parameter: {workdir}/{TABLE_FILE}' if workdir else ''))
  for w in trainer.warnings():
    warn('sharding', w)
  return table


def write_table(table: str, workdir: str | None, dry_run: bool = False) -> None:
  """The full sharding table in <workdir>/sharding_table.txt (process 0): after the starting point is chosen, so a
  rerun refused there (another model in the run's directory) leaves the run's table as it was; a dry run writes it
  only into a directory that holds no run."""
  if not workdir or jax.process_index() > 0:
    return
  if dry_run and (
    os.path.isdir(os.path.join(workdir, 'checkpoints')) or os.path.isfile(os.path.join(workdir, run_config.FILE))
  ):
    return
  storage.ensure_writable(workdir)
  with open(os.path.join(workdir, TABLE_FILE), 'w') as f:
    f.write(table + '\n')


# --- DPO's reference log-probs, precomputed (config.dpo.precompute_reference) ------------------------------------


def reference_identity(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """What makes the starting weights (the reference): the model, the adapters, the seed (initialisation, and
  config.dont_load's parameters) and init_from with its files' sizes and modification times."""
  src = config.init_from
  walked = sorted(os.path.join(root, n) for root, _, names in os.walk(src) for n in names) if src else []
  stats = data.files.identity(walked)
  return {
    'model': config.model.to_dict(),
    'lora': config.lora.to_dict(),
    'seed': config.seed,
    'init_from': src,
    'files': stats,
    'dont_load': config.dont_load,
  }


def precompute_reference(config: ml_collections.ConfigDict, trainer: training.Trainer, ds: Any) -> Any:
  """DPO with config.dpo.precompute_reference: the dataset whose pairs carry the reference's log-probs, read from
  beside the data, else computed in one pass of the starting weights (made again on a resume: the initialisation,
  or init_from's) and stored there; other runs: `ds` as it is."""
  if ds is None or config.task != 'dpo' or not preference.precomputed(config):
    return ds
  path = data.preference.reference_path(config.dataset, reference_identity(config))
  stored = data.preference.load_reference(path, ds)
  if stored is not None:
    say(f'dpo: the reference log-probs of {len(ds.train):,} + {len(ds.eval):,} pairs read from {path}')
    return data.preference.with_reference(ds, *stored)
  t0 = time.perf_counter()
  start = pretrained.init_state(trainer, models.HF_FAMILIES) if config.init_from else training.init_state(trainer)
  train, eval_ = preference.pass_over(trainer, start.params, start.model_state, ds)
  del start  # the reference's weights are not kept: the train state is made afresh (or restored) later
  if jax.process_index() == 0:
    data.preference.save_reference(path, train, eval_)
  say(
    f'dpo: the reference log-probs of {len(ds.train):,} train + {len(ds.eval):,} eval pairs computed in '
    f'{time.perf_counter() - t0:.1f}s, stored in {path}'
  )
  return data.preference.with_reference(ds, train, eval_)


# --- Input pipeline: each process reads only its rows of every global batch -------------------------------------


@dataclasses.dataclass
class Input:
  ds: Any
  train_iter: Any
  rows: slice
  floor: float | None  # the eval loss's entropy floor (synthetic languages)


def open_data(config: ml_collections.ConfigDict) -> Any:
  """The dataset, opened before the model is built: a missing file, a row without its key, a tokenizer that does
  not load or an unprepared TFDS dataset fails in seconds."""
  return data.build(config)


def make_input(
  config: ml_collections.ConfigDict, trainer: training.Trainer, ds: Any, cleanup: contextlib.ExitStack
) -> Input:
  """The dataset (open_data) checked against the task (fields, shapes, dtypes, vocabulary, classes) before
  compiling; its train iterator resumes exactly, with any process count."""
  trainer.task.check_data(config, ds.example_spec(), ds.vocab, ds.num_classes)
  max_len = config.model.get('max_len')
  if ds.language is not None and config.sample_len and max_len and 2 + config.sample_len > max_len:
    raise errors.ConfigError(
      f'config.sample_len={config.sample_len}: the sample after training (2 prompt tokens '
      f'+ sample_len) would be {2 + config.sample_len} tokens, over config.model.max_len='
      f'{max_len}'
    )
  n = trainer.task.data_batch(config)  # GRPO: prompts, group_size completions each
  rows = data.local_rows(trainer.batch_shardings['mask'], trainer.batch_abstract['mask'].shape)
  if n != config.batch_size:
    rows = slice(rows.start * n // config.batch_size, rows.stop * n // config.batch_size)
  train_iter = ds.train_iterator(n, rows, config.seed)
  cleanup.callback(train_iter.close)  # stops the prefetch threads
  say(f'data: {ds.description}')
  floor = None
  if ds.language is not None:
    floor = ds.language.loss_floor(config.dataset.seq_len)
    say(
      f'data: entropy floor of the eval loss {floor:.4f} nats/token '
      f'(bigram {ds.language.entropies()["bigram"]:.4f}, uniform {math.log(config.dataset.vocab_size):.4f})'
    )
  return Input(ds, train_iter, rows, floor)


# --- Starting point: resume this run, else pretrained weights, else scratch -------------------------------------


@dataclasses.dataclass
class Start:
  kind: str  # 'resume', 'pretrained' or 'scratch'
  ckpt: checkpointer.Checkpointer | None
  state: Any = None  # restored already: a finished run's (nothing is compiled for it)
  done: bool = False  # the restored state is at or past config.total_steps


def checkpoints(
  config: ml_collections.ConfigDict, trainer: training.Trainer, workdir: str | None, cleanup: contextlib.ExitStack
):
  """The run's Checkpointer (None without checkpointing); the workdir checked writable and its free space
  against the checkpoints to keep before compiling, and checkpoints there with checkpointing off an error (never
  a silent fresh start)."""
  if not workdir:
    return None
  storage.ensure_writable(workdir)
  if config.checkpoint_every > 0:
    keep, directory = config.keep_checkpoints, os.path.join(workdir, 'checkpoints')
    if note := storage.check_space(directory, storage.state_bytes(trainer.abstract), keep, config.checkpoint_space):
      warn('checkpoint', note)
    ckpt = checkpointer.Checkpointer(
      directory,
      every_steps=config.checkpoint_every,
      keep=keep,
      gather=cluster.gather_strings,
      timeout_s=config.checkpoint_timeout,
    )
    cleanup.callback(ckpt.close)
    cleanup.callback(ckpt.wait)  # runs first: a save in flight completes
    return ckpt
  if steps := storage.steps_in(os.path.join(workdir, 'checkpoints')):
    raise errors.ConfigError(
      f'config.checkpoint_every={config.checkpoint_every}, but {workdir}/checkpoints '
      f'holds checkpoints (steps {steps}): set config.checkpoint_every to resume from them, '
      'or give another --workdir'
    )
  return None


def choose_start(config: ml_collections.ConfigDict, trainer: training.Trainer, ckpt, train_iter) -> Start:
  """Where the state comes from, checked against the model (and the data position against the batch) from
  metadata, before compiling. A finished run rerun is restored here, without compiling anything."""
  if ckpt is not None and ckpt.latest_step() is not None:
    with contextlib.suppress(errors.DamagedCheckpointError):  # damage: resume falls back to an older one
      ckpt.check(trainer.checkpoint_target(), data_iter=train_iter)
    start = Start('resume', ckpt)
    if ckpt.latest_step() >= config.total_steps:
      start.state, start.done = resume(ckpt, trainer, train_iter, config)
    return start
  if config.init_from:
    pretrained.check_source(trainer)
    return Start('pretrained', ckpt)
  return Start('scratch', ckpt)


def resume(ckpt, trainer, train_iter, config) -> tuple[Any, bool]:
  """The newest readable checkpoint restored (model, optimizer, data position; into the new shardings), and
  whether it is at or past config.total_steps (a finished run rerun, or total_steps lowered: nothing to train)."""
  tree, damaged = ckpt.restore_latest(trainer.checkpoint_target(), train_iter, fallback=config.resume_fallback)
  state = train_state(tree)
  for w in damaged:
    warn('checkpoint', w)
  say(f'resumed from {ckpt.directory}/{int(state.step)}')
  done = int(state.step) >= config.total_steps
  if done:
    say(f'checkpoint step {int(state.step)} >= config.total_steps={config.total_steps}: nothing to train')
  return state, done


def starting_state(start: Start, trainer: training.Trainer, train_iter) -> Any:
  """The state `choose_start` chose, created or read directly in its shardings."""
  config = trainer.config
  if start.state is not None:
    return start.state
  if start.kind == 'resume':
    return resume(start.ckpt, trainer, train_iter, config)[0]
  if start.kind == 'pretrained':
    state = pretrained.init_state(trainer, models.HF_FAMILIES)
    say(f'initialised from {config.init_from}' + (f' except {config.dont_load!r}' if config.dont_load else ''))
    return state
  return training.init_state(trainer)


# --- Compile once, ahead of time ------------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
  train_step: Any
  eval_step: Any
  step_flops: Any  # flops.StepFlops, where the chip's peak is known (MFU)
  peak: float | None


def compile_steps(built: Built, peak_tflops: float | None) -> Compiled:
  """Both steps compiled, their collectives and memory reported, and checked to fit before any state exists."""
  trainer, config = built.trainer, built.trainer.config
  mesh, dcn = trainer.mesh, config.dcn_mesh
  t0 = time.perf_counter()
  train_step, eval_step = built.traced_train.lower().compile(), built.traced_eval.lower().compile()
  slice_of = partitioning.dcn_coordinates(mesh, dcn) if partitioning.num_slices(mesh, dcn) > 1 else None
  say(
    f'compiled train+eval steps in {time.perf_counter() - t0:.1f}s; train step per device: '
    f'{partitioning.audit(train_step, slice_of, trainer.pipeline)}'
  )
  if config.grad_accum_steps > 1:
    say(f'gradient accumulation: {accumulate.describe(train_step.as_text(), mesh.size, config)}')
  device = jax.devices()[0]
  profiling.check_fits({'train step': train_step, 'eval step': eval_step}, device, config)  # before allocating
  peak, peak_from = flops.describe_peak(device, peak_tflops)  # MFU where the chip's peak is known
  step_flops = flops.step_flops(trainer) if peak else None
  if step_flops:
    say(
      f'model FLOPs per step: {step_flops.causal / 1e12:.4g} T (causal-correct; PaLM count '
      f'{step_flops.palm / 1e12:.4g} T); MFU against {peak_from}'
    )
  return Compiled(train_step, eval_step, step_flops, peak)


# --- Train loop -----------------------------------------------------------------------------------------------


def evaluate(eval_step, state, ds, trainer, rows) -> dict[str, float]:
  """Exact metrics over the whole eval split (the last batch is padded and masked)."""
  sums = [
    eval_step(state, data.to_global(local, trainer.batch_shardings, trainer.config.batch_size))
    for local in ds.eval_batches(trainer.config.batch_size, rows)
  ]
  totals = {k: sum(float(s[k]) for s in jax.device_get(sums)) for k in sums[0]}
  w = totals['weight']
  return {'loss': totals['loss_sum'] / w, 'accuracy': totals['correct_sum'] / w, 'weight': w}


def metric_writer(
  config: ml_collections.ConfigDict, workdir: str | None, cleanup: contextlib.ExitStack, last_good: Any
) -> Any:
  """TensorBoard events in the workdir (process 0), the config's scalar fields as hyperparameters. Not clu's
  default writer: its logging half would repeat every progress line and the hyperparameters on the console.
  A full disk under the event files is one line, like a checkpoint's (storage.GuardedWriter)."""
  from clu import metric_writers  # noqa: PLC0415 (imports TensorFlow, ~3 s: only once a run trains)

  if not workdir or jax.process_index() > 0:
    return metric_writers.MultiWriter([])
  make = lambda: metric_writers.AsyncWriter(metric_writers.SummaryWriter(workdir))
  writer = storage.GuardedWriter.create(make, workdir, last_good)
  cleanup.callback(writer.close)
  writer.write_hparams({k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str))})
  return writer


def train_loop(
  trainer: training.Trainer,
  state: Any,
  compiled: Compiled,
  inp: Input,
  ckpt,
  workdir: str | None,
  cleanup: contextlib.ExitStack,
  rollout: Any = None,
) -> tuple[Any, dict[str, Any], training.NonFiniteGuard]:
  """Steps from the state's step to config.total_steps: progress every log_every steps, exact eval every
  eval_every, checkpoints as due, a SIGTERM saves and stops. Returns the last state, what was logged last
  (train, eval, preempted_at) and the non-finite guard. `rollout` (GRPO, training/rollout.py): makes the batches
  from the data's prompts and the current parameters, one every config.grpo.iterations steps, and evaluates."""
  config = trainer.config
  last_good = lambda: 'none' if ckpt is None or ckpt.latest_step() is None else f'{ckpt.directory}/{ckpt.latest_step()}'
  if workdir:  # what export.py rebuilds the model from; written once the run has started (a failed resume keeps it)
    run_config.save(config, workdir, last_good())
  guard = training.NonFiniteGuard(trainer, config.on_nonfinite, config.max_nonfinite_skips)
  preemption = Preemption(sync_every=config.log_every)
  cleanup.callback(preemption.close)  # restores the SIGTERM handler
  profiler = profiling.StepProfiler(workdir or '.', config.profile_first_step, config.profile_steps)
  cleanup.callback(profiler.close)
  writer = metric_writer(config, workdir, cleanup, last_good)
  B, unit, step_flops = config.batch_size, trainer.task.unit, compiled.step_flops
  units_per_step = math.prod(trainer.batch_abstract[trainer.task.unit_field].shape)
  pending, wait_s, t_last, step_last, result = [], 0.0, time.perf_counter(), int(state.step), {}
  batch, rollout_stats, every = None, [], config.grpo.iterations if rollout is not None else 1
  owed = False  # a checkpoint fell due inside a GRPO batch's iterations: it is written when the batch is used up
  for step in range(int(state.step) + 1, config.total_steps + 1):
    # Input wait = time the device sat idle for the next batch: next() is timed only when the previous
    # step had already finished (with asynchronous dispatch, time spent in next() while the device is
    # still busy costs nothing). A lower bound when the step finishes during next().
    t_in, idle = time.perf_counter(), not pending or pending[-1]['loss'].is_ready()
    if rollout is None:
      batch = data.to_global(next(inp.train_iter), trainer.batch_shardings, B)
    elif batch is None or (step - 1) % every == 0:  # sampling is the rollout's work, not input wait
      batch, stats = rollout(state, next(inp.train_iter), step)
      rollout_stats.append(stats)
      idle = False
    wait_s += (time.perf_counter() - t_in) if idle else 0.0
    profiler.before(step)
    state, metrics = compiled.train_step(state, batch)
    if ckpt is not None:
      ckpt.poll()  # a save that failed in the background stops the run now, not at the next save
    pending.append(metrics)
    guard.add(step, metrics)
    if profiler.after(step, state):
      say(f'profile of steps {profiler.first}-{step} in {workdir} (TensorBoard profile tab; perfetto_trace.json.gz)')
    # GRPO with iterations > 1 saves and stops only once a batch of samples is used up: a run resumed inside one
    # would sample that batch again from later parameters, and so not resume bitwise.
    used_up = step % every == 0 or step == config.total_steps
    stop = preemption.requested(step) and used_up  # SIGTERM: log the pending steps, save and stop
    if step % config.log_every == 0 or step == config.total_steps or stop:
      guard.check(last_good())  # a non-finite step stops the run here ('stop'), or is counted ('skip')
      logged = {
        k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0] if k != training.FIRST_NONFINITE
      }
      if rollout_stats:  # the rollouts' rewards and lengths, averaged over those since the last log
        logged |= {k: float(np.mean([r[k] for r in rollout_stats])) for k in rollout_stats[0]}
        rollout_stats = []
      dt, n = time.perf_counter() - t_last, step - step_last
      logged |= {
        'steps_per_sec': n / dt,
        f'{unit}_per_sec': n * units_per_step / dt,
        'input_wait_fraction': wait_s / dt,
      }
      if step_flops:
        logged['tflops_per_device'] = step_flops.per_device_tflops(dt / n, jax.device_count())
        logged['mfu'] = logged['tflops_per_device'] / compiled.peak
      writer.write_scalars(step, {f'train/{k}': v for k, v in logged.items()})
      say(
        f'step {step:5d} | loss {logged["loss"]:.4f} | acc {logged["accuracy"]:.3f} | '
        + ''.join(f'{k} {logged[k]:.4g} | ' for k in trainer.task.progress if k in logged)
        + f'{logged["steps_per_sec"]:.2f} steps/s | {logged[f"{unit}_per_sec"]:,.0f} '
        f'{unit}/s | input wait {100 * logged["input_wait_fraction"]:.1f}%'
        + (
          f' | {logged["tflops_per_device"]:.1f} TFLOP/s/device | MFU {100 * logged["mfu"]:.1f}%' if step_flops else ''
        )
      )
      pending, wait_s, t_last, step_last, result['train'] = [], 0.0, time.perf_counter(), step, logged
    if step % config.eval_every == 0 or step == config.total_steps:
      t_eval = time.perf_counter()
      if rollout is not None:  # GRPO: the rewards of greedy completions of the eval prompts
        ev = rollout.evaluate(state)
        writer.write_scalars(step, {f'eval/{k}': v for k, v in ev.items() if k != 'weight'})
        say(f'eval @ {step:5d} | ' + ' | '.join(f'{k} {v:.4f}' for k, v in ev.items() if k not in ('weight', 'loss')))
      else:
        ev = evaluate(compiled.eval_step, state, inp.ds, trainer, inp.rows)
        writer.write_scalars(step, {f'eval/{k}': v for k, v in ev.items() if k != 'weight'})
        gap = f' (floor {inp.floor:.4f}, gap {ev["loss"] - inp.floor:+.4f})' if inp.floor is not None else ''
        say(f'eval @ {step:5d} | loss {ev["loss"]:.4f}{gap} | acc {ev["accuracy"]:.3f}')
      result['eval'] = ev
      t_last += time.perf_counter() - t_eval  # eval time is not train time
    owed = ckpt is not None and (owed or ckpt.due(step, force=step == config.total_steps))
    if owed and used_up:
      owed = False
      guard.check(last_good())  # no checkpoint is written after a non-finite step under 'stop'
      ckpt.save(step, state_tree(state), inp.train_iter, force=True)  # due (maybe inside the batch): asynchronous
    if stop:
      if ckpt is not None:
        guard.check(last_good())
        ckpt.save(step, state_tree(state), inp.train_iter, force=True, stopping=True)
      say(f'SIGTERM: stopped at step {step}' + (f', checkpoint in {ckpt.directory}' if ckpt else ' (no checkpoints)'))
      result['preempted_at'] = step
      break
  return state, result, guard


# --- Finish ---------------------------------------------------------------------------------------------------


def finish(
  trainer: training.Trainer, state: Any, result: dict[str, Any], guard, inp: Input, workdir: str | None
) -> dict[str, Any]:
  """After the loop (everything flushed and saved): skipped steps reported, LoRA adapters merged into an export."""
  config = trainer.config
  if guard.skipped:
    say(f'skipped {len(guard.skipped)} non-finite step(s) (config.on_nonfinite=skip): {guard.skipped[:20]}')
  result['nonfinite_skipped'] = guard.skipped
  result['state'] = state
  if result.get('preempted_at'):
    return result
  if config.lora.rank and config.lora.export_merged and workdir:
    say(f'LoRA adapters merged into the base weights: {export.export_merged_lora(trainer, state, workdir)}')
  return result


# --- GRPO's rollouts (sampled by generation: train.py hands the sampler over, training never imports it) --------


def make_rollout(config: ml_collections.ConfigDict, trainer: training.Trainer, inp: Input, sampler) -> Any:
  """GRPO's rollout (training/rollout.py), its reward functions imported and checked before compiling; None for
  other tasks. `sampler`: generation.policy_sampler."""
  if config.task != 'grpo':
    return None
  t = trainer
  sample = sampler(t.graphdef, rules=t.rules, mesh=t.mesh, max_len=config.model.get('max_len'),
                   vocab=config.model.vocab_size)  # fmt: skip
  r = rollout_lib.Rollout(trainer, inp.ds, sample)
  say(
    f'grpo: {config.batch_size // config.grpo.group_size} prompts x {config.grpo.group_size} completions per '
    f'rollout, up to {config.grpo.max_new_tokens} new tokens; rewards '
    + ', '.join(f'{x.name} x{x.weight:g}' for x in r.rewards)
  )
  return r


# --- End-of-run sample (decoded by generation: train.py hands it over, training never imports it) ---------------


@dataclasses.dataclass
class SampleRequest:
  """A language model's end-of-run sample: the trained weights as a generation.Generator takes them, prompt rows
  of the eval split, and how many tokens to sample after each (temperature 1, seeded)."""

  graphdef: Any
  params: Any
  model_state: Any
  rules: partitioning.AxisRules
  mesh: jax.sharding.Mesh
  max_len: int | None
  vocab: int | None
  prompts: np.ndarray  # (rows, 2) token ids
  new_tokens: int
  seed: int


def sample_request(trainer: training.Trainer, result: dict[str, Any], inp: Input) -> SampleRequest | None:
  """The sample to take after a finished run on a language whose true distribution is known (config.sample_len
  tokens; 0: none), else None."""
  config, state = trainer.config, result['state']
  if result.get('preempted_at') or inp.ds.language is None or not config.sample_len:
    return None
  return SampleRequest(
    trainer.graphdef,
    state.params,
    state.model_state,
    trainer.rules,
    trainer.mesh,
    config.model.get('max_len'),
    config.model.vocab_size,
    np.asarray(inp.ds.eval[:8, :2], np.int32),
    config.sample_len,
    config.seed,
  )


def score_sample(request: SampleRequest, new_ids: np.ndarray, inp: Input, result: dict[str, Any]) -> dict[str, Any]:
  """The sample (prompts, then the `new_ids` generation gave) scored under the true language: result['sample_nll']."""
  language = inp.ds.language
  tokens = np.concatenate([request.prompts, new_ids], axis=1)
  nll = language.nll(tokens)
  say(f'sample: {language.decode(tokens[0])}')
  say(
    f'sample NLL under the true language: {nll:.4f} nats/token (entropy rate '
    f'{language.entropies()["order2"]:.4f}; a sampler of the true language scores about that)'
  )
  result['sample_nll'] = nll
  return result


# --- What next -------------------------------------------------------------------------------------------------


def next_steps(config: ml_collections.ConfigDict, inp: Input, workdir: str | None) -> None:
  """Where the run's checkpoint is, and the commands that use it (generate, export) as they would be typed."""
  steps = storage.steps_in(os.path.join(workdir, 'checkpoints')) if workdir else []
  if not steps:
    return
  w = shlex.quote(workdir)
  say(
    f'checkpoint: {os.path.join(workdir, "checkpoints", str(steps[-1]))} (the same command resumes from it; '
    f'with --config.total_steps above {steps[-1]} it trains on)'
  )
  if config.task == 'lm' and inp.ds.prompt:
    flag, text = inp.ds.prompt
    say(f'generate: python generate.py --workdir {w} {flag} {shlex.quote(text)}')
  if config.model.name in models.HF_FAMILIES:
    say(f'export:   python export.py --workdir {w} --out {shlex.quote(os.path.join(workdir, "hf"))}')
