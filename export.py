r"""Exports a trained run as a Hugging Face model directory that transformers loads.

  python export.py --workdir DIR --out HF_DIR [--step N] [--dtype bfloat16] [--max_shard_size 5GB] [--overwrite]
  python export.py --workdir DIR --out HF_DIR --config configs/gpt2.py:tiny [--config.key=value ...]

The run's config comes from DIR/run_config.json (train.py writes it), or from --config for runs that
predate it. The checkpoint's arrays are restored onto the run's mesh and rules and written one tensor at
a time (training/export.py, models/hf_export.py); LoRA adapters are merged into the base weights. --out
must be new or empty (--overwrite: first remove the files of an earlier export there) and not a directory
the export reads (the run's checkpoints, its init_from, its tokenizer directory).
"""

from __future__ import annotations

import os
import time

import jax
from absl import app, flags
from ml_collections import config_flags

import errors
import models
import partitioning
import training
from checkpointing import run_config
from configs import cli, schema
from training import export

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  'config', None, "The run's config (default: WORKDIR/run_config.json).", lock_config=True
)
flags.DEFINE_string('workdir', None, 'The run directory (its checkpoints/ are read).')
flags.DEFINE_string('out', None, 'The Hugging Face directory to write.')
flags.DEFINE_integer('step', None, 'The checkpoint step (default: the latest).')
flags.DEFINE_string('dtype', None, "Weights dtype on disk, e.g. bfloat16 (default: the parameters', float32).")
flags.DEFINE_string('max_shard_size', '5GB', 'Split the weights into files of at most this size (with an index).')
flags.DEFINE_bool(
  'overwrite',
  False,
  'Export into a non-empty --out: first remove the files an export writes there '
  '(model*.safetensors, the index, config.json, generation_config.json, tokenizer files); others stay.',
)


def main(argv) -> None:
  del argv  # cli.parse_flags refused stray arguments
  if not FLAGS.workdir or not FLAGS.out:
    raise errors.usage('--workdir and --out are required')
  try:
    export.check_options(FLAGS.dtype, FLAGS.max_shard_size)  # before anything is built
    run_config.check_workdir(FLAGS.workdir)
    config = FLAGS.config or run_config.load(FLAGS.workdir)
    schema.check(config)
    checkpoints = os.path.join(FLAGS.workdir, 'checkpoints')
    export.check_out_dir(config, FLAGS.out, overwrite=FLAGS.overwrite, checkpoints=checkpoints)
    mesh, _ = partitioning.start_mesh(config.mesh)  # a mesh fitted to the accelerators writes the same files
    trainer = training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))
    if FLAGS.step is not None:
      checkpoints = os.path.join(checkpoints, str(FLAGS.step))
    t0 = time.perf_counter()
    out = export.export_hf(
      trainer,
      checkpoints,
      FLAGS.out,
      models.HF_FAMILIES,
      dtype=FLAGS.dtype,
      max_shard_size=FLAGS.max_shard_size,
      overwrite=FLAGS.overwrite,
    )
    if jax.process_index() == 0:
      print(
        f'exported {out["step_dir"]} -> {FLAGS.out}: {out["tensors"]} tensors, {out["bytes"] / 2**20:.1f} MiB '
        f'{out["dtype"]} in {len(out["files"])} file(s), {time.perf_counter() - t0:.1f}s'
        + (f'; removed {", ".join(out["removed"])}' if out['removed'] else '')
        + (f'; copied {", ".join(out["copied"])}' if out['copied'] else '')
        + (f'; wrote {", ".join(out["written"])}' if out.get('written') else ''),
        flush=True,
      )
  except errors.CheckpointError as e:
    raise SystemExit(f'shardzoo: checkpoint error: {e}') from None
  except errors.ConfigError as e:  # HFImportError, HFExportError too
    raise SystemExit(f'shardzoo: export error: {e}') from None


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
