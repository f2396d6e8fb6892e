r"""Loss parity of the fast paths: N train steps of a config as it is and with its reference settings.

  python benchmarks/loss_parity.py --config configs/gpt2.py --config.batch_size=16 --steps 50
  python benchmarks/loss_parity.py --config configs/resnet.py --config.batch_size=64 \
      --reference model.scan_layers=True,model.bn_fast_variance=False
  python benchmarks/loss_parity.py --config configs/gpt2.py:tiny --steps 5            # CPU smoke test
  python benchmarks/loss_parity.py --config configs/gpt2.py --config.batch_size=16 --reference= \
      --reference_logsumexp two                 # on a GPU: the one-pass log-sum-exp against two passes

Both runs start from the same initial state (unrolled and scanned stacks initialise identically) and see
the same synthetic batches (the task's, one seed per step). The reference defaults to the previous path:
XLA attention, scanned layers, no remat, float32 logits, flax's two-pass BatchNorm. Prints the two loss
curves' largest difference relative to the reference loss, and where it happened.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import errors  # noqa: E402
import partitioning  # noqa: E402
import training  # noqa: E402
from configs import cli, schema  # noqa: E402
from training import profiling, xent  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/gpt2.py[:preset].', lock_config=True)
flags.DEFINE_integer('steps', 50, 'Train steps of each run.')
flags.DEFINE_string(
  'reference',
  'model.attention=xla,model.scan_layers=True,model.remat=none,'
  'model.logits_dtype=float32,model.bn_fast_variance=False,model.bn_fused=False',
  'Comma-separated key=value overrides that make the reference run (keys the config lacks are skipped).',
)
flags.DEFINE_enum(
  'logsumexp',
  'auto',
  xent.LOGSUMEXP_CHOICES,
  "The loss's log-sum-exp in this run: auto "
  '(one pass over the logits on GPUs, two elsewhere), or one / two passes on any device.',
)
flags.DEFINE_enum('reference_logsumexp', 'auto', xent.LOGSUMEXP_CHOICES, 'The same for the reference run.')


@errors.one_line()  # bad input: one line, no traceback
def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  config = FLAGS.config
  if config is None:
    raise app.UsageError('--config is required, e.g. --config configs/gpt2.py')
  schema.check(config)  # every field's type and range, before anything is built
  task = training.tasks.get(config.task)
  batches = [task.synthetic_batch(config, seed=config.seed + i) for i in range(FLAGS.steps)]
  mesh, note = partitioning.start_mesh(config.mesh)
  if note:
    print(note)
  reference = config.copy_and_resolve_references()
  changes = profiling.config_overrides(reference, FLAGS.reference)
  reference.update_from_flattened_dict(changes)
  with xent.logsumexp_passes(FLAGS.logsumexp):
    ours = profiling.train_losses(config, mesh, batches)
  with xent.logsumexp_passes(FLAGS.reference_logsumexp):
    ref = profiling.train_losses(reference, mesh, batches)
  rel = np.abs(ours - ref) / np.abs(ref)
  worst = int(np.argmax(rel))
  m = config.model
  print(
    f'\n{m.name}, batch {config.batch_size}, {FLAGS.steps} steps on {jax.device_count()} '
    f'{jax.devices()[0].device_kind}; dtype {m.dtype}'
  )
  print(
    'reference: '
    + ', '.join(
      [f'{k}={v}' for k, v in changes.items()]
      + (
        [f'log-sum-exp {FLAGS.reference_logsumexp} vs {FLAGS.logsumexp}']
        if FLAGS.logsumexp != FLAGS.reference_logsumexp
        else []
      )
    )
  )
  print(f'loss: step 1 {ours[0]:.5f} vs {ref[0]:.5f}; step {FLAGS.steps} {ours[-1]:.5f} vs {ref[-1]:.5f}')
  print(f'largest relative difference: {rel[worst]:.2e} at step {worst + 1}; median {np.median(rel):.2e}')


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line too
