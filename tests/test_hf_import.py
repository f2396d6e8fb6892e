"""Hugging Face import: logits match transformers (torch, fp32) with the model sharded on 8 devices;
each device reads only its slice; unexplained tensors and bad directories are clear errors."""

import itertools
import json
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
from checkpointing import hf_config  # noqa: E402
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
  hf_config.adopt(cfg, models.HF_FAMILIES)
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
  with pytest.raises(
    hf_import.HFImportError,
    match=r"Zoo parameters with no HF tensor \(2\): \['ln_f/bias', "
    r"'ln_f/scale'\].*HF tensors the model does not use \(1\): "
    r"\['transformer.extra.weight'\]",
  ):
    pretrained.init_state(trainer, models.HF_FAMILIES)
  save_file(
    {k: v for k, v in tensors.items() if 'ln_f' not in k and 'extra' not in k}, str(broken / 'model.safetensors')
  )
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
    hf_config.adopt(cfg, models.HF_FAMILIES)


class _FakeHF:
  def __init__(self, x):
    self.x, self.reads = x, []

  def shape(self, key):
    return self.x.shape

  def read(self, key, region):
    self.reads.append(region)
    return self.x[tuple(slice(a, b) for a, b in region)]


@pytest.mark.parametrize(
  'shape,ops',
  [
    ((6, 12), [T((1, 0)), R((3, 4, 6))]),  # Linear (out=H*K, in=D) -> (D, H, K)
    ((8, 36), [Slice(1, 12, 24), R((8, 3, 4))]),  # fused q|k|v, key part
    ((10, 4), [Pad(0, 16)]),  # padded vocabulary
    ((4, 6), [R((4, 2, 3)), T((1, 2, 0))]),
    ((2, 3, 4, 5), [R((6, 20))]),  # merged dims
    ((5, 3, 2, 2), [T((2, 3, 1, 0)), R((12, 5))]),  # conv (O, I, kh, kw) -> flattened patches
  ],
)
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
  with pytest.raises(
    hf_import.HFImportError,
    match=(
      rf"^init_from='tiny-org/missing': no such directory, and as a hub id not in the Hugging Face cache {cache} "
      r'and not downloadable \(.*\); fetch '
      r"it where the hub can be reached with `hf download tiny-org/missing --include 'config.json' '\*.safetensors'"
    ),
  ):
    hf_import.resolve('tiny-org/missing')


# --- config.json that disagrees with the weights; tied heads ------------------------------------------


def variant(src, dst, config=None, tensors=None):
  """A copy of the single-file HF directory src at dst, with config.json fields and tensors replaced."""
  from safetensors.numpy import load_file, save_file

  shutil.copytree(src, dst)
  c = json.loads((dst / 'config.json').read_text())
  (dst / 'config.json').write_text(json.dumps({**c, **(config or {})}))
  save_file({**load_file(str(dst / 'model.safetensors')), **(tensors or {})}, str(dst / 'model.safetensors'))
  return str(dst)


def test_ops_refuse_an_input_they_do_not_fit():
  """Pad and R check their input (a padded vocabulary of another length was padded or cut silently; a reshape
  of another element count failed with an IndexError)."""
  with pytest.raises(ValueError, match=r'^holds 100 entries along axis 0, not 120 \(padded to 128\)$'):
    Pad(0, 128, 120).shape((100, 64))
  with pytest.raises(ValueError, match=r'^holds 100 entries along axis 0, not 90$'):
    Pad(0, 90, 90).shape((100, 64))
  with pytest.raises(ValueError, match=r'^holds 20 entries along axis 0, more than the 16 it is padded to$'):
    Pad(0, 16).shape((20, 4))
  assert Pad(0, 50304, 50257).shape((50257, 8)) == (50304, 8) and Pad(0, 16).shape((10, 4)) == (16, 4)
  with pytest.raises(ValueError, match=r'^cannot reshape \(64, 32\) to \(64, 4, 16\)$'):
    R((64, 4, 16)).shape((64, 32))
  with pytest.raises(ValueError, match=r'^cannot reshape \(4, 4\) to \(-1, 3\)$'):
    R((-1, 3)).shape((4, 4))
  assert R((-1, 4)).shape((4, 8)) == (8, 4) and R((2, 8)).shape((4, 4)) == (2, 8)


