r"""The decode kernel (models/kernels) against XLA on a decode step's weight matmuls and cached attention: GPT-2
124M's 48 weight matrices (and its tied head for matrix-vector rows), chained as a step's matmuls are, and its 12
layers' attention over their KV caches (layers.Attention's cached step), `--steps` steps inside one jitted loop (a
decode loop's), each side's program timed `--reps` times, `--rounds` rounds alternating the sides. XLA's side is
the model's: a Dense layer's einsum in the weights' dtype, the head's with float32 logits, the attention's XLA path.

  python benchmarks/decode_kernel.py       # rows 1, 4, 8 (float32, bfloat16); GEMM rows 32, 128 (and 32 in a
                                           # loop, W packed once), float32 and bfloat16; attention rows 1, 32
  python benchmarks/decode_kernel.py --rows 1 --gemm_rows '' --packed_rows '' --attention_rows ''

Matrix-vector rows (at most kernels.MAX_ROWS) run float32 and bfloat16 weights, activations in float32 as a decode
step's; GEMM rows run float32 throughout (where the library has its float32 GEMM: AVX2 or AVX-512) and bfloat16
throughout (where the CPU has AVX-512 BF16), one step per execution (a prefill's path: XLA's temporaries are fresh
pages in every execution, as a prefill's are), and `--packed_rows` `--steps` steps in a loop, packing W's panels as
it goes and, then, with a body that packs W by an operation of its own (kernels.decode_matmuls(prepack=True): XLA
packs it once, before the loop, as in a decode loop of batch 32). The
weights are the loops' arguments, as a decode loop's are. Prints, per case, the median ms per step of each round
(XLA, then the kernel) and the rate: GB/s of weights read (matrix-vector), GFLOP/s (GEMM), GB/s of cache read
(attention, at slot 5/6 of `--slots`). Refuses a busy machine as benchmarks/generate.py does (--max_load, --busy).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

flags.DEFINE_string('rows', '1,4,8', 'Matrix-vector row counts (at most models/kernels MAX_ROWS).')
flags.DEFINE_string('gemm_rows', '32,128', 'bfloat16 GEMM row counts (empty: none).')
flags.DEFINE_string('packed_rows', '32', 'bfloat16 GEMM row counts in a decode loop, W packed once (empty: none).')
flags.DEFINE_string('attention_rows', '1,32', 'Rows of the cached-attention cases (empty: none).')
flags.DEFINE_integer('slots', 192, 'KV cache slots of the attention cases (GPT-2 at prompt 128 + 64 new tokens).')
flags.DEFINE_integer('hidden', 768, 'Width (GPT-2 124M: 768; the MLP is 4x).')
flags.DEFINE_integer('layers', 12, 'Layers (4 matrices each).')
flags.DEFINE_integer('vocab', 50304, 'Rows of the tied head (matrix-vector cases only).')
flags.DEFINE_integer('steps', 8, 'Steps chained inside one jitted loop per call.')
flags.DEFINE_integer('reps', 7, 'Timed calls per side and round.')
flags.DEFINE_integer('rounds', 2, 'Rounds per case, the sides alternating.')
flags.DEFINE_float('max_load', 0.3, 'Busiest the machine may be (1-minute load average) at the start.')
flags.DEFINE_bool('busy', False, 'Run on a busy machine anyway (development, not figures).')
FLAGS = flags.FLAGS


def chain(ws, head, x, use_kernel: bool, dtype, prepack: bool = False):
  """One decode step's matmuls: every weight in order (a row's activations tiled up to a wide matrix's input),
  then the tied head; through the kernel where `use_kernel` (kernels.matmul, as a decode step's Dense layers)."""
  import jax.numpy as jnp

  from models import kernels

  def mm(spec, a, w, preferred):
    # XLA's side is the model's einsum: a Dense layer's in the weights' dtype, the head's with float32 logits
    a = a.astype(w.dtype)
    with kernels.decode_matmuls(use_kernel, prepack=prepack):
      got = kernels.matmul(spec, a, w, preferred or w.dtype)
    return got if got is not None else jnp.einsum(spec, a, w, preferred_element_type=preferred)

  D = FLAGS.hidden
  for w in ws:
    xi = x if w.shape[0] == D else jnp.tile(x, (1, w.shape[0] // D))
    x = jnp.tanh(mm('md,df->mf', xi, w, None)[:, :D].astype(jnp.float32))
  if head is not None:
    x = x + 1e-3 * mm('md,vd->mv', x, head, jnp.float32)[:, :D]
  return x


def alternate(step, carry, steps: int, args=()) -> dict[bool, list[float]]:
  """Median seconds per step of each round, XLA's side (False) and the kernel's (True) alternating: `steps` calls of
  step(use_kernel, carry, *args) inside one jitted loop per call. `args` (the weights) are the program's arguments,
  as a decode loop's are: XLA computes what depends on them alone once, before the loop (a packing of W). The carry
  is donated and each call's result carried into the next, as a decode loop carries its KV cache: a program that
  kept its input would copy the cache on every call."""
  import jax

  programs = {}
  for use in (False, True):
    loop = lambda c, *a, use=use: jax.lax.fori_loop(0, steps, lambda i, c: step(use, c, *a), c)
    programs[use] = jax.jit(loop, donate_argnums=0)
    carry = jax.block_until_ready(programs[use](carry, *args))
  medians = {False: [], True: []}
  for r in range(FLAGS.rounds):
    for use in (False, True) if r % 2 == 0 else (True, False):
      times = []
      for _ in range(FLAGS.reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(programs[use](carry, *args))
        times.append((time.perf_counter() - t0) / steps)
      medians[use].append(float(np.median(times)))
  return medians


def case(rows: int, wdtype: str, xdtype: str, with_head: bool, steps: int, prepack: bool = False) -> str:
  import jax.numpy as jnp

  rng = np.random.default_rng(0)
  D = FLAGS.hidden
  shapes = [(D, 3 * D), (D, D), (D, 4 * D), (4 * D, D)] * FLAGS.layers
  ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, wdtype) for s in shapes]
  head = jnp.asarray(rng.standard_normal((FLAGS.vocab, D), np.float32) * 0.02, wdtype) if with_head else None
  x = jnp.full((rows, D), 0.1, xdtype)
  step = lambda use, x, ws, head: chain(ws, head, x, use, xdtype, prepack).astype(xdtype)
  medians = alternate(step, x, steps, (ws, head))
  nbytes = sum(w.nbytes for w in ws) + (head.nbytes if with_head else 0)
  flops = 2 * rows * sum(int(np.prod(s)) for s in shapes)
  rate = lambda t: f'{nbytes / t / 1e9:.1f} GB/s' if with_head else f'{flops / t / 1e9:.0f} GFLOP/s'
  fmt = lambda ts: ', '.join(f'{t * 1e3:.2f}' for t in ts) + f' ms ({rate(float(np.median(ts)))})'
  loop = ', W packed before the loop' if prepack else ', in a loop' if steps > 1 else ''
  kind = 'matrix-vector' if with_head else f'GEMM{loop}'
  return f'| {rows} | {wdtype} | {kind} | {fmt(medians[False])} | {fmt(medians[True])} |'


def attention_case(rows: int, dtype: str, steps: int) -> str:
  """Every layer's cached attention of one decode step (heads of 64: GPT-2's 12 a layer) at slot 5/6 of the
  cache, its new keys and values written, as layers.Attention runs it in a decode."""
  import jax.numpy as jnp
  from flax import nnx

  from models import attention, kernels, layers

  D, C = FLAGS.hidden, FLAGS.slots
  H = max(1, D // 64)
  K = D // H
  attn = layers.Attention(D, H, rngs=nnx.Rngs(0))  # its cached step uses no weights
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((rows, 1, H, K)), dtype)
  caches = [
    tuple(jnp.asarray(rng.standard_normal((rows, H, C, K)), dtype) for _ in range(2)) for _ in range(FLAGS.layers)
  ]
  index = C * 5 // 6
  d = layers.Decoding(index=jnp.int32(index), valid_BS=jnp.ones((rows, C), bool))

  # one row's loop carries its caches without the batch axis, as generation/engine.py's does
  squeeze = (lambda c: c[0]) if rows == 1 else (lambda c: c)
  unsqueeze = (lambda c: c[None]) if rows == 1 else (lambda c: c)

  def step(use, carry):
    q, caches = carry
    outs, written = [], []
    with kernels.decode_matmuls(use):
      for k, v in caches:
        o, (k, v) = attn._cached(q, q, q, (unsqueeze(k), unsqueeze(v)), d, attention.PLAIN)
        outs.append(o)
        written.append((squeeze(k), squeeze(v)))
    return (q + 1e-3 * sum(outs)).astype(q.dtype), written

  medians = alternate(step, (q, [(squeeze(k), squeeze(v)) for k, v in caches]), steps)
  nbytes = FLAGS.layers * 2 * rows * H * (index + 1) * K * jnp.dtype(dtype).itemsize
  fmt = lambda ts: ', '.join(f'{t * 1e3:.2f}' for t in ts) + f' ms ({nbytes / float(np.median(ts)) / 1e9:.1f} GB/s)'
  return f'| {rows} | {dtype} cache | attention | {fmt(medians[False])} | {fmt(medians[True])} |'


def main(argv) -> None:
  del argv
  load = os.getloadavg()[0]
  if load > FLAGS.max_load and not FLAGS.busy:
    sys.exit(f'shardzoo: the machine is busy (1-minute load average {load:.2f} > --max_load {FLAGS.max_load}); --busy')
  from models import kernels

  usable, said = kernels.status()
  print(said)
  if not usable:
    sys.exit('shardzoo: nothing to compare: the decode kernel does not run here')
  lines = ['| rows | weights | kind | XLA ms/step per round | kernel ms/step per round |', '|---|---|---|---|---|']
  for rows in [int(r) for r in FLAGS.rows.split(',') if r]:
    for wdtype in ('float32', 'bfloat16'):
      lines.append(case(rows, wdtype, 'float32', with_head=True, steps=FLAGS.steps))
  # the GEMMs: float32 (a library built for AVX2 or AVX-512) and bfloat16 pairs (AVX-512 BF16)
  gemms = [dt for dt, runs in (('float32', kernels.f32_gemm()), ('bfloat16', kernels.bf16_gemm())) if runs]
  for rows in [int(r) for r in FLAGS.gemm_rows.split(',') if r]:
    for dt in gemms:
      lines.append(case(rows, dt, dt, with_head=False, steps=1))
  for rows in [int(r) for r in FLAGS.packed_rows.split(',') if r]:
    for dt in gemms:
      for prepack in (False, True):  # the kernel's side in a loop, packing as it goes and packed before
        lines.append(case(rows, dt, dt, with_head=False, steps=FLAGS.steps, prepack=prepack))
  for rows in [int(r) for r in FLAGS.attention_rows.split(',') if r]:
    for dtype in ('float32', 'bfloat16'):
      lines.append(attention_case(rows, dtype, steps=FLAGS.steps))
  print(
    f'load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end'
    + (' BUSY' if load > FLAGS.max_load else '')
  )
  print('\n'.join(lines))


if __name__ == '__main__':
  app.run(main)
