r"""Peak host memory and time of exporting a model sharded over 8 devices as a Hugging Face directory.

  python benchmarks/hf_export_memory.py [--layers 12 --dim 768] [--dtype float32]   # GPT-2 small by default

Builds GPT-2 (random weights, configs/gpt2.py `fsdp` preset, float32 parameters) on 8 simulated CPU devices,
then writes it with training/export.write_hf (models/hf_export.py: one zoo tensor gathered at a time, written
in place into safetensors files laid out up front) and reports the time and the peak allocated host memory
(RssAnon, and the peak of traced numpy allocations) beyond what the sharded arrays already occupied before the
export. The output is then loaded by
transformers as a check (its logits are compared with the zoo's in the tests, not here).
"""

import argparse
import ctypes
import os
import sys
import tempfile
import time
import tracemalloc

from hf_import_memory import ROOT, PeakRSS, rss_mib


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--layers', type=int, default=12)
  p.add_argument('--dim', type=int, default=768)
  p.add_argument('--dtype', default='float32')
  p.add_argument('--out', default=None)
  a = p.parse_args()
  sys.path.insert(0, ROOT)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import partitioning

  partitioning.simulate_cpu_devices(8)
  import jax
  from flax import nnx

  import models
  import training
  from configs import gpt2
  from training import export

  cfg = gpt2.get_config('fsdp')
  cfg.model.update(
    num_layers=a.layers, embed_dim=a.dim, num_heads=a.dim // 64, mlp_dim=4 * a.dim, pad_vocab_to=1, dtype='float32'
  )
  cfg.logical_axis_rules = [r if r[0] != 'vocab' else ('vocab', None) for r in cfg.logical_axis_rules]
  trainer = training.build(cfg, partitioning.make_mesh(cfg.mesh), lambda rngs: models.create(cfg.model, rngs))
  make = lambda: nnx.to_pure_dict(nnx.state(trainer.make_model(nnx.Rngs(0)), nnx.Param))
  params = jax.block_until_ready(jax.jit(make, out_shardings=trainer.shardings.params)())
  out = a.out or tempfile.mkdtemp(prefix='hf_export_')
  ctypes.CDLL('libc.so.6').malloc_trim(0)  # freed init temporaries go back to the OS: they would hide the peak
  before = rss_mib()
  tracemalloc.start()  # numpy's allocations (the gathered tensors and their transforms) are traced
  t0 = time.perf_counter()
  with PeakRSS(before) as sampler:
    stats = export.write_hf(trainer, params, {}, out, models.HF_FAMILIES, dtype=a.dtype)
  dt = time.perf_counter() - t0
  traced = tracemalloc.get_traced_memory()[1] / 2**20
  full = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
  largest = max(x.nbytes for x in jax.tree.leaves(params)) / 2**20
  print(
    f'model: {sum(x.size for x in jax.tree.leaves(params)):,} parameters, {full:.1f} MiB in float32; '
    f'written: {stats["tensors"]} tensors, {stats["bytes"] / 2**20:.1f} MiB {stats["dtype"]} in '
    f'{len(stats["files"])} file(s) -> {out}'
  )
  print(
    f'export: {dt:.1f} s; peak allocated host memory beyond the sharded arrays: {sampler.peak:.0f} MiB RssAnon, '
    f'{traced:.0f} MiB traced numpy/Python allocations = {100 * max(sampler.peak, traced) / full:.1f}% of the '
    f'model (largest zoo tensor: {largest:.0f} MiB)'
  )
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  print(f'transformers loads it: {type(model).__name__}, {model.num_parameters():,} parameters')


if __name__ == '__main__':
  main()
