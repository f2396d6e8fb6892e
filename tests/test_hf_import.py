"""Hugging Face import: logits match transformers (torch, fp32) with the model sharded on 8 devices;
each device reads only its slice; unexplained tensors and bad directories are clear errors."""
import itertools
import os
import shutil

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402
from models import hf_import  # noqa: E402
from models.hf_import import Pad, R, Slice, T  # noqa: E402
from tests.conftest import assert_hf_round_trip, build_trainer, load_exported, train_steps  # noqa: E402
from training import pretrained, tasks  # noqa: E402

PARITY_ATOL = 1e-4  # max |logits difference| allowed (fp32 both sides)


def forward(trainer, state, *args, **kwargs):
  """The model's output (eval mode) under the trainer's shardings."""
  def run(params, rest, *a):
    return tasks.eval_view(nnx.merge(trainer.graphdef, params, rest))(*a, **kwargs)
  return np.asarray(jax.jit(run)(state.params, state.model_state, *args))


def zoo_config(config_file, arg, hf_dir, **overrides):
  cfg = config_file.get_config(arg)
  cfg.init_from = hf_dir
  cfg.dont_load = ''
  for k, v in overrides.items():
    cfg.model[k] = v
  pretrained.adopt_hf_config(cfg, models.HF_FAMILIES)
  return cfg


@pytest.fixture(scope='module')
def gpt2_dir(tmp_path_factory):
  torch.manual_seed(0)
  hf_cfg = transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=64, n_layer=2, n_head=4)
  model = transformers.GPT2LMHeadModel(hf_cfg).eval()
  path = str(tmp_path_factory.mktemp('hf_gpt2'))
  model.save_pretrained(path)
  return path, model


@pytest.mark.parametrize('arg,scan', [('fsdp_tp,tiny', True), ('tp,tiny', False)])
def test_gpt2_logits_match_transformers_and_export_back(gpt2_dir, arg, scan, tmp_path):
  """Import: the zoo's logits are transformers'. Export (training/export.py): HF -> zoo -> HF is bitwise;
  after 2 train steps, the exported model loaded by transformers gives the zoo's logits."""
  path, hf_model = gpt2_dir
  cfg = zoo_config(gpt2_config, arg, path, scan_layers=scan, pad_vocab_to=8)
  assert (cfg.model.vocab_size, cfg.model.embed_dim, cfg.model.num_layers) == (100, 64, 2)  # from config.json
  trainer = build_trainer(cfg)
  state = pretrained.init_state(trainer, models.HF_FAMILIES)
  tokens = np.random.default_rng(0).integers(0, 100, (2, 32))

  def err(state, hf_model):
    ours = forward(trainer, state, tokens)[..., :100]
    with torch.no_grad():
      theirs = hf_model(torch.tensor(tokens)).logits.numpy()
    return float(np.abs(ours - theirs).max())
  assert err(state, hf_model) < PARITY_ATOL
  emb = state.params['tok']['embed']['embedding']
  assert emb.shape == (104, 64) and emb.sharding.spec == trainer.specs.params['tok']['embed']['embedding']
  assert not np.asarray(emb[100:]).any()  # padded rows are zeros
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip')
  trained = train_steps(trainer, state)
  assert not np.array_equal(trained.params['ln_f']['scale'], state.params['ln_f']['scale'])
  exported = load_exported(trainer, trained, tmp_path / 'trained', transformers.AutoModelForCausalLM)
  e = err(trained, exported)
  print(f'gpt2 {arg}: trained -> HF -> transformers: max |logits diff| {e:.2e}')
  assert e < PARITY_ATOL, e


def test_unexplained_parameters_are_listed_and_dont_load_initialises_them(gpt2_dir, tmp_path):
  path, hf_model = gpt2_dir
  cfg = zoo_config(gpt2_config, 'fsdp,tiny', path)
  trainer = build_trainer(cfg)
  # Drop ln_f from a copy of the checkpoint: the zoo's ln_f is then unexplained.
  from safetensors.numpy import load_file, save_file
  broken = tmp_path / 'broken'
  broken.mkdir()
  (broken / 'config.json').write_text(open(os.path.join(path, 'config.json')).read())
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  tensors['transformer.extra.weight'] = np.zeros(3, np.float32)
  save_file({k: v for k, v in tensors.items() if 'ln_f' not in k}, str(broken / 'model.safetensors'))
  cfg.init_from = str(broken)
  with pytest.raises(hf_import.HFImportError, match=r"Zoo parameters with no HF tensor \(2\): \['ln_f/bias', "
                                                    r"'ln_f/scale'\].*HF tensors the model does not use \(1\): "
                                                    r"\['transformer.extra.weight'\]"):
    pretrained.init_state(trainer, models.HF_FAMILIES)
  save_file({k: v for k, v in tensors.items() if 'ln_f' not in k and 'extra' not in k},
            str(broken / 'model.safetensors'))
  cfg.dont_load = '^ln_f/'
  state = pretrained.init_state(trainer, models.HF_FAMILIES)
  np.testing.assert_array_equal(np.asarray(state.params['ln_f']['scale']), 1.0)  # fresh init
  np.testing.assert_array_equal(np.asarray(state.params['pos']), tensors['transformer.wpe.weight'])


