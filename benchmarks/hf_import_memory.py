r"""Peak host memory while importing a Hugging Face checkpoint into a model sharded over 8 devices.

  python benchmarks/hf_import_memory.py [--layers 12 --dim 768]   # GPT-2 small layout by default

Step 1 (a child process) builds a random GPT-2 with transformers and saves it as safetensors.
Step 2 imports it with models/hf_import.py onto 8 simulated CPU devices under the gpt2 `fsdp`
preset and reports: the model's full size, the resident memory the imported (sharded) arrays
occupy, and the transient peak above that, i.e. what the import itself needed on the host.
On simulated CPU devices the device buffers live in host memory too, so they are measured
separately: transient = peak RSS - RSS after the import.
Compare: loading the whole file with safetensors.numpy.load_file first needs the full model size.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib(kind: str = 'RssAnon') -> float:
  """Resident memory (MiB): 'RssAnon' is memory the process allocated; 'RssFile' is file pages it maps
  (safetensors reads through mmap: those pages are page cache, reclaimable, not allocations)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(kind + ':'):
        return int(line.split()[1]) / 1024
  raise RuntimeError(f'{kind} not in /proc/self/status')


class PeakRSS:
  """Samples, every millisecond, resident memory minus `baseline` minus the bytes of the arrays
  created so far (`created`, MiB, updated by the caller): the host memory the import itself uses."""

  def __init__(self, baseline: float):
    self.baseline, self.created, self.peak = baseline, 0.0, 0.0

  def __enter__(self):
    self._stop = threading.Event()

    def run():
      while not self._stop.is_set():
        self.peak = max(self.peak, rss_mib() - self.baseline - self.created)
        time.sleep(0.001)

    self._thread = threading.Thread(target=run, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def save(path: str, layers: int, dim: int) -> None:
  import torch
  import transformers

  torch.manual_seed(0)
  cfg = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=dim // 64)
  transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--layers', type=int, default=12)
  p.add_argument('--dim', type=int, default=768)
  p.add_argument('--dir', default=None)
  p.add_argument('--_save', action='store_true')
  a = p.parse_args()
  if a._save:
    save(a.dir, a.layers, a.dim)
    return
  path = a.dir or tempfile.mkdtemp(prefix='hf_gpt2_')
  if not os.path.exists(os.path.join(path, 'config.json')):
    subprocess.run(
      [sys.executable, __file__, '--_save', '--dir', path, '--layers', str(a.layers), '--dim', str(a.dim)],
      check=True,
      env={**os.environ, 'HF_HUB_OFFLINE': '1'},
    )
  file_mib = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith('.safetensors'))
  file_mib /= 2**20

  sys.path.insert(0, ROOT)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import partitioning

  partitioning.simulate_cpu_devices(8)
  import jax

  import models
  import training
  from checkpointing import hf_config
  from configs import gpt2

  cfg = gpt2.get_config('fsdp')
  cfg.init_from = path
  cfg.model.update(pad_vocab_to=1, dtype='float32')
  cfg.logical_axis_rules = [r if r[0] != 'vocab' else ('vocab', None) for r in cfg.logical_axis_rules]
  hf_config.adopt(cfg, models.HF_FAMILIES)
  trainer = training.build(cfg, partitioning.make_mesh(cfg.mesh), lambda rngs: models.create(cfg.model, rngs))
  from models import hf_import

  before = rss_mib()
  t0 = time.perf_counter()
  make_array = jax.make_array_from_callback
  with PeakRSS(before) as sampler:

    def counted(shape, sharding, read, *args, **kwargs):  # the import makes each array from its devices' slices
      def counted_read(index):  # every slice read becomes one device buffer
        out = read(index)
        sampler.created += out.nbytes / 2**20
        return out

      return make_array(shape, sharding, counted_read, *args, **kwargs)

    with mock.patch.object(jax, 'make_array_from_callback', counted):
      params, _ = hf_import.import_params(
        hf_import.HFDir(path), models.HF_FAMILIES['gpt2'], cfg.model, trainer.abstract.params, trainer.shardings.params
      )
    jax.block_until_ready(params)
  dt = time.perf_counter() - t0
  after, transient = rss_mib(), sampler.peak
  n = sum(x.size for x in jax.tree.leaves(params))
  full = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
  per_device = (
    sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards if s.device == jax.devices()[0])
    / 2**20
  )
  print(f'model: {n:,} parameters, {full:.1f} MiB in float32 ({file_mib:.1f} MiB of safetensors)')
  print(f'import: {dt:.1f} s; device 0 holds {per_device:.1f} MiB (fsdp=8)')
  print(
    f'resident memory: {before:.0f} MiB before, {after:.0f} MiB after (+{after - before:.0f} MiB: the sharded '
    'arrays of all 8 simulated devices, which live in host memory on CPU)'
  )
  print(
    f'peak allocated host memory (RssAnon) of the import beyond the arrays created so far: {transient:.0f} MiB '
    f'= {100 * transient / full:.1f}% of the full model (largest tensor: '
    f'{max(x.nbytes for x in jax.tree.leaves(params)) / 2**20:.0f} MiB)'
  )


if __name__ == '__main__':
  main()
