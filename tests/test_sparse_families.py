"""The sparse families on the MoE block (models/moe.py): Qwen3-MoE, DeepSeek-V3 (latent attention, models/mla.py)
and GPT-OSS (attention sinks, sliding windows, biases, clamped SwiGLU), each from a tiny Hugging Face model whose
config no other test uses, against transformers (torch, fp32): logits within 1e-5 and an export bitwise the
checkpoint that transformers loads; greedy tokens equal to transformers' (latent caches, ring caches of the
windows); the ep and fsdp presets trained equal to one device (the pp preset: tests/test_pipeline.py); the published
parameter counts."""

import importlib
import os

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import generation  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
import training  # noqa: E402
from models import moe  # noqa: E402
from tests.conftest import assert_hf_round_trip, build_trainer, load_exported  # noqa: E402
from tests.test_context import _train as train  # noqa: E402
from tests.test_equivalence import ATOL, RTOL  # noqa: E402
from tests.test_generation import check_one_row, check_parity  # noqa: E402
from tests.test_hf_families import import_hf, save, zoo_config  # noqa: E402
from training import tasks  # noqa: E402

PARITY_ATOL = 1e-5  # fp32 logits against transformers'
_C = dict(vocab_size=96, hidden_size=32, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1)
# family -> (config class, its arguments, save_pretrained arguments, zoo preset, scan_layers)
CASES = {
  # 8 experts top-3 (unnormalised weights), a dense layer first (mlp_only_layers), untied, sharded files
  'qwen3_moe': (
    transformers.Qwen3MoeConfig,
    dict(
      _C,
      intermediate_size=40,
      moe_intermediate_size=24,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      num_experts=8,
      num_experts_per_tok=3,
      norm_topk_prob=False,
      mlp_only_layers=[0],
      tie_word_embeddings=False,
    ),
    dict(max_shard_size='40KB'),
    'ep,tiny',
    True,
  ),
  # latent q and kv, interleaved rotary dims, yarn with mscale; sigmoid routing with the correction bias, 4 groups
  # of which 2 are kept, a shared expert, routed_scaling_factor; one dense layer first
  'deepseek_v3': (
    transformers.DeepseekV3Config,
    dict(
      _C,
      intermediate_size=48,
      moe_intermediate_size=16,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=4,
      n_routed_experts=8,
      num_experts_per_tok=2,
      n_shared_experts=1,
      n_group=4,
      topk_group=2,
      routed_scaling_factor=2.5,
      first_k_dense_replace=1,
      q_lora_rank=24,
      kv_lora_rank=16,
      qk_nope_head_dim=8,
      qk_rope_head_dim=8,
      v_head_dim=12,
      rope_parameters=dict(
        rope_type='yarn',
        rope_theta=1e4,
        factor=4.0,
        original_max_position_embeddings=32,
        mscale=1.0,
        mscale_all_dim=0.8,
      ),
      tie_word_embeddings=False,
    ),
    {},
    'fsdp_ep,tiny',
    False,
  ),
  # sinks, windows of 4 on alternate layers, biases everywhere, clamped SwiGLU (limit 1.5: it cuts)
  'gpt_oss': (
    transformers.GptOssConfig,
    dict(
      _C,
      intermediate_size=24,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      num_local_experts=8,
      num_experts_per_tok=2,
      sliding_window=4,
      swiglu_limit=1.5,
      rope_parameters=dict(
        rope_type='yarn',
        rope_theta=1e4,
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
      ),
      tie_word_embeddings=False,
    ),
    {},
    'ep_tp,tiny',
    True,
  ),
}
PROMPTS = [[5, 17, 3, 9, 22, 41, 7, 11, 30, 2, 8], [12], [8, 30, 2, 2, 50, 6]]  # longer than the windows (4)


def config_file(name):
  return importlib.import_module(f'configs.{name}')


def _randomise(model):
  """Sinks, biases and the correction bias start at zero in transformers: random values, so each one counts."""
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for k, p in model.named_parameters():
      if k.endswith(('sinks', 'bias')):
        p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    for k, b in model.named_buffers():
      if k.endswith('e_score_correction_bias'):
        b.copy_(torch.rand(b.shape, generator=g) * 0.2)
  return model


