"""The GPU speed paths, tested where CI runs (CPU): attention selection and its fallback, remat policies,
bf16 logits, FLOP counting, chip peaks, mesh fitting, MFU and profiles in train.py, the benchmark."""

import contextlib
import functools
import glob
import io
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import partitioning
import train
import training
from configs import resnet as resnet_config
from errors import ConfigError, ShardingError
from models import attention, layers, resnet
from partitioning import hlo
from tests import children
from tests.conftest import ROOT, all_eqns, build_trainer, subprocess_env, tiny_config, train_on_random_batches
from training import flops, profiling


def _qkv(B=2, L=16, H=4, G=2, K=8, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal((B, L, n, K)), dtype) for n in (H, G, G))


def test_auto_attention_on_cpu_runs_xla_and_says_why():
  q, k, v = _qkv()
  assert attention.choose('auto', q, k, causal=True, packed=False, padded=False) == ('xla', None)
  why = [d for d in attention.decisions() if d.startswith('xla (causal, float32, L=16, head_dim 8)')]
  assert why and 'cpu backend (cuDNN and Pallas run on GPUs)' in why[0] and 'float32 compute' in why[0], (
    attention.decisions()
  )


def test_cudnn_where_it_cannot_run_is_one_error_naming_why():
  q, k, v = _qkv(K=12)
  with pytest.raises(
    ConfigError,
    match=r'config.model.attention=cudnn cannot run this attention .*cpu backend.*'
    r'head_dim 12 \(fused kernels take a multiple of 8',
  ):
    attention.choose('cudnn', q, k, causal=True, packed=False, padded=False)
  q, k, v = _qkv(L=24, K=24)
  with pytest.raises(
    ConfigError,
    match=r'config.model.attention=pallas cannot run this attention .*cpu backend.*'
    r'length 24 \(Pallas takes a multiple of 128\); '
    r'head_dim 24 \(Pallas takes a power',
  ):
    attention.choose('pallas', q, k, causal=True, packed=True, padded=False)
  with pytest.raises(ConfigError, match=r"config.model.attention='flash' is not known; choose one of"):
    attention.choose('flash', q, k, causal=True, packed=False, padded=False)


