r"""Memory of a language model's train step with the loss in 0, 4, 8 chunks (compiled abstractly: nothing allocated).

  python benchmarks/loss_chunks_memory.py --config configs/gpt2.py --config.batch_size=16 --config.dataset.pack=False
  python benchmarks/loss_chunks_memory.py --config configs/llama.py --config.batch_size=8 --config.dataset.pack=False
  python benchmarks/loss_chunks_memory.py --config configs/gpt2.py:tiny --chunks 0,2,4                # seconds

For each value of config.model.loss_chunks the train step train.py runs (training.build + jit_train_step) is
traced and compiled for one simulated CPU device (every mesh axis 1) and its memory_analysis printed:
temporaries (activations, logits, gradients in flight), arguments (params, optimizer state, the batch) and
outputs, beside the size of the whole (B, L, V) logits in the config's logits dtype. These are XLA's CPU
figures: a GPU's compiled program (fusions, cuDNN/cuBLAS workspaces) differs.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import errors  # noqa: E402
from configs import cli, schema  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/gpt2.py', 'A language-model config file.', lock_config=True)
flags.DEFINE_list('chunks', ['0', '4', '8'], 'Values of config.model.loss_chunks to compile for.')


@errors.one_line()  # bad input: one line, no traceback
def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  import jax

  import models
  import partitioning
  import training
  from models import layers
  from partitioning import fmt_bytes

  config = FLAGS.config
  schema.check(config)
  if config.task != 'lm':
    raise app.UsageError(f'config.task={config.task!r}: loss_chunks is for language models (task lm)')
  m, B, L = config.model, config.batch_size, config.dataset.seq_len
  V = layers.padded_vocab(m)
  logits = B * L * V * layers.logits_dtype(m).itemsize
  print(
    f'{m.name}, batch {B} x {L} tokens, vocab {V}, 1 {jax.devices()[0].platform} device; dtype={m.dtype}, '
    f'remat={m.get("remat")}, scan_layers={m.get("scan_layers")}; whole logits {fmt_bytes(logits)} '
    f'({layers.logits_dtype(m).name})'
  )
  print(f'{"loss_chunks":>11} {"temporaries":>12} {"arguments":>10} {"outputs":>10} {"compile s":>9}')
  first = None
  for chunks in (int(c) for c in FLAGS.chunks):
    cfg = config.copy_and_resolve_references()
    cfg.model.loss_chunks = chunks
    cfg.mesh.update({k: 1 for k in cfg.mesh})
    mesh = partitioning.make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = training.build(cfg, mesh, lambda rngs, cfg=cfg: models.create(cfg.model, rngs))
    start = time.perf_counter()
    mem = training.compile_step(trainer, training.jit_train_step(trainer)).memory_analysis()
    first = first or mem.temp_size_in_bytes
    print(
      f'{chunks:>11} {fmt_bytes(mem.temp_size_in_bytes):>12} {fmt_bytes(mem.argument_size_in_bytes):>10} '
      f'{fmt_bytes(mem.output_size_in_bytes):>10} {time.perf_counter() - start:>9.1f}'
      f'   ({mem.temp_size_in_bytes / first:.3f} of the first)',
      flush=True,
    )


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line too
