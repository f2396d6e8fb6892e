"""The dense decoder families on one block (models/decoder.py): Qwen2, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, Phi-3
and OLMo-2, each from a tiny Hugging Face model whose config no other test uses, against transformers (torch, fp32):
logits within 1e-5 and an export that transformers loads, bitwise the checkpoint (hub layouts: bfloat16, sharded
with an index, tied and untied heads, Phi-3's fused tensors); greedy tokens equal to transformers' with prompts
longer than the sliding windows (window-sized ring caches); the presets trained equal to one device; the rotary
scalings equal to transformers' own; the published parameter counts."""

import contextlib
import importlib
import json
import os
from unittest import mock

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import errors  # noqa: E402
import generation  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
import training  # noqa: E402
from configs import decoders  # noqa: E402
from models import attention, decoder, hf_import, layers  # noqa: E402
from tests.conftest import assert_hf_round_trip, build_trainer, load_exported  # noqa: E402
from tests.test_context import _train as train  # noqa: E402
from tests.test_equivalence import ATOL, RTOL  # noqa: E402
from tests.test_generation import NEW, check_one_row, check_parity  # noqa: E402
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
  return importlib.import_module(f'configs.{name}')  # configs/llama.py too


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def save_tokenizer(path):
  """A word-level tokenizer with a chat template, as a hub snapshot holds one beside the weights."""
  import tokenizers

  words = ['<eos>', '<unk>', 'the', 'quick', 'brown', 'fox']
  tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='<unk>'))
  tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token='<eos>', unk_token='<unk>')
  tok.chat_template = CHAT_TEMPLATE
  tok.save_pretrained(path)


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
  save_tokenizer(path)
  # The reference reads the file as saved (a bfloat16 checkpoint's rounded weights), in float32.
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return name, path, model, arg, scan


def test_logits_match_transformers_and_export_back(family, tmp_path):
  name, path, hf_model, arg, scan = family
  _, _, save_kw, _, _ = CASES[name]
  cfg = zoo_config(config_file(name), arg, path, scan_layers=scan)
  assert cfg.model.name == name and cfg.model.vocab_size == 96
  # generate.py / evaluate_lm.py pick the family's config file by model_type; a Llama config (the SFT config)
  # takes the family's checkpoint as that family
  assert generation.loading.family_config(path) == f'configs/{name}.py'
  sft = zoo_config(importlib.import_module('configs.llama_sft'), 'tiny', path)
  assert sft.model.name == name and sft.model.to_dict() == dict(cfg.model.to_dict(), scan_layers=sft.model.scan_layers)
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
  # the tokenizer files and chat template come along (the run read no other tokenizer directory)
  tokenizer_files = lambda d: sorted(f for f in os.listdir(d) if f.startswith(('tokenizer', 'chat_template')))
  assert tokenizer_files(tmp_path / 'round_trip') == tokenizer_files(path) != []
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'round_trip')
  assert tok.apply_chat_template([{'role': 'user', 'content': 'the fox'}], tokenize=False) == '<user>the fox'
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
  assert set(gen.layout.windows) <= windows and not gen.layout.scanned  # a decode runs its layers unrolled
  got = check_parity(gen, hf_model)
  assert len({t for g in got for t in g.ids}) > 2  # not one token repeated
  if name == 'gemma3':  # one row: ring caches and soft caps; scanned: the pattern's groups and the rest's caches
    check_one_row(gen, got)
    assert scan
    scanned = generation.load(cfg, partitioning.make_mesh(cfg.mesh), unroll=False)
    assert scanned.layout.scanned
    check_parity(scanned, hf_model)
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


