"""train.py end to end: the loss falls, metrics land in the workdir, the CLI validates before compiling."""

import glob
import math
import subprocess
import sys

import pytest

import data
import errors
import models
import train
from tests import children
from tests.conftest import BACKEND_COMPILE, ROOT, recorded_compile_events, subprocess_env, tiny_config
from training import run


def test_default_config_learns(tmp_path):
  cfg = tiny_config()
  cfg.dataset.update(num_train=8192, num_eval=250)  # 250 is not a multiple of the batch: padded eval
  # No checkpoints here (tests/test_resume.py covers them): the compile count below is the train loop's.
  cfg.update(total_steps=400, log_every=100, eval_every=200, sample_len=8, checkpoint_every=0)
  cfg.optim.update(lr=3e-3, warmup_steps=20)
  with recorded_compile_events() as compiles:
    result = train.train_and_evaluate(cfg, str(tmp_path))
  assert result['eval']['weight'] == 250 * 16  # every eval token counted once, padding masked
  # Below the bigram entropy: the model uses the two-back context, which only attention provides.
  bigram = data.MarkovLanguage(16, 4, 0.03, 0).entropies()['bigram']
  assert result['eval']['loss'] < bigram - 0.1 < math.log(16), result['eval']
  assert result['train']['loss'] < bigram
  assert int(result['state'].step) == 400
  assert math.isfinite(result['sample_nll'])  # the end-of-run sample: train.py -> generation.sample -> scored
  assert glob.glob(str(tmp_path / 'events.out.tfevents.*'))
  # Train step, eval step, init, and three for sampling (key, seed, loop): none per step, log or eval.
  assert compiles.count(BACKEND_COMPILE) <= 6, compiles


def _cli(*args, timeout=300):
  return children.run(
    [sys.executable, 'train.py', '--config', 'configs/default.py', *args],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.mark.slow
def test_cli_dry_run_on_one_device():
  r = _cli('--dry_run', '--config.mesh.data=1', '--config.mesh.fsdp=1', '--config.mesh.tensor=1')
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'on 1 cpu devices' in r.stdout
  assert 'blocks/layers/0/mlp/up/layer/kernel' in r.stdout and "P('fsdp', 'tensor')" in r.stdout
  assert 'parameters: 803,584' in r.stdout and 'optimizer state per device' in r.stdout
  assert 'step ' not in r.stdout  # nothing trained


@pytest.mark.slow
def test_cli_preset_switches_strategy():
  r = _cli('--dry_run', '--config', 'configs/default.py:tp')
  assert r.returncode == 0, r.stderr[-3000:]
  assert "mesh: {'data': 2, 'fsdp': 1, 'tensor': 4} on 8 cpu devices" in r.stdout
  row = next(line for line in r.stdout.splitlines() if line.startswith('blocks/layers/0/mlp/up/layer/kernel'))
  assert "P(None, 'tensor')" in row and '64.00 KiB' in row  # 128x512 f32 = 256 KiB over tensor=4


@pytest.mark.slow
def test_cli_bad_model_name_is_one_clear_error():
  r = _cli('--dry_run', '--config.model.name=gtp')
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
    f"shardzoo: config error: config.model.name='gtp': must be one of {sorted(models.MODELS)}"
  )


@pytest.mark.slow
def test_cli_bad_batch_is_one_clear_error():
  r = _cli('--dry_run', '--config.batch_size=6')
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
    "shardzoo: sharding error: global batch size 6 is not divisible by the mesh axes of logical axis 'batch' "
    '(data=2 x fsdp=2 = 4); use a multiple of 4'
  )
  assert 'Traceback' not in r.stderr


