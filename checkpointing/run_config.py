"""A run's config as it trained (after --config.* overrides and config.json adoption), kept beside its checkpoints
as <workdir>/run_config.json, so export.py and decoding rebuild the same model, mesh and rules without the config
file and its overrides."""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from checkpointing import storage
from configs import schema
from errors import ConfigError, StorageError, describe_os_error

FILE = 'run_config.json'


def save(config: ml_collections.ConfigDict, workdir: str, last_good: str = 'none') -> None:
  """The run's config as it trained (after --config.* overrides and config.json adoption), for export. StorageError
  naming the file, the OS error and the last good checkpoint if it cannot be written."""
  if jax.process_index() == 0:
    path = os.path.join(workdir, FILE)
    try:
      os.makedirs(workdir, exist_ok=True)
      with open(path, 'w') as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    except OSError as e:  # a full disk, a quota, a read-only or vanished workdir: one line, like a checkpoint's
      raise StorageError(
        f'{path} could not be written: {describe_os_error(e.errno, e.strerror, None)}; the last good checkpoint is '
        f'{last_good} ({storage.advice(e.errno, workdir)})'
      ) from e


def check_workdir(workdir: str) -> None:
  """A ConfigError saying what `workdir` is when it is not a run's directory (one train.py wrote: run_config.json
  and/or checkpoints/): missing, a file, empty, the run's checkpoints/ folder, or one step's folder in it."""
  expected = 'the directory a run was trained in (train.py --workdir), which holds run_config.json and checkpoints/'
  path = os.path.abspath(workdir)
  if not os.path.exists(path):
    raise ConfigError(f'--workdir {workdir} does not exist: give {expected}')
  if not os.path.isdir(path):
    raise ConfigError(f'--workdir {workdir} is a file, not a directory: give {expected}')
  if os.path.isfile(os.path.join(path, FILE)) or os.path.isdir(os.path.join(path, 'checkpoints')):
    return
  parent = os.path.dirname(path)
  if os.path.isdir(os.path.join(path, 'state')):  # <run>/checkpoints/<step>
    run = os.path.dirname(parent) if os.path.basename(parent) == 'checkpoints' else parent
    raise ConfigError(
      f"--workdir {workdir} is one checkpoint step's directory: give the run's directory and the step, "
      f'--workdir {run} --step {os.path.basename(path)}'
    )
  if steps := storage.steps_in(path):
    raise ConfigError(
      f"--workdir {workdir} is a run's checkpoints/ directory (steps {steps}): give the run's directory, "
      f'--workdir {parent} (and --step N for another step than the latest)'
    )
  if not os.listdir(path):
    raise ConfigError(f'--workdir {workdir} is empty: give {expected}')
  raise ConfigError(f'--workdir {workdir} holds neither {FILE} nor checkpoints/: give {expected}')


def load(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, FILE)
  if not os.path.isfile(path):
    raise ConfigError(
      f"{path} does not exist (runs before export existed did not write it): give the run's "
      'config with --config (and the same --config.* overrides)'
    )
  with open(path) as f:
    try:
      # Completed with today's defaults: a run written before a field existed loads with the field's default.
      return schema.complete(ml_collections.ConfigDict(json.load(f)))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(
        f"{path} is damaged ({e}): give the run's config with --config (and the same --config.* overrides)"
      ) from None
