"""The dense decoder families on one block (models/decoder.py): Qwen2, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, Phi-3
and OLMo-2, each from a tiny Hugging Face model whose config no other test uses, against transformers (torch, fp32):
logits within 1e-5 and an export that transformers loads, bitwise the checkpoint (hub layouts: bfloat16, sharded
with an index, tied and untied heads, Phi-3's fused tensors); greedy tokens equal to transformers' with prompts
longer than the sliding windows (window-sized ring caches); the presets trained equal to one device; the rotary
scalings equal to transformers' own; the published parameter counts."""

import importlib
import os

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import generation  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
import training  # noqa: E402
from configs import decoders  # noqa: E402
from models import decoder, layers  # noqa: E402
from tests.conftest import assert_hf_round_trip, build_trainer, load_exported  # noqa: E402
from tests.test_context import _train as train  # noqa: E402
from tests.test_equivalence import ATOL, RTOL  # noqa: E402
from tests.test_generation import NEW, check_parity  # noqa: E402
from tests.test_hf_families import forward, import_hf, save, zoo_config  # noqa: E402

PARITY_ATOL = 1e-5  # fp32 logits against transformers'; measured worst 7e-6 (Phi-3, logits up to 3.4)
_C = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=8,
  max_position_embeddings=128,
  rms_norm_eps=1e-5,
  initializer_range=0.1,
)
_WIDE = {k: v for k, v in _C.items() if k != 'head_dim'} | dict(hidden_size=64)  # head_dim from width / heads
# family -> (config class, its arguments, save_pretrained arguments, zoo preset, scan_layers)
CASES = {
  # bfloat16 on disk; layers 1 and 2 local (use_sliding_window from max_window_layers); linear rope scaling
  'qwen2': (
    transformers.Qwen2Config,
    dict(
      _C,
      num_hidden_layers=3,
      use_sliding_window=True,
      sliding_window=4,
      max_window_layers=1,
      tie_word_embeddings=True,
      rope_parameters=dict(rope_type='linear', factor=2.0, rope_theta=1e4),
    ),
    dict(dtype=torch.bfloat16),
    'tp,tiny',
    True,
  ),
  # head_dim 16 apart from width / heads; yarn; sharded files with an index; untied
  'qwen3': (
    transformers.Qwen3Config,
    dict(
      _C,
      head_dim=16,
      num_hidden_layers=2,
      tie_word_embeddings=False,
      rope_parameters=dict(rope_type='yarn', factor=4.0, rope_theta=1e4, original_max_position_embeddings=32),
    ),
    dict(max_shard_size='20KB'),
    'fsdp_tp,tiny',
    False,
  ),
  'mistral': (transformers.MistralConfig, dict(_C, num_hidden_layers=2, sliding_window=4), {}, 'fsdp,tiny', True),
  'gemma': (transformers.GemmaConfig, dict(_C, head_dim=16, num_hidden_layers=2), {}, 'tp,tiny', False),
  # local and global layers alternating; query_pre_attn_scalar; both soft caps tight enough to cut
  'gemma2': (
    transformers.Gemma2Config,
    dict(
      _C,
      num_hidden_layers=4,
      sliding_window=4,
      query_pre_attn_scalar=12,
      attn_logit_softcapping=5.0,
      final_logit_softcapping=3.0,
      tie_word_embeddings=False,
    ),
    dict(dtype=torch.bfloat16),
    'fsdp_tp,tiny',
    True,
  ),
  # local, local, global, local, local: one scanned group of three and two layers after it; local rotary base;
  # linear scaling on the global layers only
  'gemma3': (
    transformers.Gemma3TextConfig,
    dict(
      _C,
      num_hidden_layers=5,
      sliding_window=4,
      sliding_window_pattern=3,
      query_pre_attn_scalar=12,
      tie_word_embeddings=False,
      rope_parameters=dict(
        full_attention=dict(rope_type='linear', factor=4.0, rope_theta=1e6),
        sliding_attention=dict(rope_type='default', rope_theta=1e4),
      ),
    ),
    {},
    'tp,tiny',
    True,
  ),
  # fused qkv_proj and gate_up_proj; longrope (long factors past 24 positions: the 32-token forward takes them,
  # generation stays short of them, as transformers' does); window 6 on every layer; sharded files
  'phi3': (
    transformers.Phi3Config,
    dict(
      _WIDE,
      num_hidden_layers=2,
      sliding_window=6,
      pad_token_id=0,
      bos_token_id=1,
      eos_token_id=2,
      original_max_position_embeddings=24,
      rope_parameters=dict(
        rope_type='longrope',
        rope_theta=1e4,
        short_factor=[1.0, 1.1, 1.2, 1.3],
        long_factor=[2.0, 3.0, 4.0, 5.0],
        original_max_position_embeddings=24,
      ),
      tie_word_embeddings=False,
    ),
    dict(max_shard_size='40KB'),
    'fsdp_tp,tiny',
    False,
  ),
  # q/k norm over the whole projection, under tensor parallelism (the heads it averages over are split)
  'olmo2': (transformers.Olmo2Config, dict(_WIDE, num_hidden_layers=2, tie_word_embeddings=False), {}, 'tp,tiny', True),
}
assert sorted(CASES) == sorted(decoders.SIZES), 'every decoder family file has its case'
PROMPTS = [[5, 17, 3, 9, 22, 41, 7, 11, 30, 2, 8], [12], [8, 30, 2, 2, 50, 6]]  # longer than the windows (4, 6)


