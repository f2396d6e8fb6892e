"""Llama and BERT: logical names, parameter counts, sharded == 1 device, scan == unrolled, causality,
packing, rotary, padding masks, float32 logits, config errors, and equality with Hugging Face."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import errors
import models
import partitioning
from configs import bert as bert_config
from configs import llama as llama_config
from models import bert, llama
from tests.conftest import build_trainer, stack_layers, unstack_layers

# fp32 logits, 8 devices vs 1 device (sharded matmuls sum in another order), scanned vs unrolled,
# ours vs Hugging Face's (torch CPU). Measured worst cases: 2.4e-7 absolute (llama:tp, logits up to
# 1.3), 0.0, 2.2e-7 (BERT MLM). Asserted at:
RTOL, ATOL = 1e-5, 1e-5

VARIANTS = {  # name -> (config file, arg, model overrides)
  'llama': (llama_config, 'tiny', {}),
  'llama_untied': (llama_config, 'tiny', {'tie_embeddings': False}),
  'bert_mlm': (bert_config, 'tiny', {}),
  'bert_classify': (bert_config, 'tiny,classify', {}),
}


def model_cfg(variant, **overrides):
  module, arg, base = VARIANTS[variant]
  cfg = module.get_config(arg).model
  cfg.update(**base, **overrides)
  return cfg


@functools.cache
def _model(variant, overrides):
  return models.create(model_cfg(variant, **dict(overrides)), nnx.Rngs(0))


def model(variant, **overrides):
  """A shared model (tests never mutate it): each distinct request is built once per session."""
  return _model(variant, tuple(sorted(overrides.items())))


@nnx.jit
def run(model, tokens_BL, kwargs):
  """model(tokens, **kwargs), compiled once per model structure and input shapes (eager is slower)."""
  return model(tokens_BL, **kwargs)


def tokens(shape, vocab, seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_every_parameter_has_logical_names_and_count_matches_formula(variant):
  cfg = model_cfg(variant)
  abstract = nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0)))
  state = nnx.state(abstract, nnx.Param)
  names = partitioning.nnx_logical_axes(state)
  flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
  for path, leaf in flat:
    n = names
    for k in path:
      n = n[k.key]
    assert n is not None and len(n) == leaf.ndim and all(isinstance(a, str) for a in n), partitioning.path_str(path)
  formula = (llama if cfg.name == 'llama' else bert).num_params(cfg)
  assert sum(leaf.size for _, leaf in flat) == formula
  assert sum(leaf.size for _, leaf in flat) < 500_000  # tiny trains in seconds


def test_formulas_give_the_published_counts():
  # Llama-3.2-1B (HF LlamaForCausalLM, tied embeddings): 1,235,814,400.
  assert llama.num_params(llama_config.get_config('real').model) == 1_235_814_400
  base = bert_config.get_config('base').model
  base.pad_vocab_to = 1  # the published counts have 30522 vocabulary rows
  # bert-base-uncased: HF BertModel incl. pooler 109,482,240 (= the classify head with 0 classes);
  # BertForMaskedLM 109,514,298 (no pooler; transform dense + LayerNorm + 30522 decoder biases).
  assert bert.num_params(base) == 109_514_298
  base.update(head='classify', num_classes=0)
  assert bert.num_params(base) == 109_482_240
  base.num_classes = 2
  assert bert.num_params(base) == 109_482_240 + 768 * 2 + 2  # BertForSequenceClassification, SST-2


def merged(m, params):
  """A copy of model m with other parameter values (a pure dict, e.g. from nnx.to_pure_dict)."""
  graphdef, _, rest = nnx.split(m, nnx.Param, ...)
  return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params), rest)


def forward_on_mesh(cfg, devices, batch, m):
  """The task's forward pass on the config's mesh under its rules, with m's weights placed by the
  trainer's parameter shardings; returns the logits on the host."""
  trainer = build_trainer(cfg, devices)
  _, params, rest = nnx.split(m, nnx.Param, ...)
  params = jax.device_put(nnx.to_pure_dict(params), trainer.shardings.params)
  batch = jax.device_put(batch, {k: trainer.batch_shardings[k] for k in batch})

  @jax.jit
  def forward(params, batch):
    with partitioning.use_rules(trainer.rules, trainer.mesh, seen=trainer.seen):
      return trainer.task.forward(nnx.merge(trainer.graphdef, params, rest), batch)[0]

  return np.asarray(forward(params, batch))


