"""Several processes on one machine, launched as a scheduler would: launch/slurm.sbatch under a stand-in `srun`
that starts 2 processes with SLURM's environment (jax.distributed detects it), on a hybrid mesh whose 2 DCN slices
are the processes; their checkpoint resumed by 1 process of 8 devices and by 2 of 2 (data position exact, other
meshes); a killed
process stops its peer. The Kubernetes manifest is checked for consistency."""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import children
from tests.conftest import ROOT, subprocess_env

TINY = [
  '--config',
  'configs/default.py',
  '--config.model.num_layers=2',
  '--config.model.embed_dim=64',
  '--config.model.mlp_dim=128',
  '--config.model.max_len=16',
  '--config.dataset.seq_len=16',
  '--config.dataset.num_train=512',
  '--config.dataset.num_eval=100',
  '--config.batch_size=16',
  '--config.log_every=3',
  '--config.sample_len=0',
  '--config.optim.warmup_steps=1',
]
SLURM_PORTS = 61440  # JAX's SLURM detection puts the coordinator on port 61440 + SLURM_JOB_ID % 4096
FAKE_SRUN = r"""#!/usr/bin/env python3
# srun as far as launch/slurm.sbatch needs it: SLURM_NTASKS local tasks, one per "node", with srun's variables. The
# tasks start as the suite's other train.py children do (tests/children.py: forked from a process that has imported
# the libraries); `python` is the wrapper of this interpreter on PATH.
import os, sys
sys.path.insert(0, os.environ['SLURM_SUBMIT_DIR'])
from tests import children
cmd = sys.argv[1:]
while cmd and cmd[0].startswith('--'):
  cmd = cmd[1:]
cmd = [sys.executable if cmd[0] == 'python' else cmd[0], *cmd[1:]]
n, out = int(os.environ['SLURM_NTASKS']), os.environ['FAKE_SRUN_OUT']
procs = [children.Popen(cmd, env={**os.environ, 'SLURM_PROCID': str(i), 'SLURM_LOCALID': '0', 'SLURM_NODEID': str(i),
                                  'SLURM_STEP_NODELIST': 'localhost', 'SLURM_STEP_NUM_NODES': str(n)},
                        stdout=open(f'{out}/{i}.out', 'w'), stderr=open(f'{out}/{i}.err', 'w')) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
"""


def _free_port(lo: int = 0) -> int:
  for port in [0] if not lo else range(lo + os.getpid() % 2000, lo + 4096):
    with socket.socket() as s:
      try:
        s.bind(('127.0.0.1', port))
      except OSError:
        continue
      return s.getsockname()[1]
  raise RuntimeError('no free port')


def _losses(stdout: str) -> list[float]:
  return [float(x) for x in re.findall(r'(?:step|eval @)\s+\d+ \| loss (\d+\.\d+)', stdout)]