def config_file(name):
  return importlib.import_module(f'configs.{name}')


@pytest.fixture(scope='module', params=sorted(CASES))
def family(request, tmp_path_factory):
  name = request.param
  cls, kwargs, save_kw, arg, scan = CASES[name]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).eval()
  save_kw = dict(save_kw)
  if 'dtype' in save_kw:  # the checkpoint as the hub ships it, in bfloat16
    model = model.to(save_kw.pop('dtype'))
  path, _ = save(model, tmp_path_factory.mktemp(f'hf_{name}'), **save_kw)
  # The reference reads the file as saved (a bfloat16 checkpoint's rounded weights), in float32.
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return name, path, model, arg, scan


def test_logits_match_transformers_and_export_back(family, tmp_path):
  name, path, hf_model, arg, scan = family
  _, _, save_kw, _, _ = CASES[name]
  cfg = zoo_config(config_file(name), arg, path, scan_layers=scan)
  assert cfg.model.name == name and cfg.model.vocab_size == 96
  trainer, state = import_hf(cfg)
  tokens = np.random.default_rng(0).integers(0, 96, (2, 32))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  err = float(np.abs(forward(trainer, state, tokens) - theirs).max())
  print(f'{name}: max |logits diff| {err:.2e} (logits up to {np.abs(theirs).max():.2f})')
  assert err < PARITY_ATOL, err
  # HF -> zoo -> HF is bitwise the checkpoint (in its dtype, split into files like it), and transformers loads it.
  kw = {'dtype': 'bfloat16'} if 'dtype' in save_kw else {}
  kw |= {'max_shard_size': save_kw['max_shard_size']} if 'max_shard_size' in save_kw else {}
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip', **kw)
  if 'max_shard_size' in kw:
    assert os.path.isfile(tmp_path / 'round_trip' / 'model.safetensors.index.json')
  exported = load_exported(trainer, state, tmp_path / 'loaded', transformers.AutoModelForCausalLM, **kw)
  assert type(exported) is type(hf_model)
  for (k, a), (_, b) in zip(sorted(exported.state_dict().items()), sorted(hf_model.state_dict().items())):
    assert torch.equal(a.float(), b), k