def test_xla_attention_equals_explicit_masked_softmax():
  """Causal + packed documents + padded keys, grouped kv heads, against a float64 numpy reference."""
  q, k, v = _qkv()
  seg = np.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16])
  valid = np.array([[1] * 16, [1] * 12 + [0] * 4])
  out = attention.attend(q, k, v, causal=True, segment_ids_BL=jnp.asarray(seg), valid_BL=jnp.asarray(valid))
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  kn, vn = np.repeat(kn, 2, axis=2), np.repeat(vn, 2, axis=2)
  s = np.einsum('bqhk,bshk->bhqs', qn, kn) / np.sqrt(8)
  allowed = np.tril(np.ones((16, 16), bool))[None] & (seg[:, :, None] == seg[:, None, :])
  allowed &= valid[:, None, :].astype(bool)
  s = np.where(allowed[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  ref = np.einsum('bhqs,bshk->bqhk', p / p.sum(-1, keepdims=True), vn)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_pallas_kernel_equals_xla_for_packed_padded_grouped_heads():
  """The GPU kernel itself (Pallas' interpreter on the CPU): packed documents, padding, grouped kv heads; the
  outputs of real queries and all gradients match the XLA path."""
  q, k, v = _qkv(L=32, K=16)
  seg = jnp.asarray([[1] * 6 + [2] * 17 + [0] * 9, [1] * 32])
  valid = jnp.asarray([[1] * 32, [1] * 20 + [0] * 12])
  real = (valid * (seg > 0))[:, :, None, None]

  def loss(kernel, q, k, v):
    o = kernel(q, k, v, seg, valid, causal=True)
    return (o * real * jnp.cos(jnp.arange(o.size).reshape(o.shape))).sum(), o

  pallas = functools.partial(attention._pallas, interpret=True)
  (_, out), grads = jax.value_and_grad(functools.partial(loss, pallas), (0, 1, 2), has_aux=True)(q, k, v)
  (_, ref), ref_grads = jax.value_and_grad(functools.partial(loss, attention._xla), (0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(out * real, ref * real, atol=2e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=2e-5)


def test_splash_kernel_equals_xla_for_packed_padded_grouped_heads():
  """The TPU kernel itself (Pallas' TPU interpreter on the CPU): packed documents, padding, grouped kv heads,
  causal and full; the outputs of real queries and all gradients match the XLA path."""
  q, k, v = _qkv(L=128, H=2, G=1, K=16)
  seg = jnp.asarray([[1] * 50 + [2] * 60 + [0] * 18, [1] * 128])
  valid = jnp.asarray([[1] * 128, [1] * 100 + [0] * 28])
  real = (valid * (seg > 0))[:, :, None, None]

  def loss(kernel, q, k, v):
    o = kernel(q, k, v, seg, valid, causal=True) + 2 * kernel(q, k, v, None, valid, causal=False)
    return (o * real * jnp.cos(jnp.arange(o.size).reshape(o.shape))).sum(), o

  with attention.splash_interpret():
    (_, out), grads = jax.value_and_grad(functools.partial(loss, attention._splash), (0, 1, 2), has_aux=True)(q, k, v)
  (_, ref), ref_grads = jax.value_and_grad(functools.partial(loss, attention._xla), (0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(out * real, ref * real, atol=2e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=5e-5)


def test_splash_is_chosen_as_on_a_tpu_and_refused_where_it_cannot_run():
  """'auto' picks splash on TPUs (here: splash_interpret) for lengths it takes, and XLA otherwise, saying why;
  'splash' where it cannot run (a CPU; a sharded sequence) is one ConfigError naming why."""
  q, k, v = _qkv(L=128, K=16)
  with attention.splash_interpret():
    assert attention.choose('auto', q, k, causal=True, packed=True, padded=True) == ('splash', None)
    assert attention.choose('auto', *_qkv(L=100)[:2], causal=False, packed=False, padded=False) == ('xla', None)
  assert {
    'splash (causal, packed, padding, float32, L=128, head_dim 16) in the Pallas TPU interpreter (splash_interpret)',
    'xla (full, float32, L=100, head_dim 8): splash: length 100 (splash takes a multiple of 128)',
  } <= set(attention.decisions())
  assert attention.choose('auto', q, k, causal=True, packed=False, padded=False) == ('xla', None)  # a CPU
  with pytest.raises(
    ConfigError,
    match=r'^config.model.attention=splash cannot run this attention \(causal, '
    r'float32, L=128, head_dim 16\): cpu backend \(splash attention is a TPU '
    r'kernel\)$',
  ):
    attention.choose('splash', q, k, causal=True, packed=False, padded=False)


def test_a_train_step_on_splash_per_shard_equals_xla():
  """GPT-2 (tiny, 128 tokens) under the tensor-parallel preset: splash attention per shard in shard_map (heads
  over 'tensor', rows over 'data'; the interpreter standing in for the TPU) trains to XLA's parameters (SGD:
  the update is the gradient, scaled)."""
  from configs import gpt2

  cfg = gpt2.get_config('tp,tiny')
  cfg.optim.update(name='sgd', lr=1.0, warmup_steps=1)
  cfg.model.update(max_len=128, num_layers=1)
  cfg.dataset.seq_len = 128
  cfg.update(batch_size=4)
  results = {}
  for impl in ('auto', 'xla'):
    cfg.model.attention = impl
    with attention.splash_interpret():
      start, end = train_on_random_batches(build_trainer(cfg), 2)  # the first step's learning rate is 0
    results[impl] = end
  assert any(
    d.startswith('splash (causal, float32, L=128, head_dim 16) per shard (shard_map)') for d in attention.decisions()
  ), attention.decisions()
  splash, xla = (jax.tree.leaves(results[i].params) for i in ('auto', 'xla'))
  for a, b in zip(splash, xla):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert max(np.abs(a - b).max() for a, b in zip(splash, jax.tree.leaves(start.params))) > 1e-3  # it trained


def test_blockwise_attention_equals_xla(monkeypatch):
  """'blockwise' (flash attention in JAX, any backend) against XLA: causal with packed documents and padded
  keys plus full attention with padding, grouped kv heads, 21 keys in blocks of 8 (the last one partial); the
  outputs of real queries and all gradients (its own VJP) within 2e-5 in float32."""
  monkeypatch.setattr(attention, 'BLOCKWISE_KEYS', 8)
  q, k, v = _qkv(L=21)
  seg = jnp.asarray([[1] * 6 + [2] * 12 + [0] * 3, [1] * 21])
  valid = jnp.asarray([[1] * 21, [1] * 15 + [0] * 6])
  real = (valid * (seg > 0))[:, :, None, None]

  def loss(impl, q, k, v):
    o = attention.attend(q, k, v, causal=True, impl=impl, segment_ids_BL=seg, valid_BL=valid) + 2 * attention.attend(
      q, k, v, causal=False, impl=impl, valid_BL=valid
    )
    return (o * real * jnp.cos(jnp.arange(o.size).reshape(o.shape))).sum(), o

  both = jax.jit(
    lambda q, k, v: [
      jax.value_and_grad(functools.partial(loss, impl), (0, 1, 2), has_aux=True)(q, k, v)
      for impl in ('blockwise', 'xla')
    ]
  )
  ((_, out), grads), ((_, ref), ref_grads) = both(q, k, v)
  assert (
    'blockwise (causal, packed, padding, float32, L=21, head_dim 8): config.model.attention=blockwise'
    in attention.decisions()
  )
  np.testing.assert_allclose(out * real, ref * real, atol=2e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=2e-5)


def test_gpu_stand_in_traces_attention_as_on_a_gpu():
  """The plan search compiles GPU targets on CPU under gpu_stand_in: where a GPU would run cuDNN or Pallas,
  'blockwise' runs instead (and says so); where a GPU would fall back to XLA (float32), XLA."""
  q, k, v = _qkv(L=128, K=64, dtype=jnp.bfloat16)
  with attention.gpu_stand_in():
    assert attention.choose('auto', q, k, causal=True, packed=False, padded=False) == ('blockwise', None)
    assert attention.choose('auto', q, k, causal=True, packed=True, padded=False) == ('blockwise', None)
    assert attention.choose('auto', *_qkv(L=128, K=64)[:2], causal=True, packed=False, padded=False)[0] == 'xla'
  assert attention.choose('auto', q, k, causal=True, packed=False, padded=False) == ('xla', None)
  assert {
    'blockwise (causal, bfloat16, L=128, head_dim 64) standing in for cudnn (gpu_stand_in)',
    'blockwise (causal, packed, bfloat16, L=128, head_dim 64) standing in for pallas (gpu_stand_in)',
  } <= set(attention.decisions())


def test_keys_padded_by_the_model_are_masked_and_keep_fused_attention():
  """attend(kv_length=n) on rows padded after n tokens: the real queries' outputs equal attention over the
  unpadded rows (XLA and blockwise, float32), and on a GPU 'auto' keeps the fused kernel for it where a valid_BL
  mask keeps XLA (it could be any mask). length_multiple asks a model to pad only where that kernel would be
  cuDNN. A kv_length that does not fit is one error naming it."""
  q, k, v = _qkv(L=13)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 3), (0, 0), (0, 0)))
  ref = attention.attend(q, k, v, causal=False, impl='xla')
  for impl in ('xla', 'blockwise'):
    out = attention.attend(pad(q), pad(k), pad(v), causal=False, impl=impl, kv_length=13)
    np.testing.assert_allclose(out[:, :13], ref, rtol=1e-5, atol=1e-6)
  qb, kb, _ = _qkv(L=128, K=64, dtype=jnp.bfloat16)
  with attention.gpu_stand_in():
    assert attention.choose('auto', qb, kb, causal=False, packed=False, padded=False, kv_length=125)[0] == 'blockwise'
    assert attention.choose('auto', qb, kb, causal=False, packed=False, padded=True)[0] == 'xla'
    assert attention.length_multiple('auto', jnp.bfloat16, 64) == attention.CUDNN_LENGTH_MULTIPLE == 8
    assert attention.length_multiple('auto', jnp.float32, 64) == attention.length_multiple('xla', jnp.bfloat16, 64) == 1
    with attention.forced('xla'):  # FLOP counting: the model's own length
      assert attention.length_multiple('auto', jnp.bfloat16, 64) == 1
  assert attention.length_multiple('auto', jnp.bfloat16, 64) == 1  # CPU
  assert (
    'blockwise (full, bfloat16, L=128, 125 real keys, head_dim 64) standing in for cudnn (gpu_stand_in)'
    in attention.decisions()
  )
  with pytest.raises(ValueError, match='kv_length=17 for 13 queries'):
    attention.attend(q, k, v, causal=False, kv_length=17)


def test_cudnn_would_run_per_shard_also_with_the_sequence_sharded():
  cfg = tiny_config('fsdp_tp')
  trainer = build_trainer(cfg)
  q, k, v = _qkv(B=16, L=16, H=4, G=4, K=16)
  with partitioning.use_rules(trainer.rules, trainer.mesh):
    q_spec, kv_spec, row_spec = attention._local_specs(q, k)
  assert q_spec == jax.P(('data', 'fsdp'), None, 'tensor', None) == kv_spec
  assert row_spec == jax.P(('data', 'fsdp'), None)
  rules = partitioning.AxisRules(
    [('batch', ('data', 'fsdp')), ('length', 'tensor'), ('heads', None), ('kv_heads', None), ('kv', None)]
  )
  with partitioning.use_rules(rules, trainer.mesh):  # context parallelism: per shard too (tests/test_context.py)
    q_spec, kv_spec, row_spec = attention._local_specs(q, k)
  assert q_spec == jax.P(('data', 'fsdp'), 'tensor', None, None) == kv_spec
  assert row_spec == jax.P(('data', 'fsdp'), 'tensor')


def test_unrolled_stack_initialises_as_the_scanned_one():
  """Unrolled blocks come from the scanned stack's one vmapped initialiser (fast to compile) and hold
  exactly its values, each with its own logical axes (no 'layers')."""
  from tests.conftest import unstack_layers

  cfg = _gpt2_tiny()
  params = {}
  for scan in (True, False):
    cfg.model.scan_layers = scan
    model = models.create(cfg.model, nnx.Rngs(0))
    params[scan] = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, unstack_layers(params[True], cfg.model.num_layers), params[False])
  names = partitioning.nnx_logical_axes(nnx.state(model, nnx.Param))
  assert names['blocks']['layers'][0]['mlp']['up']['layer']['kernel'] == ('embed', 'mlp')


def test_max_pool_by_slices_equals_reduce_window():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 15, 16, 3)), jnp.float32)
  ref = lambda x: nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
  ours = lambda x: layers.max_pool(x, 3, stride=2, pad=1)
  np.testing.assert_array_equal(ours(x), ref(x))
  grad = lambda f: jax.grad(lambda x: (f(x) * jnp.arange(64 * 3.0).reshape(8, 8, 3)).sum())(x)
  np.testing.assert_array_equal(grad(ours), grad(ref))


