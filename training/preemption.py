"""Preemption: SIGTERM (what schedulers send before taking machines back) asks the loop to save and stop."""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils


def _jax_preemption_service() -> bool:
  """Whether jax.distributed started JAX's preemption sync manager (jax_enable_preemption_service, the default)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  return getattr(distributed.global_state, 'preemption_sync_manager', None) is not None


class Preemption:
  """SIGTERM asks the train loop, which calls `requested(step)` every step, to save and stop.

  One process: SIGTERM sets a flag. Several: they must stop at the same step. Where jax.distributed runs JAX's
  preemption service (the default), it takes the SIGTERM (sent to any of the processes), tells the others
  through the coordination service, and agrees on the next step after every process's current one
  (multihost_utils.reached_preemption_sync_point): the run stops a step or two after the signal, with no
  collective in the loop. Without the service, the flags are combined every `sync_every` steps (one tiny
  all-gather).
  """

  def __init__(self, sync_every: int = 10):
    self._flag = threading.Event()
    self._previous = None
    self.sync_every = sync_every
    self.service = jax.process_count() > 1 and _jax_preemption_service()
    if not self.service and threading.current_thread() is threading.main_thread():  # else JAX's handler has it
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())

  def requested(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self._flag.is_set()
    if self.service:
      return multihost_utils.reached_preemption_sync_point(step)
    if step % self.sync_every:
      return False
    flags = multihost_utils.process_allgather(np.array([self._flag.is_set()], np.int32))
    return bool(np.asarray(flags).any())

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
