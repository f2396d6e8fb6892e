"""Checkpoints with orbax: asynchronous saves every N steps, keep the last K, exact resumption
(train state + each process's data-iterator position), restore onto any mesh and rules, and
params-only initialisation for fine-tuning. A damaged newest checkpoint is moved aside and the previous
one resumed (restore_latest). Disk trouble (a directory that is not writable, a disk that fills up
mid-save) is one StorageError naming the directory, the step and the OS error. (SIGTERM handling:
training/preemption.py; merged LoRA
export: training/export.py.)

Layout: <workdir>/checkpoints/<step>/{state, data}. 'state' is the TrainState as a dict of
global jax.Arrays (orbax writes each process's shards); 'data' is each process's data position
(one JSON file per process, naming the rows of the global batch it holds: DataPositionHandler). Orbax writes
a step into <step>.orbax-checkpoint-tmp and renames it to
<step> once every item is written, so a save cut short (killed, disk full) never shows as a step: the
tmp directory is ignored by every listing, and removed when the next Checkpointer opens the directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

# orbax's own pieces for its default jax.Array handler (no public path): the array-metadata store it keeps, and
# the registry's add() that replaces a handler without logging a warning on every start.
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from data.pipeline import RowsIterator
from errors import CheckpointError, DamagedCheckpointError, StorageError
from partitioning import path_str
from training.trainer import Trainer, TrainState

# Orbax writes a replicated array in slices, one per replica ("replica-parallel"), each cut by an eager
# jax.lax.slice on its device: one compilation per (shape, device). For small arrays (norm scales, biases, a
# tiny model's everything) that buys no write bandwidth and stalls the first save while it compiles: 160 slices,
# about 7 s, for the tiny ResNet on 8 CPU devices. Arrays whose slice per replica would be under this size are
# written whole by one replica; bigger ones (a replicated embedding table under data parallelism) stay parallel.
MIN_REPLICA_SLICE_BYTES = 1 << 20
type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
  jax.Array,
  ocp.type_handlers.ArrayHandler(
    array_metadata_store=array_metadata_store.Store(), min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES
  ),
  override=True,
  ignore_warnings=True,
)


class _AbandonedReads(logging.Filter):
  """Orbax reads a checkpoint's arrays as concurrent TensorStore futures on an event loop of its own, and at the
  first that fails (a damaged checkpoint) raises and closes that loop with the rest still in flight. Each of
  those then fails to call back into the closed loop (RuntimeError 'Event loop is closed', through
  sys.unraisablehook, or printed bare when it lands while the interpreter exits), fails itself when collected
  unfinished (its own read error, through sys.unraisablehook) or is logged by asyncio once collected
  ('Task/Future exception was never retrieved'): hundreds of tracebacks after the one error or
  warning that already names the damaged checkpoint (measured: 326 for the default model's resume). A
  TensorStore completion into a closed loop is dropped instead of raising (`install`: its result could never be
  delivered), and once a checkpoint is found damaged (`met`) what still reaches the hooks from those reads is
  filtered."""

  def __init__(self):
    super().__init__()
    self.damaged: set[str] = set()
    self._previous_hook = None

  def met(self, directory: str) -> None:
    if not self.damaged:
      logging.getLogger('asyncio').addFilter(self)
      self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    self.damaged.add(str(directory))

  def install(self) -> None:
    """Wraps asyncio's call_soon_threadsafe before any read (TensorStore takes the loop's bound method when a read
    starts): a TensorStore future's completion scheduled into a closed loop is dropped instead of raising. Some
    of the abandoned reads complete before the damage is known (`met`), so this does not wait for it; any other
    call, and any call into an open loop, is asyncio's."""
    call = asyncio.BaseEventLoop.call_soon_threadsafe
    if getattr(call, 'shardzoo_abandoned_reads', False):
      return

    def call_soon_threadsafe(loop, *args, **kwargs):
      try:
        return call(loop, *args, **kwargs)
      except RuntimeError:
        if loop.is_closed() and any(type(a).__module__ == 'tensorstore' for a in args[1:]):
          return None  # a read orbax abandoned when it closed its loop: its result can never be delivered
        raise

    call_soon_threadsafe.shardzoo_abandoned_reads = True
    asyncio.BaseEventLoop.call_soon_threadsafe = call_soon_threadsafe

  def _unraisable(self, unraisable) -> None:
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == 'Event loop is closed' or self._about_damaged(e)):
      self._previous_hook(unraisable)

  def _about_damaged(self, e: BaseException | None) -> bool:
    """An abandoned read's own failure (a coroutine collected unfinished), about a checkpoint found damaged."""
    return e is not None and any(d in f'{e} {e.__cause__}' for d in self.damaged)

  def filter(self, record: logging.LogRecord) -> bool:  # asyncio's logger
    e = record.exc_info[1] if record.exc_info else None
    abandoned = ('Task exception was never retrieved', 'Future exception was never retrieved')
    return not (str(record.msg).startswith(abandoned) and self._about_damaged(e))