def _loss_and_grads(cfg):
  trainer = build_trainer(cfg)
  state = training.init_state(trainer)
  batch = training.tasks.get('lm').synthetic_batch(cfg, seed=1)
  batch = {k: jnp.asarray(v) for k, v in batch.items() if k in trainer.batch_abstract}

  def loss(params):
    return trainer.task.loss(nnx.merge(trainer.graphdef, params, state.model_state), batch)[0]

  return jax.jit(jax.value_and_grad(loss))(jax.device_get(state.params))


def _gpt2_tiny(**model):
  from configs import gpt2

  cfg = gpt2.get_config('dp,tiny')
  cfg.update(batch_size=8)
  cfg.model.update(model)
  return cfg


def test_remat_policies_change_memory_not_results():
  ref_loss, ref_grads = _loss_and_grads(_gpt2_tiny())  # scanned layers
  for policy in ('full', 'dots', 'attention'):
    cfg = _gpt2_tiny(remat=policy)
    loss, grads = _loss_and_grads(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=policy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=policy), grads, ref_grads)
  with pytest.raises(ConfigError, match=r"config.model.remat='most' is not a remat policy; choose one of \['none', "):
    layers.remat_policy('most')
  assert layers.remat_policy(True) == 'full' and layers.remat_policy(False) == 'none'


def test_dots_policy_keeps_expert_matmuls_and_convolutions():
  """'dots' keeps weight matmuls that have a batch dimension (a mixture of experts' expert einsums, kept by
  name, with the tokens around their all-to-alls) and convolutions: the gradient of an MoE layer runs no expert
  matmul more than without remat, nor a ResNet block a convolution more; 'full' reruns them."""
  from configs import moe as moe_config  # pylint: disable=g-import-not-at-top
  from models import moe  # pylint: disable=g-import-not-at-top

  def count(fn, args, is_counted):
    out = {}
    for policy in ('none', 'dots', 'full'):
      f = fn if policy == 'none' else jax.checkpoint(fn, policy=layers.REMAT_POLICIES[policy])
      jaxpr = jax.make_jaxpr(jax.grad(f))(*args)
      out[policy] = sum(map(is_counted, all_eqns(jaxpr.jaxpr)))
    return out

  cfg = moe_config.get_config('fsdp_ep,tiny').model
  graphdef, params = nnx.split(moe.MoEMLP(cfg, rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, cfg.embed_dim)), jnp.float32)
  weights = {(cfg.num_experts, cfg.embed_dim, cfg.mlp_dim), (cfg.num_experts, cfg.mlp_dim, cfg.embed_dim)}
  experts = count(
    lambda p, x: nnx.merge(graphdef, p)(x)[0].sum(),
    (params, x),
    lambda e: e.primitive.name == 'dot_general' and any(v.aval.shape in weights for v in e.invars),
  )
  assert experts['dots'] == experts['none'] < experts['full'], experts
  block = resnet.Block(resnet_config.get_config('dp,tiny').model, 16, 16, 1, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  convs = count(
    lambda s, x: nnx.merge(graphdef, s)(x).sum(),
    (state, jnp.ones((2, 8, 8, 16)) * jnp.arange(16.0)),
    lambda e: e.primitive.name == 'conv_general_dilated',
  )
  assert convs['dots'] == convs['none'] < convs['full'], convs


def test_dots_policy_keeps_fused_attention_instead_of_rerunning_it(monkeypatch):
  """Traced only (CPU has no cuDNN; its version check is patched): under remat='dots' the gradient of a
  block with cuDNN attention runs the forward kernel once, and twice under 'full'. Fails if JAX renames the
  kernel's primitive (layers.CUDNN_ATTENTION_FORWARD). Likewise for 'blockwise' and splash."""
  from jax._src.cudnn import fused_attention_stablehlo

  monkeypatch.setattr(fused_attention_stablehlo, 'check_cudnn_version', lambda *a, **k: 91000)
  q, k, v = _qkv(B=2, L=128, H=4, G=4, K=64, dtype=jnp.bfloat16)

  def forward_kernels(policy):
    block = jax.checkpoint(
      lambda q, k, v: (
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='cudnn').astype(jnp.float32).sum()
      ),
      policy=policy,
    )
    jaxpr = jax.make_jaxpr(jax.grad(block, argnums=(0, 1, 2)))(q, k, v)
    return sum(e.primitive.name == layers.CUDNN_ATTENTION_FORWARD for e in all_eqns(jaxpr.jaxpr))

  assert forward_kernels(layers.REMAT_POLICIES['dots']) == 1
  assert forward_kernels(layers.REMAT_POLICIES['full']) == 2

  # 'blockwise' (the GPU stand-in): its forward loop over key blocks runs once under 'dots' (its output and
  # log-sum-exp kept by name), twice under 'full' and under a policy that keeps weight matmuls only
  def blockwise_loops(policy):
    block = jax.checkpoint(
      lambda q, k, v: attention._blockwise(q, k, v, None, None, causal=True).astype(jnp.float32).sum(), policy=policy
    )
    jaxpr = jax.make_jaxpr(jax.grad(block, argnums=(0, 1, 2)))(q, k, v)
    return sum(e.primitive.name == 'scan' for e in all_eqns(jaxpr.jaxpr))  # forward loops + the backward's one

  assert blockwise_loops(layers.REMAT_POLICIES['dots']) == 2
  assert blockwise_loops(layers.REMAT_POLICIES['full']) == 3
  assert blockwise_loops(jax.checkpoint_policies.dots_with_no_batch_dims_saveable) == 3

  # splash (the TPU kernel; interpreted here): under 'dots' its forward's output and log-sum-exp are kept (named
  # attention.SPLASH_FORWARD), so the backward does not rerun it; under 'full' they are not
  def splash_kept(policy):
    block = jax.checkpoint(
      lambda q, k, v: attention._splash(q, k, v, None, None, causal=True).astype(jnp.float32).sum(), policy=policy
    )
    out = io.StringIO()
    with attention.splash_interpret(), contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(block, q, k, v)
    return sorted(line.split()[0] for line in out.getvalue().splitlines() if '_splash_attention' in line)

  assert splash_kept(layers.REMAT_POLICIES['dots']) == ['bf16[2,4,128,64]', 'f32[2,4,128]']
  assert splash_kept(layers.REMAT_POLICIES['full']) == []