def random_batch(cfg, B=8):
  L, V = cfg.dataset.seq_len, cfg.model.vocab_size
  if cfg.task == 'lm':  # packed rows: two documents each
    cut = jax.random.randint(jax.random.key(3), (B, 1), 1, L)
    seg = jnp.where(jnp.arange(L) < cut, 1, 2).astype(jnp.int32)
    pos = jnp.where(seg == 1, jnp.arange(L), jnp.arange(L) - cut).astype(jnp.int32)
    return {'inputs': tokens((B, L), V), 'segment_ids': seg, 'positions': pos}
  n = jax.random.randint(jax.random.key(3), (B, 1), 2, L + 1)
  return {
    'inputs': tokens((B, L), V),
    'input_mask': (jnp.arange(L) < n).astype(jnp.int32),
    'token_types': (jnp.arange(L) >= n // 2).astype(jnp.int32),
  }


@pytest.mark.parametrize(
  'variant, arg', [('llama', 'tp,tiny'), ('bert_mlm', 'fsdp_tp,tiny'), ('bert_classify', 'tp,tiny,classify')]
)
def test_sharded_forward_equals_single_device(variant, arg):
  cfg = VARIANTS[variant][0].get_config(arg)
  cfg.dataset.seq_len = 16
  if cfg.task == 'lm':
    cfg.dataset.pack = True  # positions and segment ids travel sharded too
  batch = random_batch(cfg)
  sharded = forward_on_mesh(cfg, jax.devices(), batch, model(variant))
  cfg.mesh.update(data=1, fsdp=1, tensor=1)
  single = forward_on_mesh(cfg, jax.devices()[:1], batch, model(variant))
  np.testing.assert_allclose(sharded, single, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('variant', ['llama', 'bert_mlm'])
def test_scan_equals_unrolled(variant):
  unrolled = model(variant, scan_layers=False)
  params = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
  scanned = merged(model(variant, scan_layers=True), stack_layers(params))
  x = tokens((2, 16), 16)
  np.testing.assert_allclose(run(scanned, x, {}), run(unrolled, x, {}), rtol=RTOL, atol=ATOL)
  back = unstack_layers(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), 2)
  jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_float32_logits_under_bf16_compute(variant):
  m = model(variant, dtype='bfloat16')
  cfg = model_cfg(variant)
  logits = run(m, tokens((2, 16), 16), {})
  expected = (2, cfg.num_classes) if cfg.get('head') == 'classify' else (2, 16, cfg.vocab_size)
  assert logits.shape == expected and logits.dtype == jnp.float32
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(m, nnx.Param)))


# --- Llama ------------------------------------------------------------------------------------------


def test_llama_gqa_is_causal_and_packed_documents_are_isolated():
  m = model('llama')
  assert m.blocks.layers.self_attn.key.layer.kernel.shape[-2:] == (4, 8)  # 4 kv heads for 8 query heads
  x = tokens((2, 16), 16)
  logits = run(m, x, {})
  changed = x.at[:, 10].set((x[:, 10] + 1) % 16)
  diff = np.abs(np.asarray(run(m, changed, {}) - logits)).max(-1)
  assert (diff[:, :10] == 0).all() and (diff[:, 10:] > 0).all()

  # Two packed documents per row: document 2 (positions restart at 0) as if it were alone.
  seg = jnp.array([[1] * 6 + [2] * 10] * 2)
  pos = jnp.array([list(range(6)) + list(range(10))] * 2)
  packed = run(m, x, dict(positions_BL=pos, segment_ids_BL=seg))
  alone = run(m, jnp.concatenate([x[:, 6:], x[:, :6]], 1), {})[:, :10]
  np.testing.assert_allclose(packed[:, 6:], alone, rtol=RTOL, atol=ATOL)
  other = run(m, x.at[:, :6].set(3), dict(positions_BL=pos, segment_ids_BL=seg))
  np.testing.assert_array_equal(np.asarray(other[:, 6:]), np.asarray(packed[:, 6:]))


def test_llama_rotary_depends_only_on_relative_position():
  m = model('llama')
  x = tokens((2, 16), 16)
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  one_doc = lambda p: dict(positions_BL=p, segment_ids_BL=jnp.ones((2, 16), jnp.int32))
  base = run(m, x, one_doc(pos))
  np.testing.assert_allclose(run(m, x, {}), base, rtol=RTOL, atol=ATOL)  # default positions are 0..L-1
  # Shifting every position by 37 moves no logit by more than float32 rounding of the angles (2.4e-7 seen).
  np.testing.assert_allclose(run(m, x, one_doc(pos + 37)), base, rtol=RTOL, atol=ATOL)
  # ... while the positions themselves matter: a different spacing changes the logits.
  assert np.abs(np.asarray(run(m, x, one_doc(2 * pos)) - base)).max() > 1e-3


