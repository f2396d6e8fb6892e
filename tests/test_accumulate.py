"""Gradient accumulation (training/accumulate.py) gives the big step: the same update, loss and metrics as the
unsplit global batch, for every family and preset; the split moves no row; bad sizes are one error.

Every case compares one step of config.grad_accum_steps > 1 with one unaccumulated step from the same state on
the same batch, whose masks weigh the micro-batches unequally. SGD at lr 1 without clipping makes the update the
gradient itself (its first step has no momentum), so the parameters compare the gradients exactly.
"""

import importlib
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import partitioning
import training
from configs import schema
from errors import ConfigError
from partitioning.audit import collective_stats
from planning import search
from tests.conftest import build_trainer, tiny_config
from training import accumulate, flops

TOL = 1e-5  # fp32; measured worst case over the cases: parameters 1.2e-7, metrics 9.5e-7 (absolute)
FAST = search.FAST_CPU_COMPILE  # the programs run once or twice: compile them cheaply (both sides alike)
_compiled: dict = {}  # (family, preset, steps, gather_once, model overrides) -> (trainer, compiled step)
_states: dict = {}  # (family, preset, model overrides) -> initial state


def config(family: str, preset: str, **overrides):
  if family == 'default':
    cfg = tiny_config(preset)
  else:
    cfg = importlib.import_module(f'configs.{family}').get_config(f'{preset},tiny')
  cfg.optim.update(name='sgd', lr=1.0, warmup_steps=0, grad_clip=0.0)
  schema.complete(cfg)  # what SGD reads (momentum), at its default
  cfg.update(total_steps=10, batch_size=16)
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


def compiled(family: str, preset: str, steps: int, gather_once: bool = False, **overrides):
  key = (family, preset, steps, gather_once, tuple(sorted(overrides.items())))
  if key not in _compiled:
    cfg = config(family, preset, grad_accum_steps=steps, accum_gather_once=gather_once)
    for k, v in overrides.items():
      cfg.model[k] = v
    trainer = build_trainer(cfg)
    jitted = jax.jit(  # not donated: the tests run several steps from one state
      training.train_step_fn(trainer),
      in_shardings=(trainer.shardings, trainer.batch_shardings),
      out_shardings=(trainer.shardings, trainer.replicated),
    )
    _compiled[key] = trainer, training.trace(trainer, jitted).lower().compile(compiler_options=FAST)
  return _compiled[key]


def uneven_batch(trainer, seed: int = 0) -> dict:
  """The task's synthetic batch with a third of the mask zeroed at random (whole rows and single tokens): the
  micro-batches weigh differently, so only division by the global weight gives the big step."""
  batch = trainer.task.synthetic_batch(trainer.config, seed)
  rng = np.random.default_rng(seed)
  batch['mask'] = batch['mask'] * (rng.random(batch['mask'].shape) > 0.33)
  batch['mask'][:2] = 0  # rows 0 and 1: one from each of the first two micro-batches
  return jax.device_put(batch, trainer.batch_shardings)


def start(family, preset, **overrides):
  """The initial state, one per case: the accumulated and the big step take the same state and shardings."""
  key = (family, preset, tuple(sorted(overrides.items())))
  if key not in _states:
    _states[key] = training.init_state(compiled(family, preset, 1, **overrides)[0])
  return _states[key]


def run(family, preset, steps, **overrides):
  trainer, step = compiled(family, preset, steps, **overrides)
  state = start(family, preset, **overrides)
  return jax.device_get(step(state, uneven_batch(trainer))), jax.device_get(state)


def assert_close(a, b, what):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL, err_msg=f'{what} {partitioning.path_str(path)}')


# Every preset once, every family once: (family, preset, micro-batches).
CASES = [
  ('mnist', 'dp', 2),
  ('default', 'fsdp', 2),
  ('llama', 'tp', 4),
  ('bert', 'fsdp_tp', 2),
  ('vit', 'tp', 2),
  ('gpt2', 'cp', 2),  # context parallel with causal load balancing (zigzag rows)
  ('moe', 'ep', 2),
]


