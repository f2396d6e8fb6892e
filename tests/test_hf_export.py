"""Hugging Face export end to end (the README's fine-tune): a hub id -> train.py -> export.py -> a directory
that transformers' Auto classes load, giving the zoo's logits; errors that name their culprit. (Per-family
round trips: tests/test_hf_import.py and tests/test_hf_families.py; LoRA exported merged: tests/test_finetune.py.)"""
import json
import os
import shutil
import subprocess
import sys

os.environ['HF_HUB_OFFLINE'] = '1'

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import models  # noqa: E402
import train  # noqa: E402
from configs import gpt2_finetune  # noqa: E402
from errors import ConfigError, HFExportError  # noqa: E402
from models import hf_export, hf_import  # noqa: E402
from tests.conftest import ROOT, build_trainer, subprocess_env  # noqa: E402
from tests.test_hf_import import forward  # noqa: E402
from training import export  # noqa: E402

PARITY_ATOL = 1e-4


def tiny_gpt2_with_tokenizer(path):
  """A tiny GPT-2 and a byte-level BPE tokenizer trained on a few sentences, as a hub snapshot holds them."""
  tokenizers = pytest.importorskip('tokenizers')
  tk = tokenizers.Tokenizer(tokenizers.models.BPE())
  tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = tokenizers.decoders.ByteLevel()
  tk.train_from_iterator(['the quick brown fox jumps over the lazy dog'] * 4, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<|endoftext|>'], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token='<|endoftext|>', bos_token='<|endoftext|>')
  tok.save_pretrained(path)
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
  transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
  return len(tok)


def test_finetune_from_a_hub_id_then_export_py_loads_in_transformers(tmp_path, monkeypatch):
  """The README's commands on a tiny model: train.py --config configs/gpt2_finetune.py with init_from a hub id
  (here a hand-populated Hugging Face cache, offline), then `export.py --workdir W --out H`: transformers'
  AutoModelForCausalLM and AutoTokenizer load H, and the model gives the zoo's logits."""
  import huggingface_hub
  cache, commit = tmp_path / 'hub', '0123456789abcdef0123456789abcdef01234567'
  snapshot = cache / 'models--tiny-org--gpt2' / 'snapshots' / commit
  snapshot.mkdir(parents=True)
  (cache / 'models--tiny-org--gpt2' / 'refs').mkdir()
  (cache / 'models--tiny-org--gpt2' / 'refs' / 'main').write_text(commit)
  vocab = tiny_gpt2_with_tokenizer(snapshot)
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(cache))

  cfg = gpt2_finetune.get_config('fsdp_tp')  # --config.init_from=tiny-org/gpt2 --config.model.dtype=float32 ...
  cfg.init_from = 'tiny-org/gpt2'
  cfg.model.dtype = 'float32'  # the parity below is fp32; the real preset computes in bfloat16
  cfg.dataset.update(seq_len=32)
  cfg.update(batch_size=8, total_steps=3, checkpoint_every=3, eval_every=3, log_every=1, sample_len=0)
  workdir, out = tmp_path / 'run', tmp_path / 'hf_out'
  with tfds.testing.mock_data(num_examples=16):
    state = train.train_and_evaluate(cfg, str(workdir))['state']
  assert cfg.model.vocab_size == vocab and cfg.dataset.tokenizer == str(snapshot)

  run = subprocess.run([sys.executable, 'export.py', '--workdir', str(workdir), '--out', str(out)], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert f'exported {workdir}/checkpoints/3 -> {out}: 28 tensors' in run.stdout, run.stdout
  assert {'tokenizer.json', 'tokenizer_config.json', 'generation_config.json', 'config.json',
          'model.safetensors'} <= set(os.listdir(out))
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  tokens = np.asarray([tok('the lazy fox')['input_ids'] * 4])
  trainer = build_trainer(cfg)
  ours = forward(trainer, state, tokens)[..., :vocab]
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  err = float(np.abs(ours - theirs).max())
  print(f'gpt2 fine-tuned from a hub id -> export.py -> transformers: max |logits diff| {err:.2e}')
  assert err < PARITY_ATOL, err
  with open(out / 'config.json') as f:
    written = json.load(f)
  assert written['eos_token_id'] == tok.eos_token_id and written['dtype'] == 'float32'  # kept from the source


def test_export_errors_name_the_culprit(tmp_path):
  gpt2 = models.HF_FAMILIES['gpt2']
  cfg = gpt2_finetune.get_config('tiny').model
  with pytest.raises(HFExportError, match=r"zoo tensor\(s\) \['extra/kernel'\] have no Hugging Face counterpart in "
                                          r'the gpt2 table'):
    hf_export.plan(gpt2, cfg, {'ln_f/scale': (64,), 'extra/kernel': (2, 2)})
  with pytest.raises(HFExportError, match=r'wte.weight: the table pads it without saying its real length'):
    hf_export.plan(hf_import.Family(('x',), dict, [hf_import.Param('e', 'wte.weight', [hf_import.Pad(0, 8)])]),
                   cfg, {'e': (8, 4)})
  with pytest.raises(HFExportError, match=r'cannot write dtype complex64'):
    hf_export.write(gpt2, cfg, {}, None, str(tmp_path), dtype=np.complex64)
  with pytest.raises(ConfigError, match=r"config.model.name='cnn' has no Hugging Face layout to export to; families "
                                        r"with one: \['bert', 'gpt2', 'llama', 'moe', 'resnet', 'vit'\]"):
    from configs import mnist
    c = mnist.get_config()
    export.write_hf(build_trainer(c), {}, {}, str(tmp_path), models.HF_FAMILIES)
  with pytest.raises(ConfigError, match=rf'{tmp_path}/run_config.json does not exist .* give the run.s config '
                                        'with --config'):
    export.load_run_config(str(tmp_path))
  shutil.rmtree(tmp_path)
