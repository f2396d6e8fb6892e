r"""Trains a zoo model with declarative sharding. The one entry point.

  python train.py --config configs/default.py --workdir /tmp/shardzoo [--config.key=value ...]
  python train.py --config configs/default.py:fsdp --workdir /tmp/shardzoo --dry_run

Sections: devices and mesh -> model, optimizer and shardings (validated) -> sharding table ->
input pipeline (validated) -> compile the steps -> sharded init -> train loop with eval -> sample.
"""

from __future__ import annotations

import contextlib
import logging as logging_std
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging
from clu import metric_writers, periodic_actions
from ml_collections import config_flags

import data
import errors
import models
import partitioning
import training
from configs import schema
from models import attention, hf_import
from training import checkpoint, cluster, export, flops, generate, pretrained, profiling
from training.preemption import Preemption

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/default.py[:preset].', lock_config=True)
flags.DEFINE_string('workdir', None, 'Where metrics (TensorBoard events) are written.')
flags.DEFINE_bool('dry_run', False, 'Build everything abstractly, print the sharding table, exit.')
flags.DEFINE_string(
  'cluster',
  'auto',
  'Multi-process: auto (jax.distributed detects SLURM, Open MPI, Kubernetes, '
  'Cloud TPU), none, or one detection method by name (slurm, ompi, mpi4py, tpu, gcetpu, gketpu).',
)
flags.DEFINE_string('coordinator_address', None, 'Multi-process by hand: host:port of process 0 (jax.distributed).')
flags.DEFINE_integer('num_processes', 1, 'Multi-process by hand: how many processes take part.')
flags.DEFINE_integer('process_id', 0, 'Multi-process by hand: this process (0 .. num_processes-1).')
flags.DEFINE_float(
  'peer_timeout',
  60,
  'Multi-process: seconds without a heartbeat from another process before this '
  'one stops with an error naming it (training/cluster.py).',
)
flags.DEFINE_float('peak_tflops', None, 'Peak TFLOP/s per device for MFU (default: known GPUs/TPUs by device kind).')


def say(msg: str) -> None:
  """Progress for humans, printed once (by process 0), line and newline in one write: with an unbuffered
  stdout (PYTHONUNBUFFERED, usual in containers) print() writes them apart, and clu's writer thread logging
  between them glued its line onto ours."""
  if jax.process_index() == 0:
    sys.stdout.write(f'{msg}\n')
    sys.stdout.flush()


def evaluate(eval_step, state, ds, trainer, rows) -> dict[str, float]:
  """Exact metrics over the whole eval split (the last batch is padded and masked)."""
  sums = [
    eval_step(state, data.to_global(local, trainer.batch_shardings, trainer.config.batch_size))
    for local in ds.eval_batches(trainer.config.batch_size, rows)
  ]
  totals = {k: sum(float(s[k]) for s in jax.device_get(sums)) for k in sums[0]}
  w = totals['weight']
  return {'loss': totals['loss_sum'] / w, 'accuracy': totals['correct_sum'] / w, 'weight': w}


def resume(ckpt, trainer, train_iter, config) -> tuple[Any, bool]:
  """The newest readable checkpoint restored (model, optimizer, data position; into the new shardings), and
  whether it is at or past config.total_steps (a finished run rerun, or total_steps lowered: nothing to train)."""
  state, damaged = ckpt.restore_latest(trainer, train_iter, fallback=config.get('resume_fallback', True))
  for w in damaged:
    logging.warning('checkpoint: %s', w)
    say(f'WARNING checkpoint: {w}')
  say(f'resumed from {ckpt.directory}/{int(state.step)}')
  done = int(state.step) >= config.total_steps
  if done:
    say(f'checkpoint step {int(state.step)} >= config.total_steps={config.total_steps}: nothing to train')
  return state, done


def train_and_evaluate(
  config, workdir: str | None, dry_run: bool = False, peak_tflops: float | None = None
) -> dict[str, Any]:
  """Trains and evaluates; whatever happens, the prefetch threads stop, a save in flight finishes and the
  SIGTERM handler is restored (the `cleanup` stack)."""
  with contextlib.ExitStack() as cleanup:
    return _train_and_evaluate(config, workdir, dry_run, peak_tflops, cleanup)