@pytest.mark.parametrize('gated', [False, True])
def test_mlp_keeps_only_its_pre_activations(gated):
  """An MLP's backward pass keeps the pre-activations alone and recomputes the activation (layers.activation_then):
  one (B, L, F) residual for the exact-GELU MLP (plain autodiff keeps three: the output, erfc and the scaled
  input), two for SwiGLU (gate and up), the same gradients as plain autodiff, and no matmul run twice."""
  B, L, D, F = 2, 4, 8, 32
  kw = dict(rngs=nnx.Rngs(0))
  mlp = (
    layers.GatedMLP(D, F, **kw)
    if gated
    else layers.MLP(D, F, activation=functools.partial(jax.nn.gelu, approximate=False), **kw)
  )
  graphdef, params = nnx.split(mlp)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((B, L, D)), jnp.float32)
  run = lambda p, x: nnx.merge(graphdef, p)(x).sum()

  def plain(p, x):  # the same block written without activation_then
    m = nnx.merge(graphdef, p)
    h = m.activation(m.gate(x)) * m.up(x) if gated else m.activation(m.up(x))
    return m.down(h).sum()

  wide = lambda f: [r.shape for r in jax.tree.leaves(jax.vjp(f, params, x)[1]) if r.shape == (B, L, F)]  # residuals
  assert len(wide(run)) == (2 if gated else 1), wide(run)
  assert len(wide(plain)) > len(wide(run))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
    jax.grad(run, argnums=(0, 1))(params, x),
    jax.grad(plain, argnums=(0, 1))(params, x),
  )
  dots = lambda f: sum(
    e.primitive.name == 'dot_general' for e in all_eqns(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(params, x).jaxpr)
  )
  assert dots(run) == dots(plain)


@pytest.mark.parametrize('name', ['gelu_new', 'gelu_tanh', 'gelu_erf'])
def test_gelu_with_written_out_derivative_equals_autodiff(name):
  """layers.gelu_new / gelu_tanh / gelu_erf: in float32 the values of jax.nn.gelu (gelu_new, in transformers' order
  of operations, within float32's rounding); gradients equal to autodiff's in float32 (also where autodiff gives 0,
  1 or NaN: huge, infinite and NaN inputs) and, in bfloat16, closer to autodiff's float32 gradient than autodiff's
  bfloat16 one; the backward keeps only the input (autodiff of jax.nn.gelu keeps more). (Their bfloat16 values and
  the families that use them: tests/test_activations.py.)"""
  ours = getattr(layers, name)
  ref = functools.partial(jax.nn.gelu, approximate=name != 'gelu_erf')
  x = np.concatenate([np.linspace(-12, 12, 4001), [0, 1e19, -1e19, 1e30, -1e30, np.inf, -np.inf, np.nan]])
  grad = lambda f, x: jax.vmap(jax.grad(f))(x)
  x32 = jnp.asarray(x, jnp.float32)
  if name == 'gelu_new':
    np.testing.assert_allclose(ours(x32), ref(x32), rtol=1e-6, atol=1e-7)
  else:
    np.testing.assert_array_equal(ours(x32), ref(x32))
  # atol: both lose digits to 1 - tanh^2 where the gradient is ~1e-5 (about x = -4.7)
  np.testing.assert_allclose(grad(ours, x32), grad(ref, x32), rtol=2e-6, atol=5e-6)  # NaN where autodiff's is
  grad32 = np.asarray(grad(ref, jnp.asarray(x[:4001], jnp.float32)), np.float64)
  xb = jnp.asarray(x[:4001], jnp.bfloat16)
  err = lambda f: np.abs(np.asarray(grad(f, xb), np.float64) - grad32).max()
  assert err(ours) <= err(ref) and err(ours) < 8e-3, (err(ours), err(ref))
  residuals = lambda f: jax.tree.leaves(jax.vjp(f, x32)[1])
  assert len(residuals(ours)) == 1 < len(residuals(ref))


def test_compiling_for_a_gpu_without_one():
  """planning/targets: with JAX's CUDA plugin installed, a sharded step compiles for 2 H100s on this machine
  (cuDNN's attention chosen as on the GPU); without it (as in CI), one ConfigError naming the install. An unknown
  target names the known ones."""
  from planning import targets

  with pytest.raises(ConfigError, match=r"GPU target 'b300' is neither one of \['h100_sxm'\]"):
    targets.gpu_devices('b300')
  if not targets.plugin_installed():
    with pytest.raises(ConfigError, match=r'h100_sxm.* needs JAX\'s CUDA plugin .*pip install "jax\[cuda13\]=='):
      targets.gpu_devices('h100_sxm')
    return
  devices = targets.gpu_devices('h100_sxm', 2)
  assert [d.platform for d in devices] == ['gpu', 'gpu'] and 'H100' in devices[0].device_kind
  cfg = _gpt2_tiny(dtype='bfloat16')
  mesh = partitioning.make_mesh(dict(data=2), devices)
  trainer = training.build(cfg, mesh, lambda rngs: models.create(cfg.model, rngs))
  compiled = training.compile_step(trainer, training.jit_train_step(trainer))
  assert profiling.compiled_memory(compiled) > 0 and 'all-reduce' in compiled.as_text()
  assert any(d.startswith('cudnn (causal, bfloat16') for d in attention.decisions()), attention.decisions()
  kinds = hlo.kernel_summary(hlo.kernels(compiled.as_text()))  # benchmarks/compiled_memory.py --kernels
  assert {'matmul', 'attention', 'collective', 'reduction', 'elementwise'} <= set(kinds), kinds
  assert kinds['attention'][0] == 2 * cfg.model.num_layers and kinds['total'][1] > 0


