"""Checkpoints of a whole train state with orbax: asynchronous saves every N steps, keep the last K, exact resumption
(the state + each process's data-iterator position), restore onto any mesh and rules. Written against trees: the
state is a dict {'step', 'params', 'opt_state', 'model_state'} of global jax.Arrays, restored into targets of the
same keys (jax.ShapeDtypeStructs carrying their NamedShardings); training converts its TrainState. (Weights alone:
checkpointing/weights.py; disk faults: checkpointing/storage.py.)

Faults (docs/checkpoint_faults.md). Every array's checksum is computed on the devices and saved with it. A restore
is agreed between processes: each reads the step, says whether it could, and all take the same step or all fall
back; a damaged step (any failure to read its files on any process, or a checksum that does not hold) is moved
aside by process 0 and the previous one resumed (restore_latest). Disk trouble (a directory that is not writable, too
little space for the checkpoints to come, a disk that fills up mid-save) is one StorageError naming the directory,
the step, the OS error and the last good checkpoint; orbax's own tracebacks go to <workdir>/orbax_errors.log.

Layout: <workdir>/checkpoints/<step>/{state, data, checksums}. 'state' is that dict of
global jax.Arrays (orbax writes each process's shards); 'data' is each process's data position
(one JSON file per process, naming the rows of the global batch it holds: DataPositionHandler); 'checksums' one
uint32 per array of 'state'. Orbax writes a step into <step>.orbax-checkpoint-tmp and renames it to
<step> once every item is written, so a save cut short (killed, disk full) never shows as a step: the
tmp directory is ignored by every listing, removed when a save fails for lack of space, and when the next
Checkpointer opens the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import glob
import json
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from checkpointing import deadlines, integrity, storage
from checkpointing.weights import check_compatible
from data.pipeline import RowsIterator
from errors import CheckpointError, DamagedCheckpointError, OsError, StorageError, describe_os_error, os_error_of
from partitioning import path_str

# Orbax writes a replicated array in slices, one per replica ("replica-parallel"), each cut by an eager
# jax.lax.slice on its device: one compilation per (shape, device). For small arrays (norm scales, biases, a
# tiny model's everything) that buys no write bandwidth and stalls the first save while it compiles. Arrays whose
# slice per replica would be under this size are written whole by one replica; bigger ones (a replicated embedding
# table under data parallelism) stay parallel.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def write_small_replicated_arrays_whole(min_slice_bytes: int = MIN_REPLICA_SLICE_BYTES) -> None:
  """Replaces orbax's default jax.Array handler (every save in this process) by one that writes arrays under
  `min_slice_bytes` per replica whole. The one private use of orbax, written against orbax-checkpoint 0.12.8:
  no public path gives the default handler's array-metadata store, and the public register_type_handler logs a
  warning on every start where the registry's own add() can be told not to (tests/test_checkpointing.py checks
  both paths still exist)."""
  from orbax.checkpoint._src.metadata import array_metadata_store  # noqa: PLC0415 (private: only here)
  from orbax.checkpoint._src.serialization import type_handler_registry  # noqa: PLC0415

  type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
    jax.Array,
    ocp.type_handlers.ArrayHandler(
      array_metadata_store=array_metadata_store.Store(), min_slice_bytes_for_replica_parallel=min_slice_bytes
    ),
    override=True,
    ignore_warnings=True,
  )


write_small_replicated_arrays_whole()

ANOTHER_OPTIMIZER = (
  'Was it written with another optimizer? Compare config.optim.name, config.freeze, '
  'config.train_only and the optimizer settings (config.optim.*, e.g. grad_clip) with the run '
  'that wrote it'
)


def _data_positions(directory: epath.Path) -> list[dict[str, Any]]:
  """Every process's data position in a step's data directory (process_<i>-of-<n>.json, by process).
  DamagedCheckpointError when one is missing (the names say how many processes wrote them) or unreadable."""
  found = {}
  for f in directory.glob('process_*-of-*.json'):
    if m := re.fullmatch(r'process_(\d+)-of-(\d+)\.json', f.name):
      found[int(m[1]), int(m[2])] = f
  if not found:
    raise DamagedCheckpointError(f'the data position in {directory} is missing (no process_*-of-*.json there)')
  n = max(count for _, count in found)
  missing = [f'process_{i}-of-{n}.json' for i in range(n) if (i, n) not in found]
  if missing or len(found) != n:
    raise DamagedCheckpointError(
      f'the data position in {directory} is incomplete: '
      + (f'{", ".join(missing)} missing' if missing else f'files of different process counts {sorted(found)}')
    )
  try:
    return [json.loads(found[i, n].read_text()) for i in range(n)]
  except Exception as e:  # any failure to read or parse the checkpoint's own file is damage
    raise DamagedCheckpointError(f'the data position in {directory} cannot be read ({type(e).__name__}: {e})') from e


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
    _set_position(item, directory, _data_positions(directory))
    item.start_prefetch()
    return item


def _set_position(item: RowsIterator, directory: epath.Path, saved: list[dict[str, Any]]) -> None:
  """Moves `item` to the saved positions (not yet prefetching). CheckpointError when they are for another global
  batch, or in the older format (grain's own state per process) for another process count: this run's config, not
  damage; DamagedCheckpointError when the files, though complete, do not add up to one position."""
  item.check_batch(s for s in saved if 'global_batch' in s)
  if 'global_batch' not in saved[0]:  # written before positions named their rows: same layout only
    mine = directory / f'process_{jax.process_index()}-of-{jax.process_count()}.json'
    if len(saved) != jax.process_count():
      raise CheckpointError(
        f'the data position in {directory} was written by {len(saved)} process(es) in an older '
        f'format; resume it with {len(saved)} process(es)'
      )
    saved = [json.loads(mine.read_text())]
    set_state = lambda s: item.set_grain_state(s[0])
  else:
    set_state = item.set_state
  try:
    set_state(saved)
  except Exception as e:  # the processes' files contradict each other, or grain cannot take its own state back
    raise DamagedCheckpointError(f'the data position in {directory} cannot be applied ({type(e).__name__}: {e})') from e


@ocp.args.register_with_handler(DataPositionHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(DataPositionHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
  item: Any


def _free_name(src: str) -> str:
  dst, n = f'{src}.damaged', 1
  while os.path.exists(dst):
    n += 1
    dst = f'{src}.damaged{n}'
  return dst


# Every process's value of one report (topic, this process's value) -> [value of process 0, 1, ...], exchanged
# without a collective on the devices, so a process that failed to read can still say so: a multi-process run
# gives training.cluster.gather_strings (the coordination service's key-value store).
Gather = Callable[[str, str], list[str]]


def one_process(topic: str, value: str) -> list[str]:
  """The agreement of a single process."""
  if jax.process_count() > 1:
    raise RuntimeError(f'{topic}: a Checkpointer of {jax.process_count()} processes needs their gather function')
  return [value]


class Checkpointer:
  """An orbax CheckpointManager for one run directory. Restores are agreed between processes: each reads what it
  needs, says whether it could (`gather`), and all then take the same checkpoint or all fall back."""

  def __init__(
    self,
    directory: str,
    *,
    every_steps: int,
    keep: int,
    async_save: bool = True,
    log: str | None = None,
    gather: Gather = one_process,
    timeout_s: float = 0.0,
  ):
    self.directory = os.path.abspath(directory)
    storage.ensure_writable(self.directory, 'checkpoint directory')
    self.keep, self.gather = keep, gather
    self.manager = ocp.CheckpointManager(
      self.directory,
      item_names=('state', 'data', 'checksums'),
      item_handlers={
        'state': ocp.StandardCheckpointHandler(),
        'data': DataPositionHandler(),
        'checksums': ocp.StandardCheckpointHandler(),
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=every_steps,
        create=True,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        # Directories created in save() itself: created by a background thread, a directory that cannot be made
        # (read-only, full) left orbax's writer threads waiting for it until orbax's own 20-minute timeout.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
      ),
    )
    self._reader = ocp.StandardCheckpointHandler()  # its restore has no barrier: processes agree on their own
    self._tracebacks = storage.OrbaxTracebacks(log or os.path.join(os.path.dirname(self.directory), 'orbax_errors.log'))
    self._last_saved = self.manager.latest_step()
    self._in_flight: int | None = None  # the step of the asynchronous save not yet known to be complete
    self._deadlines, self._save = deadlines.Deadlines(timeout_s), None  # _save: the one in flight (its deadline)
    self._faulted = self._stuck = False  # a save failed; a save blocked (its threads may never return)
    self._removed: int | None = None  # the failed save whose partial checkpoint the line says was removed
    self._stopping = False  # the run stops after its last save (SIGTERM)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether save(step, force=force) would write a checkpoint."""
    return step != self._last_saved and (force or self.manager.should_save(step))

  def save(
    self, step: int, state: dict[str, Any], data_iter: Any, *, force: bool = False, stopping: bool = False
  ) -> bool:
    """Starts an asynchronous save (when due or forced; once per step); training continues while
    it writes. Orbax copies the arrays to host memory before returning, so donating them is safe. The arrays'
    checksums are computed on the devices and saved with them (an item of their own). A failure of the previous
    save (found now) or of this one is a StorageError when the disk is to blame, and so is a save past its deadline
    (deadlines.py: orbax's save() runs in a thread of its own, so that nothing here waits without one). `stopping`:
    the run stops after this save (SIGTERM): from now on a save that stops writing is blocked at once."""
    if not self.due(step, force=force):
      return False
    self._stopping |= stopping
    self.wait()  # orbax would wait here anyway; waiting first tells which step's save failed
    tree = dict(state)
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(tree),
      data=DataSave(data_iter),
      checksums=integrity.save_args(tree),
    )
    save = self._deadlines.start(step, storage.state_bytes(tree))
    try:
      saved = deadlines.in_thread(
        lambda: self.manager.save(step, args=args, force=force), save, self._written(step), self._stopping
      )
    except deadlines.Blocked as e:
      raise self._blocked(step, str(e)) from None
    except Exception as e:
      if (err := self._fault(step, e)) is None:
        raise
      raise err from e
    if saved:
      self._last_saved, self._in_flight, self._save = step, step, save
    return saved

  def poll(self) -> None:
    """Once per step: a StorageError as soon as the save in flight has failed (not at the next save), or has
    passed its deadline."""
    if self._in_flight is None:
      return
    if not self.manager.is_saving_in_progress():
      self.wait()
    elif self._save is not None and (late := self._save.overdue()):
      raise self._blocked(self._in_flight, late)

  def check(self, target: dict[str, Any], step: int | None = None, data_iter: Any = None) -> Any:
    """Checks a checkpoint's shapes against the target's from its metadata alone (train.py: before compiling):
    CheckpointError naming the first parameter, model state or optimizer state that differs, or (with a
    data.RowsIterator) a data position saved for another global batch; DamagedCheckpointError if the metadata
    cannot be read. Returns the abstract train state to restore."""
    step = self.latest_step() if step is None else step
    source = f'checkpoint {self.directory}/{step}'
    abstract = dict(target)
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
      except DamagedCheckpointError:
        saved = []  # damage, which the restore meets and falls back from
      try:
        data_iter.check_batch(s for s in saved if 'global_batch' in s)
      except CheckpointError as e:
        raise CheckpointError(f'{source}: {e}') from None
    return abstract

  def _read(self, target: dict[str, Any], data_iter: Any, step: int) -> tuple[Any, str, CheckpointError | None]:
    """This process's read of `step`: (restored, outcome, error). outcome is 'ok' (checksums read too),
    'unverified' (a checkpoint written without checksums), 'damaged:<why>' (any failure to read the checkpoint's
    own files), or 'error:<why>' for a checkpoint this run's config cannot take (error: the CheckpointError)."""
    source, step_dir = f'checkpoint {self.directory}/{step}', epath.Path(self.directory) / str(step)
    with storage.abandoned_reads.reading(self.directory):
      return self._read_step(target, data_iter, step, source, step_dir)

  def _read_step(
    self, target: dict[str, Any], data_iter: Any, step: int, source: str, step_dir: epath.Path
  ) -> tuple[Any, str, CheckpointError | None]:
    try:
      abstract = self.check(target, step)
      saved = None
      if isinstance(data_iter, RowsIterator):
        try:
          saved = _data_positions(step_dir / 'data')
        except DamagedCheckpointError as e:
          raise DamagedCheckpointError(f'{source} is missing or corrupt: {e}') from e
        try:
          data_iter.check_batch(s for s in saved if 'global_batch' in s)
        except CheckpointError as e:
          raise CheckpointError(f'{source}: {e}') from None
      state = self._reader.restore(step_dir / 'state', args=ocp.args.StandardRestore(abstract))
      sums = None
      if (step_dir / 'checksums').exists():
        target = integrity.sums_target(len(jax.tree.leaves(abstract)), abstract)
        sums = self._reader.restore(step_dir / 'checksums', args=ocp.args.StandardRestore(target))['sums']
      try:  # the data position last, once the arrays are read (no prefetching before the processes agree)
        if saved is None:
          DataPositionHandler().restore(step_dir / 'data', item=data_iter)  # grain's own iterator state
        else:
          _set_position(data_iter, step_dir / 'data', saved)
      except DamagedCheckpointError as e:
        raise DamagedCheckpointError(f'{source} is missing or corrupt: {e}') from e
      except CheckpointError as e:  # a position this run cannot take (older format, other process count)
        raise CheckpointError(f'{source}: {e}') from e
    except DamagedCheckpointError as e:
      storage.abandoned_reads.met(self.directory)
      return None, f'damaged:{e}', None
    except CheckpointError as e:
      return None, f'error:{e}', e
    except Exception as e:  # pylint: disable=broad-except  # reading the checkpoint's own files failed: damage
      if 'tree structures do not match' in str(e):  # readable, but (empty) optimizer states differ: not damage
        err = CheckpointError(
          f"{source}: the train state's structure differs from this run's "
          f'({" ".join(str(e).split("If this mismatch")[0].split())}). {ANOTHER_OPTIMIZER}'
        )
        return None, f'error:{err}', err
      storage.abandoned_reads.met(self.directory)  # orbax's reads still in flight fail too: quietly
      return None, f'damaged:{source} could not be restored: {storage.read_failure(e) or storage.first_line(e)}', None
    return (state, sums), 'ok' if sums is not None else 'unverified', None

  def _restore_agreed(self, target: dict[str, Any], data_iter: Any, step: int) -> tuple[dict[str, Any] | None, str]:
    """Reads `step` on every process and agrees on it: (state, '') when every process read it and its checksums
    held, else (None, why it is damaged: the same text on every process). A CheckpointError (this run's config
    cannot take it) on every process if any process met one."""
    source, n = f'checkpoint {self.directory}/{step}', jax.process_count()
    restored, outcome, error = self._read(target, data_iter, step)
    outcomes = self.gather(f'restore/{step}', outcome)
    refused = [o.removeprefix('error:') for o in outcomes if o.startswith('error:')]
    if refused:
      raise error or CheckpointError(refused[0])
    damaged = [(i, o.removeprefix('damaged:')) for i, o in enumerate(outcomes) if o.startswith('damaged:')]
    if not damaged and len(set(outcomes)) > 1:  # checksums missing where others found them
      missing = f'{source} is missing or corrupt: its checksums are missing'
      damaged = [(i, missing) for i, o in enumerate(outcomes) if o == 'unverified']
    if damaged:
      storage.abandoned_reads.met(self.directory)
      who = [i for i, _ in damaged]
      seen = f' (seen by process {", ".join(map(str, who))} of {n})' if n > 1 and len(who) < n else ''
      return None, damaged[0][1] + seen
    (state, sums) = restored
    if sums is not None:  # every process computes the same replicated figures: they agree without asking
      found, expected = np.asarray(jax.device_get(integrity.checksums(state))), np.asarray(jax.device_get(sums))
      if found.shape != expected.shape or (found != expected).any():
        paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
        bad = [p for p, f, e in zip(paths, found, expected) if f != e] if found.shape == expected.shape else paths
        return None, (
          f'{source} is corrupt: the checksums of {len(bad)} of {len(paths)} arrays differ from those saved with it '
          f'(e.g. {", ".join(bad[:3])})'
        )
    if hasattr(data_iter, 'start_prefetch'):
      data_iter.start_prefetch()
    return state, ''

  def restore(self, target: dict[str, Any], data_iter: Any, step: int | None = None) -> dict[str, Any]:
    """Restores the state into the target's shardings (any mesh, any rules) and the data
    iterator's position (any process count for a data.RowsIterator), checking shapes first and the arrays'
    checksums after. DamagedCheckpointError (on every process) if any process cannot read it or a checksum fails."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    state, damage = self._restore_agreed(target, data_iter, step)
    if state is None:
      raise DamagedCheckpointError(damage)
    return state

  def restore_latest(
    self,
    target: dict[str, Any],
    data_iter: Any,
    *,
    fallback: bool = True,
  ) -> tuple[dict[str, Any], list[str]]:
    """Restores the newest checkpoint that every process can read and whose checksums hold: (state, warnings).
    Damaged newer ones (unreadable metadata, array data or data position on any process, a failed checksum) are
    then moved aside to <step>.damaged by process 0 (kept, never deleted; their step numbers are free for the next
    saves), each with a warning naming it, the same on every process. With fallback=False
    (config.resume_fallback), a damaged newest checkpoint is an error; so is one with no readable checkpoint
    before it (nothing is moved then: a rerun must not silently start afresh). A checkpoint of another model
    or optimizer is an error either way (a config problem, not damage: nothing is moved)."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    steps = json.loads(self.gather('steps', json.dumps(steps))[0])  # process 0's list, for everyone
    damaged: list[tuple[int, str]] = []
    for step in steps:
      state, damage = self._restore_agreed(target, data_iter, step)
      if state is None:
        if not fallback:
          raise DamagedCheckpointError(f'{damage} (config.resume_fallback=True resumes from the previous one)')
        damaged.append((step, damage))
        continue
      moved = self._move_aside([s for s, _ in damaged])
      return state, [f'{d}; moved aside to {moved[s]} (not deleted); resumed from step {step}' for s, d in damaged]
    if damaged:
      raise DamagedCheckpointError(f'{damaged[0][1]}; no older checkpoint can be read either')
    raise CheckpointError(f'no checkpoint in {self.directory}')

  def _move_aside(self, steps: list[int]) -> dict[int, str]:
    """Process 0 renames each step to <step>.damaged (or .damaged2 ...) once every process is done reading; all
    return the same names (chosen before anything is renamed)."""
    if not steps:
      return {}
    moved = {s: _free_name(os.path.join(self.directory, str(s))) for s in steps}
    self.gather('aside/ready', 'ok')  # every process has chosen the names and read what it reads
    outcome = 'ok'
    if jax.process_index() == 0:
      for s, dst in moved.items():
        try:
          os.rename(os.path.join(self.directory, str(s)), dst)
        except OSError as e:
          why = describe_os_error(e.errno, e.strerror, None)
          outcome = f'{self.directory}/{s} could not be moved aside to {dst}: {why}'
          break
    outcome = self.gather('aside/done', outcome)[0]
    if outcome != 'ok':
      raise StorageError(f'damaged checkpoint {outcome}')
    self.manager.reload()
    self._last_saved = self.manager.latest_step()  # its step number is free again: the next save there happens
    return moved

  def wait(self) -> None:
    """Blocks until the save in flight is complete; a StorageError if the disk made it fail, or if it passes its
    deadline (or stops writing after SIGTERM) first."""
    step, save = self._in_flight, self._save
    self._in_flight = self._save = None
    if self._stuck:  # a blocked save's threads never return: nothing to wait for
      return
    try:
      if save is not None:
        deadlines.wait_for(self.manager.is_saving_in_progress, save, self._written(save.step), self._stopping)
      self.manager.wait_until_finished()
    except deadlines.Blocked as e:
      raise self._blocked(step, str(e)) from None
    except Exception as e:
      if (err := self._fault(step, e)) is None:
        raise
      raise err from e
    if save is not None:
      self._deadlines.finished(save)

  def _written(self, step: int) -> Callable[[], int | None]:
    """The bytes written so far into step's <step>.orbax-checkpoint-tmp (None when they cannot be counted within a
    second): how wait_for tells a save that stopped writing from a slow one."""
    tmp = os.path.join(self.directory, f'{step}.orbax-checkpoint-tmp')

    def count() -> int:
      total = 0
      for root, _, files in os.walk(tmp):
        for f in files:
          with contextlib.suppress(OSError):
            total += os.stat(os.path.join(root, f)).st_size
      return total

    return lambda: storage.within(count, 1.0)

  def _partials(self, step: int) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(self.directory), f'{step}.orbax-checkpoint-tmp*')))

  def _remove_partial(self, step: int, settle_s: float = 0.3, timeout_s: float = 5.0) -> str:
    """Removes the failed save's <step>.orbax-checkpoint-tmp*, and says what is on disk after. Orbax's other writer
    threads of that save may still be finishing (and recreating directories) after the first one failed, so it is
    removed until it stays gone: a directory they wrote into while it was emptied (not empty) or an entry they
    removed first (gone) is removed in the next round; a removal that fails otherwise (a read-only directory) is not
    tried again."""
    failed: list[BaseException] = []
    seen = []

    def record(fn, path, info) -> None:
      if not (isinstance(info[1], OSError) and info[1].errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT)):
        failed.append(info[1])

    def remove() -> None:
      deadline = time.monotonic() + timeout_s
      while time.monotonic() < deadline and not failed:
        partials = self._partials(step)
        seen.extend(partials)
        for partial in partials:
          shutil.rmtree(partial, onerror=record)
        time.sleep(settle_s)
        if not partials and not self._partials(step):
          return

    storage.within(remove, timeout_s + 1)
    left = storage.within(lambda: self._partials(step), 2.0, [f'{self.directory}/{step}.orbax-checkpoint-tmp'])
    if not left:
      return 'the partial checkpoint was removed' if seen else 'nothing of it was written'
    why = next((describe_os_error(e.errno, e.strerror, None) for e in failed if isinstance(e, OSError)), None)
    why = f'it cannot be removed: {why}' if why else 'it could not be removed in time'
    return (
      f'the partial checkpoint {left[0]} is left on disk ({why}; no run takes it for a checkpoint, and the next '
      'that can write there removes it)'
    )

  def _last_good(self) -> str:
    """The newest complete checkpoint on disk now (orbax's own list may have dropped steps it meant to delete)."""

    def newest() -> int | None:
      self.manager.reload()
      return self.manager.latest_step()

    try:
      step = storage.within(newest, 5.0)
    except Exception:  # pylint: disable=broad-except  # the directory itself is gone or unreadable
      step = None
    if step is None:
      return 'no checkpoint of this run is on disk'
    return f'the last good checkpoint is {self.directory}/{step} and a rerun resumes from it'

  def _log(self) -> str:
    """Where orbax's tracebacks of the failure went, once the failed save's futures are collected (each reports
    its failure then, into the log: storage.caught)."""
    gc.collect()
    path, failed = self._tracebacks.flush()
    if failed:
      return f"; orbax's tracebacks could not be written to {self._tracebacks.path}: {failed}"
    return f"; orbax's tracebacks are in {path}" if path else ''

  def _operation(self, step: int, e: BaseException, found: OsError) -> tuple[str, int | None]:
    """Which operation of a save of `step` failed ('write', 'rename', or 'delete': of an old checkpoint, after
    `step` was written) and the step it concerned, from the path the OS error names and orbax's frames (a removal
    names paths relative to the directory it empties); None where the old step is no longer on disk."""
    name = os.path.relpath(found.filename, self.directory).split(os.sep)[0] if found.filename else ''
    if name.isdigit() and int(name) != step:
      return 'delete', int(name)
    frames = set()
    while e is not None:
      frames |= {f.name for f in traceback.extract_tb(e.__traceback__)}
      e = e.__cause__ or e.__context__
    if frames & {'delete_steps', 'rmtree', '_rmtree_safe_fd', '_rmtree_unsafe'}:
      older = sorted(storage.steps_in(self.directory))[: -self.keep]  # kept past keep_checkpoints: not deleted
      return 'delete', older[0] if older else None
    if found.filename2 is not None:  # os.rename's errors name both paths
      return 'rename', step
    return 'write', step

  def _fault(self, step: int | None, e: Exception) -> StorageError | None:
    """The StorageError for a save of `step` that failed for `e`, if an OS error is to blame (else None): the
    operation that failed, the step it concerned, what is on disk after cleanup (the partial checkpoint removed or
    not; an old checkpoint that could not be deleted still there or not), the last good checkpoint, advice that
    fits the cause, and where orbax's tracebacks went. An orbax wait that timed out is a blocked save."""
    found = os_error_of(e)
    if found is None:
      cause = e
      while cause is not None and not isinstance(cause, TimeoutError):
        cause = cause.__cause__ or cause.__context__
      return None if cause is None else self._blocked(step, f'timed out in orbax ({storage.first_line(cause)})')
    self._faulted = True
    storage.quiet_after_fault(self.directory)
    op, concerned = self._operation(step, e, found)
    where = f'{self.directory}/{concerned}'
    if op == 'delete':
      left = 'it is still on disk' if concerned is not None and os.path.exists(where) else 'it is gone'
      old = f'old checkpoint {where}' if concerned is not None else f'an old checkpoint in {self.directory}'
      what = f'{old} could not be deleted after checkpoint {step} was written'
    else:
      left = self._remove_partial(step)
      self._removed = step if left == 'the partial checkpoint was removed' else None
      what = f'checkpoint {where} could not be ' + ('renamed into place' if op == 'rename' else 'written')
    path = found.filename if found.filename and os.path.isabs(found.filename) else None  # not one in a removal
    advice = storage.advice(found.code, where if op == 'delete' and concerned is not None else self.directory)
    err = StorageError(
      f'{what}: {describe_os_error(found.code, found.strerror, path)}; {left}; {self._last_good()} '
      f'({advice}){self._log()}'
    )
    err.__cause__ = e
    return err

  def _blocked(self, step: int | None, reason: str) -> StorageError:
    """The StorageError for a save that blocked (deadlines.Blocked): what blocks it (a directory no longer
    writable, a filesystem that does not answer, or where orbax's threads wait), what is on disk after cleanup,
    the last good checkpoint and advice. Its threads may never return: the error says so (`blocked`)."""
    self._faulted = self._stuck = True
    self._in_flight = self._save = None
    what, code = storage.probe(self.directory)
    if code is not None:
      advice = storage.advice(code, self.directory)
    elif what:
      advice = f'check the filesystem of {self.directory} (a network mount that stopped answering?) or choose another '
      advice += '--workdir'
    else:
      waits = storage.where_orbax_waits()
      what = f'{self.directory} is writable' + (f'; orbax waits in {waits}' if waits else '')
      advice = 'set config.checkpoint_timeout above the time a save takes here, or choose another --workdir'
    storage.quiet_after_fault(self.directory)
    err = StorageError(
      f'checkpoint {self.directory}/{step} could not be written: the save {reason}: {what}; '
      f'{self._remove_partial(step)}; {self._last_good()} ({advice}){self._log()}'
    )
    err.blocked = True
    return err

  def close(self) -> None:
    try:
      if not self._stuck:  # a blocked save's threads never return: orbax's close would wait for them
        # orbax removes earlier runs' unfinished temporary directories in a thread its constructor starts, and
        # joins it only before the first save (not in close): a run stopped before that (bad input found once the
        # manager exists) would leave the thread to outlive the interpreter's executors, printing a traceback after
        # our line.
        getattr(self.manager, '_maybe_await_cleanup_tmp_directory', lambda: None)()
        try:
          self.manager.close()
        except Exception:  # pylint: disable=broad-except
          if not self._faulted:  # after a failed save, orbax's close meets the same fault again: told already
            raise
        # orbax's other writer threads of a failed save, finished only now, may have made its directories again
        # after they were removed: removed once more, so that what the line said stays true.
        for partial in self._partials(self._removed) if self._removed is not None else []:
          shutil.rmtree(partial, ignore_errors=True)
    finally:
      self._tracebacks.close(faulted=self._faulted)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _read_metadata(manager: ocp.CheckpointManager, step: int, source: str) -> Mapping[str, Any]:
  try:
    md = manager.item_metadata(step)['state']
  except Exception as e:  # orbax raises assorted errors for missing/corrupt metadata
    storage.abandoned_reads.met(manager.directory)
    raise DamagedCheckpointError(f'{source} is missing or corrupt (cannot read its metadata: {e})') from e
  if md is None:
    raise DamagedCheckpointError(f'{source} is missing or corrupt (no state metadata)')
  return md.tree if hasattr(md, 'tree') else md