# --- BERT -------------------------------------------------------------------------------------------


@pytest.mark.parametrize('variant', ['bert_mlm', 'bert_classify'])
def test_bert_padding_does_not_reach_real_tokens(variant):
  m = model(variant)
  x = tokens((2, 16), 260)
  valid = (jnp.arange(16) < jnp.array([[9], [13]])).astype(jnp.int32)
  kw = dict(valid_BL=valid, token_types_BL=(jnp.arange(16) >= 5).astype(jnp.int32)[None].repeat(2, 0))
  out = run(m, x, kw)
  repadded = run(m, jnp.where(valid == 1, x, 7), kw)
  if variant == 'bert_mlm':
    real = np.asarray(valid, bool)
    np.testing.assert_array_equal(np.asarray(repadded)[real], np.asarray(out)[real])
    # Bidirectional: changing token 8 changes the logits of earlier positions too.
    moved = run(m, x.at[:, 8].set((x[:, 8] + 1) % 260), kw)
    assert (np.abs(np.asarray(moved - out))[:, :8].max(-1) > 0).all()
  else:
    np.testing.assert_array_equal(np.asarray(repadded), np.asarray(out))
  # Eval batches pad whole rows (input_mask all 0): their logits must stay finite (masked loss * 0).
  assert np.isfinite(np.asarray(run(m, x, {**kw, 'valid_BL': jnp.zeros_like(valid)}))).all()


# --- Hugging Face: same weights, same logits ----------------------------------------------------------


def _hf_linear(w, *out_shape):
  """HF nn.Linear weight (out, in) -> our kernel (in, *out_shape)."""
  return w.T.reshape(w.shape[1], *out_shape)


def test_llama_equals_hugging_face():
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  cfg = model_cfg('llama_untied')
  D, H, G, K = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  hf = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
      vocab_size=cfg.vocab_size,
      hidden_size=D,
      intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=H,
      num_key_value_heads=G,
      head_dim=K,
      rope_theta=cfg.rope_theta,
      rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=False,
    )
  ).eval()
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

  def layer(i):
    p = f'model.layers.{i}'
    kernel = lambda name, *shape: {'layer': {'kernel': _hf_linear(sd[f'{p}.{name}.weight'], *shape)}}
    return {
      'input_layernorm': {'scale': sd[f'{p}.input_layernorm.weight']},
      'post_attention_layernorm': {'scale': sd[f'{p}.post_attention_layernorm.weight']},
      'self_attn': {
        'query': kernel('self_attn.q_proj', H, K),
        'key': kernel('self_attn.k_proj', G, K),
        'value': kernel('self_attn.v_proj', G, K),
        'out': {'layer': {'kernel': sd[f'{p}.self_attn.o_proj.weight'].T.reshape(H, K, D)}},
      },
      'mlp': {
        'gate': kernel('mlp.gate_proj', cfg.mlp_dim),
        'up': kernel('mlp.up_proj', cfg.mlp_dim),
        'down': kernel('mlp.down_proj', D),
      },
    }

  params = {
    'embed_tokens': {'embed': {'embedding': sd['model.embed_tokens.weight']}},
    'blocks': {'layers': stack_layers({'layers': {i: layer(i) for i in range(cfg.num_layers)}})['layers']},
    'norm': {'scale': sd['model.norm.weight']},
    'lm_head': {'layer': {'kernel': sd['lm_head.weight'].T}},
  }
  x = np.asarray(tokens((2, 16), cfg.vocab_size))
  with torch.no_grad():
    expected = hf(torch.tensor(x)).logits.numpy()
  np.testing.assert_allclose(
    run(merged(model('llama_untied'), params), jnp.asarray(x), {}), expected, rtol=RTOL, atol=ATOL
  )