def test_a_vision_language_gemma3_checkpoint_gives_its_language_model(tmp_path):
  """Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration: its text_config and the language model's tensors
  (under language_model.model.) are imported, the vision tower ignored; the export is a Gemma3ForCausalLM whose
  text logits are the vision-language model's."""
  cls, kwargs, _, arg, scan = CASES['gemma3']
  torch.manual_seed(0)
  vision = transformers.SiglipVisionConfig(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
  )
  both = transformers.Gemma3Config(
    text_config=cls(**kwargs),
    vision_config=vision,
    mm_tokens_per_image=4,
    boi_token_index=93,
    eoi_token_index=94,
    image_token_index=95,
  )
  path, hf_model = save(transformers.Gemma3ForConditionalGeneration(both).eval(), tmp_path / 'hf')
  cfg = zoo_config(config_file('gemma3'), arg, path, scan_layers=scan)
  assert (cfg.model.name, cfg.model.num_layers, cfg.model.tie_embeddings) == ('gemma3', 5, True)
  trainer, state = import_hf(cfg)
  tokens = np.random.default_rng(0).integers(0, 93, (2, 32))
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.tensor(tokens)).logits.numpy()
  assert float(np.abs(forward(trainer, state, tokens) - theirs).max()) < PARITY_ATOL
  exported = load_exported(trainer, state, tmp_path / 'out', transformers.AutoModelForCausalLM)
  assert type(exported).__name__ == 'Gemma3ForCausalLM'
  with torch.no_grad():
    np.testing.assert_array_equal(exported(torch.tensor(tokens)).logits.numpy(), theirs)


# --- sliding windows and soft caps in every kernel ---------------------------------------------------------------

# kernel -> (implementation, run per context shard, rows in zigzag order over the shards)
KERNELS = {
  'blockwise': ('blockwise', None, False),
  'splash': ('splash', None, False),
  'per_shard_xla': ('auto', attention.per_shard_xla, True),
  'per_shard_blockwise': ('blockwise', None, False),
  'per_shard_splash': ('auto', attention.splash_interpret, True),
  'gspmd_xla': ('auto', None, True),
}


