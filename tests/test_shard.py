"""shard() places data outside jit and constrains inside jit; shard_logical resolves via the active rules."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import partitioning
from partitioning import AxisRules, shard, shard_logical, use_rules


def _mesh():
  return partitioning.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})


def test_shard_places_host_and_device_values():
  mesh = _mesh()
  tree = {'a': np.arange(16.0).reshape(4, 4), 'b': jnp.ones((8,)), 'c': 3.0}
  shardings = {
    'a': NamedSharding(mesh, P('fsdp', 'tensor')),
    'b': NamedSharding(mesh, P('data')),
    'c': NamedSharding(mesh, P()),
  }
  out = shard(tree, shardings)
  for k in tree:
    assert out[k].sharding == shardings[k]
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))
  assert out['a'].addressable_shards[0].data.shape == (2, 2)


def test_shard_inside_jit_is_a_constraint():
  mesh = _mesh()
  s = NamedSharding(mesh, P('tensor'))
  f = jax.jit(lambda x: shard(x * 2, s))
  assert 'sharding' in f.lower(jnp.ones(8)).as_text()
  assert f(jnp.ones(8)).sharding == s


def test_shard_logical_outside_rules_is_identity_and_inside_constrains():
  mesh = _mesh()
  x = jnp.ones((8, 4))
  assert shard_logical(x, ('batch', 'embed')) is x
  rules = AxisRules([('batch', ('data', 'fsdp')), ('embed', 'tensor')])
  seen = set()

  @jax.jit
  def f(x):
    with use_rules(rules, mesh, seen=seen):
      return shard_logical(x + 1, ('batch', 'embed'))

  assert f(x).sharding.spec == P(('data', 'fsdp'), 'tensor')
  assert seen == {'batch', 'embed'}