@pytest.mark.parametrize('family,preset,steps', CASES)
def test_accumulated_step_equals_the_big_step(family, preset, steps):
  # MoE: the load-balancing loss off (a product of two means: see test_moe_load_balancing_loss_...), the router
  # z-loss on (a token mean, exact).
  extra = dict(aux_loss_weight=0.0) if family == 'moe' else {}
  (big, big_m), start = run(family, preset, 1, **extra)
  (acc, acc_m), _ = run(family, preset, steps, **extra)
  assert set(big_m) == set(acc_m)
  if family == 'moe':
    assert 'router_z_loss' in acc_m and float(acc_m['aux_loss']) > 0
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(start.params)))
  assert moved > 1e-3  # the step did something
  assert_close(acc.params, big.params, 'parameter')
  assert_close(acc.model_state, big.model_state, 'model state')
  for k in set(big_m) - {'load_balance_loss'}:  # the next test's
    np.testing.assert_allclose(acc_m[k], big_m[k], rtol=TOL, atol=TOL, err_msg=k)


def test_moe_load_balancing_loss_is_the_mean_over_micro_batches():
  """E * sum_e f_e p_e is a product of two means over the tokens: accumulated, its value (and gradient) is the
  mean over micro-batches of each micro-batch's own, which the unaccumulated step on that micro-batch gives
  (reference: the 1-step program on the micro-batch's rows repeated twice, which leaves every mean unchanged)."""
  trainer, step = compiled('moe', 'ep', 2, aux_loss_weight=0.0)  # the statistic is reported all the same
  ref_trainer, ref_step = compiled('moe', 'ep', 1, aux_loss_weight=0.0)
  state = start('moe', 'ep', aux_loss_weight=0.0)
  batch = jax.device_get(uneven_batch(trainer))
  _, m = step(state, jax.device_put(batch, trainer.batch_shardings))
  per_micro = []
  for i in range(2):
    rows = {k: np.concatenate([v[i::2]] * 2) for k, v in batch.items()}
    per_micro.append(float(ref_step(state, jax.device_put(rows, ref_trainer.batch_shardings))[1]['load_balance_loss']))
  np.testing.assert_allclose(float(m['load_balance_loss']), np.mean(per_micro), rtol=TOL)
  _, m_big = ref_step(state, jax.device_put(batch, ref_trainer.batch_shardings))
  assert abs(float(m_big['load_balance_loss']) - np.mean(per_micro)) > 1e-6  # the big batch's differs: documented


def test_batchnorm_normalises_each_micro_batch_and_updates_its_averages_in_order():
  """ResNet under accumulation = two half-batch steps: the gradient is the mean of each micro-batch's (each
  normalised by its own statistics), the running averages those after micro-batch 0 then micro-batch 1."""
  trainer, step = compiled('resnet', 'dp', 2, stage_sizes=(1, 1))  # two stages: one downsampling BatchNorm
  cfg = config('resnet', 'dp', batch_size=8)
  cfg.model.stage_sizes = (1, 1)
  half_trainer = build_trainer(cfg)
  half = jax.jit(
    training.train_step_fn(half_trainer),
    in_shardings=(half_trainer.shardings, half_trainer.batch_shardings),
    out_shardings=(half_trainer.shardings, half_trainer.replicated),
  )
  half = training.trace(half_trainer, half).lower().compile(compiler_options=FAST)
  state = training.init_state(trainer)
  batch = trainer.task.synthetic_batch(trainer.config, 0)  # masks all 1: equal weights, so means average
  acc, m = jax.device_get(step(state, jax.device_put(batch, trainer.batch_shardings)))
  a, ma = half(state, jax.device_put({k: v[0::2] for k, v in batch.items()}, half_trainer.batch_shardings))
  b, mb = half(
    state.replace(model_state=a.model_state),
    jax.device_put({k: v[1::2] for k, v in batch.items()}, half_trainer.batch_shardings),
  )
  a, b = jax.device_get((a, b))
  assert_close(acc.params, jax.tree.map(lambda x, y: (x + y) / 2, a.params, b.params), 'parameter')
  assert_close(acc.model_state, b.model_state, 'BatchNorm statistics')
  np.testing.assert_allclose(m['loss'], (float(ma['loss']) + float(mb['loss'])) / 2, rtol=TOL)