def test_an_exception_in_the_loop_releases_everything_and_a_corrupt_checkpoint_says_so(tmp_path, monkeypatch):
  """The SIGTERM handler is restored and the save in flight completes when the loop raises; rerunning on
  that checkpoint, corrupted, stops with a 'checkpoint error' (not a config error)."""
  import signal

  import data as data_pkg

  handler = signal.getsignal(signal.SIGTERM)
  calls, real = [], data_pkg.to_global

  def failing(*args):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError('input pipeline broke')
    return real(*args)

  monkeypatch.setattr(data_pkg, 'to_global', failing)
  cfg = tiny_config('fsdp_tp', checkpoint_every=1, total_steps=3)
  with pytest.raises(RuntimeError, match='input pipeline broke'):
    train.train_and_evaluate(cfg, str(tmp_path))
  assert signal.getsignal(signal.SIGTERM) is handler
  state_dir = tmp_path / 'checkpoints' / '1' / 'state'
  assert (state_dir / '_METADATA').is_file()  # step 1's asynchronous save finished before the error surfaced
  # Another model, another optimizer, or checkpointing off in this workdir: one error before compiling.
  for overrides, error in (
    (
      {'model.mlp_dim': 256},
      r"parameter 'blocks/layers/0/mlp/down/layer/kernel': the model expects shape "
      r'\(256, 64\), the checkpoint has \(128, 64\)',
    ),
    ({'optim.name': 'sgd'}, r"optimizer state '.*' .*Was it written with another optimizer"),
    (
      {'checkpoint_every': 0},
      rf'config.checkpoint_every=0, but {tmp_path}/checkpoints holds checkpoints '
      r'\(steps \[1\]\): set config.checkpoint_every to resume from them',
    ),
  ):
    other = tiny_config('fsdp_tp', checkpoint_every=1, total_steps=3)
    other.update_from_flattened_dict(overrides)
    with recorded_compile_events() as compiles, pytest.raises(errors.ConfigError, match=error):
      train.train_and_evaluate(other, str(tmp_path))
    assert compiles.count(BACKEND_COMPILE) == 0, (overrides, compiles)
  # Likewise starting another run from it (init_from): a missing path, a workdir for its checkpoints, another model.
  for init_from, mlp_dim, error in (
    (tmp_path / 'nowhere', 128, r'is neither a checkpoint directory of this project nor a Hugging Face model'),
    (
      tmp_path,
      128,
      rf"no checkpoint there .*; a run's checkpoints are in its workdir's checkpoints/: "
      rf'{tmp_path}/checkpoints$',
    ),
    (tmp_path / 'checkpoints', 256, r"parameter 'blocks/layers/0/mlp/down/layer/kernel': the model expects shape"),
  ):
    other = tiny_config('fsdp_tp', init_from=str(init_from), total_steps=3)
    other.model.mlp_dim = mlp_dim
    with recorded_compile_events() as compiles, pytest.raises(errors.ConfigError, match=error):
      train.train_and_evaluate(other, str(tmp_path / 'finetune'))
    assert compiles.count(BACKEND_COMPILE) == 0, (init_from, compiles)
  (state_dir / '_METADATA').write_text('{not json')
  flags = [
    '--config.model.num_layers=2',
    '--config.model.embed_dim=64',
    '--config.model.mlp_dim=128',
    '--config.model.max_len=16',
    '--config.dataset.seq_len=16',
    '--config.dataset.num_train=512',
    '--config.dataset.num_eval=100',
    '--config.batch_size=16',
    '--config.total_steps=3',
    '--config.sample_len=0',
    '--config.checkpoint_every=1',
  ]
  r = _cli('--workdir', str(tmp_path), *flags)
  assert r.returncode == 1, r.stderr[-2000:]
  assert (
    r.stderr.strip().splitlines()[-1].startswith('shardzoo: checkpoint error: checkpoint ') and 'corrupt' in r.stderr
  )


def test_a_sample_longer_than_the_model_is_refused_before_compiling(tmp_path):
  cfg = tiny_config(sample_len=15)  # 2 prompt tokens + 15 > max_len 16
  with (
    recorded_compile_events() as compiles,
    pytest.raises(
      errors.ConfigError,
      match=(
        r'^config.sample_len=15: the sample after training \(2 prompt tokens \+ sample_len\) would be 17 tokens, '
        r'over config.model.max_len=16$'
      ),
    ),
  ):
    train.train_and_evaluate(cfg, str(tmp_path))
  assert compiles.count(BACKEND_COMPILE) == 0, compiles


@pytest.mark.slow
def test_cli_empty_workdir_is_a_usage_error():
  r = _cli('--workdir=', '--config.total_steps=1')  # e.g. an unset $WORKDIR: once ran with no checkpoints
  assert (
    r.returncode == 1
    and r.stderr.strip().splitlines()[-1]
    == (
      'shardzoo: usage error: --workdir is required: metrics and checkpoints are written there (--help for all flags)'
    )
    and 'USAGE' not in r.stderr
  ), r.stderr[-2000:]


