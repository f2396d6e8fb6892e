r"""Storage faults during a save, tried again and again: train.py (the tiny 12-step run of tests/conftest.py's
TINY_RUN, checkpoints at steps 1, 4, 8 and 12) meets a fault while it saves step 8, `--tries` times per fault with a
seeded random moment each, and must end within seconds in the one storage-error line (docs/checkpoint_faults.md).

  sudo python benchmarks/storage_faults.py --tries 20                   # every fault, 20 tries each
  python benchmarks/storage_faults.py --faults blocked deadline --tries 3

Faults (readonly, full and delete are real, and need root: mount):
  readonly  the checkpoint directory (a bind mount) remounted read-only 0-0.3 s after step 8's save starts
  full      the run's 64 MiB tmpfs filled by a ballast file 0-0.3 s after step 8's save starts
  delete    step 1's directory remounted read-only before step 8's save, which deletes it (keep_checkpoints=2)
  blocked   step 8's array writes never complete (injected), and SIGTERM comes 1 s after the save starts
  deadline  the same without SIGTERM, under config.checkpoint_timeout=3

A try reports: the exit status; the seconds from the fault to the exit (a hang: no exit within --hang_s of the
fault); the lines printed in all and after the last progress line (1 expected: the storage error); whether a
traceback or asyncio's 'never retrieved' reached the terminal; what the line says is on disk, checked against the
directory; whether the error log the line names is whole (no part of it left beside it, no traceback cut short).
The first try of each fault (all with --rerun) then removes the fault and runs the same command again, which must
resume from the last good checkpoint the line names and finish. No JAX compilation cache is shared (one can
deadlock programs of several CPU devices, which would pass for a hang): each run compiles its own, a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import soak  # noqa: E402

TINY = {
  'model.num_layers': 2,
  'model.embed_dim': 64,
  'model.mlp_dim': 128,
  'model.max_len': 16,
  'dataset.seq_len': 16,
  'dataset.num_train': 512,
  'dataset.num_eval': 100,
  'batch_size': 16,
  'optim.warmup_steps': 1,
  'sample_len': 0,
  'total_steps': 12,
  'checkpoint_every': 4,
  'log_every': 4,
  'eval_every': 12,
  'checkpoint_space': 'warn',
}
ENV = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'}
FAULTS = ('readonly', 'full', 'delete', 'blocked', 'deadline')
REAL = ('readonly', 'full', 'delete')


def _mount(*args: str) -> None:
  subprocess.run(['mount', *args], check=True, capture_output=True)


def _remount_ro(path: str, within_s: float = 2.0) -> None:
  """A bind mount remounted read-only; retried while files are open for writing on it (EBUSY)."""
  deadline = time.monotonic() + within_s
  while True:
    r = subprocess.run(['mount', '-o', 'remount,bind,ro', path], capture_output=True, text=True)
    if r.returncode == 0 or time.monotonic() > deadline:
      return
    time.sleep(0.002)


def child(fault: str, delay: float, mount: str, stamp: str) -> None:
  """train.py's main with the fault armed for step 8's save; the fault's time goes to `stamp`."""
  import orbax.checkpoint as ocp

  save = ocp.CheckpointManager.save
  ckpts = os.path.join(mount, 'run', 'checkpoints')

  def fire() -> None:
    if fault == 'readonly':
      _remount_ro(ckpts)
    elif fault == 'full':
      with open(os.path.join(mount, 'ballast'), 'wb') as f, contextlib.suppress(OSError):
        while True:
          f.write(b'\0' * 2**20)
          f.flush()
    with open(stamp, 'w') as f:
      f.write(str(time.time()))

  armed = []
  from checkpointing import deadlines

  deadlines.STALL_S = 2.0  # a try in seconds (the default gives a blocked save 10 s of silence after SIGTERM)
  if fault in ('blocked', 'deadline'):  # a write that never returns, through orbax's public ArrayHandler
    import concurrent.futures

    serialize = ocp.type_handlers.ArrayHandler.serialize

    async def never_committed(self, values, infos, args=None):
      futures = await serialize(self, values, infos, args)
      return [*futures, concurrent.futures.Future()] if armed else futures

    ocp.type_handlers.ArrayHandler.serialize = never_committed

  def hooked(self, step, *args, **kwargs):
    if step == 8:
      if fault == 'delete':
        one = os.path.join(ckpts, '1')
        _mount('--bind', one, one)
        _remount_ro(one)
        fire()
      elif fault in ('blocked', 'deadline'):
        armed.append(step)
        fire()
      else:
        threading.Timer(delay, fire).start()
    return save(self, step, *args, **kwargs)

  ocp.CheckpointManager.save = hooked
  sys.argv = ['train.py', *sys.argv[sys.argv.index('--') + 1 :]]
  os.chdir(ROOT)
  from absl import app

  import train
  from configs import cli

  app.run(train.main, flags_parser=cli.parse_flags)


