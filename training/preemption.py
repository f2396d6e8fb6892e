"""Preemption: SIGTERM (what schedulers send before taking machines back) asks the loop to save and stop."""
from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils


class Preemption:
  """SIGTERM sets a flag; the train loop asks `requested(step)` and saves before exiting.

  With several processes they must stop at the same step: the flags are combined across processes
  every `sync_every` steps (one tiny all-gather), so all processes stop together.
  """

  def __init__(self, sync_every: int = 10):
    self._flag = threading.Event()
    self._previous = None
    self.sync_every = sync_every
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())

  def requested(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self._flag.is_set()
    if step % self.sync_every:
      return False
    flags = multihost_utils.process_allgather(np.array([self._flag.is_set()], np.int32))
    return bool(np.asarray(flags).any())

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