def test_progress_lines_are_written_whole(monkeypatch):
  """One write per line: under an unbuffered stdout (PYTHONUNBUFFERED) a line and its newline written apart
  let clu's writer thread log in between, gluing its line onto ours."""
  writes = []

  class Stdout:
    def write(self, text):
      writes.append(text)

    def flush(self):
      pass

  monkeypatch.setattr(sys, 'stdout', Stdout())
  run.say('step     1 | loss 2.7')
  assert writes == ['step     1 | loss 2.7\n']


TINY_CLI = [
  '--config.mesh.data=1',
  '--config.mesh.fsdp=1',
  '--config.mesh.tensor=1',
  '--config.model.num_layers=2',
  '--config.model.embed_dim=64',
  '--config.model.mlp_dim=128',
  '--config.model.max_len=16',
  '--config.dataset.seq_len=16',
  '--config.dataset.num_train=512',
  '--config.dataset.num_eval=100',
  '--config.batch_size=16',
  '--config.sample_len=0',
  '--config.checkpoint_every=0',
]


@pytest.mark.slow
def test_cli_says_each_line_once_and_the_full_table_goes_to_the_workdir(tmp_path):
  """What a run prints: each progress line, warning and attention choice once (no logging writer repeating them,
  no progress reporter with its own steps/s, no hyperparameter line, TensorFlow's start-up once at most); the
  sharding table as a per-module summary, the full one in the workdir."""
  r = _cli(
    '--workdir', str(tmp_path), *TINY_CLI, '--config.total_steps=4', '--config.log_every=2', '--config.eval_every=4'
  )
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout + r.stderr
  for line in r.stdout.splitlines():
    if line.startswith(('step ', 'eval @', 'attention:', 'WARNING')):
      assert out.count(line.split(' | ')[0] if line.startswith(('step ', 'eval @')) else line) == 1, line
  assert len([line for line in r.stdout.splitlines() if line.startswith('step ')]) == 2
  assert sum(line.count('attention: ') for line in out.splitlines()) == 1, out[-3000:]
  for noise in ('Setting work unit notes', 'Hyperparameters', 'steps_per_sec=', 'train/loss='):
    assert noise not in out, noise
  assert out.count('absl::InitializeLog') <= 1
  full = (tmp_path / 'sharding_table.txt').read_text()
  assert 'mlp/up/layer/kernel' in full and 'mlp/up/layer/kernel' not in r.stdout
  summary = r.stdout[r.stdout.index('module ') : r.stdout.index('per parameter:')]
  assert summary.splitlines()[-1] == full.splitlines()[-1]  # the same totals
  assert len(summary.splitlines()) < len(full.splitlines())
  assert glob.glob(str(tmp_path / 'events.out.tfevents.*'))  # TensorBoard scalars still written


@pytest.mark.slow
def test_cli_config_error_comes_before_the_heavy_imports(tmp_path):
  """A misspelled field is reported before JAX, TensorFlow, clu or grain are imported (seconds, not tens)."""
  r = subprocess.run(
    [sys.executable, '-X', 'importtime', 'train.py', '--config', 'configs/gpt2.py:tiny']
    + ['--config.model.emebd_dim=3', '--workdir', str(tmp_path)],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.endswith("--config.model.emebd_dim=3: the config has no field 'emebd_dim'; did you mean 'embed_dim'?")
  imported = {line.split('|')[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')}
  assert not imported & {'jax', 'tensorflow', 'clu', 'grain', 'flax'}, sorted(
    imported & {'jax', 'tensorflow', 'clu', 'grain', 'flax'}
  )
  # A bad value (found by schema.check, after parsing) too.
  r = subprocess.run(
    [sys.executable, '-X', 'importtime', 'train.py', '--config', 'configs/gpt2.py:tiny']
    + ['--config.optim.lr=-1', '--workdir', str(tmp_path)],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert (
    r.stderr.strip().splitlines()[-1] == 'shardzoo: config error: config.optim.lr=-1.0: must be a finite number >= 0'
  )
  imported = {line.split('|')[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')}
  assert not imported & {'tensorflow', 'clu', 'grain'}