def test_greedy_is_transformers_past_the_sliding_window(family, monkeypatch):
  """Prompts of up to 11 tokens and 6 new ones against windows of 4 and 6: the local layers decode from ring
  caches of the window's slots; every step's logits are a full forward pass's (test_generation.check_parity)."""
  name, path, hf_model, arg, scan = family
  monkeypatch.setattr('tests.test_generation.PROMPTS', PROMPTS)
  cfg = zoo_config(config_file(name), arg, path, scan_layers=scan)
  gen = generation.load(cfg, partitioning.make_mesh(cfg.mesh))
  windows = set(decoder.layer_windows(cfg.model))
  assert set(gen.layout.windows) <= windows and gen.layout.scanned == scan
  got = check_parity(gen, hf_model)
  assert len({t for g in got for t in g.ids}) > 2  # not one token repeated
  rows, _, slots = gen.shapes(PROMPTS, generation.Sampling(NEW, temperature=0.0))
  cache = gen.layout.abstract(rows, slots)[0]
  # a local layer's cache holds its window's slots, not the decode's 32
  assert {s.shape[-2] for s in cache.values()} == {slots if w is None else w for w in gen.layout.windows}
  assert ('local (window' in gen.cache_table(rows, slots)) == any(gen.layout.windows)


# --- every preset trains as on one device ------------------------------------------------------------------------

# By default three families train under the presets where their options meet the sharding: Gemma 3 (with soft
# caps on, which its config.json carries: windows, soft caps, per-head q/k norms and the layer pattern's groups)
# under context parallelism and in the pipeline, OLMo-2's norm over split heads under tensor parallelism, Qwen2's
# biases under FSDP + tensor; the other presets and families shard nothing new (tests/test_equivalence.py covers
# them for GPT-2). `pytest --all-presets` trains every family under every preset. Each family's presets start from
# one initial state and are compared with one 1-device run (one compile).
PRESETS = {'gemma3': ('cp', 'pp'), 'olmo2': ('tp',), 'qwen2': ('fsdp_tp',)}


def pytest_generate_tests(metafunc):
  if 'family_presets' in metafunc.fixturenames:
    every = metafunc.config.getoption('--all-presets')
    cases = {name: tuple(config_file(name).RULES) if every else PRESETS.get(name) for name in sorted(CASES)}
    cases = {name: presets for name, presets in cases.items() if presets}
    metafunc.parametrize('family_presets', list(cases.items()), ids=list(cases))


def tiny(name, preset):
  """The family's tiny config under `preset`, with rows of 32 tokens (its windows of 16 still cut) and as many
  layers for every preset as the pipeline's (4 groups of the layer pattern), so all its presets train one model.
  Gemma 3 alternates its layers (a group of two compiles faster than of three) and caps its logits."""
  cfg = config_file(name).get_config(f'{preset},tiny')
  cfg.update(batch_size=16)  # pp: 8 micro-batches of 2 rows
  cfg.dataset.update(seq_len=32)
  if name == 'gemma3':
    cfg.model.update(layer_pattern='LG', attn_softcap=20.0, final_softcap=10.0)
  cfg.model.num_layers = 4 * len(decoder.pattern(cfg.model))
  cfg.optim.warmup_steps = 1
  return cfg


def test_presets_train_equal_to_one_device(family_presets):
  """2 AdamW steps on the same batches from the same initial state: losses and parameters within fp32 1e-5 of the
  1-device run (tests/test_equivalence.py's tolerance)."""
  name, presets = family_presets
  one = tiny(name, presets[0]).copy_and_resolve_references()
  one.mesh.update({k: 1 for k in one.mesh})
  trainer_1 = build_trainer(one, jax.devices()[:1])
  start = jax.device_get(training.init_state(trainer_1))
  batches = [training.tasks.get('lm').synthetic_batch(one, seed=i) for i in range(2)]
  losses_1, params_1 = train(trainer_1, jax.device_put(start, trainer_1.shardings), batches)
  for preset in presets:
    trainer = build_trainer(tiny(name, preset))
    assert trainer.mesh.size == 8 and trainer.abstract.params == trainer_1.abstract.params
    losses, params = train(trainer, jax.device_put(start, trainer.shardings), batches)
    np.testing.assert_allclose(losses, losses_1, rtol=RTOL, atol=ATOL, err_msg=f'{name}:{preset}')
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params_1)):
      np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f'{name}:{preset} {jax.tree_util.keystr(path)}')