def _train_and_evaluate(
  config, workdir: str | None, dry_run: bool, peak_tflops: float | None, cleanup: contextlib.ExitStack
) -> dict[str, Any]:
  schema.check(config)  # every field's type and range, before anything is built
  # --- Devices and mesh ------------------------------------------------------------------------
  device = jax.devices()[0]
  dcn = config.get('dcn_mesh')  # slices over the slower network (hosts): the outer factor of each mesh axis
  note = partitioning.fit_mesh(config.mesh, dcn)  # a mesh for more (or fewer) accelerators than there are is fitted
  if note:
    say(f'WARNING {note}')
  mesh = partitioning.make_mesh(config.mesh, dcn_cfg=dcn)
  slices = partitioning.num_slices(mesh, dcn)
  say(
    f'mesh: {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices, '
    f'{jax.process_count()} process(es)'
    + (f', {slices} DCN slices ({partitioning.describe_dcn(mesh, dcn)})' if slices > 1 else '')
  )

  # --- Model, optimizer and their shardings (validated; nothing allocated yet) ------------------
  if config.get('init_from'):  # a hub id becomes its directory in the Hugging Face cache (downloaded if need be)
    config.init_from = hf_import.resolve(config.init_from, download=not dry_run)
    if dry_run and not os.path.exists(config.init_from):
      say(
        f'WARNING init_from {config.init_from!r} is neither a directory nor a cached hub id: the dry run '
        'uses config.model as written'
      )
  if config.get('init_from') and hf_import.is_hf_dir(config.init_from):  # architecture from config.json
    taken, kept = pretrained.adopt_hf_config(config, models.HF_FAMILIES)
    say(
      f'init_from {config.init_from}: from config.json: '
      + ', '.join(f'{k}={v!r}' for k, v in taken.items())
      + ''.join(f'; kept config.model.{k}={ours!r} (config.json: {theirs!r})' for k, (ours, theirs) in kept.items())
    )
  trainer = training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.get('lora')))
  # Tracing runs the model code on abstract inputs: every activation constraint is validated here.
  traced_train = training.trace(trainer, training.jit_train_step(trainer))
  traced_eval = training.trace(trainer, training.jit_eval_step(trainer))
  for decision in attention.decisions():  # the kernel each attention runs on, and why
    say(f'attention: {decision}')

  # --- Sharding table ---------------------------------------------------------------------------
  say(
    partitioning.sharding_table(
      trainer.abstract.params,
      trainer.axes.params,
      trainer.specs.params,
      mesh.shape,
      trainer.abstract.opt_state,
      trainer.specs.opt_state,
    )
  )
  for w in trainer.warnings():
    logging.warning('sharding: %s', w)
    say(f'WARNING sharding: {w}')
  if dry_run:
    return {'num_params': training.num_params(trainer)}

  # --- Input pipeline: each process reads only its rows of every global batch -------------------
  # Built before compiling, so a bad dataset, split or size fails in seconds; the task checks that the
  # dataset makes its fields (shapes, dtypes) and fits the model's vocabulary and classes.
  ds = data.build(config)
  trainer.task.check_data(config, ds.example_spec(), ds.vocab, ds.num_classes)
  max_len = config.model.get('max_len')
  if ds.language is not None and config.get('sample_len') and max_len and 2 + config.sample_len > max_len:
    raise errors.ConfigError(
      f'config.sample_len={config.sample_len}: the sample after training (2 prompt tokens '
      f'+ sample_len) would be {2 + config.sample_len} tokens, over config.model.max_len='
      f'{max_len}'
    )
  B = config.batch_size
  rows = data.local_rows(trainer.batch_shardings['mask'], trainer.batch_abstract['mask'].shape)
  train_iter = ds.train_iterator(B, rows, config.seed)  # its position resumes exactly, with any process count
  cleanup.callback(train_iter.close)  # stops the prefetch threads
  units_per_step = math.prod(trainer.batch_abstract[trainer.task.unit_field].shape)
  say(f'data: {ds.description}')
  if ds.language is not None:
    floor = ds.language.loss_floor(config.dataset.seq_len)
    say(
      f'data: entropy floor of the eval loss {floor:.4f} nats/token '
      f'(bigram {ds.language.entropies()["bigram"]:.4f}, uniform {math.log(config.dataset.vocab_size):.4f})'
    )

  # --- Workdir: checked writable before compiling; checkpoints (their directory checked too) -------
  ckpt = None
  if workdir:
    checkpoint.ensure_writable(workdir)
  if workdir and config.get('checkpoint_every', 0) > 0:
    ckpt = checkpoint.Checkpointer(
      os.path.join(workdir, 'checkpoints'), every_steps=config.checkpoint_every, keep=config.get('keep_checkpoints', 2)
    )
    cleanup.callback(ckpt.close)
    cleanup.callback(ckpt.wait)  # runs first: a save in flight completes
  elif workdir and (steps := checkpoint.steps_in(os.path.join(workdir, 'checkpoints'))):  # never a silent fresh start
    raise errors.ConfigError(
      f'config.checkpoint_every={config.get("checkpoint_every", 0)}, but {workdir}/checkpoints '
      f'holds checkpoints (steps {steps}): set config.checkpoint_every to resume from them, '
      'or give another --workdir'
    )
  # What the state comes from, checked against the model (and the data position against the batch) from
  # metadata before compiling (damage: see below). A finished run rerun is restored without compiling anything.
  state = None
  if ckpt is not None and ckpt.latest_step() is not None:
    with contextlib.suppress(errors.DamagedCheckpointError):
      ckpt.check(trainer, data_iter=train_iter)
    if ckpt.latest_step() >= config.total_steps:
      state, done = resume(ckpt, trainer, train_iter, config)
      if done:
        return {'state': state, 'nonfinite_skipped': []}
  elif config.get('init_from'):
    pretrained.check_source(trainer)

  # --- Compile once (ahead of time), then create the state directly in its shardings ------------
  t0 = time.perf_counter()
  train_step, eval_step = traced_train.lower().compile(), traced_eval.lower().compile()
  slice_of = partitioning.dcn_coordinates(mesh, dcn) if slices > 1 else None  # which collectives cross DCN
  say(
    f'compiled train+eval steps in {time.perf_counter() - t0:.1f}s; train step per device: '
    f'{partitioning.audit(train_step, slice_of)}'
  )
  profiling.check_fits({'train step': train_step, 'eval step': eval_step}, device, config)  # before allocating
  peak, peak_from = flops.describe_peak(device, peak_tflops)  # MFU where the chip's peak is known
  step_flops = flops.step_flops(trainer) if peak else None
  if step_flops:
    say(
      f'model FLOPs per step: {step_flops.causal / 1e12:.4g} T (causal-correct; PaLM count '
      f'{step_flops.palm / 1e12:.4g} T); MFU against {peak_from}'
    )

  # --- State: resume this run, else start from pretrained weights, else from scratch ------------
  if state is not None:  # restored above (the newest checkpoint was damaged: an older one was read)
    pass
  elif ckpt is not None and ckpt.latest_step() is not None:  # model, optimizer and data position, new shardings
    state, _ = resume(ckpt, trainer, train_iter, config)
  elif config.get('init_from'):
    state = pretrained.init_state(trainer, models.HF_FAMILIES)
    say(f'initialised from {config.init_from}' + (f' except {config.dont_load!r}' if config.get('dont_load') else ''))
  else:
    state = training.init_state(trainer)
  if workdir:  # what export.py rebuilds the model from; written once the run has started (a failed resume keeps it)
    export.save_run_config(config, workdir)
  guard = training.NonFiniteGuard(trainer, config.get('on_nonfinite', 'stop'), config.get('max_nonfinite_skips', 10))
  last_good = lambda: 'none' if ckpt is None or ckpt.latest_step() is None else f'{ckpt.directory}/{ckpt.latest_step()}'
  preemption = Preemption(sync_every=config.log_every)
  cleanup.callback(preemption.close)  # restores the SIGTERM handler
  profiler = profiling.StepProfiler(workdir or '.', config.get('profile_first_step', 0), config.get('profile_steps', 5))
  cleanup.callback(profiler.close)

  # --- Train loop -------------------------------------------------------------------------------
  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  cleanup.callback(writer.flush)
  writer.write_hparams({k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str))})
  progress = periodic_actions.ReportProgress(
    num_train_steps=config.total_steps, writer=writer, every_steps=config.log_every, every_secs=None
  )
  pending, wait_s, t_last, step_last, result = [], 0.0, time.perf_counter(), int(state.step), {}
  for step in range(int(state.step) + 1, config.total_steps + 1):
    # Input wait = time the device sat idle for the next batch: next() is timed only when the previous
    # step had already finished (with asynchronous dispatch, time spent in next() while the device is
    # still busy costs nothing). A lower bound when the step finishes during next().
    t_in, idle = time.perf_counter(), not pending or pending[-1]['loss'].is_ready()
    batch = data.to_global(next(train_iter), trainer.batch_shardings, B)
    wait_s += (time.perf_counter() - t_in) if idle else 0.0
    profiler.before(step)
    state, metrics = train_step(state, batch)
    pending.append(metrics)
    guard.add(step, metrics)
    progress(step)
    if profiler.after(step, state):
      say(f'profile of steps {profiler.first}-{step} in {workdir} (TensorBoard profile tab; perfetto_trace.json.gz)')
    stop = preemption.requested(step)  # SIGTERM: log the pending steps, save and stop
    if step % config.log_every == 0 or step == config.total_steps or stop:
      guard.check(last_good())  # a non-finite step stops the run here ('stop'), or is counted ('skip')
      logged = {
        k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0] if k != training.FIRST_NONFINITE
      }
      dt, n = time.perf_counter() - t_last, step - step_last
      logged |= {
        'steps_per_sec': n / dt,
        f'{trainer.task.unit}_per_sec': n * units_per_step / dt,
        'input_wait_fraction': wait_s / dt,
      }
      if step_flops:
        logged['tflops_per_device'] = step_flops.per_device_tflops(dt / n, jax.device_count())
        logged['mfu'] = logged['tflops_per_device'] / peak
      writer.write_scalars(step, {f'train/{k}': v for k, v in logged.items()})
      say(
        f'step {step:5d} | loss {logged["loss"]:.4f} | acc {logged["accuracy"]:.3f} | '
        f'{logged["steps_per_sec"]:.2f} steps/s | {logged[f"{trainer.task.unit}_per_sec"]:,.0f} '
        f'{trainer.task.unit}/s | input wait {100 * logged["input_wait_fraction"]:.1f}%'
        + (
          f' | {logged["tflops_per_device"]:.1f} TFLOP/s/device | MFU {100 * logged["mfu"]:.1f}%' if step_flops else ''
        )
      )
      pending, wait_s, t_last, step_last, result['train'] = [], 0.0, time.perf_counter(), step, logged
    if step % config.eval_every == 0 or step == config.total_steps:
      t_eval = time.perf_counter()
      ev = evaluate(eval_step, state, ds, trainer, rows)
      writer.write_scalars(step, {f'eval/{k}': v for k, v in ev.items() if k != 'weight'})
      gap = f' (floor {floor:.4f}, gap {ev["loss"] - floor:+.4f})' if ds.language is not None else ''
      say(f'eval @ {step:5d} | loss {ev["loss"]:.4f}{gap} | acc {ev["accuracy"]:.3f}')
      result['eval'] = ev
      t_last += time.perf_counter() - t_eval  # eval time is not train time
    if ckpt is not None and ckpt.due(step, force=step == config.total_steps):
      guard.check(last_good())  # no checkpoint is written after a non-finite step under 'stop'
      ckpt.save(step, state, train_iter, force=step == config.total_steps)  # asynchronous: training goes on
    if stop:
      if ckpt is not None:
        guard.check(last_good())
        ckpt.save(step, state, train_iter, force=True)
      say(f'SIGTERM: stopped at step {step}' + (f', checkpoint in {ckpt.directory}' if ckpt else ' (no checkpoints)'))
      result['preempted_at'] = step
      break
  cleanup.close()  # flush, finish saving, restore SIGTERM, stop the prefetch threads
  if guard.skipped:
    say(f'skipped {len(guard.skipped)} non-finite step(s) (config.on_nonfinite=skip): {guard.skipped[:20]}')
  result['nonfinite_skipped'] = guard.skipped
  if result.get('preempted_at'):
    result['state'] = state
    return result
  if config.get('lora') and config.lora.get('rank') and config.lora.get('export_merged') and workdir:
    say(f'LoRA adapters merged into the base weights: {export.export_merged_lora(trainer, state, workdir)}')

  # --- Sample -----------------------------------------------------------------------------------
  if ds.language is not None and config.sample_len:
    prompt = np.asarray(ds.eval[:8, :2], np.int32)  # decoded with the KV cache (training/generate.py)
    sampling = generate.Sampling(max_new_tokens=config.sample_len, temperature=1.0, seed=config.seed)
    out = generate.for_trainer(trainer, state.params, state.model_state).generate(prompt.tolist(), sampling)
    tokens = np.concatenate([prompt, np.asarray([g.ids for g in out], np.int32)], axis=1)
    nll = ds.language.nll(tokens)
    say(f'sample: {ds.language.decode(tokens[0])}')
    say(
      f'sample NLL under the true language: {nll:.4f} nats/token (entropy rate '
      f'{ds.language.entropies()["order2"]:.4f}; a sampler of the true language scores about that)'
    )
    result['sample_nll'] = nll
  result['state'] = state
  return result