def _tail(output: str) -> list[str]:
  """The lines after the last progress line (step / eval)."""
  lines = output.splitlines()
  last = max((i for i, line in enumerate(lines) if re.match(r'(step|eval @) +\d+ \|', line)), default=-1)
  return [line for line in lines[last + 1 :] if line.strip()]


def _check_disk(line: str, ckpts: str) -> str:
  """'' when what the line says is on disk holds, else what differs."""
  steps = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
  partials = [d for d in os.listdir(ckpts) if '.orbax-checkpoint-tmp' in d]
  wrong = []
  if m := re.search(r'the last good checkpoint is (\S+)/(\d+) ', line):
    if not steps or int(m.group(2)) != steps[-1]:
      wrong.append(f'last good {m.group(2)} but steps {steps}')
  if ('partial checkpoint was removed' in line or 'nothing of it was written' in line) and partials:
    wrong.append(f'partials left: {partials}')
  if m := re.search(r'the partial checkpoint (\S+) is left on disk', line):
    if os.path.basename(m.group(1)) not in partials:
      wrong.append(f'{m.group(1)} is not there')
  if m := re.search(r'old checkpoint (\S+) could not be deleted.*; (it is still on disk|it is gone)', line):
    if os.path.exists(m.group(1)) != (m.group(2) == 'it is still on disk'):
      wrong.append(f'{m.group(1)} exists: {os.path.exists(m.group(1))}')
  return '; '.join(wrong)


def _check_log(line: str) -> str:
  """'' when the error log is as the line says: whole (no file left beside it, the last traceback ended) where it
  names the log; not there, nor a part of it, where it says the log could not be written."""
  if m := re.search(r"orbax's tracebacks are in (\S+)$", line):
    path = m.group(1)
    if not os.path.isfile(path) or os.path.exists(path + '.writing'):
      return f'{path} missing, or a part of it left beside it'
    text = open(path, errors='replace').read()
    last = text.rstrip('\n').splitlines()[-1] if text.strip() else ''
    if not text.endswith('\n') or last.startswith(' '):  # a traceback ends on its exception, not inside a frame
      return f'{path} ends mid-traceback: {last[:80]!r}'
  elif m := re.search(r"orbax's tracebacks could not be written to (\S+):", line):
    if os.path.exists(m.group(1) + '.writing'):
      return f'a part of {m.group(1)} is left beside it'
  return ''


