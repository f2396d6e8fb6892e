"""Several processes (hosts): starting jax.distributed where users launch, and never hanging on a dead peer.

Launch. `python train.py ...` started by a scheduler initialises `jax.distributed` by itself, through JAX's own
cluster detection: SLURM (`srun`: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID), Open MPI
(`mpirun`), Kubernetes (an indexed Job or JobSet; needs `pip install "jax[k8s]"` and a service account that may
read pods, see launch/), and Cloud TPU pod slices (GCE, GKE). The coordinator is the first host of the job; the
process count and id come from the scheduler. `--coordinator_address/--num_processes/--process_id` override it
by hand, `--cluster=none` turns detection off, `--cluster=slurm` (a JAX detection method's name) insists on one.

Failure. When a process dies (kill -9, a lost host, an exception), every other process is most likely blocked in
a collective that will never complete. JAX's coordination service notices a silent peer after its heartbeat
timeout (100 s by default) and then aborts the process with a C++ stack trace. PeerWatch is faster and says
what happened: each process bumps a counter in the coordination service's key-value store every
`timeout / 5` seconds and reads everyone's; a process that exits with an error first marks itself failed. A
peer marked failed, or whose counter has not moved for `timeout` seconds, or a coordinator that cannot be
reached for that long, makes this process print one line naming it and exit with status PEER_LOST_EXIT. An
error that is not one of ours (a collective that fails outright, e.g. gloo's "Connection reset by peer" on
CPUs) waits for that verdict before it is reported as this process's own. The bound: a
surviving process exits within `timeout` + `timeout / 5` seconds of a silent death, and within `timeout / 5`
seconds of a peer's error. When process 0 dies, the coordination service dies with it, and JAX's client aborts
the others at once with its own message ("the leader task was preempted/died").

A process that fails skips JAX's exit-time shutdown barrier, which would otherwise wait for the dead peer
(up to 5 minutes).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
from jax.experimental import multihost_utils

from errors import ConfigError, NonFiniteError, StorageError

_OWN_ERRORS = (ConfigError, StorageError, NonFiniteError, KeyboardInterrupt, SystemExit)  # not about peers
PEER_LOST_EXIT = 75  # EX_TEMPFAIL: the run can be resumed from its last checkpoint
_KEY = 'shardzoo/peers/'
_DONE, _FAILED = 'done', 'failed'


def scheduler() -> Any | None:
  """The cluster environment JAX detects (its ClusterEnv class: SLURM, Open MPI, Kubernetes, Cloud TPU), or None.
  jax.distributed.initialize() with no arguments uses the same detection; asking first tells how many processes
  to expect before JAX starts (simulated CPU devices are sized per process)."""
  from jax._src import clusters  # pylint: disable=g-import-not-at-top  # JAX's detection, registered on import

  return next(
    (
      env
      for env in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
      if not env.opt_in_only_method and env.is_env_present()
    ),
    None,
  )


def _method(cluster: str) -> Any:
  from jax._src import clusters  # pylint: disable=g-import-not-at-top

  known = {env.name: env for env in clusters.ClusterEnv._cluster_types if env.name}  # pylint: disable=protected-access
  if cluster not in known:
    raise ConfigError(
      f'--cluster={cluster!r} is not a cluster JAX detects; choose auto, none or one of {sorted(known)}'
    )
  if not known[cluster].is_env_present():
    raise ConfigError(
      f'--cluster={cluster}: this process does not run in a {cluster} environment (its variables are missing)'
    )
  return known[cluster]


class Launch:
  """How this run's processes are started: built before JAX starts (num_processes sizes simulated devices),
  `start()` to join the others."""

  def __init__(self, coordinator_address: str | None, num_processes: int, process_id: int, cluster: str = 'auto'):
    self.manual = coordinator_address is not None or num_processes > 1
    if num_processes < 1:
      raise ConfigError(f'--num_processes={num_processes} must be >= 1')
    if self.manual and num_processes < 2:
      raise ConfigError(f'--coordinator_address={coordinator_address} needs --num_processes >= 2 (got {num_processes})')
    if self.manual and coordinator_address is None:
      raise ConfigError(
        f"--num_processes={num_processes} needs --coordinator_address=host:port (process 0's address; "
        'and --process_id on each process); under a scheduler (SLURM, Open MPI, Kubernetes, Cloud TPU) '
        'leave out both: the scheduler gives them'
      )
    if not 0 <= process_id < num_processes:
      raise ConfigError(
        f'--process_id={process_id} is not in 0..{num_processes - 1} (--num_processes={num_processes})'
        + ('' if self.manual else '; to start processes by hand give --num_processes and --coordinator_address too')
      )
    if self.manual and cluster not in ('auto', 'none'):
      raise ConfigError(
        f'--cluster={cluster} and --coordinator_address/--num_processes both say how processes start; '
        f'give one: --cluster={cluster} alone (the scheduler gives the rest), or the manual flags'
      )
    self.coordinator_address, self.process_id, self.cluster = coordinator_address, process_id, cluster
    self.env = None
    if self.manual or cluster == 'none':
      self.num_processes = num_processes
    else:
      self.env = scheduler() if cluster == 'auto' else _method(cluster)
      try:
        self.num_processes = self.env.get_process_count() if self.env is not None else 1
      except Exception as e:  # e.g. a Kubernetes pod that is not part of a Job
        raise ConfigError(
          f'jax.distributed detected a {self.env.name} environment but could not read its process '
          f'count ({type(e).__name__}: {str(e).splitlines()[0][:200]}); run with --cluster=none for '
          'one process, or give --coordinator_address/--num_processes/--process_id'
        ) from e

  @property
  def how(self) -> str:
    if self.num_processes == 1:
      return 'one process'
    if self.manual:
      return f'{self.num_processes} processes (--coordinator_address {self.coordinator_address})'
    return f'{self.num_processes} processes ({self.env.name} environment, detected by jax.distributed)'

  def start(self, heartbeat_timeout_s: int) -> None:
    """jax.distributed.initialize for several processes (no-op for one). JAX's own heartbeat timeout is set above
    PeerWatch's, so PeerWatch reports a dead peer first."""
    if self.num_processes == 1:
      return
    if self.manual:
      jax.distributed.initialize(
        self.coordinator_address, self.num_processes, self.process_id, heartbeat_timeout_seconds=heartbeat_timeout_s
      )
    else:
      jax.distributed.initialize(
        cluster_detection_method=self.env.name,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        local_device_ids=self._local_device_ids(),
      )

  def _local_device_ids(self) -> list[int] | None:
    """JAX's SLURM detection assumes one process per GPU (it shows process k of a node GPU k only). With one
    process per node (launch/slurm.sbatch), this process takes every GPU SLURM gave the node."""
    env = os.environ
    if self.env.name != 'slurm' or env.get('SLURM_NTASKS') != env.get('SLURM_STEP_NUM_NODES', env.get('SLURM_NNODES')):
      return None
    gpus = env.get('CUDA_VISIBLE_DEVICES') or env.get('SLURM_STEP_GPUS') or env.get('SLURM_JOB_GPUS')
    count = len(gpus.split(',')) if gpus else int(env.get('SLURM_GPUS_ON_NODE', 0) or 0)
    return list(range(count)) or None