def test_gpt2_vocab_size_that_disagrees_with_wte_is_refused(gpt2_dir, tmp_path):
  """config.json vocab_size 120 or 90 with 100 rows in wte (transformers refuses both): one error naming the key
  and shapes, not zero-padded or truncated rows."""
  for vocab, pad in ((120, 8), (90, 1)):
    path = variant(gpt2_dir[0], tmp_path / str(vocab), config=dict(vocab_size=vocab))
    cfg = zoo_config(gpt2_config, 'fsdp,tiny', path, pad_vocab_to=pad)
    with pytest.raises(
      hf_import.HFImportError,
      match=(
        rf'{path}: transformer.wte.weight \(100, 64\): holds 100 entries along axis 0, not {vocab}.*, for zoo '
        rf"parameter 'tok/embed/embedding', which expects \({-(-vocab // pad) * pad}, 64\); does config.json match"
      ),
    ):
      pretrained.init_state(build_trainer(cfg), models.HF_FAMILIES)


def test_gpt2_head_in_the_file_must_be_a_copy_of_wte(gpt2_dir, tmp_path):
  """The zoo's GPT-2 is tied: a file's lm_head.weight equal to wte (a tied checkpoint's copy) is accepted, another
  one (an untied checkpoint: its logits would silently differ) is one error, and so is tie_word_embeddings=false."""
  from safetensors.numpy import load_file

  wte = load_file(os.path.join(gpt2_dir[0], 'model.safetensors'))['transformer.wte.weight']
  cfg = zoo_config(gpt2_config, 'fsdp,tiny', variant(gpt2_dir[0], tmp_path / 'copy', tensors={'lm_head.weight': wte}))
  trainer = build_trainer(cfg)
  state = pretrained.init_state(trainer, models.HF_FAMILIES)
  np.testing.assert_array_equal(np.asarray(state.params['tok']['embed']['embedding'])[:100], wte)
  cfg.init_from = variant(gpt2_dir[0], tmp_path / 'untied', tensors={'lm_head.weight': wte + 1})
  with pytest.raises(
    hf_import.HFImportError,
    match=(
      rf'^{cfg.init_from}: lm_head.weight \(100, 64\) is not a copy of the embedding transformer.wte.weight '
      r'\(100, 64\), but the model ties its head to the embedding \(config.json tie_word_embeddings='
    ),
  ):
    pretrained.init_state(trainer, models.HF_FAMILIES)
  cfg.dont_load = '^tok/'  # a fresh embedding: the tied head is fresh too, the file's head is not wanted
  pretrained.init_state(trainer, models.HF_FAMILIES)
  with pytest.raises(ValueError, match=r"config.json tie_word_embeddings=False: the zoo's GPT-2 ties its head"):
    zoo_config(gpt2_config, 'fsdp,tiny', variant(gpt2_dir[0], tmp_path / 'cfg', config=dict(tie_word_embeddings=False)))


def test_llama_config_json_that_disagrees_with_the_weights_is_refused(tmp_path):
  """Tied in config.json but a different lm_head.weight in the file; kv heads, heads or head_dim that do not
  divide the projections (an IndexError from the reshape before): each one error naming the HF key."""
  from configs import llama as llama_config

  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
  )
  src = str(tmp_path / 'src')
  transformers.LlamaForCausalLM(hf_cfg).save_pretrained(src)
  from safetensors.numpy import load_file

  emb = load_file(os.path.join(src, 'model.safetensors'))['model.embed_tokens.weight']
  cfg = zoo_config(llama_config, 'fsdp,tiny', variant(src, tmp_path / 'copy', tensors={'lm_head.weight': emb}))
  assert cfg.model.tie_embeddings
  trainer = build_trainer(cfg)
  pretrained.init_state(trainer, models.HF_FAMILIES)  # a tied checkpoint's copy of the embedding
  cfg.init_from = variant(src, tmp_path / 'untied', tensors={'lm_head.weight': emb * 2})
  with pytest.raises(
    hf_import.HFImportError,
    match=(
      r'lm_head.weight \(96, 64\) is not a copy of the embedding model.embed_tokens.weight \(96, 64\), but the model '
      r'ties its head to the embedding \(config.json tie_word_embeddings=True\)'
    ),
  ):
    pretrained.init_state(trainer, models.HF_FAMILIES)
  for name, edit, key, shapes in (
    ('kv', dict(num_key_value_heads=4), 'k_proj', r'\(32, 64\): cannot reshape \(64, 32\) to \(64, 4, 16\)'),
    ('heads', dict(num_attention_heads=2), 'q_proj', r'\(64, 64\): cannot reshape \(64, 64\) to \(64, 2, 16\)'),
    ('head_dim', dict(head_dim=32), 'q_proj', r'\(64, 64\): cannot reshape \(64, 64\) to \(64, 4, 32\)'),
  ):
    cfg = zoo_config(llama_config, 'fsdp,tiny', variant(src, tmp_path / name, config=edit))
    with pytest.raises(
      hf_import.HFImportError,
      match=rf'model.layers.0.self_attn.{key}.weight {shapes}, for zoo '
      r'parameter .* does config.json match the model config\?',
    ):
      pretrained.init_state(build_trainer(cfg), models.HF_FAMILIES)
