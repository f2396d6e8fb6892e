"""Where checkpoints and event files are written, and what goes wrong there: writability, free space, OS errors
named in one line with advice fitting their cause, TensorBoard writers whose disk faults are one StorageError, a
probe of a directory that may not answer, and what keeps orbax's own failures (a failed save's background threads
and futures, abandoned reads of a damaged checkpoint) off the terminal: the event loops orbax runs in report
unretrieved failures into the error log, and a log filter keeps its threads' tracebacks there. The checkpointer and
the weight loaders share them; nothing here knows a train state."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from errors import StorageError, describe_os_error, os_error_of


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


def advice(code: int, directory: str) -> str:
  """What to do about the OS error `code` met writing under `directory`, fitting its cause: free space (with the
  figures) for a full disk or quota, a remount for a read-only filesystem, permissions for a denied write."""
  if code in (errno.ENOSPC, errno.EDQUOT):
    try:
      usage = shutil.disk_usage(directory)
      figures = f', {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB there'
    except OSError:
      figures = ''
    what = 'the disk quota is used up' if code == errno.EDQUOT else 'the disk is full'
    return f'{what}{figures}: free space or choose another --workdir'
  if code == errno.EROFS:
    return f'{directory} is on a filesystem mounted read-only: remount it read-write or choose another --workdir'
  if code in (errno.EACCES, errno.EPERM):
    return (
      f'this user (uid {os.getuid()}) may not write in {directory}: give it write permission there or choose '
      'another --workdir'
    )
  if code == errno.ENOENT:
    return f'{directory} or a directory in it vanished while it was written: choose another --workdir'
  if code == errno.EIO:
    return 'the device reports an I/O error: check the disk (dmesg) or choose another --workdir'
  return 'choose another --workdir'


def within(fn: Callable[[], Any], timeout_s: float, default: Any = None) -> Any:
  """fn() in a thread of its own, or `default` if it has not returned within timeout_s (a call into a
  filesystem that does not answer blocks in the kernel; the thread is left to it)."""
  box = []
  thread = threading.Thread(target=lambda: box.append(fn()), name='shardzoo-storage', daemon=True)
  thread.start()
  thread.join(timeout_s)
  return box[0] if box else default


def probe(directory: str, timeout_s: float = 2.0) -> tuple[str, int | None]:
  """Whether a small file can be written in `directory` now: ('', None) if it can, else (what stops it, its errno or
  None), within timeout_s even where the filesystem does not answer."""

  def attempt() -> tuple[str, int | None]:
    try:
      with tempfile.NamedTemporaryFile(dir=directory, prefix='.shardzoo-write-test-') as f:
        f.write(b'0')
        f.flush()
      return '', None
    except OSError as e:
      return f'{directory} is not writable: {describe_os_error(e.errno, e.strerror, None)}', e.errno

  late = f'a write to {directory} did not return within {timeout_s:g} s (the filesystem does not answer)', None
  return within(attempt, timeout_s, late)


def where_orbax_waits() -> str | None:
  """The innermost orbax function each of orbax's threads is in now (sys._current_frames, documented for such
  diagnostics), e.g. 'wait_for_signals (orbax/checkpoint/_src/futures/future.py:264)'."""
  found = []
  for frame in sys._current_frames().values():  # noqa: SLF001
    for fs in reversed(traceback.extract_stack(frame)):
      if '/orbax/' in fs.filename:
        where = f'{fs.name} ({fs.filename[fs.filename.index("orbax/") :]}:{fs.lineno})'
        if where not in found:
          found.append(where)
        break
  return ', '.join(found[:3]) if found else None


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
        f'the last good checkpoint is {self._last_good()} ({advice(code, self._workdir)})'
      ) from e


class OrbaxTracebacks(logging.Filter):
  """A save that fails (a full disk, a read-only directory) fails in several of orbax's background threads and
  futures at once: each thread logs the error with its traceback, and each future whose failure nobody awaited (orbax
  stops at the first) is reported by its event loop as 'Future exception was never retrieved' when it is collected:
  hundreds of lines for the one StorageError the run stops with (clu's event writer logs one per failed write too).
  Both are kept here, in memory (the disk may be the one that is full): orbax's and clu's error records by a log
  filter, the futures' failures by the exception handler of every event loop (`caught`, storage faults only), and
  written to `path` when the StorageError is made, after the partial checkpoint is removed, and when the
  Checkpointer closes. Orbax's warnings still reach the terminal."""

  MAX_ENTRIES = 200

  def __init__(self, path: str):
    super().__init__()
    self.path, self.entries, self.dropped, self.written = path, [], 0, 0
    self.format = logging.Formatter('%(asctime)s %(threadName)s %(pathname)s:%(lineno)d %(levelname)s %(message)s')
    self.lock = threading.Lock()
    for logger in (logging.getLogger('absl'), logging.getLogger()):  # orbax logs through absl, or plain logging
      logger.addFilter(self)
    _sinks.append(self)

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or not ('/orbax/' in record.pathname or '/clu/asynclib' in record.pathname):
      return True
    self.keep(self.format.format(record))
    return False

  def keep(self, text: str) -> None:
    with self.lock:
      if len(self.entries) < self.MAX_ENTRIES:
        self.entries.append(text)
      else:
        self.dropped += 1

  def flush(self) -> tuple[str | None, str | None]:
    """Writes what was kept since the last flush to the log file, whole or not at all (written beside it, then
    renamed over it): (its path, None) once anything is in it; (None, the OS error) if it could not be written;
    (None, None) if nothing was logged."""
    with self.lock:
      entries, dropped = self.entries, self.dropped
      self.entries, self.dropped = [], 0
    if entries or dropped:
      text = ''.join(e.rstrip('\n') + '\n' for e in entries)
      text += f'... and {dropped} more such records, not kept\n' if dropped else ''
      aside = f'{self.path}.writing'
      try:
        before = ''
        if os.path.exists(self.path):
          with open(self.path) as f:
            before = f.read()
        with open(aside, 'w') as f:
          f.write(before + text)
          f.flush()
          os.fsync(f.fileno())
        os.replace(aside, self.path)
      except OSError as e:
        with contextlib.suppress(OSError):
          os.remove(aside)
        return None, describe_os_error(e.errno, e.strerror, None)
      self.written += len(entries) + dropped
    return (self.path if self.written else None), None

  def close(self, *, faulted: bool = False) -> None:
    """Writes what is left and stops filtering the logs. After a storage fault (`faulted`) it goes on: what orbax's
    threads and futures of the failed save report later (as they end, or are collected) goes to this log when
    the process exits (or nowhere, if it cannot be written then), never to the terminal."""
    self.flush()
    if faulted:
      atexit.register(self.flush)
      return
    for logger in (logging.getLogger('absl'), logging.getLogger()):
      logger.removeFilter(self)
    if self in _sinks:
      _sinks.remove(self)


_sinks: list[OrbaxTracebacks] = []  # the open error logs; the newest takes what event loops report


def _format_context(context: dict[str, Any]) -> str:
  e = context['exception']
  return f'{context.get("message", "")}\n' + ''.join(traceback.format_exception(type(e), e, e.__traceback__))


def caught(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
  """Every event loop's exception handler (_CaughtLoops): a failure of a future or task nobody awaited ('Future
  exception was never retrieved') that an OS error caused goes to the newest error log, where orbax's tracebacks go;
  anything else, or with no log open, to asyncio's own handler."""
  e = context.get('exception')
  if _sinks and e is not None and os_error_of(e) is not None:
    _sinks[-1].keep(_format_context(context))
    return
  loop.default_exception_handler(context)


class _CaughtLoops(asyncio.DefaultEventLoopPolicy):
  """Orbax runs its work on event loops it makes with asyncio.new_event_loop: each gets `caught` as its exception
  handler (asyncio's public hook for failures nobody retrieved), so those failures are caught where they are born."""

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    loop = super().new_event_loop()
    loop.set_exception_handler(caught)
    return loop


def catch_loop_failures() -> None:
  """Installs _CaughtLoops, unless another event loop policy than asyncio's default is in place."""
  if type(asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
    asyncio.set_event_loop_policy(_CaughtLoops())


def quiet_after_fault(directory: str) -> None:
  """After a save under `directory` failed: orbax's abandoned work on it reports nothing more on the terminal (its
  futures' callbacks into closed loops, coroutines it never started, collected as the process exits)."""
  abandoned_reads.met(directory)
  warnings.filterwarnings('ignore', message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


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
  ('Task/Future/_GatheringFuture exception was never retrieved'): hundreds of tracebacks after the one error or
  warning that already names the damaged checkpoint. A
  TensorStore completion into a closed loop is dropped instead of raising (`install`: its result could never be
  delivered), and once a checkpoint is found damaged (`met`) what still reaches the hooks from those reads is
  filtered. asyncio can log an abandoned task as orbax drops it, before its error reaches the checkpointer:
  while a checkpoint is read (`reading`) such a log is held until the read ends, then dropped if the checkpoint
  was found damaged, else passed on as it came."""

  def __init__(self):
    super().__init__()
    self.damaged: set[str] = set()
    self._reading: list[str] = []
    self._held: list[logging.LogRecord] = []
    self._previous_hook = None

  def met(self, directory: str) -> None:
    if not self.damaged:
      self._listen()
      self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    self.damaged.add(str(directory))

  @contextlib.contextmanager
  def reading(self, directory: str):
    """Around a read of a checkpoint under `directory`: asyncio's logs of its abandoned reads are held until it
    ends (see the class)."""
    self._listen()
    self._reading.append(str(directory))
    try:
      yield
    finally:
      self._reading.remove(str(directory))
      held, self._held = self._held, []
      for record in held:  # through the filter again: dropped where the damage is now known
        logging.getLogger('asyncio').handle(record)

  def _listen(self) -> None:
    asyncio_log = logging.getLogger('asyncio')
    if self not in asyncio_log.filters:
      asyncio_log.addFilter(self)

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

  def _about_damaged(self, e: BaseException | None, directories: Iterable[str] | None = None) -> bool:
    """An abandoned read's own failure (a coroutine collected unfinished), about a checkpoint found damaged (or
    under one of `directories`)."""
    return e is not None and any(
      d in f'{e} {e.__cause__}' for d in (self.damaged if directories is None else directories)
    )

  def filter(self, record: logging.LogRecord) -> bool:  # asyncio's logger
    e = record.exc_info[1] if record.exc_info else None
    # asyncio's message: '<Task, Future or a subclass> exception was never retrieved', then the future's lines
    if not str(record.msg).partition('\n')[0].endswith(' exception was never retrieved'):
      return True
    if self._about_damaged(e):
      return False
    if self._about_damaged(e, self._reading):
      self._held.append(record)
      return False
    return True


abandoned_reads = AbandonedReads()
abandoned_reads.install()
catch_loop_failures()