def test_bad_directories_are_clear_errors(gpt2_dir, tmp_path):
  with pytest.raises(hf_import.HFImportError, match='no config.json'):
    hf_import.HFDir(str(tmp_path))
  (tmp_path / 'config.json').write_text('{"model_type": "gpt2"}')
  with pytest.raises(hf_import.HFImportError, match=r'has no \*.safetensors files'):
    hf_import.HFDir(str(tmp_path))
  cfg = gpt2_config.get_config('tiny')
  cfg.init_from = gpt2_dir[0]
  cfg.model.name = 'llama_typo'
  with pytest.raises(ValueError, match="config.model.name='llama_typo' has no Hugging Face importer"):
    pretrained.adopt_hf_config(cfg, models.HF_FAMILIES)


class _FakeHF:
  def __init__(self, x):
    self.x, self.reads = x, []

  def shape(self, key):
    return self.x.shape

  def read(self, key, region):
    self.reads.append(region)
    return self.x[tuple(slice(a, b) for a, b in region)]


@pytest.mark.parametrize('shape,ops', [
    ((6, 12), [T((1, 0)), R((3, 4, 6))]),  # Linear (out=H*K, in=D) -> (D, H, K)
    ((8, 36), [Slice(1, 12, 24), R((8, 3, 4))]),  # fused q|k|v, key part
    ((10, 4), [Pad(0, 16)]),  # padded vocabulary
    ((4, 6), [R((4, 2, 3)), T((1, 2, 0))]),
    ((2, 3, 4, 5), [R((6, 20))]),  # merged dims
    ((5, 3, 2, 2), [T((2, 3, 1, 0)), R((12, 5))]),  # conv (O, I, kh, kw) -> flattened patches
])
def test_ops_read_only_the_region_a_slice_needs(shape, ops):
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  full = x
  for op in ops:
    full = op(full)
  def slices(n):
    return [slice(0, n)] + [slice(a, a + w) for w in range(1, n) if n % w == 0 for a in range(0, n, w)]
  for index in itertools.product(*(slices(n) for n in full.shape)):
    fake = _FakeHF(x)
    got = hf_import._read_through(fake, 'k', ops, index, np.float32)
    np.testing.assert_array_equal(got, full[index])
  # A head-range slice of a (D, H, K) kernel from a (H*K, D) Linear weight reads only those rows.
  fake = _FakeHF(np.zeros((12, 6), np.float32))
  hf_import._read_through(fake, 'k', [T((1, 0)), R((6, 3, 4))], (slice(0, 6), slice(1, 2), slice(0, 4)), np.float32)
  assert fake.reads == [[(4, 8), (0, 6)]]


def test_hub_ids_resolve_through_the_cache_and_a_missing_one_says_how_to_fetch_it(gpt2_dir, tmp_path, monkeypatch):
  """init_from='org/name': the snapshot in huggingface_hub's cache (populated here from a tiny local model,
  offline); train.py adopts its config.json. A missing id: one line with the id, the cache and the command."""
  import huggingface_hub
  import train
  from configs import gpt2_finetune
  cache, commit = tmp_path / 'hub', '0123456789abcdef0123456789abcdef01234567'
  repo = cache / 'models--tiny-org--gpt2'
  (repo / 'refs').mkdir(parents=True)
  (repo / 'refs' / 'main').write_text(commit)
  shutil.copytree(gpt2_dir[0], repo / 'snapshots' / commit)
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(cache))
  monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
  path = hf_import.resolve('tiny-org/gpt2')
  assert path == str(repo / 'snapshots' / commit) and hf_import.is_hf_dir(path)
  assert hf_import.resolve(gpt2_dir[0]) == gpt2_dir[0] and hf_import.resolve('') == ''
  assert hf_import.resolve('tiny-org/missing', download=False) == 'tiny-org/missing'  # dry runs
  cfg = gpt2_finetune.get_config('fsdp_tp')
  cfg.init_from = 'tiny-org/gpt2'
  cfg.dataset.seq_len = 32
  out = train.train_and_evaluate(cfg, None, dry_run=True)
  assert cfg.init_from == path and cfg.dataset.tokenizer == path and cfg.model.vocab_size == 100
  assert out['num_params'] > 0
  with pytest.raises(hf_import.HFImportError, match=(
      rf"^init_from='tiny-org/missing': no such directory, and as a hub id not in the Hugging Face cache {cache} "
      r"and not downloadable \(.*\); fetch "
      r"it where the hub can be reached with `hf download tiny-org/missing --include 'config.json' '\*.safetensors'")):
    hf_import.resolve('tiny-org/missing')