def _client() -> Any:
  from jax._src import distributed  # pylint: disable=g-import-not-at-top  # the coordination service's client

  return distributed.global_state.client


_gathered = 0  # calls of gather_strings so far: every process makes the same calls in the same order


def gather_strings(topic: str, value: str, timeout_s: float = 3600) -> list[str]:
  """Every process's `value` (one per process, by process index), through the coordination service's key-value
  store: a string each process reports without a collective on the devices, so a process that failed to read
  something can still take part (and say what failed). Returns once every process has reported; a peer that died
  meanwhile is PeerWatch's to report. One process: [value]."""
  global _gathered
  if jax.process_count() == 1:
    return [value]
  _gathered += 1
  key = f'shardzoo/gather/{_gathered}/{topic}/'
  client = _client()
  client.key_value_set(f'{key}{jax.process_index()}', value)
  return [client.blocking_key_value_get(f'{key}{i}', int(timeout_s * 1000)) for i in range(jax.process_count())]


def _exit_now() -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access


def _stop(message: str) -> None:
  sys.stdout.flush()
  print(f'shardzoo: {message}', file=sys.stderr, flush=True)
  os._exit(PEER_LOST_EXIT)  # pylint: disable=protected-access  # other threads may be stuck in a collective


class PeerWatch:
  """Watches the other processes of a multi-process run from a daemon thread (see the module docstring)."""

  def __init__(self, timeout_s: float):
    self.timeout_s, self.interval_s = timeout_s, max(timeout_s / 5, 0.2)
    self.me, self.n = jax.process_index(), jax.process_count()
    self._client = _client()
    self._beats = 0
    self._stopped = threading.Event()
    self._seen: dict[int, tuple[str, float]] = {}  # process -> (its last value, when it changed here)
    self._unreachable_since: float | None = None
    self._beat()
    self._thread = threading.Thread(target=self._run, name='shardzoo-peer-watch', daemon=True)
    self._thread.start()

  def _beat(self, value: str | None = None) -> None:
    self._beats += 1
    self._client.key_value_set(f'{_KEY}{self.me}', value or str(self._beats), allow_overwrite=True)

  def _run(self) -> None:
    while not self._stopped.wait(self.interval_s):
      try:
        self._beat()
        found = dict(self._client.key_value_dir_get(_KEY))
        self._unreachable_since = None
      except Exception as e:  # the coordination service (process 0) cannot be reached
        now = time.monotonic()
        self._unreachable_since = self._unreachable_since or now
        if now - self._unreachable_since >= self.timeout_s:
          _stop(
            f'process {self.me} of {self.n}: lost the coordinator (process 0) for {self.timeout_s:g} s '
            f'({type(e).__name__}: {str(e).splitlines()[0][:200]}); stopping. Resume from the last checkpoint.'
          )
        continue
      self._check({int(k.rsplit('/', 1)[-1]): v for k, v in found.items()})

  def _check(self, values: dict[int, str]) -> None:
    now = time.monotonic()
    for peer in range(self.n):
      if peer == self.me:
        continue
      value = values.get(peer, '')
      if value.startswith(_FAILED):
        _stop(
          f'process {peer} of {self.n} failed ({value[len(_FAILED) + 1 :]}); process {self.me} stops too. '
          f"See process {peer}'s log; resume from the last checkpoint."
        )
      if value == _DONE:
        continue
      last, since = self._seen.get(peer, (None, now))
      if value != last:
        self._seen[peer] = (value, now)
      elif now - since >= self.timeout_s:
        _stop(
          f'process {peer} of {self.n} stopped responding (no heartbeat for {now - since:.0f} s: killed, out of '
          f'memory or its host lost); process {self.me} stops too instead of waiting in a collective. Resume '
          'from the last checkpoint (rerun the same command).'
        )

  def await_verdict(self) -> None:
    """Gives PeerWatch the time to find a dead peer (it then ends this process); returns if it finds none."""
    self._stopped.wait(self.timeout_s + 2 * self.interval_s)

  def close(self, failed: str | None = None) -> None:
    """Stops watching; tells the others this process is done, or failed (they then stop at once)."""
    self._stopped.set()
    self._thread.join()
    with contextlib.suppress(Exception):
      self._beat(f'{_FAILED}:{failed[:300]}' if failed else _DONE)


@contextlib.contextmanager
def watched(launch: Launch, peer_timeout_s: float) -> Iterator[None]:
  """With several processes: PeerWatch while the body runs; at a normal end, the processes leave together (the
  coordinator must not shut down under a client) and jax.distributed shuts down; an error marks this process
  failed for the others before it propagates."""
  if launch.num_processes == 1:
    yield
    return
  watch = PeerWatch(peer_timeout_s)
  try:
    yield
  except BaseException as e:
    if not isinstance(e, _OWN_ERRORS):  # e.g. gloo's "Connection reset by peer": a peer may have died; if so,
      watch.await_verdict()  # PeerWatch stops this process naming it, within its bound
    watch.close(failed=f'{type(e).__name__}: {e}'.splitlines()[0])
    atexit.register(_exit_now)  # runs before JAX's own exit handler, whose shutdown barrier would wait for the dead
    raise
  multihost_utils.sync_global_devices('shardzoo:end')
  watch.close()
  jax.distributed.shutdown()
