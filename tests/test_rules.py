"""Rule resolution semantics: first free match, fallbacks, None, tuples, and every error."""

import pytest
from jax.sharding import PartitionSpec as P

from errors import ShardingError
from partitioning import AxisRules

MESH = {'data': 2, 'fsdp': 2, 'tensor': 2}
RULES = AxisRules(
  [
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('embed', None),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv', None),
  ]
)


def test_first_match():
  assert RULES.spec(('embed', 'mlp')) == P('fsdp', 'tensor')
  assert RULES.spec(('mlp', 'embed')) == P('tensor', 'fsdp')


def test_fallback_when_mesh_axis_already_used():
  # 'batch' takes data+fsdp, so 'embed' falls back to its next rule (None).
  assert RULES.spec(('batch', 'embed')) == P(('data', 'fsdp'))
  # Dimensions resolve in order: here 'embed' takes 'fsdp' first and 'batch' has no free rule.
  with pytest.raises(ShardingError, match=r"'batch' \(dim 1\)"):
    RULES.spec(('embed', 'batch'))


def test_fallback_to_a_different_mesh_axis():
  rules = AxisRules([('embed', 'fsdp'), ('embed', 'tensor'), ('vocab', 'fsdp')])
  assert rules.spec(('vocab', 'embed')) == P('fsdp', 'tensor')
  assert rules.spec(('embed',)) == P('fsdp')


def test_all_rules_blocked_is_an_error_not_silent_replication():
  rules = AxisRules([('embed', 'fsdp'), ('vocab', 'fsdp')])
  with pytest.raises(
    ShardingError,
    match=r"param 'w'.*logical axis 'vocab' \(dim 1\).*'fsdp' by dim 0 \('embed'\)"
    r".*\('vocab', None\)",
  ):
    rules.spec(('embed', 'vocab'), what="param 'w'")


def test_none_replicates_and_tuple_shards_over_several_axes():
  assert RULES.spec(('kv',)) == P()
  assert RULES.spec(('heads', 'kv')) == P('tensor')
  assert RULES.spec(('batch',)) == P(('data', 'fsdp'))


def test_tuple_rule_blocks_each_of_its_axes():
  rules = AxisRules([('batch', ('data', 'fsdp')), ('embed', 'fsdp'), ('embed', 'data'), ('embed', None)])
  assert rules.spec(('batch', 'embed')) == P(('data', 'fsdp'))
  assert rules.spec(('embed',)) == P('fsdp')


def test_later_duplicate_does_not_override_earlier():
  rules = AxisRules([('mlp', 'tensor'), ('mlp', 'fsdp')])
  assert rules.spec(('mlp',)) == P('tensor')


def test_missing_rule_names_array_and_axis():
  with pytest.raises(ShardingError, match=r"parameter 'blocks/0/w'.*logical axis 'vocab' \(dim 0\) has no rule"):
    RULES.spec(('vocab', 'embed'), what="parameter 'blocks/0/w'")


def test_unknown_logical_name_is_never_taken_as_a_mesh_axis():
  # flax's dict rules pass unknown names through as mesh axes; ours refuse.
  with pytest.raises(ShardingError, match="'tensor' \\(dim 0\\) has no rule"):
    RULES.spec(('tensor',))


def test_rule_naming_a_missing_mesh_axis():
  rules = AxisRules([('mlp', 'model')])
  with pytest.raises(
    ShardingError,
    match=r"rule #0 \('mlp', 'model'\) names mesh axis 'model', which is not in "
    r'the mesh \(data=2 x fsdp=2 x tensor=2\)',
  ):
    rules.check_mesh(MESH)


def test_divisibility_error_names_sizes():
  with pytest.raises(
    ShardingError,
    match=r"parameter 'mlp/w': dim 1 \('mlp'\) has size 33, not divisible by "
    r'mesh axes tensor=2 = 2',
  ):
    RULES.spec(('embed', 'mlp'), (64, 33), MESH, what="parameter 'mlp/w'")
  with pytest.raises(
    ShardingError,
    match=r"dim 0 \('batch'\) has size 6, not divisible by mesh axes "
    r'data=2 x fsdp=2 = 4',
  ):
    RULES.spec(('batch', 'embed'), (6, 64), MESH)


def test_rank_mismatch():
  with pytest.raises(ShardingError, match=r'has 3 dimensions \(shape \(1, 2, 3\)\) but 2 logical axis names'):
    RULES.spec(('embed', 'mlp'), (1, 2, 3), MESH)


@pytest.mark.parametrize(
  'bad, msg',
  [
    ([('embed',)], r'logical_axis_rules\[0\].*must be a pair'),
    ([('embed', 3)], r'logical_axis_rules\[0\].*the target 3 is not a mesh axis name'),
    ([('', 'fsdp')], r'logical name must be a non-empty string'),
    ([('a', None), ('b', ('x', 'x'))], r'logical_axis_rules\[1\].*appears twice'),
    ('embed', r'must be a list of pairs'),
  ],
)
def test_malformed_rules(bad, msg):
  with pytest.raises(ShardingError, match=msg):
    AxisRules(bad)


def test_unused_rules_reported():
  assert [r.logical for r in RULES.unused({'batch', 'embed', 'mlp'})] == ['heads', 'kv']