@pytest.fixture(scope='module', params=sorted(CASES))
def family(request, tmp_path_factory):
  name = request.param
  cls, kwargs, save_kw, arg, scan = CASES[name]
  torch.manual_seed(0)
  model = _randomise(transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).eval())
  path, _ = save(model, tmp_path_factory.mktemp(f'hf_{name}'), **save_kw)
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return name, path, model, arg, scan


def test_logits_match_transformers_and_export_back(family, tmp_path):
  name, path, hf_model, arg, scan = family
  cfg = zoo_config(config_file(name), arg, path, scan_layers=scan)
  assert cfg.model.name == name and cfg.model.vocab_size == 96
  assert generation.loading.family_config(path) == f'configs/{name}.py'
  trainer, state = import_hf(cfg)
  tokens = np.random.default_rng(0).integers(0, 96, (2, 32))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  run = lambda p, s, t: tasks.eval_view(nnx.merge(trainer.graphdef, p, s))(t)
  ours, aux = jax.jit(run)(state.params, state.model_state, tokens)
  assert float(aux['dropped_fraction']) == 0.0  # dropless, as transformers'
  err = float(np.abs(np.asarray(ours) - theirs).max())
  print(f'{name}: max |logits diff| {err:.2e} (logits up to {np.abs(theirs).max():.2f})')
  assert err < PARITY_ATOL, err
  _, _, save_kw, _, _ = CASES[name]
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip', **save_kw)
  exported = load_exported(trainer, state, tmp_path / 'loaded', transformers.AutoModelForCausalLM)
  assert type(exported) is type(hf_model)
  for (k, a), (_, b) in zip(sorted(exported.state_dict().items()), sorted(hf_model.state_dict().items())):
    assert torch.equal(a.float(), b), k


def test_greedy_is_transformers(family, monkeypatch):
  """Greedy decoding from the family's cache (DeepSeek: the latent and rotary key, absorbed projections; GPT-OSS:
  ring caches of its windows, sinks) equals transformers' tokens; every step's logits a full forward pass's."""
  name, path, hf_model, arg, scan = family
  monkeypatch.setattr('tests.test_generation.PROMPTS', PROMPTS)
  cfg = zoo_config(config_file(name), arg, path, scan_layers=scan)
  gen = generation.load(cfg, partitioning.make_mesh(cfg.mesh))
  got = check_parity(gen, hf_model)
  assert len({t for g in got for t in g.ids}) > 1  # not one token repeated
  check_one_row(gen, got)  # latent caches; ring caches with sinks
  rows, _, slots = gen.shapes(PROMPTS, generation.Sampling(6, temperature=0.0))
  table = gen.cache_table(rows, slots)
  print(table)
  if name == 'deepseek_v3':
    assert 'full keys and values' in table


# By default each family trains under the preset that shards what is new in it: Qwen3-MoE's 128-way routing over
# `expert`, DeepSeek's latent attention in 'fsdp_tp_cp' (fsdp=2 x context=2 x tensor=2: its weights over `fsdp`,
# its heads and latent dims over `tensor`, every row split over `context`), GPT-OSS's sinks and expert biases over
# `fsdp`; `pytest --all-presets` trains the shipped presets too (every compile here costs tens of seconds on 2 cores).
PRESETS = {'qwen3_moe': ('ep',), 'deepseek_v3': ('fsdp_tp_cp',), 'gpt_oss': ('fsdp',)}
EVERY = {
  'qwen3_moe': ('ep', 'fsdp'),
  'deepseek_v3': ('ep', 'fsdp', 'ep_tp', 'cp', 'fsdp_tp_cp'),
  'gpt_oss': ('ep', 'fsdp'),
}
# Test-only rules: the cp preset's, with latent attention's heads and latent dims (and the MLPs) on `tensor`;
# the latents take `tensor` first, so kv_b_proj and q_b_proj keep their heads whole (the fallback).
TP_CP = [('q_lora', 'tensor'), ('kv_lora', 'tensor'), ('heads', 'tensor'), ('mlp', 'tensor'), ('heads', None)]


def pytest_generate_tests(metafunc):
  if 'family_presets' in metafunc.fixturenames:
    cases = (EVERY if metafunc.config.getoption('--all-presets') else PRESETS).items()
    metafunc.parametrize('family_presets', list(cases), ids=[name for name, _ in cases])


