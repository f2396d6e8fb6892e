"""Issue 12, items 2 and 4, short: train.py (real processes) killed with SIGKILL in the middle of asynchronous
checkpoint saves and stopped with SIGTERM at a random point, restarted each time, resumes from the newest
complete checkpoint every time and ends bitwise equal to an uninterrupted run. The harness is
benchmarks/soak.py; run it for the long soak (thousands of steps of the default config)."""

import random

import jax
import pytest

import train
from benchmarks import soak
from configs import default
from tests import children
from tests.conftest import TINY_RUN, subprocess_env


@pytest.mark.slow
def test_sigkill_during_saves_and_sigterm_resume_bitwise(tmp_path):
  # The uninterrupted run in this process (its final checkpoint is the reference); the compilation cache it
  # shares with the restarts (and with test_faults' full-disk run) is filled by whichever runs first.
  cfg = default.get_config()
  cfg.update_from_flattened_dict(TINY_RUN)
  train.train_and_evaluate(cfg, str(tmp_path / 'reference'))
  rng = random.Random(12)  # a save of this model takes ~0.1-0.3 s here: the kills land inside or just after one
  faults = [
    soak.Fault('SIGKILL', 'save', rng.uniform(0, 0.05), nth=1),
    soak.Fault('SIGTERM', 'loop', rng.uniform(0, 0.5)),
  ]
  env = soak.environment(jax.config.jax_compilation_cache_dir, subprocess_env())
  report = soak.soak(
    'configs/default.py',
    TINY_RUN,
    str(tmp_path),
    faults,
    env=env,
    reference=str(tmp_path / 'reference' / 'checkpoints' / '12'),
    timeout=120,
    launch=children.Popen,
  )
  assert report['sigkill'] == 1 and report['sigterm'] == 1 and report['runs'] == 3, report
  assert report['interrupted_saves'] >= 1, report  # at least one kill left a half-written save behind
