"""Hugging Face export end to end (the README's fine-tune): a hub id -> train.py -> export.py -> a directory
that transformers' Auto classes load, giving the zoo's logits; errors that name their culprit. (Per-family
round trips: tests/test_hf_import.py and tests/test_hf_families.py; LoRA exported merged: tests/test_finetune.py.)"""

import json
import os
import re
import shutil
import sys

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import models  # noqa: E402
import train  # noqa: E402
from checkpointing import run_config  # noqa: E402
from configs import gpt2_finetune  # noqa: E402
from errors import ConfigError, HFExportError  # noqa: E402
from models import hf_export, hf_import  # noqa: E402
from tests import children
from tests.conftest import ROOT, build_trainer, export_hf, subprocess_env  # noqa: E402
from tests.test_hf_import import forward, gpt2_dir, zoo_config  # noqa: E402,F401  (gpt2_dir: a fixture)
from training import export, pretrained  # noqa: E402

PARITY_ATOL = 1e-4


def tiny_gpt2_with_tokenizer(path):
  """A tiny GPT-2 and a byte-level BPE tokenizer trained on a few sentences, as a hub snapshot holds them."""
  tokenizers = pytest.importorskip('tokenizers')
  tk = tokenizers.Tokenizer(tokenizers.models.BPE())
  tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = tokenizers.decoders.ByteLevel()
  tk.train_from_iterator(
    ['the quick brown fox jumps over the lazy dog'] * 4,
    tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<|endoftext|>'], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    ),
  )
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token='<|endoftext|>', bos_token='<|endoftext|>')
  tok.save_pretrained(path)
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(
    vocab_size=len(tok),
    n_positions=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    bos_token_id=tok.eos_token_id,
    eos_token_id=tok.eos_token_id,
  )
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

  run = children.run(
    [sys.executable, 'export.py', '--workdir', str(workdir), '--out', str(out)],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert f'exported {workdir}/checkpoints/3 -> {out}: 28 tensors' in run.stdout, run.stdout
  assert {
    'tokenizer.json',
    'tokenizer_config.json',
    'generation_config.json',
    'config.json',
    'model.safetensors',
  } <= set(os.listdir(out))
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
  with pytest.raises(
    HFExportError,
    match=r"zoo tensor\(s\) \['extra/kernel'\] have no Hugging Face counterpart in "
    r'the gpt2 table',
  ):
    hf_export.plan(gpt2, cfg, {'ln_f/scale': (64,), 'extra/kernel': (2, 2)})
  with pytest.raises(HFExportError, match=r'wte.weight: the table pads it without saying its real length'):
    hf_export.plan(
      hf_import.Family(('x',), dict, [hf_import.Param('e', 'wte.weight', [hf_import.Pad(0, 8)])]), cfg, {'e': (8, 4)}
    )
  with pytest.raises(HFExportError, match=r'cannot write dtype complex64'):
    hf_export.write(gpt2, cfg, {}, None, str(tmp_path), dtype=np.complex64)
  with pytest.raises(
    ConfigError,
    match=r"config.model.name='cnn' has no Hugging Face layout to export to; families "
    r"with one: \['bert', .*'gpt2', .*'llama', .*'resnet', 'vit'\]",
  ):
    from configs import mnist

    c = mnist.get_config()
    export.write_hf(build_trainer(c), {}, {}, str(tmp_path), models.HF_FAMILIES)
  with pytest.raises(
    ConfigError,
    match=rf'{tmp_path}/run_config.json does not exist .* give the run.s config '
    'with --config',
  ):
    run_config.load(str(tmp_path))
  shutil.rmtree(tmp_path)


def imported_gpt2(hf_dir):
  """(trainer, state) of the tiny GPT-2 in hf_dir, imported (no train step: nothing compiles)."""
  from configs import gpt2 as gpt2_config

  trainer = build_trainer(zoo_config(gpt2_config, 'fsdp,tiny', hf_dir))
  return trainer, pretrained.init_state(trainer, models.HF_FAMILIES)


def test_export_into_a_non_empty_directory_needs_overwrite_which_removes_only_export_files(gpt2_dir, tmp_path):
  """A single-file export, then a sharded one into the same directory: refused without overwrite (before, the
  old model.safetensors stayed beside the new index and transformers loaded the old weights); with it, the
  files of the earlier export go first (listed), other files stay, and transformers reads the new shards."""
  trainer, state = imported_gpt2(gpt2_dir[0])
  out = tmp_path / 'hf'
  assert export_hf(trainer, state, out)['removed'] == []
  (out / 'notes.txt').write_text('not ours')
  (out / 'tokenizer.json').write_text('{}')  # e.g. left by an export of a run with another tokenizer
  with pytest.raises(
    ConfigError,
    match=(
      rf"^export directory '{out}' is not empty \(config.json, generation_config.json, model.safetensors, notes.txt, "
      r'...\): pass --overwrite \(overwrite=True\)'
    ),
  ):
    export_hf(trainer, state, out, max_shard_size='50KB')
  trained = state.replace(params=jax.tree.map(lambda x: x + 1, state.params))
  stats = export_hf(trainer, trained, out, max_shard_size='50KB', overwrite=True)
  assert stats['removed'] == ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json']
  assert (
    sorted(os.listdir(out))
    == sorted(stats['files'] + stats['copied'] + ['config.json', 'model.safetensors.index.json', 'notes.txt'])
    and len(stats['files']) > 1
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
  np.testing.assert_array_equal(
    model.transformer.wte.weight.detach().numpy(), np.asarray(trained.params['tok']['embed']['embedding'])[:100]
  )
  with pytest.raises(ConfigError, match=rf"^export directory '{out}/notes.txt' is an existing file, not a directory"):
    export_hf(trainer, state, out / 'notes.txt', overwrite=True)


def test_export_refuses_to_write_into_what_it_reads(gpt2_dir, tmp_path):
  """An export directory that is the run's init_from (its weights were overwritten, then shutil.SameFileError),
  its tokenizer directory, or its checkpoint directory (or inside it): one error before anything is written or
  restored, overwrite or not, also through a symlink."""
  src = tmp_path / 'src'
  shutil.copytree(gpt2_dir[0], src)
  trainer, state = imported_gpt2(str(src))
  tok = tmp_path / 'tok'
  tok.mkdir()
  (tok / 'tokenizer.json').write_text('{}')
  trainer.config.dataset.tokenizer = str(tok)
  (tmp_path / 'link').symlink_to(src)
  before = {f: (src / f).read_bytes() for f in os.listdir(src)}
  for out, field, source in (
    (src, 'config.init_from', src),
    (tok, 'config.dataset.tokenizer', tok),
    (tmp_path / 'link', 'config.init_from', src),
  ):
    for overwrite in (False, True):
      with pytest.raises(
        ConfigError,
        match=re.escape(f"export directory '{out}' is the run's {field} ({source}), which the export reads"),
      ):
        export_hf(trainer, state, out, overwrite=overwrite)
  assert {f: (src / f).read_bytes() for f in os.listdir(src)} == before
  checkpoints = tmp_path / 'run' / 'checkpoints'
  (checkpoints / '3' / 'state').mkdir(parents=True)  # not a readable checkpoint: the out check comes first
  root = os.path.realpath(checkpoints)
  for out in (checkpoints, checkpoints / '3', checkpoints / '3' / 'hf'):
    for step in (checkpoints, checkpoints / '3'):
      with pytest.raises(
        ConfigError,
        match=re.escape(f"export directory '{out}' is ")
        + '(inside )?'
        + re.escape(f'the checkpoint directory {root}, which the export reads'),
      ):
        export.export_hf(trainer, str(step), str(out), models.HF_FAMILIES, overwrite=True)
  assert sorted(os.listdir(checkpoints / '3')) == ['state']


def test_export_py_checks_dtype_and_max_shard_size_before_anything_else(tmp_path):
  """Bad --dtype / --max_shard_size values were a TypeError / ValueError traceback mid-export: one line naming the
  flag and what it accepts, before the workdir is read."""
  with pytest.raises(ConfigError, match=r"^--dtype='bf16': one of float32, bfloat16, float16, float64"):
    export.check_options('bf16', '5GB')
  for bad in ('5XB', '0GB', '5', 'GB', '-1MB', '1e3MB'):
    with pytest.raises(
      ConfigError,
      match=rf"^--max_shard_size='{bad}': a positive number with a unit KB, MB, GB or "
      r'TB, e.g. 5GB or 500MB$',
    ):
      export.check_options(None, bad)
  for dtype, size in ((None, '5GB'), ('bfloat16', '500MB'), ('float16', '0.05mb'), ('float32', '1.5 GB')):
    export.check_options(dtype, size)
  run = children.run(
    [
      sys.executable,
      'export.py',
      '--workdir',
      str(tmp_path / 'none'),
      '--out',
      str(tmp_path / 'hf'),
      '--max_shard_size=5XB',
    ],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 1 and 'Traceback' not in run.stderr, run.stderr[-3000:]
  assert run.stderr.strip().splitlines()[-1] == (
    "shardzoo: export error: --max_shard_size='5XB': a positive number with a unit KB, MB, GB or TB, e.g. 5GB or 500MB"
  ), run.stderr[-3000:]
  assert not os.path.exists(tmp_path / 'hf')


def test_export_py_refuses_a_non_empty_out_before_building_the_model(tmp_path):
  from configs import gpt2 as gpt2_config

  run_config.save(gpt2_config.get_config('fsdp,tiny'), str(tmp_path / 'run'))
  (tmp_path / 'hf').mkdir()
  (tmp_path / 'hf' / 'model.safetensors').write_text('an earlier export')
  run = children.run(
    [sys.executable, 'export.py', '--workdir', str(tmp_path / 'run'), '--out', str(tmp_path / 'hf')],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 1 and 'Traceback' not in run.stderr, run.stderr[-3000:]
  assert run.stderr.strip().splitlines()[-1] == (
    f"shardzoo: export error: export directory '{tmp_path}/hf' is not "
    'empty (model.safetensors): pass --overwrite (overwrite=True) to '
    'replace the files of an earlier export there, or give an empty '
    'directory'
  ), run.stderr[-3000:]
