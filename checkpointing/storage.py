"""Where checkpoints and event files are written, and what goes wrong there: writability, free space, OS errors
named in one line, TensorBoard writers whose disk faults are one StorageError, and the filters that keep orbax's
own tracebacks (a failed save, abandoned reads of a damaged checkpoint) off the terminal. The checkpointer and the
weight loaders share them; nothing here knows a train state."""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from typing import Any

import jax
import numpy as np

from errors import StorageError


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
      f'{what} {os.path.abspath(directory)} is not writable: {describe_os_error(e.errno, e.strerror, e.filename)}'
    ) from e


def describe_os_error(code: int | None, strerror: str | None, filename: str | None) -> str:
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


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.ENOENT, errno.EIO)


class GuardedWriter:
  """A clu metric writer whose failures to write the event files (TensorFlow's writer reports a full disk, a quota,
  a read-only or vanished workdir as its own errors, at the next write) are one StorageError naming the workdir,
  the cause and the last good checkpoint (`last_good()`); clu's traceback for them is logged in its thread."""

  def __init__(self, writer: Any, workdir: str, last_good: Any):
    self._writer, self._workdir, self._last_good = writer, os.path.abspath(workdir or '.'), last_good

  @classmethod
  def create(cls, make_writer: Any, workdir: str, last_good: Any) -> GuardedWriter:
    """The writer `make_writer()` builds, guarded from its creation on (TensorFlow opens the event file then)."""
    guarded = cls(None, workdir, last_good)
    guarded._writer = guarded._call(make_writer)
    return guarded

  def __getattr__(self, name: str) -> Any:
    method = getattr(self._writer, name)
    if not callable(method):
      return method
    return lambda *args, **kwargs: self._call(method, *args, **kwargs)

  def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
      return fn(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      text = f'{e} {e.__cause__ or ""}'
      code = next((c for c in _STORAGE_ERRNOS if os.strerror(c) in text), None)
      if code is None:
        raise
      raise StorageError(
        f'the event files in {self._workdir} could not be written: {describe_os_error(code, os.strerror(code), None)}; '
        f'the last good checkpoint is {self._last_good()} (free space or choose another --workdir)'
      ) from e


class OrbaxTracebacks(logging.Filter):
  """A save that fails (a full disk) fails in several of orbax's background threads, and each logs the error with
  its traceback: hundreds of lines for the one StorageError the run stops with (clu's event writer logs one per
  failed write). Orbax's errors are kept here (in
  memory: the disk may be the one that is full) and written to `path` when the StorageError is raised, once the
  partial checkpoint is removed, or when the Checkpointer closes. Orbax's warnings still reach the terminal."""

  MAX_RECORDS = 100

  def __init__(self, path: str):
    super().__init__()
    self.path, self.records, self.written = path, [], 0
    self.format = logging.Formatter('%(asctime)s %(threadName)s %(pathname)s:%(lineno)d %(levelname)s %(message)s')
    for logger in (logging.getLogger('absl'), logging.getLogger()):  # orbax logs through absl, or plain logging
      logger.addFilter(self)

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or not ('/orbax/' in record.pathname or '/clu/asynclib' in record.pathname):
      return True
    if len(self.records) < self.MAX_RECORDS:
      self.records.append(record)
    return False

  def flush(self) -> str | None:
    """Writes what was kept to the log file: its path, or None if nothing was logged (or it cannot be written)."""
    if self.records:
      try:
        with open(self.path, 'a') as f:
          f.writelines(self.format.format(r) + '\n' for r in self.records)
        self.written += len(self.records)
      except OSError:
        return None
      self.records = []
    return self.path if self.written else None

  def close(self) -> None:
    self.flush()
    for logger in (logging.getLogger('absl'), logging.getLogger()):
      logger.removeFilter(self)


def state_bytes(abstract: Any) -> int:
  """A state's size (a tree of arrays or ShapeDtypeStructs): what one checkpoint of it takes on disk (orbax stores
  the arrays uncompressed)."""
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))


def steps_in(directory: str) -> list[int]:
  """The checkpoint steps in a Checkpointer's directory (none if it does not exist): orbax renames a step's
  directory to its number only once every item is written."""
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []


def check_space(directory: str, nbytes: int, keep: int, policy: str = 'refuse') -> str | None:
  """Before training: whether `directory`'s free space holds the checkpoints still to be written, each of
  `nbytes` (state_bytes): `keep` of them, plus the one being written before the oldest is deleted, less those
  already there. StorageError naming both figures ('refuse'), or that message to print ('warn'); None if they fit."""
  directory = os.path.abspath(directory)
  ensure_writable(directory, 'checkpoint directory')
  count = max(1, keep + 1 - len(steps_in(directory)))
  free = shutil.disk_usage(directory).free
  if count * nbytes <= free:
    return None
  msg = (
    f'checkpoint directory {directory} has {free / 2**20:.1f} MiB free, but the run needs '
    f'{count * nbytes / 2**20:.1f} MiB there: {count} checkpoint(s) of {nbytes / 2**20:.1f} MiB '
    f'(config.keep_checkpoints={keep}, plus the one being written)'
  )
  if policy == 'warn':
    return f"{msg}; training anyway (config.checkpoint_space='warn')"
  raise StorageError(
    f'{msg}: free space, choose another --workdir or lower config.keep_checkpoints '
    "(config.checkpoint_space='warn' trains anyway)"
  )


def first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines() or ['']
  return f'{type(e).__name__}: {lines[0][:600]}'


def read_failure(e: BaseException) -> str | None:
  """What failed to read, where `e` (or what it wraps) is a ValueError or OSError: orbax wraps TensorStore's
  errors over array data that cannot be read (a truncated chunk file: OUT_OF_RANGE) in a bare Exception whose
  message is the whole TensorStore spec. The message's first line, without that spec; None for anything else."""
  while e is not None and not isinstance(e, (ValueError, OSError)):
    e = e.__cause__
  if e is None:
    return None
  lines = str(e).strip().splitlines() or [type(e).__name__]
  return lines[0] if len(lines[0]) <= 600 else lines[0][:600] + ' ...'


class AbandonedReads(logging.Filter):
  """Orbax reads a checkpoint's arrays as concurrent TensorStore futures on an event loop of its own, and at the
  first that fails (a damaged checkpoint) raises and closes that loop with the rest still in flight. Each of
  those then fails to call back into the closed loop (RuntimeError 'Event loop is closed', through
  sys.unraisablehook, or printed bare when it lands while the interpreter exits), fails itself when collected
  unfinished (its own read error, through sys.unraisablehook) or is logged by asyncio once collected
  ('Task/Future exception was never retrieved'): hundreds of tracebacks after the one error or
  warning that already names the damaged checkpoint. A
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


abandoned_reads = AbandonedReads()
abandoned_reads.install()