def try_once(fault: str, seed: int, args: argparse.Namespace, rerun: bool) -> dict:
  rng = random.Random(seed)
  delay = round(rng.uniform(0, 0.3), 3)
  base = tempfile.mkdtemp(prefix=f'faults-{fault}-')
  mount = os.path.join(base, 'm')
  os.makedirs(mount)
  stamp = os.path.join(base, 'stamp')
  mounts = []
  try:
    if fault in REAL:
      _mount('-t', 'tmpfs', '-o', 'size=64m', 'tmpfs', mount)
      mounts.append(mount)
    ckpts = os.path.join(mount, 'run', 'checkpoints')
    os.makedirs(ckpts)
    if fault == 'readonly':
      _mount('--bind', ckpts, ckpts)
      mounts.append(ckpts)
    overrides = dict(TINY, checkpoint_timeout=3 if fault == 'deadline' else 0)
    train_args = soak.command('configs/default.py', os.path.join(mount, 'run'), overrides)[2:]
    cmd = [sys.executable, os.path.abspath(__file__), '--child', fault, '--delay', str(delay), '--mount', mount]
    cmd += ['--stamp', stamp, '--', *train_args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # The time to the fault (start-up, compiles, 8 steps) varies with the machine's load: a hang is counted from it.
    while not os.path.exists(stamp) and proc.poll() is None and time.time() - t0 < args.start_s:
      time.sleep(0.05)
    if fault == 'blocked':  # SIGTERM 1 s after the save began
      time.sleep(1.0)
      proc.send_signal(signal.SIGTERM)
    try:
      out, _ = proc.communicate(timeout=args.hang_s)
      hang = False
    except subprocess.TimeoutExpired:
      proc.kill()
      out, _ = proc.communicate()
      hang = True
    end = time.time()
    out = out.decode(errors='replace')
    fault_t = float(open(stamp).read()) if os.path.exists(stamp) else None
    tail = _tail(out)
    line = next((t for t in tail if t.startswith('shardzoo:')), '')
    if fault in ('readonly', 'delete'):  # make it writable again before looking and rerunning
      for m in reversed(mounts[1:] + ([os.path.join(ckpts, '1')] if fault == 'delete' else [])):
        subprocess.run(['umount', '-l', m], capture_output=True)
    if fault == 'full':
      with contextlib.suppress(OSError):
        os.remove(os.path.join(mount, 'ballast'))
    result = {
      'fault': fault,
      'seed': seed,
      'delay_s': delay,
      'rc': proc.returncode,
      'hang': hang,
      'fault_to_exit_s': round(end - fault_t, 2) if fault_t else None,
      'lines': len(out.splitlines()),
      'lines_after_progress': len(tail),
      'traceback': 'Traceback' in out,
      'never_retrieved': 'never retrieved' in out,
      'disk': _check_disk(line, ckpts) if line else 'no line',
      'log': _check_log(line),
      'line': line,
    }
    if rerun and not hang:
      r = subprocess.run(
        [sys.executable, 'train.py', *train_args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
      )
      resumed = re.search(r'resumed from \S+/(\d+)', r.stdout)
      result['rerun'] = f'rc {r.returncode}, resumed from {resumed.group(1) if resumed else None}, ' + (
        'finished' if 'step    12 |' in r.stdout else 'did not finish'
      )
    return result
  finally:
    for m in reversed(mounts):
      subprocess.run(['umount', '-l', m], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--faults', nargs='*', default=list(FAULTS), choices=FAULTS)
  parser.add_argument('--tries', type=int, default=20)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--hang_s', type=float, default=60, help='a run still alive this long after the fault hangs')
  parser.add_argument('--start_s', type=float, default=600, help='the longest a run may take to reach the fault')
  parser.add_argument('--rerun', action='store_true', help='rerun after every try (default: the first of each fault)')
  parser.add_argument('--json', help='write every try here')
  parser.add_argument('--child', choices=FAULTS, help=argparse.SUPPRESS)
  parser.add_argument('--delay', type=float, default=0.0, help=argparse.SUPPRESS)
  parser.add_argument('--mount', help=argparse.SUPPRESS)
  parser.add_argument('--stamp', help=argparse.SUPPRESS)
  args, _ = parser.parse_known_args(sys.argv[1 : sys.argv.index('--')] if '--' in sys.argv else None)
  if args.child:
    return child(args.child, args.delay, args.mount, args.stamp)
  can_mount = os.geteuid() == 0 and shutil.which('mount')
  results = []
  for fault in args.faults:
    if fault in REAL and not can_mount:
      print(f'{fault}: skipped (needs root to mount a tmpfs)')
      continue
    for i in range(args.tries):
      r = try_once(fault, args.seed * 1000 + i, args, rerun=args.rerun or i == 0)
      results.append(r)
      print(json.dumps({k: v for k, v in r.items() if k != 'line'}), flush=True)
      if i == 0:
        print(f'  {r["line"]}', flush=True)
  print(
    '\nfault     tries  hangs  rc!=1  one-line  tracebacks  never-retrieved  disk-wrong  log-wrong  lines (max)  '
    'fault->exit s (max)'
  )
  for fault in args.faults:
    rs = [r for r in results if r['fault'] == fault]
    if not rs:
      continue
    times = [r['fault_to_exit_s'] for r in rs if r['fault_to_exit_s'] is not None]
    print(
      f'{fault:9s} {len(rs):5d}  {sum(r["hang"] for r in rs):5d}  {sum(r["rc"] != 1 for r in rs):5d}  '
      f'{sum(r["lines_after_progress"] == 1 for r in rs):8d}  {sum(r["traceback"] for r in rs):10d}  '
      f'{sum(r["never_retrieved"] for r in rs):15d}  {sum(bool(r["disk"]) for r in rs):10d}  '
      f'{sum(bool(r["log"]) for r in rs):9d}  {max(r["lines"] for r in rs):11d}  '
      f'{max(times) if times else float("nan"):.1f}'
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