def _per_step_collectives(family, preset, steps, gather_once=False):
  """{op: (runs, bytes)} of a compiled step, each op counted as often as it runs (loop trips)."""
  return accumulate.per_step_collectives(compiled(family, preset, steps, gather_once)[1].as_text(), 8)


def test_the_split_moves_no_row_and_gather_once_gathers_once():
  """FSDP, 2 micro-batches: the step has the big step's collectives per micro-batch (each gathers the weights and
  reduces its gradient) and nothing else: nothing moves rows, no bytes are added for the split. With
  gather_once the weights are gathered once per step, before the loop."""
  text1, text2 = compiled('default', 'fsdp', 1)[1].as_text(), compiled('default', 'fsdp', 2)[1].as_text()
  # the same matmuls (the loop body's once): the forward traced for the global weight was dropped by XLA
  assert text2.count(' dot(') == text1.count(' dot(') > 0
  one, two = collective_stats(text1), collective_stats(text2)  # static: a loop body's ops once
  assert set(two) == {'all-gather', 'all-reduce'}  # no all-to-all or collective-permute: no row moves
  assert two['all-gather'] == one['all-gather']  # the same weights gathered, the same bytes
  assert two['all-reduce'][1] <= one['all-reduce'][1]  # gradients (and scalars) reduced: no more bytes
  per1, per2 = _per_step_collectives('default', 'fsdp', 1), _per_step_collectives('default', 'fsdp', 2)
  assert per2['all-gather'] == (2 * per1['all-gather'][0], 2 * per1['all-gather'][1])  # once per micro-batch
  once = _per_step_collectives('default', 'fsdp', 2, gather_once=True)
  assert once['all-gather'][1] <= per1['all-gather'][1]  # once per step, before the loop
  assert once['all-reduce'] == per2['all-reduce']
  # train.py's line: both choices' gathers per step (the other one estimated from this program)
  trainer, step = compiled('default', 'fsdp', 2)
  line = accumulate.describe(step.as_text(), 8, trainer.config)
  assert f'all-gather x{per2["all-gather"][0]} ({partitioning.fmt_bytes(per2["all-gather"][1])})' in line
  assert f'accum_gather_once=True would gather about {partitioning.fmt_bytes(per1["all-gather"][1])}' in line


def test_the_accumulator_is_float32_and_sharded_like_the_parameters():
  """FSDP, 2 micro-batches: what the compiled loop carries from one micro-batch to the next (the accumulator, the
  sharded weights) holds each sharded parameter as its float32 shard, never whole."""
  trainer, step = compiled('default', 'fsdp', 2)
  (loop,) = [line for line in step.as_text().splitlines() if ' while(' in line and 'f32[]' in line]
  carried = re.findall(r'f32\[([0-9,]*)\]', loop.split(' while(')[0])
  leaves = list(zip(jax.tree.leaves(trainer.abstract.params), jax.tree.leaves(trainer.shardings.params)))
  shards = {s.shard_shape(leaf.shape) for leaf, s in leaves}
  text = lambda shape: ','.join(map(str, shape))
  whole = [leaf.shape for leaf, s in leaves if s.shard_shape(leaf.shape) != leaf.shape]
  for leaf, sharding in leaves:
    assert carried.count(text(sharding.shard_shape(leaf.shape))) >= 2  # the parameter's shard, and its gradient's
  checked = [shape for shape in whole if shape not in shards]  # (a whole shape no other leaf's shard has)
  assert len(checked) > 5
  for shape in checked:
    assert text(shape) not in carried, shape


