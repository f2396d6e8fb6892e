"""Context (sequence) parallelism: each row split along 'length' over a 'context' mesh axis (the 'cp' presets)
trains as on 1 device, for GPT-2, Llama (grouped-query attention, packed documents) and MoE; attention run per
shard in shard_map (models/attention.py) equals unsharded attention; a length the context axis does not divide
is one error before anything compiles."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioning
import training
from errors import ConfigError, ShardingError
from models import attention
from tests.conftest import build_trainer

TOL = 1e-5  # fp32, the bar (losses relative, parameters absolute after AdamW: see test_equivalence)


def _packed_batches(cfg, steps):
  """Synthetic LM batches with packed documents: segment ids 1, 2, ... per row (a document may cross the
  context shards' boundaries), positions restarting at 0 in each, a padding tail (segment 0, mask 0)."""
  B, L = cfg.batch_size, cfg.dataset.seq_len
  rng = np.random.default_rng(0)
  out = []
  for _ in range(steps):
    seg = np.zeros((B, L), np.int32)
    for b in range(B):
      cuts = np.sort(rng.choice(np.arange(1, L - 4), 2, replace=False))
      seg[b, : cuts[0]], seg[b, cuts[0] : cuts[1]], seg[b, cuts[1] : L - 3] = 1, 2, 3
    pos = np.zeros((B, L), np.int32)
    for b in range(B):
      for s in np.unique(seg[b]):
        pos[b, seg[b] == s] = np.arange((seg[b] == s).sum())
    tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    out.append(
      dict(
        inputs=tokens[:, :-1], targets=tokens[:, 1:], mask=(seg > 0).astype(np.float32), segment_ids=seg, positions=pos
      )
    )
  return out


def _train(trainer, state, batches):
  step = training.jit_train_step(trainer)
  losses = []
  for batch in batches:
    batch = {k: v for k, v in batch.items() if k in trainer.batch_abstract}
    state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
    losses.append(float(metrics['loss']))
  return losses, jax.device_get(state.params)


def _family(name):
  from configs import gpt2, llama, moe

  cfg = {'gpt2': gpt2, 'llama': llama, 'moe': moe}[name].get_config('cp,tiny')
  cfg.update(batch_size=4)
  cfg.dataset.update(seq_len=32, pack=name == 'llama')
  cfg.optim.warmup_steps = 1
  if name == 'moe':
    cfg.model.group_size = 16  # two routing groups per row, each split over 2 of the 4 context shards
    # Rows in natural order: in zigzag order (the cp preset's load balancing) a routing group holds other tokens,
    # so capacity and the load-balancing loss see other groups than on 1 device (README: Context parallelism)
    cfg.context_load_balance = False
  return cfg


@pytest.mark.parametrize('name', ['gpt2', 'llama', 'moe'])
def test_context_parallel_training_equals_one_device(name):
  """2 AdamW steps under the 'cp' preset (fsdp=2 x context=4: 8 tokens of each row per device) against the
  same config on 1 device: losses and parameters within fp32 1e-5. GPT-2 (learned positions) and Llama (rotary)
  with the preset's causal load balancing (rows in zigzag order), MoE in natural order. Llama: grouped-query
  heads and packed documents (segment ids, positions); its attention runs per shard in shard_map (the decision
  says so)."""
  cfg = _family(name)
  batches = (
    _packed_batches(cfg, 2)
    if name == 'llama'
    else [training.tasks.get('lm').synthetic_batch(cfg, seed=i) for i in range(2)]
  )
  one = cfg.copy_and_resolve_references()
  one.mesh.update({k: 1 for k in one.mesh})
  trainer_1 = build_trainer(one, jax.devices()[:1])
  start = jax.device_get(training.init_state(trainer_1))  # one init program, placed on both meshes
  trainer = build_trainer(cfg)
  assert dict(trainer.mesh.shape) == {
    'data': 1,
    'fsdp': 2,
    'context': 4,
    'tensor': 1,
    **({'expert': 1} if name == 'moe' else {}),
  }
  assert trainer.batch_shardings['inputs'].spec == jax.P(('data', 'fsdp'), 'context')
  with attention.per_shard_xla():  # the shard_map path cuDNN takes on GPUs, with XLA inside
    losses, params = _train(trainer, jax.device_put(start, trainer.shardings), batches)
  losses_1, params_1 = _train(trainer_1, jax.device_put(start, trainer_1.shardings), batches)
  np.testing.assert_allclose(losses, losses_1, rtol=TOL, atol=TOL)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params_1)):
    # GPT-2's key bias adds q . b to every score of a query: softmax cancels it, so its gradient is 0 up to
    # rounding (1.6e-11 here), which AdamW's division by sqrt(nu) turns into updates of either sign (1e-5)
    dead = "['key']['layer']['bias']" in jax.tree_util.keystr(path)
    np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-4 if dead else TOL, err_msg=jax.tree_util.keystr(path))
  assert trainer.balance == (1 if name == 'moe' else 4)
  if name == 'llama':
    assert any(
      "per shard over 'context'" in d and 'packed' in d and 'zigzag order (load-balanced over 4 shards)' in d
      for d in attention.decisions()
    ), attention.decisions()


