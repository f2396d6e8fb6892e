"""Declarative sharding: logical axis names -> config rules -> NamedShardings.

Models name the axes of their parameters and activations with *logical* names (`embed`, `mlp`,
`heads`, `batch`, ...). A config maps those names to *mesh* axes with an ordered rule list:

    config.mesh = dict(data=2, fsdp=2, tensor=2)     # mesh axis -> size; one size may be -1
    config.logical_axis_rules = [
        ('batch', ('data', 'fsdp')),   # a tuple shards one dimension over several mesh axes
        ('embed', 'fsdp'),
        ('embed', None),               # fallback: used where 'fsdp' is already taken
        ('mlp', 'tensor'),
        ('heads', 'tensor'),
        ('vocab', 'tensor'),
        ('kv', None),                  # None replicates (and says so explicitly)
    ]

Resolution, per array: for each dimension in order, take the FIRST rule for its logical name whose
mesh axes are not already used by an earlier dimension of the same array. Later rules for the same
name are fallbacks. With the rules above, a `('embed', 'mlp')` kernel becomes `P('fsdp', 'tensor')`,
and a `('batch', 'length', 'embed')` activation becomes `P(('data', 'fsdp'), None, None)`: 'batch'
took 'fsdp', so 'embed' falls back to None.

Nothing is replicated silently. These are errors, raised before anything compiles, each naming
the parameter path (or activation), the logical name, the mesh axes and the sizes involved:
  * a logical name used by the model with no rule at all (write `(name, None)` to replicate);
  * a dimension whose every rule names an already-used mesh axis (add a `(name, None)` fallback);
  * a rule naming a mesh axis that is not in the mesh;
  * mesh sizes whose product is not the device count;
  * a dimension not divisible by the product of its mesh axis sizes;
  * a global batch not divisible by the mesh axes of 'batch'.
Rules whose logical name nothing uses are reported as warnings.

Under context parallelism (a rule sharding 'length'), `config.context_load_balance` stores each row in zigzag
order so that every context shard's causal attention does the same work (partitioning/context.py).

This package never imports a model: it works on trees of shapes and logical names.
"""

from partitioning import context, pipeline
from partitioning.audit import audit, collective_shapes, collective_stats
from partitioning.hlo import replica_groups
from partitioning.mesh import (
  accelerator_present,
  check_platform,
  cpu_devices_note,
  dcn_coordinates,
  dcn_shape,
  describe_dcn,
  devices_needed,
  fit_mesh,
  fit_mesh_shape,
  make_mesh,
  num_slices,
  resolve_mesh_shape,
  simulate_cpu_devices,
  start_mesh,
  user_cpu_devices,
)
from partitioning.plan import (
  PlacedModel,
  check_batch,
  leading_rows,
  named_shardings,
  nnx_logical_axes,
  opt_state_axes,
  path_str,
  place_model,
  sharded_abstract,
  tree_specs,
)
from partitioning.rules import AxisRules, Rule, bytes_per_device, entry_axes, entry_size, rule_problem
from partitioning.shard import active_mesh, logical_spec, shard, shard_logical, suspend_rules, use_rules
from partitioning.table import fmt_bytes, sharding_summary, sharding_table, tree_bytes_per_device

__all__ = [
  'AxisRules',
  'PlacedModel',
  'Rule',
  'active_mesh',
  'audit',
  'bytes_per_device',
  'check_batch',
  'context',
  'pipeline',
  'accelerator_present',
  'check_platform',
  'collective_shapes',
  'collective_stats',
  'dcn_coordinates',
  'dcn_shape',
  'describe_dcn',
  'entry_axes',
  'entry_size',
  'leading_rows',
  'devices_needed',
  'cpu_devices_note',
  'fit_mesh',
  'fit_mesh_shape',
  'fmt_bytes',
  'logical_spec',
  'make_mesh',
  'named_shardings',
  'nnx_logical_axes',
  'num_slices',
  'opt_state_axes',
  'path_str',
  'place_model',
  'replica_groups',
  'resolve_mesh_shape',
  'rule_problem',
  'shard',
  'shard_logical',
  'sharded_abstract',
  'sharding_summary',
  'sharding_table',
  'simulate_cpu_devices',
  'start_mesh',
  'user_cpu_devices',
  'suspend_rules',
  'tree_bytes_per_device',
  'tree_specs',
  'use_rules',
]
