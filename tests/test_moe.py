"""MoE: routing, capacity and drops, the load-balancing loss, counts, expert parallelism (sharded
expert weights, no all-gather of them in the compiled step, sharded == 1-device), scan == unrolled."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
import partitioning
import training
from configs import moe as moe_config
from errors import ConfigError, ShardingError
from models import moe
from tests.conftest import assert_every_leaf_named, build_trainer, stack_layers

# fp32 forward, ep (8 devices) vs 1 device: measured max abs difference 1.7e-7 on logits up to 0.53
# (reductions in another order); routing, including the 29% of assignments dropped at capacity factor
# 1.25 with groups of 16 tokens, is identical.
RTOL = ATOL = 1e-5
L = 16  # test sequence length (also the group size)


def tiny_cfg(preset='ep', **model):
  cfg = moe_config.get_config(f'{preset},tiny')
  cfg.model.update({'group_size': L, **model})
  cfg.dataset.seq_len = L
  return cfg


def count(cfg):
  model = nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


route = jax.jit(moe.route, static_argnums=(1, 2))  # jitted: op-by-op dispatch on 8 CPU devices is slow
apply = nnx.jit(lambda model, *args: model(*args))


def tokens(B=4, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, L), 0, 16)


def test_every_parameter_has_logical_names():
  abstract = nnx.eval_shape(lambda: models.create(tiny_cfg().model, nnx.Rngs(0)))
  axes = assert_every_leaf_named(nnx.state(abstract))
  layers = axes['blocks']['layers']['moe']
  assert layers['gate'] == ('layers', 'expert', 'embed', 'mlp')
  assert layers['down'] == ('layers', 'expert', 'mlp', 'embed')
  assert layers['router']['layer']['kernel'] == ('layers', 'embed', 'expert')


@pytest.mark.parametrize(
  'overrides', [{}, {'scan_layers': False}, {'tie_embeddings': True, 'vocab_size': 13, 'pad_vocab_to': 8}]
)
def test_parameter_count_matches_formula(overrides):
  cfg = tiny_cfg(**overrides).model
  assert count(cfg) == moe.num_params(cfg)


def test_formula_gives_published_counts():
  # Mixtral-8x7B (Mistral AI; Hugging Face MixtralForCausalLM): 46,702,792,704 parameters ("46.7B"),
  # 12.9B active per token. V=32000, D=4096, 32 layers, 32 heads, 8 kv heads, F=14336, 8 experts, top-2.
  mixtral = dict(
    vocab_size=32000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336, num_experts=8, top_k=2
  )
  c = moe_config.get_config('small').model
  c.update(mixtral, head_dim=128)  # Mixtral's 4096 / 32
  assert moe.num_params(c) == 46_702_792_704
  assert moe.num_active_params(c) == 12_879_925_248
  small = moe_config.get_config('small').model  # this zoo's 'small' size
  assert (moe.num_params(small), moe.num_active_params(small)) == (927_589_376, 304_735_232)


def test_top_k_picks_the_largest_logits_and_renormalises():
  G, S, E, k = 3, 8, 8, 2
  logits = jax.random.normal(jax.random.key(0), (G, S, E))
  dispatch, combine, stats = route(logits, k, S)  # capacity S: nothing dropped
  top = np.argsort(-np.asarray(logits), axis=-1)[..., :k]
  chosen = np.asarray(dispatch).sum(-1)  # (G, S, E): 1 where the token went to the expert
  np.testing.assert_array_equal(chosen, np.asarray(jax.nn.one_hot(top, E).sum(-2)))
  w = np.asarray(jax.nn.softmax(jnp.take_along_axis(logits, jnp.asarray(top), -1), -1))  # renormalised top-k
  np.testing.assert_allclose(np.take_along_axis(np.asarray(combine).sum(-1), top, -1), w, rtol=1e-6)
  assert float(stats['dropped_fraction']) == 0.0
  # Every slot holds at most one token; every (token, expert) has at most one slot.
  assert np.asarray(dispatch).sum(1).max() == 1 and np.asarray(dispatch).sum(-1).max() == 1
  ours = jax.jit(moe.top_k, static_argnums=1)(logits, k)
  ref = jax.lax.top_k(logits, k)
  for a, b in zip(ours, ref):
    np.testing.assert_array_equal(a, b)


def test_capacity_keeps_first_choices_before_second_choices():
  # One group, 4 tokens, 4 experts, k=2, capacity 2. First choices: token 0 -> expert 0, tokens 1, 2, 3
  # -> expert 1. Second choices: token 0 -> expert 1, tokens 1, 2, 3 -> expert 2.
  logits = jnp.array([[[9.0, 5.0, 0.0, 0.0], [0.0, 9.0, 5.0, 0.0], [0.0, 9.0, 5.0, 0.0], [0.0, 9.0, 5.0, 0.0]]])
  dispatch, combine, stats = route(logits, 2, 2)
  kept = np.asarray(dispatch).sum(-1)[0]  # (S, E)
  # Expert 1: the first choices of tokens 1 and 2 fill it; token 3's first and token 0's second choice drop.
  np.testing.assert_array_equal(kept[:, 1], [0, 1, 1, 0])
  # Expert 2 (second choices only): tokens 1 and 2, in token order; token 3's drops.
  np.testing.assert_array_equal(kept[:, 2], [0, 1, 1, 0])
  assert kept[0, 0] == 1 and float(stats['dropped_fraction']) == 3 / 8
  # Slots are filled in order: expert 1 slot 0 = token 1, slot 1 = token 2.
  np.testing.assert_array_equal(np.asarray(dispatch)[0, :, 1], [[0, 0], [1, 0], [0, 1], [0, 0]])
  # A dropped assignment carries no weight (the kept ones are not renormalised again); token 3 lost both
  # experts and passes through the residual connection alone.
  w0 = float(jax.nn.softmax(jnp.array([9.0, 5.0]))[0])
  assert float(combine[0, 0].sum()) == pytest.approx(w0, rel=1e-6) and float(combine[0, 3].sum()) == 0.0


def load_balance_by_hand(logits, k):
  logits = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
  T, E = logits.shape
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  counts = np.zeros(E)
  for t in range(T):
    for e in np.argsort(-logits[t])[:k]:
      counts[e] += 1
  return E * np.sum(counts / (T * k) * probs.mean(0))


def test_load_balance_loss_equals_the_formula_and_is_one_when_uniform():
  logits = 2 * jax.random.normal(jax.random.key(3), (2, 8, 4))
  _, _, stats = route(logits, 2, 8)
  lb = float(stats['load_balance_loss'])
  assert lb > 0
  np.testing.assert_allclose(lb, load_balance_by_hand(logits, 2), rtol=1e-6)
  lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  np.testing.assert_allclose(float(stats['router_z_loss']), np.mean(lse**2), rtol=1e-6)
  # Uniform routing: token t's logits are a fixed vector rolled by t, so over 4 tokens every expert gets
  # the same share of assignments and the same mean probability: E * sum_e (1/E)(1/E) = 1, the minimum.
  base = jnp.array([3.0, 2.0, 1.0, 0.0])
  uniform = jnp.stack([jnp.roll(base, t) for t in range(8)])[None]
  _, _, stats = route(uniform, 2, 8)
  np.testing.assert_allclose(float(stats['load_balance_loss']), 1.0, rtol=1e-6)
  skewed = uniform.at[..., 0].add(5.0)  # expert 0 favoured: the loss rises above its minimum
  assert float(route(skewed, 2, 8)[2]['load_balance_loss']) > 1.5


def test_model_aux_loss_is_weighted_sum_over_layers_and_added_to_the_lm_loss():
  cfg = tiny_cfg(router_z_loss_weight=0.0).model
  model = models.create(cfg, nnx.Rngs(0))
  router = model.blocks.layers.moe.router.layer.kernel
  router[...] = jnp.zeros_like(router[...])  # every token sees uniform probabilities
  batch = {'inputs': tokens(), 'targets': tokens(seed=2), 'mask': jnp.ones((4, L))}
  loss, metrics = nnx.jit(training.tasks.get('lm').loss)(model, batch)  # metrics hold the model's aux
  np.testing.assert_allclose(float(metrics['load_balance_loss']), 1.0, rtol=1e-6)  # mean over layers
  np.testing.assert_allclose(float(metrics['aux_loss']), cfg.num_layers * cfg.aux_loss_weight * 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(loss), float(metrics['loss'] + metrics['aux_loss']), rtol=1e-6)


def test_moe_layer_without_drops_equals_the_dense_mixture():
  cfg = tiny_cfg(capacity_factor=4.0).model  # capacity_factor >= E / k: C = S, nothing dropped
  layer = moe.MoEMLP(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, L, cfg.embed_dim))
  y, aux = apply(layer, x)
  assert float(aux['dropped_fraction']) == 0.0

  @nnx.jit
  def dense_mixture(layer, x):
    w, e = jax.lax.top_k(jax.nn.softmax(layer.router(x), -1), cfg.top_k)
    w = w / w.sum(-1, keepdims=True)
    expert = lambda i: (jax.nn.silu(x @ layer.gate[i]) * (x @ layer.up[i])) @ layer.down[i]
    all_experts = jnp.stack([expert(i) for i in range(cfg.num_experts)], -2)  # (B, L, E, D)
    return (jnp.take_along_axis(all_experts, e[..., None], -2) * w[..., None]).sum(-2)

  ref = dense_mixture(layer, x)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def forward(trainer, state, toks):
  @jax.jit
  def run(params, toks):
    with partitioning.use_rules(trainer.rules, trainer.mesh):
      return nnx.merge(trainer.graphdef, params, state.model_state)(toks)

  return jax.device_get(run(state.params, partitioning.shard(toks, trainer.batch_shardings['inputs'])))


def test_expert_parallel_forward_equals_single_device():
  cfg = tiny_cfg('ep')
  trainer = build_trainer(cfg)
  state = training.init_state(trainer)
  # Expert weights are split over the 'expert' mesh axis: each device holds 2 of the 8 experts.
  experts = state.params['blocks']['layers']['moe']
  for name in ('gate', 'up', 'down'):
    assert experts[name].sharding.spec == P(None, 'expert'), name
    assert experts[name].addressable_shards[0].data.shape[:2] == (cfg.model.num_layers, 2), name
  logits, aux = forward(trainer, state, tokens(16))
  cfg.mesh.update(data=1, expert=1)
  single = build_trainer(cfg, jax.devices()[:1])
  logits_1, aux_1 = forward(single, training.init_state(single), tokens(16))
  np.testing.assert_allclose(logits, logits_1, rtol=RTOL, atol=ATOL)
  for k in aux_1:
    np.testing.assert_allclose(aux[k], aux_1[k], rtol=RTOL, atol=ATOL, err_msg=k)


@pytest.mark.parametrize('preset', ['ep', 'fsdp_ep'])
def test_compiled_step_moves_tokens_not_expert_weights(preset):
  cfg = tiny_cfg(preset, mlp_dim=48)  # a width no other array has, so expert shapes are unambiguous
  trainer = build_trainer(cfg)
  hlo = training.compile_step(trainer, training.jit_train_step(trainer)).as_text()
  m = cfg.model
  E, D, F, N = m.num_experts, m.embed_dim, m.mlp_dim, m.num_layers
  full_shapes = {(N, E, D, F), (N, E, F, D), (E, D, F), (E, F, D)}
  layer_bytes = E * D * F * 4  # one layer's full gate (or up, or down) weights
  gathers = partitioning.collective_shapes(hlo, 'all-gather')  # per-device result shapes
  assert gathers  # the parser sees the gathers that are there (the router kernel, FSDP's dense weights)
  for shape in gathers:
    assert shape not in full_shapes, shape
    assert 4 * np.prod(shape) < layer_bytes, shape
  if preset == 'ep':  # the only gathers: the router's (embed, expert) kernel, forward and backward
    assert gathers == [(D, E), (D, E)], gathers
  else:  # FSDP gathers this device's experts over 'fsdp' only: (E / expert, D, F), 2 of the 8 experts
    assert (E // 4, D, F) in gathers and (E // 4, F, D) in gathers, gathers
  # Tokens move instead: all-to-all to the experts and back, in the forward and the backward pass.
  stats = partitioning.collective_stats(hlo)
  assert stats['all-to-all'][0] == 4, stats


def test_scan_equals_unrolled():
  unrolled = models.create(tiny_cfg(scan_layers=False).model, nnx.Rngs(0))
  scanned = models.create(tiny_cfg(scan_layers=True).model, nnx.Rngs(1))
  nnx.update(scanned, stack_layers(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))))
  (a, aux_a), (b, aux_b) = apply(scanned, tokens()), apply(unrolled, tokens())
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for k in aux_b:
    np.testing.assert_allclose(aux_a[k], aux_b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_bf16_compute_gives_f32_logits_and_is_causal():
  cfg = tiny_cfg(dtype='bfloat16', capacity_factor=4.0).model  # no drops: routing is per token
  model = models.create(cfg, nnx.Rngs(0))
  toks = tokens(2)
  logits, aux = apply(model, toks)
  assert logits.shape == (2, L, 16) and logits.dtype == jnp.float32 and aux['aux_loss'].dtype == jnp.float32
  assert model.blocks.layers.moe.gate[...].dtype == jnp.float32  # params stay f32
  changed = toks.at[:, 10].set((toks[:, 10] + 1) % 16)
  diff = np.abs(np.asarray(apply(model, changed)[0] - logits)).max(-1)
  assert (diff[:, :10] == 0).all() and (diff[:, 10:] > 0).all()


@pytest.mark.parametrize(
  'field,value,msg',
  [
    ('top_k', 0, 'config.model.top_k=0 must be in [1, num_experts=8]'),
    ('top_k', 9, 'config.model.top_k=9 must be in [1, num_experts=8]'),
    ('capacity_factor', 0.0, 'config.model.capacity_factor=0.0 must be > 0'),
    ('group_size', 0, 'config.model.group_size=0 must be >= 1'),
  ],
)
def test_bad_config_values(field, value, msg):
  with pytest.raises(ConfigError, match=re.escape(msg)):
    models.create(tiny_cfg(**{field: value}).model, nnx.Rngs(0))


def test_group_size_must_divide_the_sequence():
  model = models.create(tiny_cfg(group_size=6).model, nnx.Rngs(0))
  with pytest.raises(ConfigError, match=re.escape('config.model.group_size=6 must divide the sequence length 16')):
    apply(model, tokens())


def test_experts_must_divide_the_expert_mesh_axis():
  with pytest.raises(
    ShardingError,
    match=r"parameter 'blocks/layers/moe/down': dim 1 \('expert'\) has size 6, "
    r'not divisible by mesh axes expert=4',
  ):
    build_trainer(tiny_cfg('ep', num_experts=6))


def test_equals_hugging_face_mixtral_when_nothing_is_dropped():
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  cfg = tiny_cfg(capacity_factor=4.0, mlp_dim=48).model  # C = S: dropless, like Hugging Face's Mixtral
  D, H, G, F, E = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.mlp_dim, cfg.num_experts
  K = D // H
  torch.manual_seed(0)
  hf = transformers.MixtralForCausalLM(
    transformers.MixtralConfig(
      vocab_size=cfg.vocab_size,
      hidden_size=D,
      intermediate_size=F,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=H,
      num_key_value_heads=G,
      num_local_experts=E,
      num_experts_per_tok=cfg.top_k,
      rope_theta=cfg.rope_theta,
      rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=False,
    )
  ).eval()
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

  def layer(i):
    p = f'model.layers.{i}'
    kernel = lambda name, *shape: {'layer': {'kernel': sd[f'{p}.{name}.weight'].T.reshape(D, *shape)}}
    gate_up = sd[f'{p}.mlp.experts.gate_up_proj'].transpose(0, 2, 1)  # (E, 2F, D) -> (E, D, 2F)
    return {
      'input_layernorm': {'scale': sd[f'{p}.input_layernorm.weight']},
      'post_attention_layernorm': {'scale': sd[f'{p}.post_attention_layernorm.weight']},
      'self_attn': {
        'query': kernel('self_attn.q_proj', H, K),
        'key': kernel('self_attn.k_proj', G, K),
        'value': kernel('self_attn.v_proj', G, K),
        'out': {'layer': {'kernel': sd[f'{p}.self_attn.o_proj.weight'].T.reshape(H, K, D)}},
      },
      'moe': {
        'router': {'layer': {'kernel': sd[f'{p}.mlp.gate.weight'].T}},
        'gate': gate_up[..., :F],
        'up': gate_up[..., F:],
        'down': sd[f'{p}.mlp.experts.down_proj'].transpose(0, 2, 1),
      },
    }

  params = {
    'embed_tokens': {'embed': {'embedding': sd['model.embed_tokens.weight']}},
    'blocks': {'layers': stack_layers({'layers': {i: layer(i) for i in range(cfg.num_layers)}})['layers']},
    'norm': {'scale': sd['model.norm.weight']},
    'lm_head': {'layer': {'kernel': sd['lm_head.weight'].T}},
  }
  model = models.create(cfg, nnx.Rngs(0))
  nnx.update(model, jax.tree.map(jnp.asarray, params))
  x = np.asarray(tokens(2))
  with torch.no_grad():
    expected = hf(torch.tensor(x)).logits.numpy()
  logits, aux = apply(model, jnp.asarray(x))
  assert float(aux['dropped_fraction']) == 0.0
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