def test_model_flops_count_every_micro_batch():
  """MFU's numerator: the model FLOPs of the whole global batch, whatever the micro-batches."""
  one, two = compiled('default', 'fsdp', 1)[0], compiled('default', 'fsdp', 2)[0]
  assert flops.step_flops(two) == flops.step_flops(one)
  assert flops.step_flops(two).palm == 2 * flops.step_flops(build_trainer(config('default', 'fsdp', batch_size=8))).palm


def test_batch_not_divisible_by_micro_batches_times_shards_is_one_error_before_compiling():
  cfg = config('default', 'fsdp', grad_accum_steps=3)  # 16 rows, 3 micro-batches, 8 batch shards
  with pytest.raises(ConfigError, match=r'batch_size=16 .*grad_accum_steps=3 x the 8 batch shards'):
    build_trainer(cfg)
  cfg = config('default', 'fsdp', grad_accum_steps=4)  # 4 rows per micro-batch over 8 shards
  with pytest.raises(ConfigError, match=r'batch_size=16 .*grad_accum_steps=4 x the 8 batch shards'):
    build_trainer(cfg)


def test_split_is_strided_and_keeps_every_device_rows():
  """Micro-batch i is rows i, i + n, ...; laid out as (n, B / n) with the batch sharding on the second axis,
  each device holds exactly the rows it held before (a reshape of its own shard)."""
  x = np.arange(16 * 3).reshape(16, 3)
  parts = accumulate.split({'x': x}, 2)['x']
  np.testing.assert_array_equal(parts[1], x[1::2])
  mesh = partitioning.make_mesh({'data': 8}, jax.devices())
  sharding = jax.sharding.NamedSharding(mesh, P('data'))
  (stacked,) = accumulate.stacked({'x': sharding}).values()
  before = {d.id: set(map(tuple, x[idx])) for d, idx in sharding.devices_indices_map(x.shape).items()}
  p = np.asarray(parts)
  after = {d.id: set(map(tuple, p[idx].reshape(-1, 3))) for d, idx in stacked.devices_indices_map(p.shape).items()}
  assert before == after


def test_checkpoint_resumes_under_another_grad_accum_steps(tmp_path):
  """2 steps unaccumulated, the checkpoint resumed with 2 micro-batches for steps 3-4 (same global batch, same
  data positions) ends where 4 unaccumulated steps end."""
  import shutil

  import train

  def cfg(steps):
    c = config('gpt2', 'fsdp_tp', grad_accum_steps=steps)
    c.optim = config('gpt2', 'fsdp_tp').optim  # the AdamW of the config file
    c.optim.update(name='adamw', lr=1e-3, warmup_steps=1, grad_clip=1.0)
    c.update(total_steps=4, checkpoint_every=2, log_every=2, eval_every=4)
    c.model.num_layers = 1
    return c

  full = train.train_and_evaluate(cfg(1), str(tmp_path / 'full'))
  os.makedirs(tmp_path / 'resumed' / 'checkpoints')
  shutil.copytree(tmp_path / 'full' / 'checkpoints' / '2', tmp_path / 'resumed' / 'checkpoints' / '2')
  resumed = train.train_and_evaluate(cfg(2), str(tmp_path / 'resumed'))
  assert int(resumed['state'].step) == 4
  assert_close(jax.device_get(resumed['state'].params), jax.device_get(full['state'].params), 'parameter')
  np.testing.assert_allclose(resumed['train']['loss'], full['train']['loss'], rtol=TOL)
  np.testing.assert_allclose(resumed['eval']['loss'], full['eval']['loss'], rtol=TOL)