class _QuietOrbax(logging_std.Filter):
  """orbax logs every save/restore detail at INFO; keep its warnings and errors only."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    return record.levelno >= logging_std.WARNING or '/orbax/' not in record.pathname


def main(argv) -> None:
  logging.get_absl_handler().addFilter(_QuietOrbax())
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  config = FLAGS.config
  if config is None:
    raise SystemExit(
      'shardzoo: usage error: --config is required, e.g. --config configs/default.py (--help for all flags)'
    )
  if not FLAGS.workdir and not FLAGS.dry_run:  # also --workdir= (an unset $WORKDIR in a script)
    raise SystemExit(
      'shardzoo: usage error: --workdir is required (metrics and checkpoints are written there; --help for all flags)'
    )
  with errors.one_line():  # bad input, disk trouble, divergence: one line, no traceback
    schema.check(config)  # before JAX starts
    if not FLAGS.peer_timeout >= 5:  # beats come every peer_timeout / 5 s; a peer busy compiling is not dead
      raise errors.ConfigError(f'--peer_timeout={FLAGS.peer_timeout}: must be at least 5 seconds')
    # Several processes: by hand (flags), else what a scheduler (srun, mpirun, a Kubernetes Job) says.
    launch = cluster.Launch(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, FLAGS.cluster)
    # Simulated CPU devices must be requested before JAX starts its backends (no effect on GPU/TPU): enough
    # per process for the mesh (a -1 axis counts as 1); make_mesh checks the real count once JAX has started.
    needed = partitioning.devices_needed(config.mesh, config.get('dcn_mesh'))
    partitioning.simulate_cpu_devices(-(-needed // launch.num_processes))
    launch.start(heartbeat_timeout_s=max(100, int(3 * FLAGS.peer_timeout)))  # JAX's own bound, above ours
    partitioning.check_platform()
    if launch.num_processes > 1:
      say(f'processes: {launch.how}')
    with cluster.watched(launch, FLAGS.peer_timeout):  # a dead peer stops this process with its name, no hang
      train_and_evaluate(config, FLAGS.workdir, dry_run=FLAGS.dry_run, peak_tflops=FLAGS.peak_tflops)


if __name__ == '__main__':
  app.run(main, flags_parser=schema.parse_flags)  # a bad --config is one line, not a traceback