@pytest.mark.parametrize('kernel', sorted(KERNELS))
def test_every_kernel_takes_sliding_windows_and_soft_caps(kernel):
  """Causal attention with a sliding window (not a multiple of the kernels' blocks), a soft cap and another scale,
  packed documents crossing the context shards, padding and grouped kv heads: blockwise (keys in blocks of 8),
  splash (Pallas' TPU interpreter) and, per context shard in shard_map or partitioned by GSPMD, XLA, blockwise and
  splash against unsharded XLA attention: real queries' outputs and all gradients within 1e-5."""
  impl, context, zigzag = KERNELS[kernel]
  splash, cp = 'splash' in kernel, kernel not in ('blockwise', 'splash')
  B, L, H, G, K = (4, 256, 2, 1, 8) if splash else (2, 32, 4, 2, 8)
  logits = attention.Logits(scale=0.3, softcap=2.0, window=L // 4 + 3)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, L, n, K)), jnp.float32) for n in (H, G, G))
  seg = jnp.asarray(np.resize(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], L // 4, axis=1), (B, L)))
  valid = jnp.asarray(np.arange(L)[None] < np.resize([L, L - 5], (B, 1)))
  real = (valid * (seg > 0))[:, :, None, None]
  weights = jnp.cos(jnp.arange(q.size).reshape(q.shape))
  shards = 2 if splash else 4

  def loss(q, k, v, impl, order=1):
    zz = lambda x: partitioning.context.to_zigzag(x, order)
    with partitioning.context.zigzag(order):
      o = attention.attend(
        zz(q), zz(k), zz(v), causal=True, impl=impl, segment_ids_BL=zz(seg), valid_BL=zz(valid), logits=logits
      )
    o = partitioning.context.from_zigzag(o, order) * real
    return (o * weights).sum(), o

  ref = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v, 'xla')
  run = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True), static_argnums=(3, 4))
  with contextlib.ExitStack() as stack:
    stack.enter_context(mock.patch.object(attention, 'BLOCKWISE_KEYS', 8))
    if splash:
      stack.enter_context(attention.splash_interpret())
    if context is not None:
      stack.enter_context(context())
    if cp:
      mesh = partitioning.make_mesh({'fsdp': 8 // shards, 'context': shards})
      rules = [('batch', 'fsdp'), ('length', 'context'), ('heads', None), ('kv_heads', None), ('kv', None)]
      stack.enter_context(partitioning.use_rules(partitioning.AxisRules(rules), mesh))
    got = run(q, k, v, impl, shards if zigzag else 1)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  want = {'blockwise': 'blockwise', 'per_shard_blockwise': 'blockwise', 'gspmd_xla': 'xla'}.get(kernel, kernel)
  assert any(
    d.startswith(want.split('_')[-1] + f' (causal, window {logits.window}, softcap 2')
    and (('per shard' in d) == (cp and kernel != 'gspmd_xla'))
    for d in attention.decisions()
  ), attention.decisions()


# --- config.json ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', sorted(decoders.SIZES))
def test_config_json_reads_back_the_same_architecture(name):
  """config.model -> config.json -> config.model at every size of the family; transformers builds its config class
  from the file (the tiny sizes: a model with the zoo's parameter count)."""
  for size in decoders.SIZES[name]:
    cfg = config_file(name).get_config(size).model
    d = json.loads(json.dumps(models.HF_FAMILIES[name].to_config(cfg)))
    fields = models.HF_FAMILIES[name].config(d)
    expected = {k: cfg[k] for k in fields}
    expected['rope_scaling'] = layers.rope_scaling_params(cfg.rope_scaling)
    expected['layer_pattern'] = decoder.pattern(cfg)
    assert fields == expected, (name, size)
    hf_cfg = transformers.AutoConfig.for_model(**d)
    if size == 'tiny':
      model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
      assert sum(p.numel() for p in model.parameters()) == decoder.num_params(cfg), name


def test_config_json_settings_the_zoo_cannot_build_or_write_are_named():
  """Import: a setting the block does not implement is an HFImportError naming the config.json field. Export: an
  architecture the family's config.json cannot express is an HFExportError naming the config.model field."""
  base = {name: models.HF_FAMILIES[name].to_config(config_file(name).get_config('tiny').model) for name in CASES}
  cases = [
    ('qwen3', dict(attention_bias=True), r'config.json attention_bias=True'),
    ('gemma2', dict(use_bidirectional_attention=True), r'config.json use_bidirectional_attention=True'),
    ('gemma', dict(hidden_act='relu'), r"config.json hidden_act='relu'"),
    ('gemma2', dict(layer_types=['sliding_attention', 'chunked_attention']), r'config.json layer_types='),
    ('phi3', dict(partial_rotary_factor=0.75), r'config.json partial_rotary_factor=0.75'),
    ('olmo2', dict(sliding_window=8), r'config.json sliding_window=8: the olmo2 family attends to the whole'),
    ('mistral', dict(rope_parameters=dict(rope_type='dynamic', factor=2.0)), r"rope_type='dynamic'"),
    (
      'gemma3',
      dict(
        rope_parameters=dict(
          full_attention=dict(rope_type='default', rope_theta=1e6),
          sliding_attention=dict(rope_type='linear', factor=2.0, rope_theta=1e4),
        )
      ),
      r'config.json rope_parameters.sliding_attention=.*local layers are unscaled',
    ),
  ]
  for name, change, message in cases:
    with pytest.raises(hf_import.HFImportError, match=message):
      models.HF_FAMILIES[name].config(dict(base[name], **change))
  for name, change, message in (
    ('llama', dict(sliding_window=16, layer_pattern='LG'), r'config.model.sliding_window=16: a LlamaForCausalLM'),
    ('qwen3', dict(attn_softcap=30.0), r'config.model.attn_softcap=30.0: a Qwen3ForCausalLM config.json cannot'),
    ('mistral', dict(layer_pattern='LG'), r"layer_pattern='LG': a MistralForCausalLM config.json has one"),
  ):
    cfg = config_file(name).get_config('tiny').model
    cfg.update(change)
    with pytest.raises(errors.HFExportError, match=message):
      models.HF_FAMILIES[name].to_config(cfg)
