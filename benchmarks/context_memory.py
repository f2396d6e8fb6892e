r"""Per-device memory of a context-parallel train step at context = 1, 2, 4, 8 (compiled abstractly: nothing allocated).

  python benchmarks/context_memory.py                                      # configs/llama.py:cp (32k tokens)
  python benchmarks/context_memory.py --config configs/llama.py:cp,tiny --contexts 1,2,4,8
  python benchmarks/context_memory.py --config.model.scan_layers=True      # faster compiles, same figures ±

For each size c of the config's 'context' mesh axis (its other axes kept, so the same global batch and the
same data-parallel split), the train step is traced and compiled for 2c simulated CPU devices (fsdp=2 x
context=c for the cp presets) and its memory_analysis printed per device: temporaries (activations, attention
scores, gradients in flight), arguments (params, optimizer state, the batch) and outputs. On the CPU, attention
runs on XLA, partitioned by GSPMD (--per_shard_xla: per shard in shard_map, the path cuDNN takes on a GPU,
with XLA inside); cuDNN's own temporaries on a GPU are not what these figures show. Then, for language models, the
work of each context shard's causal attention where the kernel skips masked tiles (splash on TPUs), rows in natural
and in zigzag order (config.context_load_balance).
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import errors  # noqa: E402
import partitioning  # noqa: E402
from configs import cli, schema  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  'config', 'configs/llama.py:cp', 'Config file with a context mesh axis.', lock_config=True
)
flags.DEFINE_list('contexts', ['1', '2', '4', '8'], 'Sizes of the context mesh axis to compile for.')
flags.DEFINE_bool(
  'per_shard_xla',
  False,
  'Without a GPU: XLA attention per shard in shard_map (the path cuDNN '
  'takes on GPUs) instead of GSPMD partitioning it.',
)


@errors.one_line()  # bad input: one line, no traceback
def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  config = FLAGS.config
  if 'context' not in config.mesh:
    raise app.UsageError(f'config.mesh {dict(config.mesh)} has no context axis: use a cp preset')
  contexts = [int(c) for c in FLAGS.contexts]
  others = 1
  for name, size in config.mesh.items():
    others *= 1 if name == 'context' else size
  partitioning.simulate_cpu_devices(others * max(contexts))
  import jax

  import models
  import training
  from models import attention
  from partitioning import fmt_bytes

  schema.check(config)
  B, L = config.batch_size, config.dataset.seq_len
  print(
    f'{config.model.name}, batch {B} x {L} tokens, mesh {dict(config.mesh)} with context = {contexts}; '
    f'attention={config.model.attention}, remat={config.model.get("remat")}, dtype={config.model.dtype}'
  )
  print(f'{"context":>7} {"devices":>7} {"tokens/device":>13} {"temporaries":>12} {"arguments":>10} {"outputs":>10}')
  first = None
  for c in contexts:
    cfg = config.copy_and_resolve_references()
    cfg.mesh.context = c
    mesh = partitioning.make_mesh(cfg.mesh, jax.devices()[: others * c])
    trainer = training.build(cfg, mesh, lambda rngs, cfg=cfg: models.create(cfg.model, rngs))
    with attention.per_shard_xla() if FLAGS.per_shard_xla else contextlib.nullcontext():
      mem = training.compile_step(trainer, training.jit_train_step(trainer)).memory_analysis()
    first = first or mem.temp_size_in_bytes
    print(
      f'{c:>7} {mesh.size:>7} {B * L // mesh.size:>13,} {fmt_bytes(mem.temp_size_in_bytes):>12} '
      f'{fmt_bytes(mem.argument_size_in_bytes):>10} {fmt_bytes(mem.output_size_in_bytes):>10}'
      f'   ({mem.temp_size_in_bytes / first:.3f} of context=1)',
      flush=True,
    )
  for decision in attention.decisions():
    print(f'attention: {decision}')
  if config.task == 'lm':
    _splash_tiles(L, contexts)


def _splash_tiles(L: int, contexts: list[int]) -> None:
  """Each context shard's causal attention work where a kernel skips masked tiles (splash, on TPUs): the tiles
  its forward computes for one row and head, rows in natural order and in zigzag order (context_load_balance).
  The step waits on the busiest shard: max / mean is the attention time lost to imbalance."""
  from models import attention

  print(
    f'splash attention tiles per context shard ({attention.SPLASH_BLOCK}-token query blocks; one row, one head, '
    'forward), natural order -> zigzag order (config.context_load_balance):'
  )
  for c in contexts:
    if c == 1 or (L // c) % attention.SPLASH_BLOCK or L % (2 * c):
      print(
        f'  context={c}: none ({L // c} tokens per shard; splash takes multiples of {attention.SPLASH_BLOCK} '
        'and balancing cuts the row into 2 x context chunks)'
        if c > 1
        else '  context=1: one shard'
      )
      continue
    natural, zigzag = (attention.splash_tiles(L, c, zigzag=z) for z in (False, True))
    imbalance = lambda tiles: max(tiles) * len(tiles) / sum(tiles)
    print(
      f'  context={c}: {natural} (max/mean {imbalance(natural):.2f}) -> {zigzag} (max/mean {imbalance(zigzag):.2f})',
      flush=True,
    )


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line too
