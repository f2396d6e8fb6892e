"""Validation of a whole model+optimizer+batch against the rules, before anything compiles."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import errors
import partitioning
import training
from errors import ShardingError
from models.layers import axes
from tests.conftest import build_trainer, tiny_config


def without_rule(rules, name):
  return [r for r in rules if r[0] != name]


def test_parameter_logical_name_without_rule():
  cfg = tiny_config(logical_axis_rules=without_rule(tiny_config().logical_axis_rules, 'mlp'))
  with pytest.raises(
    ShardingError,
    match=r"parameter 'blocks/layers/0/mlp/down/layer/kernel'.*logical axis 'mlp' "
    r"\(dim 0\) has no rule; add \('mlp', <mesh axis>\)",
  ):
    build_trainer(cfg)


class ActivationOnlyName(nnx.Module):
  """Parameters fully named; one activation uses a name ('hidden') that no rule covers."""

  def __init__(self, rngs):
    self.w = nnx.Param(jnp.zeros((16, 16)), **axes('vocab', 'embed'))

  def __call__(self, tokens_BL):
    return partitioning.shard_logical(self.w[...][tokens_BL], ('batch', 'length', 'hidden'))


def test_activation_logical_name_without_rule_fails_at_trace_time():
  cfg = tiny_config()
  trainer = training.build(cfg, partitioning.make_mesh(cfg.mesh), ActivationOnlyName)  # params are fine
  with pytest.raises(
    ShardingError,
    match=r"activation \('batch', 'length', 'hidden'\) of shape \(16, 16, 16\) "
    r"at tests/test_validation.py:\d+ \(__call__\): logical axis 'hidden' "
    r'\(dim 2\) has no rule',
  ):
    training.trace(trainer, training.jit_train_step(trainer))


def test_rule_naming_unknown_mesh_axis():
  cfg = tiny_config(logical_axis_rules=tiny_config().logical_axis_rules + [('vocab', 'model')])
  with pytest.raises(ShardingError, match=r"\('vocab', 'model'\) names mesh axis 'model', which is not in the mesh"):
    build_trainer(cfg)


def test_mesh_product_must_match_device_count():
  cfg = tiny_config()
  cfg.mesh.data = 4
  with pytest.raises(ShardingError, match='needs 16 devices, but there are 8 cpu devices'):
    build_trainer(cfg)


def test_parameter_not_divisible():
  cfg = tiny_config()
  cfg.model.mlp_dim = 129  # 'mlp' is sharded over tensor=2
  with pytest.raises(
    ShardingError,
    match=r"parameter 'blocks/layers/0/mlp/down/layer/kernel': dim 0 \('mlp'\) has size "
    r'129, not divisible by mesh axes tensor=2 = 2',
  ):
    build_trainer(cfg)


def test_global_batch_not_divisible():
  with pytest.raises(
    ShardingError,
    match=r'global batch size 6 is not divisible by the mesh axes of logical axis '
    r"'batch' \(data=2 x fsdp=2 = 4\)",
  ):
    build_trainer(tiny_config(batch_size=6))


def test_unused_rule_and_unused_mesh_axis_warnings():
  cfg = tiny_config('dp', logical_axis_rules=tiny_config('dp').logical_axis_rules + [('expert', None)])
  cfg.mesh.update(data=2, fsdp=1, tensor=4)  # tensor is in no dp rule: 4x duplicated work
  trainer = build_trainer(cfg)
  training.trace(trainer, training.jit_train_step(trainer))
  warnings = trainer.warnings()
  assert any("('expert', None) is used by no parameter or activation" in w for w in warnings), warnings
  assert any("mesh axis 'tensor' (size 4) is used by no rule" in w for w in warnings), warnings
  assert len(warnings) == 2


def test_default_config_has_no_warnings():
  trainer = build_trainer(tiny_config())
  training.trace(trainer, training.jit_train_step(trainer))
  assert trainer.warnings() == []


def test_unnamed_parameter_is_rejected():
  class Bad(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jnp.zeros((4, 4)))  # no logical names

    def __call__(self, x):
      return x @ self.w

  cfg = tiny_config()
  mesh = partitioning.make_mesh(cfg.mesh)
  with pytest.raises(ShardingError, match=r"parameter 'w' of shape \(4, 4\) has no logical axis names"):
    training.build(cfg, mesh, Bad)


def test_parameter_dim_named_none_is_rejected():
  """None leaves an activation's dim unsharded; a stored array must name every dim (never replicated silently)."""

  class Bad(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jnp.zeros((4, 8)), out_sharding=(None, 'embed'), eager_sharding=False)

    def __call__(self, x):
      return x @ self.w

  cfg = tiny_config()
  with pytest.raises(
    ShardingError,
    match=r"parameter 'w' of shape \(4, 8\): dim 0 has no logical axis name "
    r"\(\(None, 'embed'\)\); name it in the model",
  ):
    training.build(cfg, partitioning.make_mesh(cfg.mesh), Bad)


def test_optimizer_state_follows_params():
  trainer = build_trainer(tiny_config())
  adam = trainer.specs.opt_state[1][0]
  assert adam.mu == trainer.specs.params and adam.nu == trainer.specs.params
  assert adam.count == P()
  assert trainer.specs.step == P()
  assert trainer.batch_shardings['inputs'].spec == P(('data', 'fsdp'))


def test_opt_state_leaf_that_mirrors_no_param():
  params = {'w': jax.ShapeDtypeStruct((4, 8), jnp.float32)}
  opt = {'factored_row': jax.ShapeDtypeStruct((4,), jnp.float32)}
  with pytest.raises(ShardingError, match=r"optimizer state 'factored_row' of shape \(4,\) mirrors no parameter"):
    partitioning.opt_state_axes(opt, params, {'w': ('embed', 'mlp')})


@pytest.mark.parametrize(
  'field, value, msg',
  [
    ('dataset.seq_len', 32, r'config.dataset.seq_len=32 exceeds config.model.max_len=16'),
    ('optim.name', 'adam', r"config.optim.name='adam' is not known"),
    ('task', 'translate', r"config.task='translate' is not a known task"),
  ],
)
def test_config_errors_name_the_field(field, value, msg):
  cfg = tiny_config()
  section, _, key = field.rpartition('.')
  (cfg[section] if section else cfg)[key] = value
  with pytest.raises(errors.ConfigError, match=msg):
    build_trainer(cfg)
