"""train.py end to end with checkpoints: SIGTERM saves and stops; rerunning resumes and ends bitwise
equal to an uninterrupted run; fine-tuning from a Hugging Face directory and from our own checkpoint."""

import os
import re
import signal
import threading
import time

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import errors  # noqa: E402
import train  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402


def _config(**overrides):
  cfg = gpt2_config.get_config('fsdp_tp,tiny')
  cfg.update({'total_steps': 24, 'log_every': 4, 'eval_every': 24, 'checkpoint_every': 8, **overrides})
  cfg.dataset.update(num_train=1024, num_eval=64)
  return cfg


def _sigterm_when(path, min_step):
  """Sends SIGTERM to this process once a checkpoint >= min_step exists (the train loop is running)."""

  def watch():
    while True:
      steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
      if any(s >= min_step for s in steps):
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.01)

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


def test_sigterm_saves_and_resume_is_bitwise_equal(tmp_path, capsys):
  full = train.train_and_evaluate(_config(), str(tmp_path / 'full'))['state']

  workdir = str(tmp_path / 'interrupted')
  ckpts, run_config = os.path.join(workdir, 'checkpoints'), os.path.join(workdir, 'run_config.json')
  watcher = _sigterm_when(ckpts, 8)
  capsys.readouterr()
  first = train.train_and_evaluate(_config(), workdir)
  watcher.join(timeout=5)
  stopped = first['preempted_at']
  assert 8 <= stopped < 24, stopped
  assert str(stopped) in os.listdir(ckpts)  # saved at the SIGTERM step
  # The steps since the last log line are logged before stopping (log_every=4).
  assert re.search(rf'^step {stopped:5d} \|.*\nSIGTERM: stopped at step {stopped},', capsys.readouterr().out, re.M)

  resumed = train.train_and_evaluate(_config(), workdir)  # the same command again
  assert 'preempted_at' not in resumed
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed['state']), jax.device_get(full))

  # Rerunning the finished run: one line says so; nothing is trained or evaluated.
  kept = sorted(os.listdir(ckpts))  # [16 or the SIGTERM step, 24]
  capsys.readouterr()
  again = train.train_and_evaluate(_config(), workdir)
  assert 'checkpoint step 24 >= config.total_steps=24: nothing to train\n' in capsys.readouterr().out
  assert int(again['state'].step) == 24 and 'eval' not in again and sorted(os.listdir(ckpts)) == kept

  # A resume that fails leaves run_config.json (what export.py rebuilds the model from) as it was, here with
  # step 24's data position lost and config.resume_fallback=False, which run_config.json would otherwise record.
  with open(run_config) as f:
    written = f.read()
  os.remove(os.path.join(ckpts, '24', 'data', 'process_0-of-1.json'))
  with pytest.raises(
    errors.DamagedCheckpointError,
    match=rf'^checkpoint {ckpts}/24 is missing or corrupt: the data '
    rf'position in {ckpts}/24/data is missing',
  ):
    train.train_and_evaluate(_config(resume_fallback=False), workdir)
  with open(run_config) as f:
    assert f.read() == written

  # The fallback (the default): 24 moved aside, the one before resumed, and step 24 is saved again at the end.
  again = train.train_and_evaluate(_config(), workdir)
  assert sorted(os.listdir(ckpts)) == [*kept, '24.damaged']
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(again['state']), jax.device_get(full))


@pytest.fixture(scope='module')
def hf_gpt2(tmp_path_factory):
  import torch
  import transformers

  torch.manual_seed(0)
  path = str(tmp_path_factory.mktemp('hf_gpt2'))
  cfg = transformers.GPT2Config(vocab_size=16, n_positions=64, n_embd=64, n_layer=2, n_head=4)
  transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
  return path


def test_finetune_from_hugging_face(hf_gpt2, tmp_path):
  cfg = _config(init_from=hf_gpt2, checkpoint_every=0, total_steps=40, log_every=10, eval_every=40)
  cfg.optim.update(lr=1e-2, warmup_steps=5)
  out = train.train_and_evaluate(cfg, str(tmp_path / 'full'))
  # The random HF model starts near uniform (ln 16 = 2.77); fine-tuning learns the language.
  assert out['eval']['loss'] < 2.68, out['eval']  # measured 2.62 after 40 steps


def test_lora_finetune_then_merged_export_initialises_the_plain_model(hf_gpt2, tmp_path):
  cfg = _config(init_from=hf_gpt2, checkpoint_every=0, total_steps=40, log_every=10, eval_every=40)
  cfg.lora.update(rank=4, alpha=8.0, targets=r'attn/(query|value)$|mlp/up$', export_merged=True)
  cfg.logical_axis_rules = [*cfg.logical_axis_rules, ('lora_rank', None)]
  cfg.optim.update(lr=3e-2, warmup_steps=5)
  out = train.train_and_evaluate(cfg, str(tmp_path / 'lora'))
  assert out['eval']['loss'] < 2.72, out['eval']  # adapters alone move a random base off uniform (2.77)
  export = str(tmp_path / 'lora' / 'export')
  assert os.path.isdir(os.path.join(export, '0', 'state'))

  # The merged export initialises the plain model (no adapters) and reproduces the LoRA model's eval loss.
  base = _config(init_from=export, checkpoint_every=0, total_steps=1, log_every=1, eval_every=1)
  base.optim.lr = 0.0
  again = train.train_and_evaluate(base, str(tmp_path / 'base'))
  np.testing.assert_allclose(again['eval']['loss'], out['eval']['loss'], rtol=1e-4)


# SIGTERM to train.py as a process (clean exit with a checkpoint at that step, the rerun resumes from it):
# tests/test_soak.py, whose harness checks each run's exit status and the step it resumed from.
