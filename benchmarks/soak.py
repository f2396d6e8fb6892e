r"""Soak: train.py killed (SIGKILL, i.e. kill -9) and preempted (SIGTERM) at random seeded moments, many of
them in the middle of an asynchronous checkpoint save, and restarted each time: it must end bitwise equal to
one uninterrupted run (docs/checkpoints.md). tests/test_soak.py runs a short version.

  python benchmarks/soak.py --workdir /tmp/soak                            # default config, 2,000 steps
  python benchmarks/soak.py --workdir /tmp/soak --steps 300 --faults 8     # a shorter one

A fault is a signal and a moment: `save` faults wait for the k-th checkpoint save the run starts (orbax's
`<step>.orbax-checkpoint-tmp` directory appearing, k in 1..3), then a random delay of up to a typical save
(`--save_delay`); `loop` faults wait for the first save, then a random delay of up to `--loop_delay`, i.e.
anywhere in the train loop. After each fault the same command runs again, and must resume from the newest
complete checkpoint on disk (orbax renames `<step>.orbax-checkpoint-tmp` to `<step>` once everything is
written) with no warning (no damaged or half-written checkpoint picked up). When the faults are spent the
run trains to the end. Its final checkpoint (params, optimizer state, model state, step, and the data
iterator's position) must equal that of one uninterrupted run bit for bit. Every run shares one JAX
persistent compilation cache, so only the first compiles.

Durations, measured on the 2-core CPU machine while another engineer's jobs shared it: 435 s for
  python benchmarks/soak.py --steps 200 --checkpoint_every 4 --faults 30 --kill_fraction 1 --save_fraction 1 \
      --save_delay 0.1 --set model.num_layers=2 model.embed_dim=64 model.mlp_dim=128 model.max_len=16 \
      dataset.seq_len=16 dataset.num_train=512 dataset.num_eval=100 batch_size=16 optim.warmup_steps=1
(30 SIGKILLs, all inside a save; 31 runs of about 7-12 s each, the uninterrupted one included). The default,
`python benchmarks/soak.py --workdir /tmp/soak` (configs/default.py, 2,000 steps, checkpoints every 25 steps,
20 faults, seed 0), alone on the 2 cores: 16 min 40 s, i.e. 394 s for the uninterrupted run and 1,000 s for 21
faulted and restarted runs (10 SIGKILLs, 9 of them cutting a save short; 10 SIGTERMs); every restart resumed
from the newest complete checkpoint, and the final checkpoint (207 arrays and the data position) was bitwise
equal. A restart costs ~7-10 s here (imports, tracing, restoring; compilation comes from the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP = '.orbax-checkpoint-tmp'


@dataclasses.dataclass(frozen=True)
class Fault:
  signal: str  # 'SIGKILL' or 'SIGTERM'
  where: str  # 'save': during the `nth` save this run starts; 'loop': `delay` s after its first save starts
  delay: float  # seconds after the save started
  nth: int = 1


def plan(
  n: int,
  seed: int,
  *,
  kill_fraction: float = 0.75,
  save_fraction: float = 0.75,
  save_delay: float = 0.2,
  loop_delay: float = 5.0,
) -> list[Fault]:
  """`n` seeded faults: mostly SIGKILL, mostly during a save."""
  rng = random.Random(seed)
  faults = []
  for _ in range(n):
    sig = 'SIGKILL' if rng.random() < kill_fraction else 'SIGTERM'
    if rng.random() < save_fraction:
      faults.append(Fault(sig, 'save', round(rng.uniform(0, save_delay), 4), rng.randint(1, 3)))
    else:
      faults.append(Fault(sig, 'loop', round(rng.uniform(0, loop_delay), 3)))
  return faults


def command(config: str, workdir: str, overrides: dict[str, Any]) -> list[str]:
  return [
    sys.executable,
    'train.py',
    '--config',
    config,
    '--workdir',
    workdir,
    *(f'--config.{k}={v}' for k, v in overrides.items()),
  ]


def environment(cache_dir: str, base: dict[str, str] | None = None) -> dict[str, str]:
  """The child's environment: a JAX persistent compilation cache shared by every run (small programs too)."""
  return {
    **(os.environ if base is None else base),
    'JAX_COMPILATION_CACHE_DIR': cache_dir,
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
    'TF_CPP_MIN_LOG_LEVEL': '2',
  }


