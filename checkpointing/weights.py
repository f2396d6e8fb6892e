"""Weights out of a checkpoint of this project, without its optimizer state: parameters (and model state, e.g.
BatchNorm statistics) of a run's checkpoint or of a params-only one (a LoRA export), read straight into given
targets: abstract trees whose leaves are jax.ShapeDtypeStructs carrying their NamedShardings, so each process reads
only its shards. Fine-tuning, export and decoding read weights so; every shape is checked against the targets from
the checkpoint's metadata first (check_weights), and a mismatch names the first parameter that differs."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from checkpointing import integrity, storage
from errors import CheckpointError, DamagedCheckpointError
from partitioning import path_str


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))
  return {path_str(p): (tuple(x.shape), str(np.dtype(x.dtype))) for p, x in leaves}


ANOTHER_MODEL = 'Was it written by another model or config?'


def check_compatible(expected: Any, found: Any, *, what: str, source: str, hint: str = ANOTHER_MODEL) -> None:
  """Raises CheckpointError naming the first parameter (or optimizer state) whose path or shape differs."""
  exp, got = _shapes(expected), _shapes(found)
  for path, (shape, _dtype) in exp.items():
    if path not in got:
      extra = sorted(set(got) - set(exp))
      instead = f'; the checkpoint has instead e.g. {extra[:3]}' if extra else ''
      raise CheckpointError(
        f'{source}: {what} {path!r} (shape {shape}) is missing from the checkpoint{instead}. {hint}'
      )
    if got[path][0] != shape:
      raise CheckpointError(
        f'{source}: {what} {path!r}: the model expects shape {shape}, the checkpoint has {got[path][0]}. {hint}'
      )
  extra = sorted(set(got) - set(exp))
  if extra:
    raise CheckpointError(
      f'{source}: the checkpoint has {what}s the model does not: {extra[:5]}{" ..." if len(extra) > 5 else ""}. {hint}'
    )


def _filter(tree: Any, keep, prefix: str = '') -> Any:
  """The nested dict without the leaves whose path fails `keep` (empty dicts dropped)."""
  if not isinstance(tree, Mapping):
    return tree if keep(prefix) else None
  out = {}
  for k, v in tree.items():
    sub = _filter(v, keep, f'{prefix}/{k}' if prefix else str(k))
    if sub is not None and sub != {}:
      out[k] = sub
  return out


def step_directory(path: str) -> str:
  """A run's checkpoint directory -> its latest step's directory; a step's directory as it is."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, 'state')):
    return path
  steps = storage.steps_in(path)
  if not steps:
    run = os.path.join(path, 'checkpoints')  # a run's workdir given for its checkpoint directory
    hint = f"; a run's checkpoints are in its workdir's checkpoints/: {run}" if os.path.isdir(run) else ''
    raise CheckpointError(f'{path!r}: no checkpoint there (expected <dir>/<step>/state){hint}')
  return os.path.join(path, str(steps[-1]))


def older_step(step_dir: str) -> str:
  """What to load instead of a damaged step: the run's newest older step, named by number and directory."""
  root, name = os.path.split(step_dir)
  older = [s for s in storage.steps_in(root) if not name.isdigit() or s < int(name)]
  if not older:
    return f'no older step to load instead in {root}'
  return f'load an older step instead: step {older[-1]} ({os.path.join(root, str(older[-1]))})'


def _state_metadata(step_dir: str) -> Any:
  """The tree of orbax's metadata of a step's 'state' item, read with its handler (a checkpointer would look for
  step metadata inside it and warn); CheckpointError if it cannot be read."""
  try:
    md = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir) / 'state')
  except Exception as e:
    storage.abandoned_reads.met(step_dir)
    raise DamagedCheckpointError(
      f'checkpoint {step_dir} is missing or corrupt (cannot read its metadata: {e}); {older_step(step_dir)}'
    ) from e
  return md.tree if hasattr(md, 'tree') else md


def check_weights(
  path: str, params: Any, model_state: Any = None, *, dont_load: str | None = None
) -> tuple[str, dict[str, Any]]:
  """load_weights' checks, from the checkpoint's metadata alone (train.py runs them before compiling): (the step
  directory, the targets to restore); CheckpointError naming the first parameter that differs."""
  return _checked(path, params, model_state, dont_load)[:2]