@pytest.mark.parametrize('variant', ['bert_mlm', 'bert_classify'])
def test_bert_equals_hugging_face(variant):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  cfg = model_cfg(variant)
  D, H = cfg.embed_dim, cfg.num_heads
  K = D // H
  hf_cfg = transformers.BertConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=D,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=H,
    intermediate_size=cfg.mlp_dim,
    max_position_embeddings=cfg.max_len,
    type_vocab_size=cfg.type_vocab_size,
    layer_norm_eps=cfg.norm_eps,
    hidden_act='gelu',
    num_labels=cfg.get('num_classes') or 2,
  )
  hf = (transformers.BertForMaskedLM if cfg.head == 'mlm' else transformers.BertForSequenceClassification)(hf_cfg)
  hf.eval()
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  ln = lambda p: {'scale': sd[f'{p}.weight'], 'bias': sd[f'{p}.bias']}
  dense = lambda p, *shape: {
    'layer': {'kernel': _hf_linear(sd[f'{p}.weight'], *shape), 'bias': sd[f'{p}.bias'].reshape(shape)}
  }

  def layer(i):
    p = f'bert.encoder.layer.{i}'
    attn = {n: dense(f'{p}.attention.self.{n}', H, K) for n in ('query', 'key', 'value')}
    attn['out'] = {
      'layer': {
        'kernel': sd[f'{p}.attention.output.dense.weight'].T.reshape(H, K, D),
        'bias': sd[f'{p}.attention.output.dense.bias'],
      }
    }
    return {
      'attention': attn,
      'attention_ln': ln(f'{p}.attention.output.LayerNorm'),
      'mlp': {'up': dense(f'{p}.intermediate.dense', cfg.mlp_dim), 'down': dense(f'{p}.output.dense', D)},
      'output_ln': ln(f'{p}.output.LayerNorm'),
    }

  e = 'bert.embeddings'
  params = {
    'word_embeddings': {'embed': {'embedding': sd[f'{e}.word_embeddings.weight']}},
    'position_embeddings': sd[f'{e}.position_embeddings.weight'],
    'token_type_embeddings': sd[f'{e}.token_type_embeddings.weight'],
    'embeddings_ln': ln(f'{e}.LayerNorm'),
    'encoder': stack_layers({'layers': {i: layer(i) for i in range(cfg.num_layers)}}),
  }
  if cfg.head == 'mlm':
    params.update(
      transform=dense('cls.predictions.transform.dense', D),
      transform_ln=ln('cls.predictions.transform.LayerNorm'),
      decoder_bias=sd['cls.predictions.bias'],
    )
  else:
    params.update(pooler=dense('bert.pooler.dense', D), classifier=dense('classifier', cfg.num_classes))
  x = np.asarray(tokens((2, 16), cfg.vocab_size))
  valid = (np.arange(16) < np.array([[16], [11]])).astype(np.int32)
  types = (np.arange(16) >= 6)[None].repeat(2, 0).astype(np.int32)
  with torch.no_grad():
    expected = hf(
      input_ids=torch.tensor(x), attention_mask=torch.tensor(valid), token_type_ids=torch.tensor(types)
    ).logits.numpy()
  got = np.asarray(
    run(
      merged(model(variant), params),
      jnp.asarray(x),
      dict(valid_BL=jnp.asarray(valid), token_types_BL=jnp.asarray(types)),
    )
  )
  if cfg.head == 'mlm':  # compare real positions (padded ones are never scored)
    got, expected = got[valid == 1], expected[valid == 1]
  np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# --- Config errors ----------------------------------------------------------------------------------


def test_config_errors_name_the_culprit():
  with pytest.raises(errors.ConfigError, match='num_heads 8 is not a multiple of num_kv_heads 3'):
    nnx.eval_shape(lambda: models.create(model_cfg('llama', num_kv_heads=3), nnx.Rngs(0)))
  with pytest.raises(errors.ConfigError, match=re.escape("config.model.head='pooler' is not a BERT head")):
    nnx.eval_shape(lambda: models.create(model_cfg('bert_mlm', head='pooler'), nnx.Rngs(0)))
  with pytest.raises(errors.ConfigError, match='sequence length 65 exceeds the model max_len 64'):
    model('bert_mlm')(jnp.zeros((1, 65), jnp.int32))
  known = "presets: ['dp', 'fsdp', 'fsdp_tp', 'tp'], sizes: ['base', 'tiny'], tasks: ['classify', 'mlm']"
  with pytest.raises(ValueError, match=re.escape(f"unknown config argument 'clasify'; {known}")):
    bert_config.get_config('tiny,clasify')
  # 2 kv heads cannot be split over tensor=4 (the tp preset): the rules say which array and why.
  cfg = llama_config.get_config('tp,tiny')
  cfg.model.num_kv_heads = 2
  with pytest.raises(
    errors.ShardingError,
    match=r"parameter 'blocks/layers/self_attn/key/layer/kernel': "
    r"dim 2 \('kv_heads'\) has size 2, not divisible by mesh axes "
    r'tensor=4',
  ):
    build_trainer(cfg)