def _qkv(B=2, L=32, H=4, G=2, K=8):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal((B, L, n, K)), jnp.float32) for n in (H, G, G))


def test_per_shard_attention_equals_unsharded():
  """The shard_map path (keys/values all-gathered, causal offset by position) on 8 devices, sequence over
  context=4, against unsharded XLA attention: causal with packed documents (one crossing shard boundaries),
  padded keys and grouped kv heads, and full (non-causal) attention; outputs and gradients within 1e-5."""
  q, k, v = _qkv()
  seg = jnp.asarray([[1] * 5 + [2] * 15 + [3] * 9 + [0] * 3, [1] * 32])
  valid = jnp.asarray([[1] * 32, [1] * 20 + [0] * 12])
  weights = jnp.cos(jnp.arange(q.size).reshape(q.shape))

  def f(q, k, v, impl='auto'):
    causal = attention.attend(q, k, v, causal=True, impl=impl, segment_ids_BL=seg, valid_BL=valid)
    full = attention.attend(q, k, v, causal=False, impl=impl, valid_BL=valid)
    return ((causal + 2 * full) * weights).sum(), (causal, full)

  ref = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(q, k, v)
  mesh = partitioning.make_mesh({'fsdp': 2, 'context': 4})
  rules = partitioning.AxisRules(
    [('batch', 'fsdp'), ('length', 'context'), ('heads', None), ('kv_heads', None), ('kv', None)]
  )
  with partitioning.use_rules(rules, mesh):
    assert attention.choose('auto', q, k, causal=True, packed=True, padded=True) == ('xla', None)  # GSPMD
    with attention.per_shard_xla():
      assert attention.choose('auto', q, k, causal=True, packed=True, padded=True)[1] is not None
      got = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(q, k, v)
  assert any(
    d.startswith(
      'xla (causal, packed, padding, float32, L=32, head_dim 8) per shard over '
      "'context': shard_map, keys/values all-gathered (per_shard_xla): cpu backend"
    )
    for d in attention.decisions()
  )
  assert any(
    d.startswith(
      'xla (causal, packed, padding, float32, L=32, head_dim 8): sequence sharded over '
      "'context', partitioned by GSPMD: cpu backend"
    )
    for d in attention.decisions()
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
  # 'blockwise' per shard (queries offset to their global positions, keys in blocks of 8), on real queries only:
  # a padded query gets 0 from it and a mean of the keys from XLA
  real = (valid * (seg > 0))[:, :, None, None]

  def g(q, k, v, impl):
    (causal, full) = f(q, k, v, impl)[1]
    return ((causal * real + 2 * full * valid[:, :, None, None]) * weights).sum()

  ref = jax.value_and_grad(g, (0, 1, 2))(q, k, v, 'xla')
  with partitioning.use_rules(rules, mesh), mock.patch.object(attention, 'BLOCKWISE_KEYS', 8):
    got = jax.jit(jax.value_and_grad(g, (0, 1, 2)), static_argnums=3)(q, k, v, 'blockwise')
  assert any(
    d.startswith("blockwise (causal, packed, padding, float32, L=32, head_dim 8) per shard over 'context'")
    for d in attention.decisions()
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def test_splash_per_shard_equals_unsharded():
  """On TPUs 'auto' runs splash per context shard (here in Pallas' TPU interpreter): keys and values all-gathered,
  each shard's causal mask offset to its queries' positions (one kernel per shard, lax.switch); causal with packed
  documents crossing the shards' boundaries, padded keys, grouped kv heads, and full attention, against unsharded
  XLA attention: real queries' outputs and all gradients within 1e-5."""
  q, k, v = _qkv(B=4, L=256, H=2, G=1)
  seg = jnp.asarray([[1] * 40 + [2] * 150 + [3] * 50 + [0] * 16, [1] * 256, [1] * 128 + [2] * 128, [1] * 256])
  valid = jnp.asarray([[1] * 256, [1] * 200 + [0] * 56, [1] * 256, [1] * 100 + [0] * 156])
  real = (valid * (seg > 0))[:, :, None, None]
  weights = jnp.cos(jnp.arange(q.size).reshape(q.shape))

  def g(q, k, v, impl):
    causal = attention.attend(q, k, v, causal=True, impl=impl, segment_ids_BL=seg, valid_BL=valid)
    full = attention.attend(q, k, v, causal=False, impl=impl, valid_BL=valid)
    return ((causal * real + 2 * full * valid[:, :, None, None]) * weights).sum()

  ref = jax.value_and_grad(g, (0, 1, 2))(q, k, v, 'xla')
  mesh = partitioning.make_mesh({'fsdp': 4, 'context': 2})
  rules = partitioning.AxisRules(
    [('batch', 'fsdp'), ('length', 'context'), ('heads', None), ('kv_heads', None), ('kv', None)]
  )
  with partitioning.use_rules(rules, mesh), attention.splash_interpret():
    got = jax.jit(jax.value_and_grad(g, (0, 1, 2)), static_argnums=3)(q, k, v, 'auto')
  assert any(
    d.startswith(
      "splash (causal, packed, padding, float32, L=256, head_dim 8) per shard over 'context': "
      'shard_map, keys/values all-gathered, causal offset per shard'
    )
    for d in attention.decisions()
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def _zigzag_case(impl, shards, L, **qkv):
  """(outputs, gradients) of causal (packed, padded) plus full attention on rows in zigzag order over `shards`
  context shards, the rows permuted inside the function so that everything is in natural order outside it."""
  q, k, v = _qkv(L=L, **qkv)
  B = q.shape[0]
  seg = jnp.asarray(np.resize(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], L // 4, axis=1), (B, L)))  # across shards
  valid = jnp.asarray(np.arange(L)[None] < np.resize([L, L - 5], (B, 1)))
  real = (valid * (seg > 0))[:, :, None, None]  # padded queries' outputs differ by kernel and go unused
  weights = jnp.cos(jnp.arange(q.size).reshape(q.shape))

  def f(q, k, v):
    zz = lambda x: partitioning.context.to_zigzag(x, shards)
    with partitioning.context.zigzag(shards):
      causal = attention.attend(zz(q), zz(k), zz(v), causal=True, impl=impl, segment_ids_BL=zz(seg), valid_BL=zz(valid))
      full = attention.attend(zz(q), zz(k), zz(v), causal=False, impl=impl, valid_BL=zz(valid))
    causal, full = (partitioning.context.from_zigzag(x, shards) for x in (causal, full))
    return ((causal * real + 2 * full * valid[:, :, None, None]) * weights).sum(), causal * real

  return jax.value_and_grad(f, (0, 1, 2), has_aux=True), (q, k, v)


@pytest.mark.parametrize('impl', ['per_shard_xla', 'gspmd_xla', 'blockwise', 'splash'])
def test_zigzag_rows_attend_as_natural_rows(impl):
  """Causal load balancing (rows in zigzag order over the context shards; partitioning/context.py): attention on
  permuted rows, per shard (XLA inside shard_map, blockwise, splash in the interpreter) or partitioned by GSPMD,
  equals unsharded attention on the natural rows: packed documents crossing shards, padding, grouped kv heads,
  full attention too; outputs and gradients within 1e-5."""
  shards, L, shape = (2, 256, dict(B=4, H=2, G=1)) if impl == 'splash' else (4, 32, {})
  fn, args = _zigzag_case('xla', 1, L, **shape)
  ref = fn(*args)
  mesh = partitioning.make_mesh({'fsdp': 8 // shards, 'context': shards})
  rules = partitioning.AxisRules(
    [('batch', 'fsdp'), ('length', 'context'), ('heads', None), ('kv_heads', None), ('kv', None)]
  )
  fn, args = _zigzag_case('blockwise' if impl == 'blockwise' else 'auto', shards, L, **shape)
  extra = {'per_shard_xla': attention.per_shard_xla, 'splash': attention.splash_interpret}.get(impl)
  with (
    partitioning.use_rules(rules, mesh),
    extra() if extra else contextlib.nullcontext(),
    mock.patch.object(attention, 'BLOCKWISE_KEYS', 8),
  ):
    got = jax.jit(fn)(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
  kernel = impl.split('_')[-1]
  if impl == 'gspmd_xla':
    assert any(
      d.startswith(
        'xla (causal, packed, padding, float32, L=32, head_dim 8): sequence sharded over '
        "'context' (rows in zigzag order: causal mask from positions), partitioned by GSPMD"
      )
      for d in attention.decisions()
    ), attention.decisions()
  else:
    assert any(
      d.startswith(kernel) and f'rows in zigzag order (load-balanced over {shards} shards)' in d
      for d in attention.decisions()
    ), attention.decisions()


def test_zigzag_order_balances_the_splash_tiles():
  """Splash skips the masked tiles of causal attention: in natural order a row's last context shard computes
  2c - 1 times the first one's tiles (rounded to blocks), in zigzag order every shard the same number, the
  row's total the same. The permutation round-trips, and the trainer refuses what it cannot balance."""
  natural, zigzag = attention.splash_tiles(1024, 4, zigzag=False), attention.splash_tiles(1024, 4, zigzag=True)
  assert natural == [3, 7, 11, 15] and zigzag == [9, 9, 9, 9]
  assert sum(natural) == sum(zigzag)
  x = jnp.arange(2 * 48).reshape(2, 48)
  z = partitioning.context.to_zigzag(x, 3)
  np.testing.assert_array_equal(z[0], partitioning.context.zigzag_positions(48, 3))
  np.testing.assert_array_equal(z[0, :16], np.r_[0:8, 40:48])  # shard 0: chunks 0 and 5 of 6
  np.testing.assert_array_equal(partitioning.context.from_zigzag(z, 3), x)
  cfg = _family('llama')
  cfg.dataset.seq_len = 36  # divisible by the 4 context shards, not by the 8 chunks balancing cuts it into
  with pytest.raises(
    ConfigError,
    match=r'context_load_balance cuts each row of 36 tokens into 2 x 4 chunks '
    r"\(the context shards of 'length', mesh axes \('context',\)\), and 36 is not "
    r'divisible by 8',
  ):
    build_trainer(cfg)
  cfg.dataset.seq_len = 32
  cfg.update(batch_size=8)
  cfg.mesh.update(context=1, fsdp=8)  # 'length' on one device: nothing to balance, said once
  assert build_trainer(cfg).warnings()[-1] == (
    "config.context_load_balance is set, but no rule shards 'length' "
    'over more than one device: rows keep their natural order'
  )
  from configs import bert

  cfg = bert.get_config('tiny')
  cfg.context_load_balance = True
  with pytest.raises(
    ConfigError,
    match=r'context_load_balance balances causal attention across context shards, and '
    r"task 'mlm' has none",
  ):
    build_trainer(cfg)


def test_context_errors_name_the_culprit():
  """A length the context axis does not divide fails when the trainer is built (before tracing or compiling);
  Pallas, which cannot offset causality to a shard of the queries, is refused under a sharded sequence."""
  cfg = _family('llama')
  cfg.dataset.seq_len = 30
  with pytest.raises(
    ShardingError,
    match=r"batch field '\w+': dim 1 \('length'\) has size 30, not divisible by "
    r"mesh axes context=4 = 4 \(from rule #1 \('length', 'context'\)\)",
  ):
    build_trainer(cfg)
  q, k, _ = _qkv(K=16)
  mesh = partitioning.make_mesh({'fsdp': 2, 'context': 4})
  rules = partitioning.AxisRules(
    [('batch', 'fsdp'), ('length', 'context'), ('heads', None), ('kv_heads', None), ('kv', None)]
  )
  with partitioning.use_rules(rules, mesh):
    with pytest.raises(
      ConfigError,
      match=r'attention=pallas cannot run this attention .*the sequence is sharded '
      r"over 'context' and the Pallas kernel cannot offset causality",
    ):
      attention.choose('pallas', q, k, causal=True, packed=True, padded=False)
    with pytest.raises(
      ConfigError,
      match=r"attention=cudnn cannot run this attention .* per shard over 'context'"
      r'.*: cpu backend',
    ):
      attention.choose('cudnn', q, k, causal=True, packed=False, padded=False)
    assert attention.choose('xla', q, k, causal=True, packed=False, padded=False) == ('xla', None)  # GSPMD