def test_compiling_for_a_tpu_without_one(monkeypatch):
  """planning/targets: a TPU slice's chip grid for a chip count (as near square or cube as its hosts' grids tile;
  on one host, the host's grid halved), one ConfigError for a count that makes no slice or when libtpu is missing
  (as in CI); with libtpu installed, a sharded step compiles for 8 v5e chips on this machine, splash attention
  chosen as on a TPU."""
  from planning import targets

  assert targets.tpu_topology('tpu_v5e', 8) == ('v5e:2x4', dict(chips_per_host_bounds=[2, 4, 1]))
  assert targets.tpu_topology('tpu_v5e', 32) == ('v5e:4x8', dict(chips_per_host_bounds=[2, 4, 1]))
  assert targets.tpu_topology('tpu_v5p', 16) == ('v5p:2x2x4', dict(chips_per_host_bounds=[2, 2, 1]))
  assert targets.tpu_topology('tpu_v5p', 64)[0] == 'v5p:4x4x4' and targets.tpu_topology('tpu_v4', 2)[0] == 'v4:1x2x1'
  assert targets.tpu_topology('tpu_v6e', 1) == ('v6e:1x1', dict(chips_per_host_bounds=[1, 1, 1]))
  with pytest.raises(
    ConfigError,
    match=r'^12 tpu_v5e chips make no slice: ask for 1 to 8 chips \(one host\) or a '
    r'multiple of 8 \(hosts of 2x4 chips\)$',
  ):
    targets.tpu_topology('tpu_v5e', 12)
  with pytest.raises(ConfigError, match=r'^3 tpu_v5p chips make no slice: on one host ask for a power of 2 up to 4$'):
    targets.tpu_topology('tpu_v5p', 3)
  with pytest.raises(ConfigError, match=r"TPU target 'tpu_v7' is not one of \['tpu_v4', 'tpu_v5e', 'tpu_v5p', "):
    targets.compile_devices('tpu_v7')
  installed = targets.libtpu_installed()
  monkeypatch.setattr(targets, 'libtpu_installed', lambda: False)
  with pytest.raises(
    ConfigError,
    match=r"TPU target 'tpu_v5e' needs libtpu \(no TPU needed\): pip install "
    r'"jax\[tpu\]==',
  ):
    targets.compile_devices('tpu_v5e', 8)
  if not installed:
    return
  monkeypatch.undo()
  devices = targets.compile_devices('tpu_v5e', 8)
  assert {d.platform for d in devices} == {'tpu'} and devices[0].device_kind == 'TPU v5 lite'
  cfg = _gpt2_tiny(dtype='bfloat16', max_len=128)
  cfg.dataset.seq_len = 128
  mesh = partitioning.make_mesh(dict(data=2, fsdp=4), devices)
  trainer = training.build(cfg, mesh, lambda rngs: models.create(cfg.model, rngs))
  compiled = training.compile_step(trainer, training.jit_train_step(trainer))
  assert profiling.compiled_memory(compiled) > 0 and 'all-reduce' in compiled.as_text()
  assert 'splash (causal, bfloat16, L=128, head_dim 16) per shard (shard_map)' in attention.decisions()


def test_softmax_xent_gradient_scatters_nothing():
  """xent.softmax_xent: loss and gradient equal optax's in float32, and the gradient program has no scatter
  (autodiff of optax's scatters the targets' gradient into a zero array of the logits' shape: an extra pass
  over the largest activation of a language model)."""
  import optax

  from training import xent

  rng = np.random.default_rng(0)
  logits = jnp.asarray(3 * rng.standard_normal((4, 6, 40)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 40, (4, 6)), jnp.int32)
  w = jnp.asarray(rng.random((4, 6)), jnp.float32)
  ours = lambda l: (xent.softmax_xent(l, targets) * w).sum()
  ref = lambda l: (optax.softmax_cross_entropy_with_integer_labels(l, targets) * w).sum()
  np.testing.assert_allclose(ours(logits), ref(logits), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(ref)(logits), rtol=1e-5, atol=1e-7)
  scatters = lambda f: sum('scatter' in e.primitive.name for e in all_eqns(jax.make_jaxpr(jax.grad(f))(logits).jaxpr))
  assert scatters(ours) == 0 < scatters(ref)


def test_logsumexp_and_argmax_read_the_logits_once_on_gpus():
  """xent.logsumexp_argmax_one_pass equals jax.nn.logsumexp and jnp.argmax (also on -inf, inf, nan, masked rows
  and ties), and the loss lowered for a GPU reduces over the logits once (maximum, sum and the accuracy's argmax
  together) where the CPU lowering keeps jax.nn.logsumexp's two passes and jnp.argmax's."""
  from training import xent

  rng = np.random.default_rng(0)
  x = 5 * rng.standard_normal((7, 3000)).astype(np.float32)
  x[0], x[1, :7], x[2, 5], x[3] = -np.inf, np.inf, np.nan, -1e9
  x[4, 100:] = -1e9  # a padded vocabulary
  x[6, [10, 2000]] = 40.0  # a tie: the first index wins, as jnp.argmax's
  lse, argmax = (np.asarray(a) for a in xent.logsumexp_argmax_one_pass(jnp.asarray(x)))
  ref = np.asarray(jax.nn.logsumexp(jnp.asarray(x), -1))
  np.testing.assert_array_equal(lse[:4], ref[:4])
  exact = np.log(np.exp(x[4:].astype(np.float64) - x[4:].max(-1, keepdims=True)).sum(-1)) + x[4:].max(-1)
  np.testing.assert_allclose(lse[4:], exact, rtol=2e-6)
  np.testing.assert_array_equal(np.delete(argmax, 2), np.delete(np.asarray(jnp.argmax(jnp.asarray(x), -1)), 2))
  assert argmax[6] == 10
  logits = jnp.asarray(x[4:])
  targets = jnp.asarray([3, 2999, 10], jnp.int32)
  np.testing.assert_allclose(xent.softmax_xent(logits, targets), ref[4:] - x[[4, 5, 6], [3, 2999, 10]], rtol=1e-6)
  loss = lambda l: sum(y.sum() for y in xent.loss_and_hits(l, targets, None)[:2])  # loss and hits

  def reductions_over_logits(platform):
    text = jax.export.export(jax.jit(jax.value_and_grad(loss)), platforms=[platform])(logits).mlir_module()
    return [l for l in text.splitlines() if 'stablehlo.reduce' in l and 'tensor<3x3000xf32>' in l]

  on_gpu, on_cpu = reductions_over_logits('cuda'), reductions_over_logits('cpu')
  assert len(on_gpu) == 1 and len(on_cpu) == 3, (on_gpu, on_cpu)  # one vs maximum, sum, argmax
  with xent.logsumexp_passes('one'):  # forced (benchmarks/throughput.py --logsumexp)
    assert len(reductions_over_logits('cpu')) == 1
  with xent.logsumexp_passes('two'):
    assert len(reductions_over_logits('cuda')) == 3


def test_bf16_logits_keep_the_loss():
  ref, _ = _loss_and_grads(_gpt2_tiny())
  loss, _ = _loss_and_grads(_gpt2_tiny(logits_dtype='bfloat16'))
  assert abs(float(loss) - float(ref)) < 2e-3 * float(ref), (loss, ref)  # bf16 logits: ~3 significant digits


def test_step_flops_are_the_palm_count():
  """3 x forward matmul FLOPs = 6 N + 12 layers d L per token, N = the matmul parameters (kernels and the tied
  embedding, which is the output head); causal attention's matmuls halved in the causal-correct count."""
  cfg = tiny_config('dp')
  trainer = build_trainer(cfg)
  f = flops.step_flops(trainer)
  leaves = jax.tree_util.tree_leaves_with_path(trainer.abstract.params)
  n_mm = sum(x.size for p, x in leaves if partitioning.path_str(p).endswith(('kernel', 'tok/embed/embedding')))
  m, B, L = cfg.model, cfg.batch_size, cfg.dataset.seq_len
  attn = 12 * m.num_layers * m.embed_dim * L
  assert f.palm == B * L * (6 * n_mm + attn)
  assert f.causal == B * L * (6 * n_mm + attn / 2)