def test_ep_and_fsdp_presets_train_equal_to_one_device(family_presets):
  """2 AdamW steps on the same batches from the same initial state under the expert-parallel and FSDP presets (and
  DeepSeek's latent attention under tensor and context parallelism): losses and parameters within fp32 1e-5 of the
  1-device run (tests/test_equivalence.py's tolerance)."""
  name, presets = family_presets

  def tiny(preset):
    cfg = config_file(name).get_config(f'{"cp" if preset == "fsdp_tp_cp" else preset},tiny')
    cfg.update(batch_size=16)
    cfg.dataset.update(seq_len=32)
    cfg.model.update(group_size=16, num_layers=cfg.model.first_dense_layers + 2)  # one scanned group per stack
    cfg.optim.warmup_steps = 1
    if preset == 'fsdp_tp_cp':
      cfg.mesh.update(fsdp=2, context=2, tensor=2)
      cfg.logical_axis_rules = TP_CP + list(cfg.logical_axis_rules)
    if preset == 'ep_tp':  # the shipped preset leaves the latents whole; here they are split too
      cfg.logical_axis_rules = TP_CP[:2] + list(cfg.logical_axis_rules) + TP_CP[-1:]
    if any('cp' in p for p in presets):  # a routing group split over `context` drops other tokens than one
      cfg.model.capacity_factor = cfg.model.num_experts / cfg.model.top_k  # device's: every run dropless
    return cfg

  one = tiny(presets[0]).copy_and_resolve_references()
  one.mesh.update({k: 1 for k in one.mesh})
  trainer_1 = build_trainer(one, jax.devices()[:1])
  start = jax.device_get(training.init_state(trainer_1))
  batches = [training.tasks.get('lm').synthetic_batch(one, seed=i) for i in range(2)]
  losses_1, params_1 = train(trainer_1, jax.device_put(start, trainer_1.shardings), batches)
  for preset in presets:
    trainer = build_trainer(tiny(preset))
    assert trainer.mesh.size == 8 and trainer.abstract.params == trainer_1.abstract.params
    if preset == 'fsdp_tp_cp':  # rows split over `context`, the latent projections over `tensor`
      attn = trainer.specs.params['blocks']['layers']['self_attn']
      assert trainer.mesh.shape['context'] == 2 and attn['kv_a_proj']['layer']['kernel'][-1] == 'tensor'
    losses, params = train(trainer, jax.device_put(start, trainer.shardings), batches)
    np.testing.assert_allclose(losses, losses_1, rtol=RTOL, atol=ATOL, err_msg=f'{name}:{preset}')
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params_1)):
      np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f'{name}:{preset} {jax.tree_util.keystr(path)}')


# (family, size) -> (total, active parameters) as published (model cards, rounded as they give them). Active counts
# here: every layer's attention and norms, top_k routed and all shared experts, the embedding and the head.
PUBLISHED = {
  ('qwen3_moe', '30b_a3b'): ('30.5B', '3.3B'),
  ('qwen3_moe', '235b_a22b'): ('235B', '22B'),
  ('deepseek_v3', '671b'): ('671B', '37B'),
  ('deepseek_v3', 'v2_lite'): ('15.7B', None),
  ('gpt_oss', '20b'): ('20.9B', None),
  ('gpt_oss', '120b'): ('116.8B', None),
}


def test_parameter_counts_are_the_published_ones():
  """The closed form (moe.num_params) at every real size rounds to the published count, and at every tiny size is
  the model's own (built abstractly)."""
  from flax import nnx

  def rounded(n, published):
    digits = published[:-1]
    decimals = len(digits.partition('.')[2])
    return f'{round(n / 1e9, decimals):.{decimals}f}B' == published

  for (name, size), (total, active) in PUBLISHED.items():
    cfg = config_file(name).get_config(size).model
    assert rounded(moe.num_params(cfg), total), (name, size, moe.num_params(cfg))
    if active:  # the cards round these loosely (3.35B is '3.3B'): within 2%
      assert abs(moe.num_active_params(cfg) / 1e9 / float(active[:-1]) - 1) < 0.02, (name, size)
  for name in CASES:
    cfg = config_file(name).get_config('tiny').model
    abstract = nnx.eval_shape(lambda cfg=cfg: models.create(cfg, nnx.Rngs(0)))
    built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert built == moe.num_params(cfg), name