def _checked(path: str, params: Any, model_state: Any, dont_load: str | None) -> tuple[str, dict[str, Any], Any]:
  step_dir = step_directory(path)
  source = f'checkpoint {step_dir}'
  keep = (lambda p: not re.search(dont_load, p)) if dont_load else (lambda p: True)
  abstract = {'params': _filter(params, keep)}
  if model_state is not None:
    abstract['model_state'] = model_state
  tree = _state_metadata(step_dir)
  found = tree.get('params') if isinstance(tree, Mapping) else None
  if found is None:
    raise CheckpointError(f'{source} holds no parameters')
  check_compatible(abstract['params'], _filter(dict(found), keep), what='parameter', source=source)
  if model_state is not None:
    check_compatible(abstract['model_state'], tree.get('model_state') or {}, what='model state', source=source)
  return step_dir, abstract, tree


def load_weights(
  path: str, params: Any, model_state: Any = None, *, dont_load: str | None = None
) -> tuple[dict[str, Any], str]:
  """({'params': ..., ['model_state': ...]}, the step directory read) from a checkpoint of this project (`path`: a
  run's checkpoint directory, latest step, or one step's), into the targets `params` and, where given,
  `model_state` (the non-parameter variables, for export and decoding); the optimizer state is not read.
  Parameters whose path matches the regex `dont_load` are neither read nor checked (the result lacks them). What is
  read is checked against the checksums saved with it, as a resume checks them: DamagedCheckpointError naming the
  step, the arrays and an older step when they differ or cannot be read."""
  step_dir, abstract, metadata = _checked(path, params, model_state, dont_load)
  source = f'checkpoint {step_dir}'
  handler, item = ocp.PyTreeCheckpointHandler(), epath.Path(step_dir) / 'state'
  abstract = {k: v for k, v in abstract.items() if v}  # orbax restores no empty subtrees
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  try:
    out = handler.restore(
      item, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
    )
  except Exception as e:  # pylint: disable=broad-except
    if (cause := storage.read_failure(e)) is None:
      raise
    storage.abandoned_reads.met(step_dir)
    raise DamagedCheckpointError(f'{source} could not be restored: {cause}; {older_step(step_dir)}') from e
  try:
    checked = integrity.differing(out, step_dir, metadata)
  except Exception as e:  # pylint: disable=broad-except  # the checksums saved with it cannot be read
    why = storage.read_failure(e) or storage.first_line(e)
    raise DamagedCheckpointError(
      f'{source} is missing or corrupt: its checksums cannot be read ({why}); {older_step(step_dir)}'
    ) from e
  if checked is not None and checked[0]:
    bad, count = checked
    raise DamagedCheckpointError(
      f'{source} is corrupt: the checksums of {len(bad)} of the {count} arrays read differ from those saved with '
      f'it ({integrity.named(bad)}); {older_step(step_dir)}'
    )
  return {'params': {}, **({'model_state': {}} if model_state is not None else {}), **out}, step_dir


def load_params(path: str, params: Any, dont_load: str | None = None) -> Any:
  """Parameters only, into the targets `params` (fine-tuning: the optimizer state starts fresh); see
  load_weights."""
  return load_weights(path, params, dont_load=dont_load)[0]['params']


def save_weights(directory: str, tree: dict[str, Any]) -> str:
  """Writes weights alone (`tree`: {'params': ...}) as a params-only checkpoint that load_weights reads:
  <directory>/0/state, and the checksums of its arrays in <directory>/0/checksums. Returns the step directory."""
  step_dir = os.path.join(os.path.abspath(directory), '0')
  with ocp.StandardCheckpointer() as saver:
    saver.save(os.path.join(step_dir, 'state'), tree, force=True)
    saver.wait_until_finished()
    sums = integrity.save_args(tree)
    saver.save(os.path.join(step_dir, 'checksums'), sums.item, custom_metadata=sums.custom_metadata, force=True)
    saver.wait_until_finished()
  return step_dir