def test_scan_split_read_from_shapes_equals_the_recorded_counts():
  """JAX 0.11's scan records no operand counts (seen on the GPU machine); the FLOP counter then reads them from
  shapes, which must give what JAX 0.10 records, including a carry shaped like a scanned slice."""
  w = jnp.ones((4, 4))

  def f(c, h, xs):
    def body(carry, x):
      a, b = carry
      return (a @ w + x, b + 1.0), a.sum()

    return jax.lax.scan(body, (c, h), xs)

  jaxpr = jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(()), jnp.ones((3, 4)))
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
  p = eqn.params
  assert flops._scan_split(eqn, p['jaxpr'].jaxpr, p['length']) == (p['num_consts'], p['num_carry'])


def test_moe_flops_count_the_active_experts_only():
  """A mixture of experts: 6 N_active + 12 layers d_attn L per token, N_active counting k of E experts' weights
  (not the E x C capacity slots the experts run over, nor the one-hot dispatch and combine matmuls)."""
  from configs import moe as moe_config  # pylint: disable=g-import-not-at-top

  cfg = moe_config.get_config('dp,tiny')
  trainer = build_trainer(cfg)
  m, B, L = cfg.model, cfg.batch_size, cfg.dataset.seq_len
  assert models.moe.capacity(m, min(m.group_size, L)) * m.num_experts > m.top_k * min(m.group_size, L)  # idle slots
  n_active = 0.0
  for p, x in jax.tree_util.tree_leaves_with_path(trainer.abstract.params):
    path = partitioning.path_str(p)
    if path.endswith(('/moe/gate', '/moe/up', '/moe/down')):
      n_active += x.size * m.top_k / m.num_experts
    elif path.endswith('kernel'):
      n_active += x.size
  f = flops.step_flops(trainer)
  attn = 12 * m.num_layers * m.num_heads * m.head_dim * L
  assert f.palm == pytest.approx(B * L * (6 * n_active + attn), rel=1e-9)
  assert f.causal == pytest.approx(B * L * (6 * n_active + attn / 2), rel=1e-9)