def complete_steps(ckpt_dir: str) -> list[int]:
  """The steps orbax lists (tmp directories of unfinished saves are not among them)."""
  import orbax.checkpoint as ocp

  return sorted(ocp.utils.checkpoint_steps(ckpt_dir)) if os.path.isdir(ckpt_dir) else []


def _saves(ckpt_dir: str) -> set[str]:
  """The `<step>.orbax-checkpoint-tmp` directories now: saves in flight (or cut short)."""
  try:
    return {name for name in os.listdir(ckpt_dir) if name.endswith(TMP)}
  except FileNotFoundError:
    return set()


@dataclasses.dataclass
class Run:
  fault: Fault | None
  returncode: int
  resumed_from: int | None  # the step it resumed from (None: started afresh)
  newest_before: int | None  # the newest complete checkpoint before it started
  delivered: bool = False  # the fault's signal was sent (False: the run finished first)
  in_flight: str | None = None  # the save in flight when the signal was sent
  interrupted_save: bool = False  # that save never finished: its tmp directory stayed behind
  sigterm_step: int | None = None
  seconds: float = 0.0
  warnings: list[str] = dataclasses.field(default_factory=list)


def run_once(
  cmd: list[str],
  env: dict[str, str],
  ckpt_dir: str,
  log: str,
  fault: Fault | None,
  timeout: float,
  launch: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> Run:
  """Runs train.py once (a process `launch` starts: subprocess.Popen's signature), delivering `fault` (if any) at its
  moment; checks nothing, reports what happened."""
  newest = (complete_steps(ckpt_dir) or [None])[-1]
  stale = _saves(ckpt_dir)  # left by earlier kills: a save of this run only once they have vanished (cleaned up)
  t0 = time.time()
  with open(log, 'w') as out, open(log + '.stderr', 'w') as err:
    proc = launch(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
    run = Run(fault, 0, None, newest)
    seen: set[str] = set()
    while fault is not None and proc.poll() is None and time.time() - t0 < timeout:
      now = _saves(ckpt_dir)
      stale &= now
      seen |= now - stale
      if len(seen) >= (fault.nth if fault.where == 'save' else 1):
        time.sleep(fault.delay)
        if proc.poll() is not None:
          break
        flying = sorted(_saves(ckpt_dir) - stale, key=lambda name: int(name[: -len(TMP)]))
        proc.send_signal(getattr(signal, fault.signal))
        run.delivered, run.in_flight = True, (flying[-1] if flying else None)
        break
      time.sleep(0.002)
    try:
      run.returncode = proc.wait(timeout=max(timeout - (time.time() - t0), 1))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      raise AssertionError(f'{" ".join(cmd)} ran past {timeout:.0f} s; its log: {log}') from None
  run.seconds = time.time() - t0
  text = open(log).read()
  found = [
    re.search(pattern, text, re.M) for pattern in (r'^resumed from \S+/(\d+)$', r'^SIGTERM: stopped at step (\d+)')
  ]
  run.resumed_from, run.sigterm_step = (int(m.group(1)) if m else None for m in found)
  run.warnings = re.findall(r'^WARNING checkpoint.*$', text, re.M)
  if run.in_flight:
    step = run.in_flight[: -len(TMP)]
    run.interrupted_save = step not in map(str, complete_steps(ckpt_dir))
  return run


def check_resumed(run: Run, ckpt_dir: str, log: str) -> None:
  """The run resumed from the newest complete checkpoint, picking up nothing damaged or half-written."""
  if run.resumed_from != run.newest_before:
    raise AssertionError(
      f'resumed from step {run.resumed_from}, but the newest complete checkpoint in {ckpt_dir} '
      f'was {run.newest_before} (log: {log})'
    )
  if run.warnings or any(d.endswith('.damaged') or '.damaged' in d for d in os.listdir(ckpt_dir)):
    raise AssertionError(f'a damaged checkpoint was met: {run.warnings} (log: {log})')
  expected = {'SIGKILL': (-signal.SIGKILL, 0), 'SIGTERM': (0, -signal.SIGTERM)}.get(
    run.fault and run.fault.signal, (0,)
  )
  if run.returncode not in expected:  # SIGTERM kills outright after train.py restored its handler, at the very end
    raise AssertionError(f'exit status {run.returncode} (log: {log})')


def read_checkpoint(step_dir: str) -> tuple[dict, dict[str, str]]:
  """(train state as numpy arrays, data iterator state per process file) of one checkpoint step."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from etils import epath

  path, handler = epath.Path(step_dir) / 'state', ocp.PyTreeCheckpointHandler()
  md = handler.metadata(path)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md.tree if hasattr(md, 'tree') else md)
  state = handler.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
  data_dir = os.path.join(step_dir, 'data')
  data = {f: open(os.path.join(data_dir, f)).read() for f in sorted(os.listdir(data_dir)) if f.endswith('.json')}
  return state, data


def assert_bitwise_equal(expected_dir: str, got_dir: str) -> int:
  """Every array of the two checkpoints has the same dtype, shape and bytes, and the data positions are the
  same. Returns the number of arrays compared."""
  import jax

  (want, want_data), (got, got_data) = read_checkpoint(expected_dir), read_checkpoint(got_dir)
  want_leaves, got_leaves = jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)
  if [p for p, _ in want_leaves] != [p for p, _ in got_leaves]:
    raise AssertionError(f'{got_dir} and {expected_dir} hold different trees')
  for (path, a), (_, b) in zip(want_leaves, got_leaves):
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
      diff = int((a != b).sum()) if a.shape == b.shape else 'shape'
      raise AssertionError(
        f'{jax.tree_util.keystr(path)} differs between {got_dir} and {expected_dir} ({diff} of {a.size} elements)'
      )
  if want_data != got_data:
    raise AssertionError(f'the data iterator positions differ: {got_data} vs {expected_dir}: {want_data}')
  return len(want_leaves)


def soak(
  config: str,
  overrides: dict[str, Any],
  workdir: str,
  faults: list[Fault],
  *,
  env: dict[str, str],
  reference: str | None = None,
  timeout: float = 600.0,
  say=print,
  launch: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> dict[str, Any]:
  """Runs `config` with `overrides` under `faults` in `workdir`/run, restarting after each, then to the end;
  compares its final checkpoint with `reference` (a checkpoint step directory; by default one uninterrupted
  run in `workdir`/reference). `launch` starts each train.py process (subprocess.Popen's signature). Raises
  AssertionError at the first thing wrong; returns what happened."""
  total = int(overrides['total_steps'])
  run_dir, t0 = os.path.join(workdir, 'run'), time.time()
  ckpt_dir = os.path.join(run_dir, 'checkpoints')
  if reference is None:
    ref_dir = os.path.join(workdir, 'reference')
    os.makedirs(ref_dir, exist_ok=True)
    ref = run_once(
      command(config, ref_dir, overrides),
      env,
      os.path.join(ref_dir, 'checkpoints'),
      os.path.join(workdir, 'reference.log'),
      None,
      timeout,
      launch,
    )
    if ref.returncode != 0:
      raise AssertionError(f'the uninterrupted run failed (log: {workdir}/reference.log)')
    say(f'uninterrupted run: {ref.seconds:.1f} s')
    reference = os.path.join(ref_dir, 'checkpoints', str(total))
  runs: list[Run] = []
  for i, fault in enumerate([*faults, None]):
    log = os.path.join(workdir, f'run{i}.log')
    run = run_once(command(config, run_dir, overrides), env, ckpt_dir, log, fault, timeout, launch)
    check_resumed(run, ckpt_dir, log)
    runs.append(run)
    what = (
      'to the end'
      if fault is None
      else (
        f'{fault.signal} {"during save " + repr(fault.nth) if fault.where == "save" else "in the loop"} '
        f'+{fault.delay:.3f}s: '
        + (
          'not delivered (the run finished first)'
          if not run.delivered
          else f'interrupted {run.in_flight}'
          if run.interrupted_save
          else f'{run.in_flight or "no save"} in flight finished'
          if run.in_flight
          else 'no save in flight'
        )
      )
    )
    say(
      f'run {i}: resumed from {run.resumed_from}, {what}'
      + (f', stopped at step {run.sigterm_step}' if run.sigterm_step else '')
      + f' ({run.seconds:.1f} s)'
    )
    if (fault is None or not run.delivered) and run.returncode == 0 and total in complete_steps(ckpt_dir):
      break
  else:
    raise AssertionError(f'the last run did not reach step {total} (log: {log})')
  arrays = assert_bitwise_equal(reference, os.path.join(ckpt_dir, str(total)))
  delivered = [r for r in runs if r.delivered]
  report = {
    'steps': total,
    'runs': len(runs),
    'seconds': round(time.time() - t0, 1),
    'arrays_equal': arrays,
    'sigkill': sum(r.fault.signal == 'SIGKILL' for r in delivered),
    'sigterm': sum(r.fault.signal == 'SIGTERM' for r in delivered),
    'interrupted_saves': sum(r.interrupted_save for r in delivered),
    'not_delivered': sum(r.fault is not None and not r.delivered for r in runs),
    'resumed': [r.resumed_from for r in runs],
  }
  say(f'bitwise equal to the uninterrupted run ({arrays} arrays and the data position): {json.dumps(report)}')
  return report


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default=None, help='kept afterwards (default: a temporary directory, removed)')
  p.add_argument('--config', default='configs/default.py')
  p.add_argument('--steps', type=int, default=2000)
  p.add_argument('--checkpoint_every', type=int, default=25)
  p.add_argument('--faults', type=int, default=20)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--kill_fraction', type=float, default=0.75, help='share of SIGKILL among the faults (else SIGTERM)')
  p.add_argument('--save_fraction', type=float, default=0.75, help='share of faults during a save (else in the loop)')
  p.add_argument('--save_delay', type=float, default=0.2, help='longest delay into a save, seconds')
  p.add_argument('--loop_delay', type=float, default=20.0, help='longest delay into the loop, seconds')
  p.add_argument('--set', nargs='*', default=[], help='more config overrides, key=value')
  a = p.parse_args()
  overrides = {
    'total_steps': a.steps,
    'checkpoint_every': a.checkpoint_every,
    'log_every': a.checkpoint_every,
    'eval_every': a.steps,
    'sample_len': 0,
    **dict(kv.split('=', 1) for kv in a.set),
  }
  faults = plan(
    a.faults,
    a.seed,
    kill_fraction=a.kill_fraction,
    save_fraction=a.save_fraction,
    save_delay=a.save_delay,
    loop_delay=a.loop_delay,
  )
  with tempfile.TemporaryDirectory(prefix='shardzoo_soak_') as tmp:
    workdir = a.workdir or tmp
    os.makedirs(workdir, exist_ok=True)
    print(f'soak: {a.config} {overrides}, {len(faults)} faults (seed {a.seed}) in {workdir}', flush=True)
    soak(
      a.config,
      overrides,
      workdir,
      faults,
      env=environment(os.path.join(workdir, 'jax_cache')),
      say=lambda m: print(m, flush=True),
    )


if __name__ == '__main__':
  main()