_abandoned_reads = _AbandonedReads()
_abandoned_reads.install()


def state_dict(state: TrainState) -> dict[str, Any]:
  return {'step': state.step, 'params': state.params, 'opt_state': state.opt_state, 'model_state': state.model_state}


def _abstract(trainer: Trainer) -> dict[str, Any]:
  """ShapeDtypeStructs carrying the target NamedShardings: orbax reads each shard straight into place."""
  with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  return state_dict(jax.tree.map(with_sharding, trainer.abstract, trainer.shardings))


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))
  return {path_str(p): (tuple(x.shape), str(np.dtype(x.dtype))) for p, x in leaves}


ANOTHER_MODEL = 'Was it written by another model or config?'
ANOTHER_OPTIMIZER = (
  'Was it written with another optimizer? Compare config.optim.name, config.freeze, '
  'config.train_only and the optimizer settings (config.optim.*, e.g. grad_clip) with the run '
  'that wrote it'
)


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


def ensure_writable(directory: str, what: str = 'workdir') -> None:
  """Creates `directory` and writes (then removes) a small file there; StorageError naming the directory
  and the OS error otherwise. train.py calls it before compiling."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix='.shardzoo-write-test-') as f:
      f.write(b'0')
      f.flush()
  except OSError as e:
    raise StorageError(
      f'{what} {os.path.abspath(directory)} is not writable: {_describe(e.errno, e.strerror, e.filename)}'
    ) from e


def _describe(code: int | None, strerror: str | None, filename: str | None) -> str:
  name = f'{errno.errorcode[code]}, ' if code in errno.errorcode else ''
  return f'{strerror} [{name}errno {code}]' + (f' ({filename})' if filename else '')


def os_error_of(e: BaseException) -> tuple[int, str, str | None] | None:
  """(errno, strerror, filename) when `e` (or what caused it) is an OS error: an OSError, or TensorStore's
  ValueError that carries os_error_code (how a failed array write reaches orbax); None otherwise."""
  while e is not None:
    if isinstance(e, OSError) and e.errno:
      return e.errno, e.strerror or os.strerror(e.errno), e.filename
    m = re.search(r"os_error_code='?(\d+)", str(e)) if isinstance(e, ValueError) else None
    if m:
      paths = re.findall(r'"(/[^"]+)"', str(e))
      return int(m.group(1)), os.strerror(int(m.group(1))), paths[-1] if paths else None
    e = e.__cause__ or e.__context__
  return None


def _data_positions(directory: epath.Path) -> list[dict[str, Any]]:
  """Every process's data position in a step's data directory (process_<i>-of-<n>.json, by process)."""
  return [json.loads(f.read_text()) for f in sorted(directory.glob('process_*-of-*.json'))]


class DataPositionHandler(grain.checkpoint.CheckpointHandler):
  """grain's handler (one JSON file per process, process_<i>-of-<n>.json) for a data.RowsIterator, whose files
  say which rows they hold: a run resumes them with any number of processes (each reads every file and takes
  its rows). Other iterators are saved as grain saves them (resumed with the same process count)."""

  def save(self, directory: epath.Path, item: Any = None, args: Any = None) -> None:
    item = item or args.item
    if not isinstance(item, RowsIterator):
      return super().save(directory, item=item)
    (directory / f'process_{jax.process_index()}-of-{jax.process_count()}.json').write_text(
      json.dumps(item.get_state(), indent=1)
    )

  def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
    item = item or args.item
    if not isinstance(item, RowsIterator):
      return super().restore(directory, item=item)
    try:  # missing or unreadable: damage (restore_latest falls back); other mismatches are CheckpointErrors
      saved = _data_positions(directory)
    except (OSError, ValueError) as e:
      raise DamagedCheckpointError(f'the data position in {directory} cannot be read ({e})') from e
    if not saved:
      raise DamagedCheckpointError(f'the data position in {directory} is missing (no process_*-of-*.json there)')
    if 'global_batch' not in saved[0]:  # written before positions named their rows: same layout only
      mine = directory / f'process_{jax.process_index()}-of-{jax.process_count()}.json'
      if not mine.exists():
        raise CheckpointError(
          f'the data position in {directory} was written by {len(saved)} process(es) in an older '
          f'format; resume it with {len(saved)} process(es)'
        )
      item.set_grain_state(json.loads(mine.read_text()))
    else:
      item.set_state(saved)
    item.start_prefetch()
    return item


@ocp.args.register_with_handler(DataPositionHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(DataPositionHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
  item: Any


class Checkpointer:
  """An orbax CheckpointManager for one run directory."""

  def __init__(self, directory: str, *, every_steps: int, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    ensure_writable(self.directory, 'checkpoint directory')
    self.manager = ocp.CheckpointManager(
      self.directory,
      item_names=('state', 'data'),
      item_handlers={'state': ocp.StandardCheckpointHandler(), 'data': DataPositionHandler()},
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=every_steps,
        create=True,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
      ),
    )
    self._last_saved = self.manager.latest_step()
    self._in_flight: int | None = None  # the step of the asynchronous save not yet known to be complete

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether save(step, force=force) would write a checkpoint."""
    return step != self._last_saved and (force or self.manager.should_save(step))

  def save(self, step: int, state: TrainState, data_iter: Any, *, force: bool = False) -> bool:
    """Starts an asynchronous save (when due or forced; once per step); training continues while
    it writes. Orbax copies the arrays to host memory before returning, so donating them is safe.
    A failure of the previous save (found now) or of this one is a StorageError when the disk is to blame."""
    if not self.due(step, force=force):
      return False
    self.wait()  # orbax would wait here anyway; waiting first tells which step's save failed
    try:
      saved = self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state_dict(state)), data=DataSave(data_iter)),
        force=force,
      )
    except Exception as e:
      if (err := self._storage_error(step, e)) is None:
        raise
      raise err from e
    if saved:
      self._last_saved, self._in_flight = step, step
    return saved

  def check(self, trainer: Trainer, step: int | None = None, data_iter: Any = None) -> Any:
    """Checks a checkpoint's shapes against the trainer's from its metadata alone (train.py: before compiling):
    CheckpointError naming the first parameter, model state or optimizer state that differs, or (with a
    data.RowsIterator) a data position saved for another global batch; DamagedCheckpointError if the metadata
    cannot be read. Returns the abstract train state to restore."""
    step = self.latest_step() if step is None else step
    source = f'checkpoint {self.directory}/{step}'
    abstract = _abstract(trainer)
    found = _read_metadata(self.manager, step, source)  # DamagedCheckpointError if unreadable
    check_compatible(abstract['params'], found['params'], what='parameter', source=source)
    check_compatible(abstract['model_state'], found.get('model_state', {}), what='model state', source=source)
    check_compatible(
      {'opt_state': abstract['opt_state']},
      {'opt_state': found.get('opt_state', {})},
      what='optimizer state',
      source=source,
      hint=ANOTHER_OPTIMIZER,
    )  # not damage either
    if isinstance(data_iter, RowsIterator):
      try:
        saved = _data_positions(epath.Path(self.directory) / str(step) / 'data')
      except (OSError, ValueError):
        saved = []  # unreadable: damage, which the restore meets and falls back from
      try:
        data_iter.check_batch(s for s in saved if 'global_batch' in s)
      except CheckpointError as e:
        raise CheckpointError(f'{source}: {e}') from None
    return abstract

  def restore(self, trainer: Trainer, data_iter: Any, step: int | None = None) -> TrainState:
    """Restores the train state into the trainer's shardings (any mesh, any rules) and the data
    iterator's position (any process count for a data.RowsIterator), checking shapes first."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    source = f'checkpoint {self.directory}/{step}'
    abstract = self.check(trainer, step)
    try:
      restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=DataRestore(data_iter))
      )
    except DamagedCheckpointError as e:  # the data position missing or unreadable
      raise DamagedCheckpointError(f'{source} is missing or corrupt: {e}') from e
    except CheckpointError as e:  # a data position this run cannot take (another batch size): not damage
      raise CheckpointError(f'{source}: {e}') from e
    except Exception as e:  # pylint: disable=broad-except
      if (cause := _read_failure(e)) is None:
        raise
      if 'tree structures do not match' in str(e):  # readable, but (empty) optimizer states differ: not damage
        raise CheckpointError(
          f"{source}: the train state's structure differs from this run's "
          f'({" ".join(str(e).split("If this mismatch")[0].split())}). {ANOTHER_OPTIMIZER}'
        ) from e
      _abandoned_reads.met(self.directory)
      raise DamagedCheckpointError(f'{source} could not be restored: {cause}') from e
    s = restored['state']
    return TrainState(s['step'], s['params'], s['opt_state'], s['model_state'])

  def restore_latest(
    self,
    trainer: Trainer,
    data_iter: Any,
    *,
    fallback: bool = True,
  ) -> tuple[TrainState, list[str]]:
    """Restores the newest checkpoint that can be read: (state, warnings). Damaged newer ones (unreadable
    metadata, array data or data position) are then moved aside to <step>.damaged (kept, never deleted; their
    step numbers are free for the next saves), each with a warning naming it. With fallback=False
    (config.resume_fallback), a damaged newest checkpoint is an error; so is one with no readable checkpoint
    before it (nothing is moved then: a rerun must not silently start afresh). A checkpoint of another model
    or optimizer is an error either way (a config problem, not damage: nothing is moved)."""
    damaged: list[tuple[int, DamagedCheckpointError]] = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state = self.restore(trainer, data_iter, step)
      except DamagedCheckpointError as e:
        if not fallback:
          raise DamagedCheckpointError(f'{e} (config.resume_fallback=True resumes from the previous one)') from e
        damaged.append((step, e))
        continue
      warnings = [
        f'{e}; moved aside to {self._move_aside(s)} (not deleted); resumed from step {step}' for s, e in damaged
      ]
      return state, warnings
    if damaged:
      raise DamagedCheckpointError(f'{damaged[0][1]}; no older checkpoint can be read either') from damaged[0][1]
    raise CheckpointError(f'no checkpoint in {self.directory}')

  def _move_aside(self, step: int) -> str:
    src = os.path.join(self.directory, str(step))
    dst = f'{src}.damaged'
    n = 1
    while os.path.exists(dst):
      n += 1
      dst = f'{src}.damaged{n}'
    if jax.process_index() == 0:
      os.rename(src, dst)
    multihost_utils.sync_global_devices(f'shardzoo:checkpoint_aside:{step}')
    self.manager.reload()
    self._last_saved = self.manager.latest_step()  # its step number is free again: the next save there happens
    return dst

  def wait(self) -> None:
    """Blocks until the save in flight is complete; a StorageError if the disk made it fail."""
    step, self._in_flight = self._in_flight, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      if (err := self._storage_error(step, e)) is None:
        raise
      raise err from e

  def _storage_error(self, step: int | None, e: Exception) -> StorageError | None:
    """The StorageError for a save of `step` that failed for `e`, if an OS error is to blame (else None)."""
    found = os_error_of(e)
    if found is None:
      return None
    self.manager.reload()
    usage = shutil.disk_usage(self.directory)
    full = ' (the disk is full)' if found[0] in (errno.ENOSPC, errno.EDQUOT) else ''
    newest = self.manager.latest_step()
    kept = (
      f'{self.directory}/{newest} is the newest intact checkpoint'
      if newest is not None
      else 'no checkpoint was written'
    )
    err = StorageError(
      f'checkpoint {self.directory}/{step} could not be written: {_describe(*found)}{full}; '
      f'{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB there; {kept} and a '
      'rerun resumes from it (free space or choose another --workdir)'
    )
    err.__cause__ = e
    return err

  def close(self) -> None:
    # orbax removes earlier runs' unfinished temporary directories in a thread its constructor starts, and joins
    # it only before the first save (not in close): a run stopped before that (bad input found once the manager
    # exists) would leave the thread to outlive the interpreter's executors, printing a traceback after our line.
    getattr(self.manager, '_maybe_await_cleanup_tmp_directory', lambda: None)()
    self.manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _read_metadata(manager: ocp.CheckpointManager, step: int, source: str) -> Mapping[str, Any]:
  try:
    md = manager.item_metadata(step)['state']
  except Exception as e:  # orbax raises assorted errors for missing/corrupt metadata
    _abandoned_reads.met(manager.directory)
    raise DamagedCheckpointError(f'{source} is missing or corrupt (cannot read its metadata: {e})') from e
  if md is None:
    raise DamagedCheckpointError(f'{source} is missing or corrupt (no state metadata)')
  return md.tree if hasattr(md, 'tree') else md


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


def load_params(path: str, trainer: Trainer, dont_load: str | None = None) -> Any:
  """Parameters only (for fine-tuning: optimizer state starts fresh) from a checkpoint of this project:
  `path` is a run's checkpoint directory (latest step) or one step's directory. Each process reads
  only its shards, straight into the trainer's shardings. Parameters whose path matches the regex
  `dont_load` are neither read nor checked (returned tree lacks them)."""
  return load_weights(path, trainer, dont_load=dont_load)[0]['params']


def steps_in(directory: str) -> list[int]:
  """The checkpoint steps in a Checkpointer's directory (none if it does not exist)."""
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []


