"""No save waits forever. Orbax gives its own waits a fixed timeout (20 minutes), and some are never released: a
directory that turns read-only while orbax creates it leaves the threads that wait for the directory waiting, and a
filesystem that stops answering blocks its writer threads in the kernel. The Checkpointer therefore waits for a save
(orbax's save() call, run in a thread of its own, and its background writes) only through `wait_for`, which gives up
at the save's deadline (from its size and the slowest write rate measured in this run, or config.checkpoint_timeout),
or sooner once the run is stopping (SIGTERM) and the save has stopped writing: Blocked, which the Checkpointer turns
into its one line. The threads left blocked would keep the process from exiting: the StorageError says so
(`blocked`), and errors.one_line ends the process at once after printing it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

MIN_SAVE_S = 120.0  # the least a derived deadline allows: the first save also compiles its checksums
MARGIN = 4.0  # a derived deadline: this many times the time the slowest rate measured would take, beyond MIN_SAVE_S
ASSUMED_RATE = 20 * 2**20  # bytes/s before a save of this run has been measured
STALL_S = 10.0  # once the run stops (SIGTERM), a save writing nothing this long is blocked (schedulers kill at ~30 s)


class Blocked(Exception):
  """A save that did not finish in time, or wrote nothing for STALL_S after SIGTERM; the message says which."""


@dataclasses.dataclass
class Save:
  """A save under way: its step, size, deadline and what the deadline comes from."""

  step: int
  nbytes: int
  limit_s: float
  why: str
  t0: float = dataclasses.field(default_factory=time.monotonic)

  def elapsed(self) -> float:
    return time.monotonic() - self.t0

  def overdue(self) -> str | None:
    """Why the save is blocked, once its deadline has passed."""
    if self.elapsed() > self.limit_s:
      return f'did not finish within {self.limit_s:.0f} s ({self.why})'
    return None


class Deadlines:
  """Each save's deadline: config.checkpoint_timeout when set (> 0), else MIN_SAVE_S plus MARGIN times what the
  slowest save of this run so far (bytes over seconds from its start to its completion) would take for its size."""

  def __init__(self, timeout_s: float = 0.0):
    self.timeout_s, self.rate = timeout_s, None

  def start(self, step: int, nbytes: int) -> Save:
    if self.timeout_s > 0:
      return Save(step, nbytes, self.timeout_s, f'config.checkpoint_timeout={self.timeout_s:g}')
    rate = self.rate or ASSUMED_RATE
    limit = MIN_SAVE_S + MARGIN * nbytes / rate
    measured = 'the slowest rate measured' if self.rate else 'an assumed rate of'
    return Save(
      step,
      nbytes,
      limit,
      f'{nbytes / 2**20:.1f} MiB at {measured} {rate / 2**20:.1f} MiB/s, {MARGIN:g} times over, plus '
      f'{MIN_SAVE_S:g} s; config.checkpoint_timeout sets one',
    )

  def finished(self, save: Save) -> None:
    rate = save.nbytes / max(save.elapsed(), 1e-3)
    self.rate = rate if self.rate is None else min(self.rate, rate)


@contextlib.contextmanager
def sigterm_noted() -> Iterator[threading.Event]:
  """An event set when SIGTERM comes (in the main thread; elsewhere none comes): the handler in place (a train loop's
  preemption flag) still runs, and a SIGTERM that would have ended the process (no handler) is sent again once the
  wait is over without a Blocked."""
  noted = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield noted
    return
  previous = signal.getsignal(signal.SIGTERM)

  def handler(signum: int, frame: Any) -> None:
    noted.set()
    if callable(previous):
      previous(signum, frame)

  signal.signal(signal.SIGTERM, handler)
  blocked = False
  try:
    yield noted
  except Blocked:
    blocked = True
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
    if noted.is_set() and previous == signal.SIG_DFL and not blocked:
      os.kill(os.getpid(), signal.SIGTERM)


def wait_for(
  busy: Callable[[], bool], save: Save, written: Callable[[], int | None], stopping: bool = False, poll_s: float = 0.02
) -> None:
  """Returns once busy() is False. Blocked at the save's deadline, or, once the run is stopping (`stopping`: a
  SIGTERM the train loop took, or one that comes during the wait), when written() (the bytes the save has on disk;
  None when they cannot be counted in time) stays the same for STALL_S."""
  with sigterm_noted() as sigterm:
    last, since = None, None
    while busy():
      if late := save.overdue():
        raise Blocked(late)
      if stopping or sigterm.is_set():
        count = written()
        if since is None or count != last:
          last, since = count, time.monotonic()
        elif time.monotonic() - since >= STALL_S:
          raise Blocked(
            f'wrote nothing for {STALL_S:g} s once the run was stopping (SIGTERM), {save.elapsed():.0f} s in'
          )
        time.sleep(0.25)
      else:
        time.sleep(poll_s)


def in_thread(fn: Callable[[], Any], save: Save, written: Callable[[], int | None], stopping: bool = False) -> Any:
  """fn() (orbax's save(), which can block), run in a daemon thread and waited for by wait_for: its result, or the
  exception it raised."""
  box: dict[str, Any] = {}

  def run() -> None:
    try:
      box['result'] = fn()
    except BaseException as e:  # pylint: disable=broad-except  # re-raised in the caller's thread
      box['error'] = e

  thread = threading.Thread(target=run, name='shardzoo-save', daemon=True)
  thread.start()
  wait_for(thread.is_alive, save, written, stopping)
  if 'error' in box:
    raise box['error']
  return box['result']