def test_flops_count_only_the_gradients_a_step_computes():
  """A matmul counts its forward, and in the backward one matmul per operand that a trained parameter feeds:
  ViT's patch embedding twice (its input is the image), every other matmul three times; a linear probe
  (train_only='^head/') the forward once and the head's weight gradient."""
  from configs import vit as vit_config  # pylint: disable=g-import-not-at-top

  cfg = vit_config.get_config('dp,tiny')
  full = flops.step_flops(build_trainer(cfg))
  m, B = cfg.model, cfg.batch_size
  patch = 2 * B * (m.image_size // m.patch_size) ** 2 * m.patch_size**2 * m.channels * m.embed_dim
  forward = (full.palm + patch) / 3  # 3 x forward, less the patch embedding's input gradient
  cfg.train_only = '^head/'
  probe = flops.step_flops(build_trainer(cfg))
  assert probe.palm == pytest.approx(forward + 2 * B * m.embed_dim * m.num_classes, rel=1e-9)


def test_peaks_of_known_chips():
  assert flops.peak_tflops('NVIDIA H100 80GB HBM3') == 989
  assert flops.peak_tflops('NVIDIA H100 PCIe') == 756 and flops.peak_tflops('NVIDIA H800 PCIe') == 756
  assert flops.peak_tflops('NVIDIA H100 NVL') == flops.peak_tflops('NVIDIA H200 NVL') == 835
  assert flops.peak_tflops('NVIDIA A100-SXM4-80GB') == 312
  assert flops.peak_tflops('TPU v5 lite') == 197 and flops.peak_tflops('TPU v4') == 275
  assert flops.peak_tflops('cpu') is None


def test_mesh_is_fitted_to_the_accelerators_found(monkeypatch):
  assert partitioning.fit_mesh_shape({'data': 2, 'fsdp': 4}, 8, 'gpu') == ({'data': 2, 'fsdp': 4}, None)
  sizes, note = partitioning.fit_mesh_shape({'data': 1, 'fsdp': 8, 'tensor': 1}, 1, 'gpu')
  assert sizes == {'data': 1, 'fsdp': 1, 'tensor': 1}
  assert note.startswith('config.mesh (data=1 x fsdp=8 x tensor=1) asks for 8 devices; there are 1 gpu devices')
  assert '--config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1' in note
  assert partitioning.fit_mesh_shape({'data': 2, 'fsdp': 2, 'tensor': 2}, 4, 'gpu')[0] == {
    'data': 4,
    'fsdp': 1,
    'tensor': 1,
  }
  mesh = tiny_config('fsdp_tp').mesh  # fit_mesh: the config's mesh, in place, on accelerators only
  assert partitioning.fit_mesh(mesh) is None and dict(mesh) == {'data': 2, 'fsdp': 2, 'tensor': 2}
  monkeypatch.setattr(jax, 'devices', lambda *a: [type('Gpu', (), {'platform': 'gpu'})()])
  monkeypatch.setattr(jax, 'device_count', lambda *a: 1)
  assert partitioning.fit_mesh(mesh).startswith('config.mesh (data=2 x fsdp=2 x tensor=2) asks for 8 devices')
  assert dict(mesh) == {'data': 1, 'fsdp': 1, 'tensor': 1}


def test_no_silent_cpu_run_beside_a_gpu_or_a_tpu(monkeypatch):
  from jax._src import hardware_utils

  monkeypatch.setenv('JAX_PLATFORMS', '')
  partitioning.check_platform()  # this machine: neither
  with monkeypatch.context() as m:
    m.setattr(os.path, 'exists', lambda p: p == '/dev/nvidiactl')
    with pytest.raises(ShardingError, match=r'an NVIDIA GPU is present but JAX found only the CPU .*jax\[cuda13\]'):
      partitioning.check_platform()
  monkeypatch.setattr(
    hardware_utils, 'num_available_tpu_chips_and_device_id', lambda: (4, hardware_utils.TpuVersion.v5e)
  )
  with pytest.raises(
    ShardingError,
    match=r'^a TPU is attached but JAX found only the CPU \(no libtpu\?\): pip install '
    r'"jax\[tpu\]==0.10.2", or set JAX_PLATFORMS=cpu',
  ):
    partitioning.check_platform()
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  partitioning.check_platform()  # the CPU on purpose


def test_synthetic_batches_match_every_task_batch():
  from configs import bert, llama, vit

  for cfg in (tiny_config(), llama.get_config('tiny'), vit.get_config('tiny'), bert.get_config('tiny')):
    cfg.dataset.pack = cfg.dataset.get('pack', False)
    trainer_task = training.tasks.get(cfg.task)
    batch = trainer_task.synthetic_batch(cfg)
    shapes = trainer_task.example_shapes(cfg)
    assert set(batch) == set(shapes), cfg.task
    for k, (shape, dtype) in shapes.items():
      assert batch[k].shape == (cfg.batch_size, *shape) and batch[k].dtype == dtype, k


def test_train_reports_mfu_and_captures_a_profile(tmp_path, capsys):
  cfg = tiny_config(
    'dp', total_steps=4, log_every=2, eval_every=4, checkpoint_every=0, profile_first_step=2, profile_steps=2
  )
  train.train_and_evaluate(cfg, str(tmp_path), peak_tflops=1.0)
  out = capsys.readouterr().out
  assert 'model FLOPs per step:' in out and 'MFU against 1 TFLOP/s (given)' in out
  assert ' TFLOP/s/device | MFU ' in next(line for line in out.splitlines() if line.startswith('step     4'))
  assert f'profile of steps 2-3 in {tmp_path}' in out
  assert glob.glob(str(tmp_path / '**' / '*perfetto_trace.json.gz'), recursive=True)
  assert 'attention: xla (causal, float32, L=16, head_dim 16): cpu backend' in out
  t = profiling.device_time(str(tmp_path))
  assert t['ops'] > 0 and 0 < t['busy'] <= t['span'] and profiling.top_ops(str(tmp_path))


def test_device_time_merges_streams_and_counts_short_ops(tmp_path):
  """profiling.device_time on a made-up trace: two GPU streams overlap (busy counts their union), a host event
  is left out, and 3 us ops count as short."""
  import gzip
  import json

  meta = lambda pid, name: {'ph': 'M', 'name': 'process_name', 'pid': pid, 'args': {'name': name}}
  op = lambda pid, ts, dur, name='k': {'ph': 'X', 'pid': pid, 'ts': ts, 'dur': dur, 'name': name}
  events = [
    meta(1, '/device:GPU:0 stream 7'),
    meta(2, '/device:GPU:0 stream 9'),
    meta(3, '/host:CPU'),
    op(1, 0, 100),
    op(2, 50, 100),
    op(1, 200, 3),
    op(1, 210, 3, 'small'),
    op(3, 0, 1000),
    op(2, 300, 50),
  ]
  with gzip.open(tmp_path / 'x.perfetto_trace.json.gz', 'wt') as f:
    json.dump({'traceEvents': events}, f)
  t = profiling.device_time(str(tmp_path))
  assert t == dict(span=0.35, busy=0.206, idle=0.144, ops=5, short=2, short_ms=0.006), t
  assert profiling.top_ops(str(tmp_path), k=1) == [('k', 0.253, 4)]
  # Ops back to back at large timestamps: busy is the whole span, not a rounding error past it.
  starts = [
    130976.87987161666,
    130979.47133722108,
    131012.69524455354,
    131016.99720252871,
    131051.04899988144,
    131052.67545144659,
    131087.67810199748,
  ]
  with gzip.open(tmp_path / 'x.perfetto_trace.json.gz', 'wt') as f:
    json.dump(
      {'traceEvents': [meta(1, '/device:GPU:0 stream 7')] + [op(1, a, b - a) for a, b in zip(starts, starts[1:])]}, f
    )
  t = profiling.device_time(str(tmp_path))
  assert t['busy'] == t['span'] and t['idle'] == 0, t


def test_loss_parity_fp32_on_cpu():
  """The helpers of benchmarks/loss_parity.py: the fast paths (unrolled layers, remat) against the previous path
  (scanned, none), 3 steps in float32, within 1e-5 (the issue's bar)."""
  cfg = _gpt2_tiny(scan_layers=False, remat='dots')
  cfg.mesh.update(data=1)
  reference = cfg.copy_and_resolve_references()
  changes = profiling.config_overrides(reference, 'model.scan_layers=True,model.remat=none,model.nope=1,optim.lr=0.5')
  assert changes == {'model.scan_layers': True, 'model.remat': 'none', 'optim.lr': 0.5}
  reference.model.update(scan_layers=True, remat='none')
  batches = [training.tasks.get('lm').synthetic_batch(cfg, seed=i) for i in range(3)]
  mesh = partitioning.make_mesh(cfg.mesh, jax.devices()[:1])
  ours, ref = profiling.train_losses(cfg, mesh, batches), profiling.train_losses(reference, mesh, batches)
  np.testing.assert_allclose(ours, ref, rtol=1e-5)
  assert len(set(ours.round(6))) == 3  # it trained


def test_one_pass_batchnorm_variance_matches_two_pass():
  x = jnp.asarray(np.random.default_rng(0).normal(0.5, 2.0, (8, 4, 4, 16)), jnp.float32)
  out = {fast: layers.BatchNorm(16, fast_variance=fast, rngs=nnx.Rngs(0))(x) for fast in (False, True)}
  np.testing.assert_allclose(out[True], out[False], atol=1e-5)


@pytest.mark.parametrize('fast', [False, True])
def test_fused_batchnorm_equals_flax_values_statistics_and_gradients(fast):
  """layers.batch_norm_train's written-out VJP against autodiff of flax's BatchNorm: outputs, running
  averages, and the gradients of x, scale and bias (float32, 1e-5); bf16 inputs give bf16 outputs."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(0.5, 2.0, (4, 5, 3, 16)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  scale, results = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32), {}
  for fused in (False, True):
    bn = layers.BatchNorm(16, fast_variance=fast, fused=fused, momentum=0.8, rngs=nnx.Rngs(0))
    bn.scale[...], bn.bias[...] = scale, jnp.linspace(-1, 1, 16)
    graphdef, params, rest = nnx.split(bn, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def loss(params, x, rest):
      y = nnx.merge(graphdef, params, rest)(x)
      return (y * ct).sum(), y

    (_, y), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x, rest)
    bn(x)  # eager: updates the running averages
    results[fused] = (y, g_x, g_params, bn.mean[...], bn.var[...])
  for name, a, b in zip(('y', 'dx', 'dparams', 'mean', 'var'), results[True], results[False]):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name), a, b)
  y, mean, var = layers.batch_norm_train(
    x.astype(jnp.bfloat16), jnp.ones(16), jnp.zeros(16), eps=1e-5, fast_variance=fast, out_dtype=jnp.bfloat16
  )
  assert y.dtype == jnp.bfloat16 and mean.dtype == var.dtype == jnp.float32


def test_batchnorm_then_keeps_only_its_input_for_the_stem_pool():
  """ResNet's stem, BatchNorm -> ReLU -> 3x3/2 max pool, with `then`: the same values and gradients as applying
  them after the BatchNorm, and only x and per-channel statistics kept for the backward pass, where plain
  autodiff keeps the normalised full-resolution output as well (ResNet-50 at 256 images: 392 MiB). The
  recomputation is tied to the cotangent by an optimization barrier,
  without which XLA merges it back into the forward pass (as it did: compiled for an H100, no change)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(0.3, 2.0, (4, 12, 12, 8)), jnp.float32)
  scale, bias = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32), jnp.linspace(-1, 1, 8)
  ct = jnp.asarray(rng.standard_normal((4, 6, 6, 8)), jnp.float32)
  bn = functools.partial(layers.batch_norm_train, eps=1e-5, fast_variance=False, out_dtype=jnp.float32)
  fused = lambda x, s, b: bn(x, s, b, then=resnet._relu_max_pool)[0]
  after = lambda x, s, b: resnet._relu_max_pool(bn(x, s, b)[0])
  np.testing.assert_allclose(fused(x, scale, bias), after(x, scale, bias), rtol=1e-6)
  grads = lambda f: jax.grad(lambda *a: (f(*a) * ct).sum(), argnums=(0, 1, 2))(x, scale, bias)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads(fused), grads(after))
  kept = lambda f: sorted(r.shape for r in jax.tree.leaves(jax.vjp(f, x, scale, bias)[1]) if r.ndim == 4)
  assert kept(fused) == [x.shape], kept(fused)
  assert kept(after).count(x.shape) >= 2, kept(after)  # x and the normalised output (or ReLU's)
  backward = jax.make_jaxpr(lambda *a: jax.vjp(fused, *a)[1](ct))(x, scale, bias).jaxpr
  assert any(e.primitive.name == 'optimization_barrier' for e in all_eqns(backward))
  # ResNet's stem uses it: of its full-resolution (H/2) arrays, only the conv's output is kept
  cfg = resnet_config.get_config('tiny').model
  # (shapes only: the model and the residuals of its backward pass traced, not run op by op)
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: resnet.ResNet(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  image = jax.ShapeDtypeStruct((2, 16, 16, cfg.channels), jnp.float32)
  residuals = jax.eval_shape(lambda p, r, x: jax.vjp(lambda p: nnx.merge(graphdef, p, r)(x), p)[1], params, rest, image)
  stem = [r for r in jax.tree.leaves(residuals) if r.shape == (2, 8, 8, cfg.width)]
  assert len(stem) == 1, [r.shape for r in jax.tree.leaves(residuals)]


def test_wide_output_heads_run_their_backward_in_the_compute_dtype():
  """A bf16 head with float32 logits (preferred_element_type): the forward matmul returns float32, and no
  matmul of the backward pass takes a float32 operand (XLA would run those as float32/TF32 GEMMs); the
  gradients equal autodiff's with the cotangent rounded to bf16."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((16, 40)), jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((2, 8, 40)), jnp.float32)
  f = lambda x, w: (layers.wide_einsum('bld,dv->blv', x, w, preferred_element_type=jnp.float32) * ct).sum()
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
  dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == 'dot_general']
  assert len(dots) >= 3, jaxpr
  forward = [d for d in dots if d.outvars[0].aval.dtype == jnp.float32]
  assert forward and all(v.aval.dtype == jnp.bfloat16 for d in dots for v in d.invars), jaxpr
  ours = jax.grad(f, argnums=(0, 1))(x, w)
  _, vjp = jax.vjp(lambda x, w: jnp.einsum('bld,dv->blv', x, w), x, w)
  for a, b in zip(ours, vjp(ct.astype(jnp.bfloat16))):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # float32 compute keeps plain autodiff
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  g32 = jax.grad(f, argnums=(0, 1))(x32, w32)
  ref = jax.grad(lambda x, w: (jnp.einsum('bld,dv->blv', x, w) * ct).sum(), argnums=(0, 1))(x32, w32)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), g32, ref)


@pytest.mark.slow
def test_benchmark_smoke_with_torch_peer():
  r = children.run(
    [
      sys.executable,
      'benchmarks/throughput.py',
      '--config',
      'configs/gpt2.py:tiny',
      '--steps',
      '2',
      '--warmup',
      '1',
      '--peer',
      'torch',
      '--peer_compile=false',
      '--peak_tflops',
      '1',
      '--logsumexp',
      'one',
    ],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'FLOPs/step:' in r.stdout and 'peak: 1 TFLOP/s (given)' in r.stdout
  rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(('shardzoo', 'torch'))}
  assert set(rows) == {'shardzoo', 'torch'} and '%' in rows['shardzoo'], r.stdout
  assert 'ratio shardzoo / torch:' in r.stdout
  assert r.stdout.count('log-sum-exp in one pass (forced)') == 1  # the choice said once (INFO logs are off)
  assert 'timing: pipelined, median of 2 steps after 1; the host dispatches a step in' in r.stdout


class _FakeDevice:
  """A device that runs one step at a time for `device_s` after its dispatch, which costs the host `host_s`."""

  def __init__(self, host_s, device_s):
    self.host_s, self.device_s, self.free_at, self.ran = host_s, device_s, 0.0, 0

  def step(self, state, batch):
    time.sleep(self.host_s)
    self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
    self.ran += 1
    return _Ready(self.free_at), _Ready(self.free_at)  # the new state and the metrics: ready when the step ends


class _Ready:
  def __init__(self, at):
    self.at = at

  def block_until_ready(self):
    time.sleep(max(0.0, self.at - time.perf_counter()))
    return self


def test_step_timing_pipelined_hides_the_host_dispatch_and_blocking_counts_it():
  """profiling.time_steps: 'pipelined' dispatches step i+1 while step i runs (train.py's loop; the torch peer's
  CUDA events), so a step costs the device's time (90 ms) when the host keeps up; 'blocking' adds the host's
  dispatch (30 ms).
  Both run warmup + steps steps and report each dispatch."""
  for timing, low, high in (('pipelined', 0.085, 0.11), ('blocking', 0.1195, 1.0)):  # sleeps only overshoot
    dev = _FakeDevice(host_s=0.03, device_s=0.09)
    _, times, dispatch = profiling.time_steps(dev.step, None, None, warmup=1, steps=5, timing=timing)
    assert dev.ran == 6 and len(times) == 5 and len(dispatch) == 5, (timing, dev.ran, times, dispatch)
    assert low < np.median(times) < high and 0.0295 < np.median(dispatch) < 0.08, (timing, times, dispatch)
  with pytest.raises(ValueError, match="timing='async'"):
    profiling.time_steps(dev.step, None, None, warmup=0, steps=1, timing='async')


_PEER_DEVICE = """
import os, sys
sys.path.insert(0, 'benchmarks')
import partitioning, throughput
print(throughput.peer_device())
os.environ['JAX_PLATFORMS'] = ''
for present in ('gpu', 'tpu', None):
  partitioning.accelerator_present = lambda: present
  print(throughput.peer_device())
"""


def test_benchmark_runs_the_torch_peer_beside_gpus_and_cpus_not_tpus():
  """benchmarks/throughput.py --peer torch: on CUDA beside an NVIDIA GPU, on the CPU beside a CPU run, and none on
  a TPU (a CPU peer would be no comparison), saying so. In a child process: the script defines its own flags."""
  r = children.run(
    [sys.executable, '-c', _PEER_DEVICE], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0, r.stderr[-2000:]
  tpu = "(None, 'no PyTorch peer on TPUs: the peer is torch.compile on a CUDA GPU, or on the CPU beside a CPU run')"
  assert r.stdout.splitlines() == ["('cpu', '')", "('cuda', '')", tpu, "('cpu', '')"], r.stdout
