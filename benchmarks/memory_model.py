r"""The plan search's GPU memory model (planning/residuals.py) against device memory measured on one H100.

  python benchmarks/memory_model.py                 # every case below, about a minute on 2 CPU cores
  python benchmarks/memory_model.py --cases gpt2-16,llama-none

For each case the config (one device, every mesh axis 1) is built as train.py builds it, attention traced as on
a GPU (models.attention.gpu_stand_in), and the residual model compiled on one CPU device (nothing allocated):
arguments (parameters, optimizer state, batch), the kept residuals (fused: what fusion cannot recompute;
written: with the values the forward wrote for a matmul/convolution/kernel), the backward's largest new
array (planning/residuals.py), and the estimate args + (fused + written) / 2 + largest beside the H100's peak
(`benchmarks/throughput.py`, 2026-11-23, jax 0.11.2; docs/performance.md, "GPUs"). The measured figures are constants
here: this script cannot see a GPU. They were measured before the MLPs kept only their pre-activations and
the softmax cross-entropy got its own
gradient (both later that day), which lowered GPT-2's and ViT's peaks. So where JAX's CUDA plugin is installed
(planning/targets.py) each case is also compiled for one H100, the current step's own peak (exact to ~1% against
those measurements, benchmarks/compiled_memory.py), and the model's error is given against that too.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags  # noqa: E402

# name -> (config file, overrides, peak GiB measured on one H100 80GB on 2026-11-23)
CASES = {
  'gpt2-16': ('configs/gpt2.py', {'batch_size': 16, 'dataset.pack': False}, 13.45),
  'gpt2-16-bf16': (
    'configs/gpt2.py',
    {'batch_size': 16, 'dataset.pack': False, 'model.logits_dtype': 'bfloat16'},
    11.9,
  ),
  'gpt2-32': ('configs/gpt2.py', {'batch_size': 32, 'dataset.pack': False}, 24.7),
  'gpt2-64-packed': ('configs/gpt2.py', {}, 48.9),
  'llama-dots': ('configs/llama.py', {'batch_size': 8, 'dataset.pack': False}, 42.6),
  'llama-dots-bf16': (
    'configs/llama.py',
    {'batch_size': 8, 'dataset.pack': False, 'model.logits_dtype': 'bfloat16'},
    38.7,
  ),
  'llama-none': ('configs/llama.py', {'batch_size': 8, 'dataset.pack': False, 'model.remat': 'none'}, 50.4),
  'vit-256': ('configs/vit.py', {'batch_size': 256}, 23.45),
  'resnet-256': ('configs/resnet.py', {'batch_size': 256}, 10.86),
}
FLAGS = flags.FLAGS
flags.DEFINE_list('cases', list(CASES), f'Cases to run, from {list(CASES)}.')


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  bad = [c for c in FLAGS.cases if c not in CASES]
  if bad:
    raise app.UsageError(f'--cases: unknown {bad}; choose from {list(CASES)}')
  import jax

  import models
  import partitioning
  import training
  from models import attention
  from planning import candidates, residuals, targets
  from planning.search import FAST_CPU_COMPILE
  from training import profiling

  GiB = 2**30
  h100 = targets.gpu_devices('h100_sxm', 1) if targets.plugin_installed() else None
  rows = [
    ('case', 'args', 'fused', 'written', 'largest', 'estimate (range)', 'H100 peak', 'error')
    + (('compiled for H100 now', 'error') if h100 else ())
    + ('s',)
  ]
  for name in FLAGS.cases:
    path, overrides, measured = CASES[name]
    config = candidates.load_module(path).get_config(None)
    config.update_from_flattened_dict(overrides)
    t0 = time.perf_counter()
    mesh = partitioning.make_mesh({a: 1 for a in config.mesh}, jax.devices()[:1])
    tr = training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))
    args = sum(
      partitioning.tree_bytes_per_device(t, s, mesh.shape)
      for t, s in (
        (tr.abstract.params, tr.specs.params),
        (tr.abstract.opt_state, tr.specs.opt_state),
        (tr.abstract.model_state, tr.specs.model_state),
        (tr.batch_abstract, {k: v.spec for k, v in tr.batch_shardings.items()}),
      )
    )
    est = residuals.estimate(tr, attention.gpu_stand_in, FAST_CPU_COMPILE)
    lo, hi = (args + est.fused + est.largest) / GiB, (args + est.written + est.largest) / GiB
    mid = (args + est.kept + est.largest) / GiB
    now = ()
    if h100:
      gpu = training.build(
        config,
        partitioning.make_mesh({a: 1 for a in config.mesh}, h100),
        lambda rngs: models.create(config.model, rngs, config.lora),
      )
      peak = profiling.compiled_memory(training.compile_step(gpu, training.jit_train_step(gpu))) / GiB
      now = (f'{peak:.2f}', f'{100 * (mid / peak - 1):+.0f}%')
    rows.append(
      (
        name,
        f'{args / GiB:.2f}',
        f'{est.fused / GiB:.2f}',
        f'{est.written / GiB:.2f}',
        f'{est.largest / GiB:.2f}',
        f'{mid:.1f} ({lo:.1f}-{hi:.1f})',
        f'{measured:.2f}',
        f'{100 * (mid / measured - 1):+.0f}%',
      )
      + now
      + (f'{time.perf_counter() - t0:.0f}',)
    )
    print(' | '.join(rows[-1]), flush=True)
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  print('\n' + '\n'.join('  '.join(c.rjust(w) for c, w in zip(r, widths)) for r in rows))


if __name__ == '__main__':
  app.run(main)