def step_directory(path: str) -> str:
  """A run's checkpoint directory -> its latest step's directory; a step's directory as it is."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, 'state')):
    return path
  steps = steps_in(path)
  if not steps:
    run = os.path.join(path, 'checkpoints')  # a run's workdir given for its checkpoint directory
    hint = f"; a run's checkpoints are in its workdir's checkpoints/: {run}" if os.path.isdir(run) else ''
    raise CheckpointError(f'{path!r}: no checkpoint there (expected <dir>/<step>/state){hint}')
  return os.path.join(path, str(steps[-1]))


def check_weights(
  path: str,
  trainer: Trainer,
  *,
  dont_load: str | None = None,
  model_state: bool = False,
) -> tuple[str, dict[str, Any]]:
  """load_weights' checks, from the checkpoint's metadata alone (train.py runs them before compiling): (the step
  directory, the abstract tree to restore); CheckpointError naming the first parameter that differs."""
  step_dir = step_directory(path)
  source = f'checkpoint {step_dir}'
  keep = (lambda p: not re.search(dont_load, p)) if dont_load else (lambda p: True)
  full = _abstract(trainer)
  abstract = {'params': _filter(full['params'], keep)}
  if model_state:
    abstract['model_state'] = full['model_state']
  # The 'state' item is read with its handler: a checkpointer would look for step metadata inside it and warn.
  try:
    md = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir) / 'state')
  except Exception as e:
    _abandoned_reads.met(step_dir)
    raise CheckpointError(f'{source} is missing or corrupt (cannot read its metadata: {e})') from e
  tree = md.tree if hasattr(md, 'tree') else md
  found = tree.get('params') if isinstance(tree, Mapping) else None
  if found is None:
    raise CheckpointError(f'{source} holds no parameters')
  check_compatible(abstract['params'], _filter(dict(found), keep), what='parameter', source=source)
  if model_state:
    check_compatible(abstract['model_state'], tree.get('model_state') or {}, what='model state', source=source)
  return step_dir, abstract


def _read_failure(e: BaseException) -> str | None:
  """What failed to read, where `e` (or what it wraps) is a ValueError or OSError: orbax wraps TensorStore's
  errors over array data that cannot be read (a truncated chunk file: OUT_OF_RANGE) in a bare Exception whose
  message is the whole TensorStore spec. The message's first line, without that spec; None for anything else."""
  while e is not None and not isinstance(e, (ValueError, OSError)):
    e = e.__cause__
  if e is None:
    return None
  lines = str(e).strip().splitlines() or [type(e).__name__]
  return lines[0] if len(lines[0]) <= 600 else lines[0][:600] + ' ...'


def load_weights(
  path: str,
  trainer: Trainer,
  *,
  dont_load: str | None = None,
  model_state: bool = False,
) -> tuple[dict[str, Any], str]:
  """({'params': ..., ['model_state': ...]}, the step directory read) from a checkpoint of this project,
  without the optimizer state: see load_params. model_state=True also reads the non-parameter variables
  (BatchNorm statistics), for export."""
  step_dir, abstract = check_weights(path, trainer, dont_load=dont_load, model_state=model_state)
  source = f'checkpoint {step_dir}'
  handler, item = ocp.PyTreeCheckpointHandler(), epath.Path(step_dir) / 'state'
  abstract = {k: v for k, v in abstract.items() if v}  # orbax restores no empty subtrees
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  try:
    out = handler.restore(
      item, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
    )
  except Exception as e:  # pylint: disable=broad-except
    if (cause := _read_failure(e)) is None:
      raise
    _abandoned_reads.met(step_dir)
    raise CheckpointError(f'{source} could not be restored: {cause}') from e
  return {'params': {}, 'model_state': {}, **out} if model_state else {'params': {}, **out}, step_dir
