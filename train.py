r"""Trains a zoo model with declarative sharding. The one entry point.

  python train.py --config configs/default.py --workdir /tmp/shardzoo [--config.key=value ...]
  python train.py --config configs/default.py:fsdp --workdir /tmp/shardzoo --dry_run

A run prints the sharding table per module (--sharding_table=full, or --dry_run, for a row per parameter) and
writes the full table to <workdir>/sharding_table.txt.

The config is checked first (configs/schema.py), before JAX, TensorFlow and the data libraries are imported.
Then `run` takes the steps of training/run.py in order: mesh -> pretrained config and lengths -> data (files,
keys, tokenizer) -> model, optimizer and shardings (validated) -> sharding table -> input pipeline (validated) ->
starting point (resume, pretrained or scratch) -> compile -> starting state -> train loop with eval -> finish
(LoRA export) -> a language model's sample, decoded by the generation package and scored under the true language
-> where the checkpoint is, and the commands that use it.
"""

from __future__ import annotations

import contextlib
import logging as logging_std
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

import errors
import guards
from configs import cli, schema  # sets TensorFlow's C++ logging before anything imports it

# JAX, TensorFlow, clu and grain are imported once the config is checked (in `run` and `main`): a misspelled
# field is reported in about a second, not after their imports. The fields whose choices other modules own
# (attention kernels, remat policies, optimizers, ...) are checked once those are imported, before anything is built.

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/default.py[:preset].', lock_config=True)
flags.DEFINE_string('workdir', None, 'Where metrics (TensorBoard events) are written.')
flags.DEFINE_bool('dry_run', False, 'Build everything abstractly, print the full sharding table, exit.')
flags.DEFINE_enum(
  'sharding_table',
  'summary',
  ['summary', 'full'],
  'What the run prints of where parameters live: a summary per module, or a row per parameter (--dry_run prints '
  'the full table; the workdir always gets it, in sharding_table.txt).',
)
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


def train_and_evaluate(
  config, workdir: str | None, dry_run: bool = False, peak_tflops: float | None = None, sharding_table: str = 'summary'
) -> dict[str, Any]:
  """Checks every config field (schema.check), then trains and evaluates (`run`)."""
  schema.check(config)
  return run(config, workdir, dry_run, peak_tflops, sharding_table)


def run(
  config, workdir: str | None, dry_run: bool = False, peak_tflops: float | None = None, sharding_table: str = 'summary'
) -> dict[str, Any]:
  """The run, step by step (training/run.py), on a checked config. Whatever happens, the prefetch threads stop,
  a save in flight finishes and the SIGTERM handler is restored (the `cleanup` stack)."""
  import generation
  import training
  from training import run as steps  # JAX, TensorFlow, clu, grain

  with contextlib.ExitStack() as cleanup:
    for w in schema.warnings(config):  # valid settings that would not do what they say
      steps.warn('config', w)
    mesh = steps.make_mesh(config)
    steps.adopt_pretrained(config, dry_run)
    ds = None if dry_run else steps.open_data(config)  # files, keys, tokenizer: checked before the model is built
    built = steps.build(config, mesh)
    trainer = built.trainer
    ds = steps.precompute_reference(config, trainer, ds)  # DPO's reference log-probs, where asked for
    table = steps.show_shardings(trainer, workdir, full=dry_run or sharding_table == 'full')
    if dry_run:
      steps.write_table(table, workdir, dry_run=True)
      return {'num_params': training.num_params(trainer)}
    inp = steps.make_input(config, trainer, ds, cleanup)
    ckpt = steps.checkpoints(config, trainer, workdir, cleanup)
    start = steps.choose_start(config, trainer, ckpt, inp.train_iter)
    steps.write_table(table, workdir)  # once the run is known to start: a refused rerun leaves the run's table
    if start.done:
      steps.next_steps(config, inp, workdir)
      return {'state': start.state, 'nonfinite_skipped': []}
    rollout = steps.make_rollout(config, trainer, inp, generation.policy_sampler)  # GRPO's sampling, else None
    compiled = steps.compile_steps(built, peak_tflops)
    state = steps.starting_state(start, trainer, inp.train_iter)
    state, result, guard = steps.train_loop(trainer, state, compiled, inp, ckpt, workdir, cleanup, rollout)
    cleanup.close()  # flush, finish saving, restore SIGTERM, stop the prefetch threads
    result = steps.finish(trainer, state, result, guard, inp, workdir)
    if sample := steps.sample_request(trainer, result, inp):
      steps.score_sample(sample, generation.sample(sample), inp, result)
    if not result.get('preempted_at'):
      steps.next_steps(config, inp, workdir)
    return result


class _QuietOrbax(logging_std.Filter):
  """orbax logs every save/restore detail at INFO; keep its warnings and errors only."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    return record.levelno >= logging_std.WARNING or '/orbax/' not in record.pathname


def main(argv) -> None:
  logging.get_absl_handler().addFilter(_QuietOrbax())
  del argv  # cli.parse_flags refused stray arguments
  config = FLAGS.config
  if config is None:
    raise errors.usage('--config is required, e.g. --config configs/default.py')
  if not FLAGS.workdir and not FLAGS.dry_run:  # also --workdir= (an unset $WORKDIR in a script)
    raise errors.usage('--workdir is required: metrics and checkpoints are written there')
  with errors.one_line():  # bad input, disk trouble, divergence: one line, no traceback
    schema.check(config, owned=False)  # before the heavy imports and before JAX starts
    if FLAGS.workdir:
      guards.workdir(FLAGS.workdir)  # a directory, not another run's checkpoints/
    if not FLAGS.peer_timeout >= 5:  # beats come every peer_timeout / 5 s; a peer busy compiling is not dead
      raise errors.ConfigError(f'--peer_timeout={FLAGS.peer_timeout}: must be at least 5 seconds')
    import data  # noqa: F401  (it, models and training register the choices of the fields they own)
    import models  # noqa: F401
    import training  # noqa: F401

    schema.check(config)  # the owned fields, now their owners are imported
    import partitioning
    from training import cluster
    from training.run import say

    # Several processes: by hand (flags), else what a scheduler (srun, mpirun, a Kubernetes Job) says.
    launch = cluster.Launch(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, FLAGS.cluster)
    # Simulated CPU devices must be requested before JAX starts its backends (no effect on GPU/TPU): enough
    # per process for the mesh (a -1 axis counts as 1); make_mesh checks the real count once JAX has started.
    needed = partitioning.devices_needed(config.mesh, config.dcn_mesh)
    partitioning.simulate_cpu_devices(-(-needed // launch.num_processes), honour_environment=True)
    launch.start(heartbeat_timeout_s=max(100, int(3 * FLAGS.peer_timeout)))  # JAX's own bound, above ours
    partitioning.check_platform()
    if launch.num_processes > 1:
      say(f'processes: {launch.how}')
    with cluster.watched(launch, FLAGS.peer_timeout):  # a dead peer stops this process with its name, no hang
      run(config, FLAGS.workdir, FLAGS.dry_run, FLAGS.peak_tflops, FLAGS.sharding_table)


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line, not a traceback