def _start(args: list[str], n: int) -> list[subprocess.Popen]:
  """n train.py processes joined by the manual flags (one process: none)."""
  port = _free_port()
  flags = [f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={n}'] if n > 1 else []
  return [
    children.Popen(
      [sys.executable, 'train.py', *TINY, *args, *flags, *([f'--process_id={i}'] if n > 1 else [])],
      cwd=ROOT,
      env=subprocess_env(n),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(n)
  ]


def _only_steps(src, dst, keep: int) -> str:
  """A copy of run directory `src` whose checkpoints stop at step `keep` (as if the run had stopped there)."""
  shutil.copytree(src, dst)
  for d in os.listdir(os.path.join(dst, 'checkpoints')):
    if d.isdigit() and int(d) > keep:
      shutil.rmtree(os.path.join(dst, 'checkpoints', d))
  return str(dst)


@pytest.mark.slow
def test_slurm_launch_hybrid_mesh_and_resume_on_other_process_and_device_counts(tmp_path):
  run = [
    '--config.total_steps=9',
    '--config.eval_every=9',
    '--config.checkpoint_every=3',
    '--config.keep_checkpoints=3',
  ]
  # launch/slurm.sbatch on 2 "nodes": srun starts one process per node, no flags, SLURM's variables (the
  # coordinator on localhost); the script adds --config.dcn_mesh.data=2 (data parallel across the nodes).
  bin_dir, out_dir = tmp_path / 'bin', tmp_path / 'srun'
  bin_dir.mkdir(), out_dir.mkdir()
  # srun runs under this interpreter: '#!/usr/bin/env python3' through pyenv's shim would put the base
  # interpreter first on PATH, ahead of the python wrapper below.
  (bin_dir / 'srun').write_text(FAKE_SRUN.replace('/usr/bin/env python3', sys.executable, 1))
  (bin_dir / 'srun').chmod(0o755)
  # A wrapper, not a symlink: Python finds its virtualenv from the path it was started by, so a symlink to a
  # venv's python would start the base interpreter, without the venv's packages.
  (bin_dir / 'python').write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
  (bin_dir / 'python').chmod(0o755)
  env = {
    **subprocess_env(2),
    'PATH': f'{bin_dir}:{os.environ["PATH"]}',
    'FAKE_SRUN_OUT': str(out_dir),
    'SLURM_JOB_ID': str(_free_port(SLURM_PORTS) - SLURM_PORTS),
    'SLURM_NTASKS': '2',
    'SLURM_JOB_NUM_NODES': '2',
    'SLURM_SUBMIT_DIR': str(ROOT),
  }
  sbatch = subprocess.run(
    [
      'bash',
      'launch/slurm.sbatch',
      'configs/default.py',
      str(tmp_path / 'two'),
      *TINY[2:],
      *run,
      '--config.mesh.data=1',
      '--config.mesh.fsdp=4',
      '--config.mesh.tensor=1',
    ],
    cwd=ROOT,
    env=env,
    timeout=400,
  )
  two = [(out_dir / f'{i}.out').read_text() for i in range(2)]
  assert sbatch.returncode == 0, (out_dir / '0.err').read_text()[-3000:] + (out_dir / '1.err').read_text()[-3000:]
  assert 'processes: 2 processes (slurm environment, detected by jax.distributed)' in two[0]
  assert (
    '2 DCN slices (data=2 across slices x data=1 x fsdp=4 x tensor=1 within each; a slice is one process)' in two[0]
  )
  # Data parallel over DCN, FSDP inside each slice: only gradient all-reduces cross DCN.
  # The payload is about the gradient bytes per device (the parameters per device), its analytic minimum.
  over_dcn = re.search(r'over DCN: (.*)', two[0])[1]
  dcn_kib = float(re.fullmatch(r'all-reduce x\d+ \(([0-9.]+) KiB\)', over_dcn)[1])
  grad_kib = float(re.search(r'per device on mesh [^:]*: ([0-9.]+) KiB', two[0])[1])
  assert grad_kib <= dcn_kib <= 1.2 * grad_kib, (dcn_kib, grad_kib)
  assert _losses(two[1]) == [] and 'parameter' not in two[1]  # only process 0 reports
  losses = _losses(two[0])
  assert len(losses) == 4  # steps 3, 6, 9 and the eval at 9

  # At the same time: 1 process of 8 devices on another mesh (tensor parallel too) resumes the 2-process checkpoint
  # of step 3, and 2 processes of 2 devices (4 in all, where the checkpoint was written by 8; data=-1 takes what
  # is left) resume its step 6. (Saving with 1 or 4 processes and resuming with 2: the data positions' test in
  # tests/test_data.py; orbax's arrays do not care.)
  one_dir = _only_steps(tmp_path / 'two', tmp_path / 'one', 3)
  pair_dir = _only_steps(tmp_path / 'two', tmp_path / 'pair', 6)
  one = _start([*run, '--workdir', one_dir], 1)
  pair = _start(
    [*run, '--config.mesh.data=-1', '--config.mesh.fsdp=4', '--config.mesh.tensor=1', '--workdir', pair_dir], 2
  )
  outs = [p.communicate(timeout=400) for p in one + pair]
  for p, (_, err) in zip(one + pair, outs):
    assert p.returncode == 0, err[-3000:]
  one, pair = outs[0][0], outs[1][0]
  assert (
    re.search(r'on 8 cpu devices( \(simulated[^)]*\))?, 1 process\(es\)', one)
    and f'resumed from {one_dir}/checkpoints/3' in one
  )
  assert _losses(one) == pytest.approx(losses[1:], abs=2e-4)
  assert re.search(r"mesh: \{'data': 1, 'fsdp': 4, 'tensor': 1\} on 4 cpu devices( \([^)]*\))?, 2 process\(es\)", pair)
  assert f'resumed from {pair_dir}/checkpoints/6' in pair
  assert _losses(pair) == pytest.approx(losses[2:], abs=2e-4)


PEER = r"""
import sys
import jax
jax.config.update('jax_num_cpu_devices', 1)
from training import cluster
launch = cluster.Launch(sys.argv[1], 2, int(sys.argv[2]))
launch.start(heartbeat_timeout_s=100)
with cluster.watched(launch, float(sys.argv[3])):  # as train.py runs train_and_evaluate
  mesh = jax.make_mesh((2,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P('data')), jax.numpy.ones((1, 4)))
  step = jax.jit(lambda x: x * 2 - x)  # a collective-free step, then an all-reduce, as a train loop does
  total = jax.jit(lambda x: x.sum())
  print('training', flush=True)
  while True:
    x = step(x)
    total(x).block_until_ready()
"""


@pytest.mark.slow
def test_a_killed_process_stops_its_peer_within_the_timeout():
  """kill -9 of process 1 while the two are in collectives: process 0 stops within the peer timeout (x 1.2),
  naming it, with status 75, through the same launch and watch train.py uses (training/cluster.py), without the
  model around it. (kill -9 of process 0, the coordinator, makes JAX's client abort process 1 within a second:
  README.)"""
  timeout, port = 5, _free_port()
  procs = [
    children.Popen(
      [sys.executable, '-c', PEER, f'127.0.0.1:{port}', str(i), str(timeout)],
      cwd=ROOT,
      env=subprocess_env(2),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  for p in procs:
    assert p.stdout.readline() == 'training\n'
  time.sleep(1)
  os.kill(procs[1].pid, signal.SIGKILL)
  t0 = time.monotonic()
  _, err = procs[0].communicate(timeout=60)
  waited = time.monotonic() - t0
  procs[1].wait()
  assert procs[0].returncode == 75, err[-3000:]
  assert 'shardzoo: process 1 of 2 stopped responding' in err
  assert waited < timeout * 1.2 + 3, waited


PREEMPTED = r"""
import os, signal, sys, time
import jax
jax.config.update('jax_num_cpu_devices', 1)
from training import cluster
from training.preemption import Preemption
launch = cluster.Launch(sys.argv[1], 2, int(sys.argv[2]))
launch.start(heartbeat_timeout_s=100)
preemption = Preemption(sync_every=1000)  # as train.py makes it, after jax.distributed has started
for step in range(1, 400):
  if step == 5 and jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's notice, to one of the processes
  if preemption.requested(step):
    print('stopped at', step, 'service' if preemption.service else 'all-gather', flush=True)
    break
  time.sleep(0.05)  # a step
"""


def test_sigterm_to_one_process_stops_both_at_the_same_step_soon():
  """SIGTERM to one of two processes: JAX's preemption service tells the other and both stop at the same step,
  a few steps later (train.py saves there), not at the next multiple of a sync interval."""
  port = _free_port()
  procs = [
    children.Popen(
      [sys.executable, '-c', PREEMPTED, f'127.0.0.1:{port}', str(i)],
      cwd=ROOT,
      env=subprocess_env(2),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  stopped = [re.fullmatch(r'stopped at (\d+) service\n', out) for out, _ in outs]
  assert all(stopped) and stopped[0][1] == stopped[1][1], outs
  assert 5 <= int(stopped[0][1]) <= 40, stopped[0][1]


def test_bad_launches_are_one_error_each(monkeypatch):
  """Before JAX starts: manual flags that do not add up, an unknown detection method, and a scheduler whose
  environment cannot be read are one ConfigError naming the flag or variable to change."""
  from errors import ConfigError  # pylint: disable=g-import-not-at-top
  from training import cluster  # pylint: disable=g-import-not-at-top

  assert cluster.Launch(None, 1, 0).how == 'one process'
  with pytest.raises(ConfigError, match=r'--coordinator_address=h:1 needs --num_processes >= 2'):
    cluster.Launch('h:1', 1, 0)
  with pytest.raises(ConfigError, match=r'--process_id=2 is not in 0..1'):
    cluster.Launch('h:1', 2, 2)
  with pytest.raises(ConfigError, match=r"--cluster='bogus' is not a cluster JAX detects; choose auto, none or one of"):
    cluster.Launch(None, 1, 0, 'bogus')
  with pytest.raises(ConfigError, match=r'--cluster=slurm: this process does not run in a slurm environment'):
    cluster.Launch(None, 1, 0, 'slurm')
  for k, v in dict(
    SLURM_JOB_ID='5', SLURM_STEP_NODELIST='n1', SLURM_NTASKS='x', SLURM_PROCID='0', SLURM_LOCALID='0'
  ).items():
    monkeypatch.setenv(k, v)
  with pytest.raises(
    ConfigError,
    match=r'detected a slurm environment but could not read its process count .* '
    r'--cluster=none',
  ):
    cluster.Launch(None, 1, 0)
  assert cluster.Launch(None, 1, 0, 'none').num_processes == 1


def test_kubernetes_manifest_is_consistent():
  """launch/k8s.yaml: an Indexed Job whose pods find pod 0 through the headless Service (JAX's Kubernetes
  detection), may read pods and jobs, and ask for as many DCN slices as there are pods."""
  import yaml  # pylint: disable=g-import-not-at-top

  with open(os.path.join(ROOT, 'launch', 'k8s.yaml')) as f:
    docs = {d['kind']: d for d in yaml.safe_load_all(f)}
  job, svc = docs['Job'], docs['Service']
  assert job['spec']['completionMode'] == 'Indexed'
  assert job['spec']['parallelism'] == job['spec']['completions']
  pod = job['spec']['template']['spec']
  assert pod['subdomain'] == svc['metadata']['name'] and svc['spec']['clusterIP'] == 'None'
  assert svc['spec']['selector'] == {'job-name': job['metadata']['name']}
  assert pod['serviceAccountName'] == docs['ServiceAccount']['metadata']['name']
  assert {'pods'} <= set(docs['Role']['rules'][0]['resources']) and 'jobs' in docs['Role']['rules'][1]['resources']
  cmd = pod['containers'][0]['command']
  assert cmd[:2] == ['python', 'train.py'] and f'--config.dcn_mesh.data={job["spec"]["parallelism"]}' in cmd
