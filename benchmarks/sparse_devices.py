r"""The fewest devices whose memory holds a real-size model's training state, by the plan search's first pruning.

  python benchmarks/sparse_devices.py --config configs/deepseek_v3.py:671b --device_kind h100

For N = 1, 2, 4, ... the plan search's candidates (planning/candidates.py: every factorisation of N over the
config's mesh axes x the config file's presets) are resolved by the rules alone, as search.py does before it
compiles anything (planning/search.py: indivisible dims are pruned, then parameters + AdamW state over 0.9 x the
chip's memory): the first N with a candidate left is printed with the candidates that fit and their state per
device. Computed, not measured: activations, the step's temporaries and any fragmentation come on top (search.py
compiles the survivors for those), so the count is a floor.
"""

from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import errors  # noqa: E402
import models  # noqa: E402
from configs import cli  # noqa: E402
from errors import ShardingError  # noqa: E402
from partitioning import AxisRules, nnx_logical_axes, tree_bytes_per_device, tree_specs  # noqa: E402
from planning import candidates  # noqa: E402
from training import flops  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file and size, e.g. configs/deepseek_v3.py:671b.')
flags.DEFINE_enum('device_kind', 'h100', sorted(flops.CHIPS), 'The chip whose memory holds the state.')
flags.DEFINE_integer('max_devices', 4096, 'Give up above this many devices.')


@errors.one_line()  # bad input: one line, no traceback
def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  config = FLAGS.config
  chip = flops.CHIPS[FLAGS.device_kind]
  config.model.scan_layers = True  # stacked leaves: the same bytes per device (no preset shards 'layers'), fewer
  abstract = nnx.eval_shape(lambda: models.create(config.model, nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  shapes, axes = nnx.to_pure_dict(params), nnx_logical_axes(params)
  # AdamW: two moments of each parameter's dtype, sharded as the parameter (optax's state mirrors the params)
  state_per_param_byte = 3
  file = FLAGS['config'].config_filename.split(':')[0]
  presets = candidates.presets_of(file, None, config)
  mesh_axes = candidates.mesh_axes_of(presets, list(config.mesh))
  budget = 0.9 * chip.memory_gib * 2**30
  n = 1
  while n <= FLAGS.max_devices:
    fits = collections.defaultdict(list)
    for cand in candidates.generate(n, mesh_axes, presets, [None]):
      mesh = dict(cand.mesh)
      try:
        specs = tree_specs(shapes, axes, AxisRules(cand.rules), mesh)
      except ShardingError:
        continue
      state = state_per_param_byte * tree_bytes_per_device(shapes, specs, mesh)
      if state <= budget:
        fits[cand.rules_name].append((state, {a: s for a, s in cand.mesh if s > 1}))
    if fits:
      print(f'{FLAGS["config"].config_filename} fits {n} x {FLAGS.device_kind} (state <= 0.9 x {chip.memory_gib} GiB):')
      for name, plans in sorted(fits.items()):
        state, mesh = min(plans, key=lambda p: p[0])
        print(f'  {name}: {len(plans)} meshes, least state {state / 2**30:.1f} GiB/device on {mesh}')
      return
    n *= 2
  print(f'no plan up to {FLAGS.max_devices} devices')


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line too
