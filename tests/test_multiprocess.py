"""Two processes on one machine (4 simulated CPU devices each) train exactly like one process with 8."""
import re
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env

TINY = ['--config', 'configs/default.py', '--config.model.num_layers=2', '--config.model.embed_dim=64',
        '--config.model.mlp_dim=128', '--config.model.max_len=16', '--config.dataset.seq_len=16',
        '--config.dataset.num_train=512', '--config.dataset.num_eval=100', '--config.batch_size=16',
        '--config.total_steps=6', '--config.log_every=3', '--config.eval_every=6', '--config.sample_len=4',
        '--config.optim.warmup_steps=1']


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _losses(stdout: str) -> list[float]:
  return [float(x) for x in re.findall(r'(?:step|eval @)\s+\d+ \| loss (\d+\.\d+)', stdout)]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, 'train.py', *TINY, '--workdir', str(tmp_path / 'multi'),
       f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={i}'],
      cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert 'on 8 cpu devices, 2 process(es)' in outs[0][0]
  assert _losses(outs[1][0]) == [] and 'parameter' not in outs[1][0]  # only process 0 reports

  single = subprocess.run([sys.executable, 'train.py', *TINY, '--workdir', str(tmp_path / 'single')],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert single.returncode == 0, single.stderr[-3000:]
  assert 'on 8 cpu devices, 1 process(es)' in single.stdout
  multi_losses, single_losses = _losses(outs[0][0]), _losses(single.stdout)
  assert len(multi_losses) == 3
  assert multi_losses == pytest.approx(single_losses, abs=2e-4)


@pytest.mark.slow
def test_minus_one_mesh_axis_with_two_processes():
  """data=-1 takes 'the rest of the devices' across processes too (each simulates what it needs)."""
  port = _free_port()
  flags = ['--dry_run', '--config.mesh.data=-1', '--config.mesh.fsdp=1', '--config.mesh.tensor=1']
  procs = [subprocess.Popen(
      [sys.executable, 'train.py', *TINY, *flags, f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
       f'--process_id={i}'], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert "mesh: {'data': 2, 'fsdp': 1, 'tensor': 1} on 2 cpu devices, 2 process(es)" in outs[0][0]
