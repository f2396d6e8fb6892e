r"""The fused attention kernels (cuDNN, Pallas) vs the XLA path, on a GPU: outputs and gradients, and their speed.

  python benchmarks/attention_parity.py

  python benchmarks/attention_parity.py --cases context        # only the cases whose name has 'context'

For each case the zoo runs (causal GPT-2 / Llama with grouped kv heads, packed documents, ViT's 197
tokens padded for cuDNN, right-padded BERT rows, and context parallelism's per-shard kernel with its mask
as a bias, run here in shard_map over a 1-device 'context' axis), compares models/attention.py's fused kernels ('cudnn';
JAX's Pallas kernel, which alone takes packed documents) with its 'xla' kernel on the same bf16 inputs,
both against a float32 XLA reference: relative error
||out - ref|| / ||ref|| of the output and of dq, dk, dv. Then times forward + backward of each.
"""

from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import attention  # noqa: E402

CASES = {  # name -> (B, L, H, G, K, causal, packed, padded)
  'gpt2 causal': (8, 1024, 12, 12, 64, True, False, False),
  'llama causal GQA': (2, 2048, 32, 8, 64, True, False, False),
  'gpt2 packed': (8, 1024, 12, 12, 64, True, True, False),
  'llama packed GQA': (2, 2048, 32, 8, 64, True, True, False),
  'vit L=197': (64, 197, 12, 12, 64, False, False, False),
  'bert right-padded': (16, 128, 12, 12, 64, False, False, True),
  'llama packed GQA, context shard': (2, 2048, 32, 8, 64, True, True, False),
}


def inputs(B, L, H, G, K, packed, padded, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal((B, L, n, K)).astype(np.float32) for n in (H, G, G))
  seg = valid = None
  if packed:  # three documents and a padded tail per row, at different places in each row
    seg = np.zeros((B, L), np.int32)
    for b in range(B):
      cuts = sorted(rng.choice(np.arange(16, L - 16), 3, replace=False))
      seg[b, : cuts[0]], seg[b, cuts[0] : cuts[1]], seg[b, cuts[1] : cuts[2]] = 1, 2, 3
  if padded:
    lengths = rng.integers(L // 4, L + 1, B)
    valid = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
  return q, k, v, seg, valid


def context_shard(impl, q, k, v, seg, causal):
  """models/attention.py's per-shard context-parallel kernel (all-gathers, causal offset, mask from positions)
  in shard_map over a 'context' axis of one device: the program a GPU shard runs, at one shard."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('context',))
  spec, rows = P(None, 'context'), {} if seg is None else {'segment_ids_BL': seg}
  local = functools.partial(attention.per_shard_context, axes='context', causal=causal, implementation=impl)
  return jax.shard_map(
    local, mesh=mesh, in_specs=(spec, spec, spec, {k: spec for k in rows}), out_specs=spec, check_vma=False
  )(q, k, v, rows)


def run(impl, q, k, v, seg, valid, causal, dtype, context=False):
  def loss(q, k, v, ct):
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if context:
      o = context_shard(impl, q, k, v, seg, causal)
    else:
      with attention.forced(impl):
        o = attention.attend(q, k, v, causal=causal, segment_ids_BL=seg, valid_BL=valid)
    return (o.astype(jnp.float32) * ct).sum(), o

  ct = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  if valid is not None:  # padded queries' outputs are not compared (nothing uses them)
    ct = ct * valid[:, :, None, None]
  if seg is not None:
    ct = ct * (seg > 0)[:, :, None, None]
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, o), grads = f(q, k, v, ct)
  mask = 1.0 if valid is None else valid[:, :, None, None]
  mask = mask if seg is None else mask * (seg > 0)[:, :, None, None]
  jax.block_until_ready(grads)
  t0 = time.perf_counter()
  for _ in range(10):
    out = f(q, k, v, ct)
  jax.block_until_ready(out)
  seconds = (time.perf_counter() - t0) / 10
  return [np.asarray(o, np.float32) * mask] + [np.asarray(g, np.float32) for g in grads], seconds


def rel(a, b):
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
  cases = sys.argv[sys.argv.index('--cases') + 1] if '--cases' in sys.argv else ''
  print(f'{jax.devices()[0].device_kind}; jax {jax.__version__}')
  print(f'{"case":32s} {"impl":8s} {"out":>9s} {"dq":>9s} {"dk":>9s} {"dv":>9s} {"fwd+bwd ms":>11s}')
  for name, (B, L, H, G, K, causal, packed, padded) in CASES.items():
    if cases not in name:
      continue
    context = 'context' in name
    q, k, v, seg, valid = inputs(B, L, H, G, K, packed, padded)
    ref, _ = run('xla', q, k, v, seg, valid, causal, jnp.float32)
    fused = ('cudnn',) if context else ('pallas',) if packed else ('cudnn', 'pallas')
    for impl in ('xla',) + fused:
      try:
        got, t = run(impl, q, k, v, seg, valid, causal, jnp.bfloat16, context=context)
        errs = [rel(a, b) for a, b in zip(got, ref)]
        bad = ' NaN!' if any(np.isnan(e) for e in errs) else ''
        print(f'{name:32s} {impl:8s} ' + ' '.join(f'{e:9.2e}' for e in errs) + f' {1e3 * t:11.2f}{bad}', flush=True)
      except Exception as e:  # noqa: BLE001  (a probe: report and go on)
        print(f'{name:32s} {impl:8s} FAILED: {type(e).__name__}: {str(e)[:300]}', flush=True)


if __name__ == '__main__':
  main()