# --- rotary scalings, parameter counts --------------------------------------------------------------------------

ROPES = {  # name -> (rope_parameters, max_position_embeddings)
  'linear': (dict(rope_type='linear', factor=4.0), 128),
  'llama3': (
    dict(
      rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
    128,
  ),
  'yarn': (dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=256), 1024),
  'yarn_mscale_untruncated': (
    dict(
      rope_type='yarn',
      factor=40.0,
      original_max_position_embeddings=64,
      beta_fast=16.0,
      mscale=0.707,
      mscale_all_dim=0.707,
      truncate=False,
    ),
    2560,
  ),
  'longrope': (
    dict(
      rope_type='longrope',
      short_factor=[1.0 + i / 10 for i in range(16)],
      long_factor=[2.0 + i for i in range(16)],
      original_max_position_embeddings=256,
    ),
    4096,
  ),
}


@pytest.mark.parametrize('name', sorted(ROPES))
def test_rope_scaling_is_transformers(name):
  """Inverse frequencies and the cos/sin factor against transformers' ROPE_INIT_FUNCTIONS, for a config.json read
  by the importer (decoder.hf_rope: factors and lengths as transformers completes them); longrope's long and short
  sets both."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  params, max_len = ROPES[name]
  params = dict(params, rope_theta=10_000.0)
  c = dict(model_type='llama', hidden_size=256, num_attention_heads=8, head_dim=32, max_position_embeddings=max_len)
  theta, scaling = decoder.hf_rope(dict(c, rope_parameters=params))
  hf_cfg = transformers.LlamaConfig(**{k: v for k, v in c.items() if k != 'model_type'}, rope_parameters=params)
  kind = params['rope_type']
  for long in (False, True) if kind == 'longrope' else (False,):
    inv, factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, seq_len=max_len if long else None)
    ours = np.asarray(layers.rope_frequencies(32, theta, scaling, long=long))
    np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6, err_msg=f'{name} long={long}')
    assert layers.rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-7), name
  x = jax.random.normal(jax.random.key(0), (1, 300, 1, 32))
  assert not np.allclose(
    layers.rope(x, np.arange(300)[None], theta, scaling), layers.rope(x, np.arange(300)[None], theta)
  )


PUBLISHED = {  # (family, size) -> parameters (tied embeddings counted once; Gemma 3's text tower)
  ('qwen2', '0.5b'): 494_032_768,
  ('qwen2', '7b'): 7_615_616_512,
  ('qwen3', '0.6b'): 596_049_920,
  ('qwen3', '8b'): 8_190_735_360,
  ('qwen3', '32b'): 32_762_123_264,
  ('mistral', '7b'): 7_241_732_096,
  ('gemma', '2b'): 2_506_172_416,
  ('gemma2', '2b'): 2_614_341_888,
  ('gemma3', '1b'): 999_885_952,
  ('gemma3', '4b'): 3_880_263_168,
  ('gemma3', '12b'): 11_766_034_176,
  ('gemma3', '27b'): 27_009_346_304,
  ('phi3', 'mini'): 3_821_079_552,
  ('olmo2', '7b'): 7_298_617_344,
}


def test_parameter_counts_are_the_published_ones():
  """The closed form (decoder.num_params) at every real size equals the published count, and at every tiny size
  the model's own (built abstractly)."""
  from flax import nnx

  sizes = {(name, size) for name, s in decoders.SIZES.items() for size in s if size != 'tiny'}
  assert sizes == set(PUBLISHED)
  for (name, size), n in PUBLISHED.items():
    assert decoder.num_params(config_file(name).get_config(size).model) == n, (name, size)
  for name in decoders.SIZES:
    cfg = config_file(name).get_config('tiny').model
    abstract = nnx.eval_shape(lambda cfg=cfg: models.create(cfg, nnx.Rngs(0)))
    built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert built == decoder.num_params(cfg), name
