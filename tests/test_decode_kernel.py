"""The decode kernel (models/kernels): each einsum it takes equals numpy's in float64 over the same (widened) values,
for both weight layouts, float32 and bfloat16, 1 to MAX_ROWS rows and sizes that leave tails; it takes only what is
one matmul of a few rows inside decode_matmuls(True); a call gives the same bits each time; a compiler that fails is
one line naming it and the source, and the decode falls back to XLA's dot. A decode through it equals XLA's:
tests/test_generation.py."""

import concurrent.futures
import ctypes
import functools
import os
import pathlib
import platform
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models import kernels
from tests.conftest import LOAD_KERNELS

if not kernels.available():
  pytest.skip(f'the decode kernel is not available here: {kernels._loaded()[1]}', allow_module_level=True)

CASES = [
  # spec, x shape, w shape, x dtype, w dtype, output dtype
  ('bld,dhk->blhk', (1, 1, 45), (45, 3, 7), 'float32', 'float32', 'float32'),  # K, N not multiples of 8, 16
  ('bld,df->blf', (3, 1, 64), (64, 100), 'bfloat16', 'bfloat16', 'bfloat16'),  # bf16 compute, 3 rows
  ('blhk,hkd->bld', (8, 1, 2, 24), (2, 24, 40), 'float32', 'float32', 'float32'),  # MAX_ROWS rows
  ('bld,df->blf', (2, 1, 1040), (1040, 33), 'float32', 'bfloat16', 'float32'),  # chunks of K, prefetched
  ('bld,dv->blv', (2, 1, 64), (64, 16400), 'float32', 'bfloat16', 'float32'),  # an untied head: bands of columns
  ('bld,vd->blv', (1, 1, 40), (37, 40), 'float32', 'float32', 'float32'),  # [N, K] (a tied head), tails
  ('bld,vd->blv', (2, 1, 768), (520, 768), 'bfloat16', 'bfloat16', 'float32'),  # 3 chunks of rows, f32 logits
  ('bld,vd->blv', (1, 1, 100), (300, 100), 'float32', 'bfloat16', 'float32'),  # one row: W's rows in turn, K tail
  # one row against long rows of W (16 a pass with AVX-512): each chunk's 16s, then a 4 and the rest left over
  ('bld,df->blf', (1, 1, 206), (206, 1100), 'float32', 'bfloat16', 'float32'),
  ('bld,df->blf', (1, 1, 206), (206, 600), 'float32', 'float32', 'float32'),
  # one bfloat16 row against bfloat16 W (AVX-512 BF16: pairs of W's rows by dot products): 16 rows a pass, then 4s,
  # then the 2 left over; 1,100 columns, the last 12 past whole registers of 32
  ('bld,df->blf', (1, 1, 206), (206, 1100), 'bfloat16', 'bfloat16', 'float32'),
  ('bld,dhk->blhk', (1, 1, 46), (46, 3, 12), 'bfloat16', 'bfloat16', 'float32'),  # short rows: 4 a pass, 4 columns past
]
GEMM_CASES = [  # more than MAX_ROWS rows: bfloat16 dot products (AVX-512 BF16), tiles of 8 (KN) and 4 (NK) rows
  ('bld,dhk->blhk', (3, 7, 46), (46, 5, 13), 'bfloat16', 'bfloat16', 'bfloat16'),  # 21 rows, 65 columns: tails
  ('bld,df->blf', (2, 8, 64), (64, 96), 'bfloat16', 'bfloat16', 'float32'),
  ('bld,vd->blv', (1, 13, 70), (37, 70), 'bfloat16', 'bfloat16', 'float32'),  # a head: 13 rows, K tail of 32
]
# More than MAX_ROWS rows through the float32 GEMM (a library built for AVX2 or AVX-512): float32 sums, tiles of 6 rows
# (AVX2) or 8 (AVX-512), chunks of 128 columns, blocks of 768 rows of W and 96 of x.
F32_GEMM_CASES = [
  ('bld,dhk->blhk', (3, 7, 45), (45, 5, 13), 'float32', 'float32', 'float32'),  # 21 rows, 65 columns, K odd: tails
  ('bld,df->blf', (2, 8, 64), (64, 200), 'bfloat16', 'bfloat16', 'bfloat16'),  # 16 rows, 2 chunks, the last partial
  ('bld,df->blf', (4, 25, 1000), (1000, 150), 'float32', 'float32', 'float32'),  # 2 blocks of W's rows and of x's
  ('bld,vd->blv', (1, 13, 70), (37, 70), 'float32', 'bfloat16', 'float32'),  # a tied head: 13 rows, dot products
]
if kernels.bf16_gemm():
  CASES += GEMM_CASES
if kernels.f32_gemm():
  CASES += F32_GEMM_CASES


# More of the float32 GEMM's rows (tiles of R rows, the last R + 1 to 2R - 1 rows in two), over panels in W's dtype.
F32_PACKED_CASES = [
  ('bld,df->blf', (1, 32, 96), (96, 40), 'float32', 'float32', 'float32'),  # 32 rows: 6 x 4 + 4 + 4, 8 x 4
  ('bld,df->blf', (3, 9, 80), (80, 70), 'float32', 'bfloat16', 'float32'),  # 27 rows: 6 x 3 + 5 + 4, 8 x 2 + 6 + 5
  ('bld,vd->blv', (1, 10, 50), (300, 50), 'float32', 'float32', 'float32'),  # a tied head: 19 or 10 panels
]
# The GEMM cases again with W's panels packed by an operation of their own (a decode loop's body: `prepack`).
PACKED = [(*c, True) for c in GEMM_CASES] if kernels.bf16_gemm() else []
if kernels.f32_gemm():
  PACKED += [(*c, True) for c in F32_GEMM_CASES + F32_PACKED_CASES]


@pytest.mark.parametrize(
  'spec,xs,ws,xt,wt,ot,prepack',
  [(*c, False) for c in CASES] + PACKED,
  ids=[f'{c[0]}:{c[4]}:{c[1][0] * c[1][1]}rows' for c in CASES]
  + [f'{c[0]}:{c[4]}:{c[1][0] * c[1][1]}rows:packed' for c in PACKED],
)
def test_the_kernel_is_the_einsum(spec, xs, ws, xt, wt, ot, prepack):
  check_einsum(spec, xs, ws, xt, wt, ot, prepack)


# Matmuls of up to MAX_ROWS rows against [K, N] weights narrower than bands of columns: K is split into chunks (one
# per worker by default).
SPLIT_CASES = [
  c for c in CASES if (p := kernels.plan(*c[:3]))[0] <= kernels.MAX_ROWS and not p[3] and p[2] < kernels.MATVEC3_MAX_N
]


@pytest.mark.parametrize('split', [3, 16])
@pytest.mark.parametrize('case', SPLIT_CASES, ids=lambda c: f'{c[0]}:{c[4]}:K{kernels.plan(*c[:3])[1]}')
def test_a_weight_split_into_more_chunks_than_workers_is_the_einsum(monkeypatch, case, split):
  # the tree that adds the chunks' sums, with a node whose right half is missing (3) and four full levels (16)
  monkeypatch.setattr(kernels, 'SPLIT_CHUNKS', split)
  check_einsum(*case, False)


def check_einsum(spec, xs, ws, xt, wt, ot, prepack):
  """kernels.matmul(spec) runs its kernel and equals the einsum in float64 within float32's (or bfloat16's) rounding."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(xs), xt)
  w = jnp.asarray(rng.standard_normal(ws) * 0.1, wt)

  @jax.jit
  def run(x, w):
    with kernels.decode_matmuls(True, prepack=prepack):
      return kernels.matmul(spec, x, w, jnp.dtype(ot))

  got = run(x, w)
  rows = xs[0] * xs[1]
  bf16_gemm = rows > kernels.MAX_ROWS and xt == wt == 'bfloat16' and kernels.bf16_gemm()
  target = 'shardzoo_gemm_packed' if bf16_gemm and prepack else 'shardzoo_gemm_bf16' if bf16_gemm else 'shardzoo_matvec'
  if prepack and not bf16_gemm and rows > kernels.MAX_ROWS:
    target = 'shardzoo_gemm_f32_packed'

  assert target in run.lower(x, w).as_text()
  assert got.dtype == jnp.dtype(ot) and got.shape == jnp.einsum(spec, x, w).shape
  want = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
  # float32 accumulation in another order than float64's; a bfloat16 result is rounded once, to 8 bits
  tol = 2.0**-8 if ot == 'bfloat16' else 1e-5
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize('split', [0, 16])
@pytest.mark.parametrize('wt', ['float32', 'bfloat16'])
def test_a_call_gives_the_same_bits_however_its_chunks_were_shared(monkeypatch, wt, split):
  # one row against 3072 rows of W: a chunk of rows per worker (0) or 16, claimed by whichever worker is free; with an
  # accumulator per worker, 30 calls gave 5-12 different results
  monkeypatch.setattr(kernels, 'SPLIT_CHUNKS', split)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 1, 3072)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3072, 768)), wt)

  @jax.jit
  def run(x, w):
    with kernels.decode_matmuls(True):
      return kernels.matmul('bld,df->blf', x, w, jnp.float32)

  assert len({np.asarray(run(x, w)).tobytes() for _ in range(30)}) == 1


def huge_pages_here() -> bool:
  """Whether this machine collapses ranges into transparent huge pages (Linux 6.1+, THP not 'never')."""
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      mode = f.read()
  except OSError:
    return False
  release = tuple(int(p) for p in platform.release().split('.')[:2] if p.isdigit())
  return '[never]' not in mode and release >= (6, 1)


def huge_bytes(start: int, end: int) -> int:
  """AnonHugePages of the mappings of this process that overlap [start, end) (/proc/self/smaps)."""
  total, inside = 0, False
  with open('/proc/self/smaps') as f:
    for line in f:
      head = line.split()[0]
      if '-' in head and ':' not in head:
        lo, hi = (int(v, 16) for v in head.split('-'))
        inside = lo < end and start < hi
      elif inside and head == 'AnonHugePages:':
        total += int(line.split()[1]) * 1024
  return total


@pytest.mark.skipif(not huge_pages_here(), reason='no transparent huge pages to collapse into here')
def test_huge_pages_moves_arrays_onto_2mb_pages_unchanged_and_says_why_not(monkeypatch):
  x = jnp.arange(3 << 20, dtype=jnp.float32)  # 12 MiB
  small = jnp.ones((1000,))  # under `least`: left where it is
  backed, total, why = kernels.huge_pages({'w': x, 'b': small})
  start = x.unsafe_buffer_pointer()
  assert (total, why) == (x.nbytes, '') and backed >= x.nbytes - 2 * kernels.HUGE_PAGE, (backed, why)
  # the blocks at the array's two ends hold other memory too, which Linux may split off again (it splits huge pages
  # that are mostly zeros); the blocks inside stay
  assert huge_bytes(start, start + x.nbytes) >= x.nbytes - 2 * kernels.HUGE_PAGE
  np.testing.assert_array_equal(np.asarray(x), np.arange(3 << 20, dtype=np.float32))
  monkeypatch.setattr(kernels, 'MADV_COLLAPSE', 12345)  # an advice the OS refuses: nothing moves, and why
  assert kernels.huge_pages(x) == (
    0,
    x.nbytes,
    f'madvise(MADV_COLLAPSE): {os.strerror(22)} (it needs Linux 6.1+ and transparent huge pages)',
  )
  assert kernels.huge_pages(small) == (0, 0, 'no CPU arrays to move')


def test_huge_pages_takes_every_array_of_one_program_s_outputs():
  """Arrays one jit gave out under one sharding share its cached set of devices: reading an array's device must
  not empty that set for the next (a generator's weights placed by one program)."""
  one = NamedSharding(jax.make_mesh((1,), ('d',)), PartitionSpec())
  a, b = jax.jit(lambda: [jnp.zeros(1 << 18), jnp.ones(1 << 18)], out_shardings=one)()
  assert kernels.huge_pages({'a': a, 'b': b})[1] == a.nbytes + b.nbytes


def test_it_takes_one_matmul_of_a_few_rows_inside_decode_matmuls_only():
  assert kernels.plan('bld,dhk->blhk', (2, 1, 8), (8, 3, 4)) == (2, 8, 12, False)
  assert kernels.plan('bld,vd->blv', (1, 1, 8), (50, 8)) == (1, 8, 50, True)
  assert kernels.plan('blhk,hkd->bld', (1, 1, 2, 4), (2, 4, 8)) == (1, 8, 8, False)
  for spec, xs, ws in [
    ('egcd,edf->egcf', (2, 1, 1, 8), (2, 8, 4)),  # experts: a batch of matmuls
    ('bthn,rhn->bthr', (1, 1, 2, 4), (3, 2, 4)),  # heads kept: a batch of matmuls
    ('bld,dhk->bhlk', (1, 1, 8), (8, 2, 4)),  # the output reordered
    ('bld,hdk->blhk', (1, 1, 8), (2, 8, 4)),  # contracted letters in the weight's middle
    ('...d,df->...f', (1, 8), (8, 4)),
  ]:
    assert kernels.plan(spec, xs, ws) is None, spec
  x, w = jnp.ones((1, 1, 8)), jnp.ones((8, 4))
  assert kernels.matmul('bld,df->blf', x, w, jnp.float32) is None  # outside decode_matmuls(True)
  with kernels.decode_matmuls(True):
    # more rows: the AVX2 library's GEMM takes them up to GEMM_MAX_ROWS, AVX-512 BF16's bfloat16 pairs
    many = jnp.ones((kernels.MAX_ROWS + 1, 1, 8))
    assert (kernels.matmul('bld,df->blf', many, w, jnp.float32) is None) != kernels.f32_gemm()
    assert kernels.matmul('bld,df->blf', jnp.ones((kernels.GEMM_MAX_ROWS + 1, 1, 8)), w, jnp.float32) is None
    many = many.astype(jnp.bfloat16)
    assert (kernels.matmul('bld,df->blf', many, w.astype(jnp.bfloat16), jnp.float32) is None) != (
      kernels.bf16_gemm() or kernels.f32_gemm()
    )
    assert kernels.matmul('bld,df->blf', x, w.astype(jnp.float16), jnp.float32) is None
    assert kernels.matmul('bld,df->blf', x, w, jnp.float32) is not None
  with kernels.decode_matmuls(False):
    assert kernels.matmul('bld,df->blf', x, w, jnp.float32) is None


MATMULS_CASES = [  # rows, K, the three N, weight dtype
  (1, 768, (768, 256, 256), 'bfloat16'),  # grouped heads: the key and value narrower than the query
  (3, 100, (64, 48, 48), 'float32'),  # a K tail (not a multiple of the chunks' 4 rows)
  (8, 1040, (40, 33, 16383), 'bfloat16'),  # MAX_ROWS rows, the widest N taken
]


def check_matmuls(M, K, Ns, wt):
  """Three matmuls of one x in one call (kernels.matmuls) give matmul's bits, each; the HLO holds one call."""
  rng = np.random.default_rng(K)
  x = jnp.asarray(rng.standard_normal((M, 1, K)), jnp.float32)
  ws = [jnp.asarray(rng.standard_normal((K, N)), wt) for N in Ns]

  def apart(x, ws):
    with kernels.decode_matmuls(True):
      return [kernels.matmul('bld,df->blf', x, w, jnp.float32) for w in ws]

  def together(x, ws):
    with kernels.decode_matmuls(True):
      return kernels.matmuls('bld,df->blf', x, ws, jnp.float32)

  text, t = jax.jit(together).lower(x, ws).as_text(), kernels.MATVEC3_TARGET
  assert text.count(f'custom_call @{t}(') + text.count(f'custom_call @"{t}"(') == 1  # a name with '-' is quoted
  for a, b in zip(jax.jit(apart)(x, ws), jax.jit(together)(x, ws), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('split', [0, 3])
@pytest.mark.parametrize('case', MATMULS_CASES, ids=lambda c: f'M{c[0]}K{c[1]}:{c[3]}')
def test_three_matmuls_of_one_x_are_one_call_with_the_same_bits(monkeypatch, case, split):
  monkeypatch.setattr(kernels, 'SPLIT_CHUNKS', split)  # 3: each weight's tree has a node without a right half
  check_matmuls(*case)


def test_matmuls_leaves_what_one_call_does_not_take():
  x, w = jnp.ones((1, 1, 64)), jnp.ones((64, 32))
  assert kernels.matmuls('bld,df->blf', x, [w] * 3, jnp.float32) is None  # outside decode_matmuls(True)
  with kernels.decode_matmuls(True):
    assert kernels.matmuls('bld,df->blf', x, [w] * 3, jnp.float32) is not None
    assert kernels.matmuls('bld,df->blf', x, [w] * 2, jnp.float32) is None  # two
    assert kernels.matmuls('bld,df->blf', x, [w, w, w.astype(jnp.bfloat16)], jnp.float32) is None  # mixed dtypes
    assert kernels.matmuls('bld,fd->blf', x, [w.T] * 3, jnp.float32) is None  # [N, K]: a head's layout
    wide = jnp.ones((64, kernels.MATVEC3_MAX_N))
    assert kernels.matmuls('bld,df->blf', x, [w, w, wide], jnp.float32) is None  # bands of columns
    many = jnp.ones((kernels.MAX_ROWS + 1, 1, 64))
    assert kernels.matmuls('bld,df->blf', many, [w] * 3, jnp.float32) is None  # a GEMM's rows


def test_a_layers_query_key_and_value_are_one_call_where_plain(monkeypatch):
  """layers.project: plain Dense layers (biases added as nnx.Einsum adds them) give what each gives alone, in one
  call inside decode_matmuls(True); a LoRA layer among them takes its own call."""
  from flax import nnx

  from models import layers, lora

  rngs = nnx.Rngs(0)
  kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
  q = layers.Dense('bld,dhk->blhk', (64, 4, 16), ('embed', 'heads', 'kv'), bias_axes=('heads', 'kv'), **kw)
  k = layers.Dense('bld,dhk->blhk', (64, 2, 16), ('embed', 'kv_heads', 'kv'), bias_axes=('kv_heads', 'kv'), **kw)
  v = layers.Dense('bld,dhk->blhk', (64, 2, 16), ('embed', 'kv_heads', 'kv'), **kw)
  for d in (q, k):
    d.layer.bias[...] = jax.random.normal(jax.random.key(1), d.layer.bias.shape, jnp.bfloat16)
  x = jax.random.normal(jax.random.key(2), (1, 1, 64), jnp.bfloat16)

  def run(denses):
    with kernels.decode_matmuls(True):
      return layers.project(denses, x)

  calls = []  # what kernels.matmuls returned: None where the layers ran on their own

  def matmuls(*a, orig=kernels.matmuls):
    calls.append(orig(*a))
    return calls[-1]

  monkeypatch.setattr(kernels, 'matmuls', matmuls)
  together = run((q, k, v))
  assert len(calls) == 1 and calls[0] is not None and all(y.dtype == jnp.bfloat16 for y in together)
  with kernels.decode_matmuls(True):
    for y, d in zip(together, (q, k, v), strict=True):
      np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(d(x), np.float32))
  calls.clear()
  adapted = lora.LoRADense(k, rank=2, alpha=4.0, rngs=rngs)
  run((q, adapted, v))
  assert not calls


def test_a_failing_compiler_is_one_line_and_the_decode_falls_back(tmp_path, monkeypatch):
  cxx = tmp_path / 'cxx'
  cxx.write_text(
    '#!/bin/sh\necho "c++ (fake) 1.0"\n[ "$1" = --version ] && exit 0\necho "x.cc:1: error: no" >&2\nexit 1\n'
  )
  cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv('CXX', str(cxx))
  monkeypatch.setenv('SHARDZOO_CACHE', str(tmp_path / 'cache'))
  with pytest.raises(RuntimeError, match=r'cxx failed on matvec\.cc: x\.cc:1: error: no'):
    kernels.build()
  assert not any(p.suffix == '.so' for p in (tmp_path / 'cache' / 'kernels').iterdir())  # no partial library
  monkeypatch.setattr(kernels, '_loaded', lambda: (None, 'cxx failed on matvec.cc: x.cc:1: error: no'))
  use, said = kernels.status(jax.devices()[:1])
  assert (
    not use
    and said == "decode matmuls: XLA's dot (the kernel is not available: cxx failed on matvec.cc: x.cc:1: error: no)"
  )
  assert kernels.missing(jax.devices()[:1])
  use, said = kernels.status(jax.devices()[:2])
  assert not use and 'the kernel runs on one device; the weights are on 2' in said
  assert not kernels.missing(jax.devices()[:2])


def test_processes_that_build_at_once_compile_once(tmp_path, monkeypatch):
  """build() from several processes at once (a multi-process launch on one host, the test session's background
  build and its workers): one compiles, the others wait on its lock and load the same file."""
  cxx = tmp_path / 'cxx'
  log = tmp_path / 'compiles'
  cxx.write_text(
    '#!/bin/sh\n[ "$1" = --version ] && { echo "c++ (fake) 1.0"; exit 0; }\n'
    f'echo compile >> {log}\nsleep 1\nfor out; do :; done\necho library > "$out"\n'
  )
  cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
  env = {**os.environ, 'CXX': str(cxx), 'SHARDZOO_CACHE': str(tmp_path / 'cache')}
  code = LOAD_KERNELS + 'print(kernels.build())'
  procs = [
    subprocess.Popen([sys.executable, '-c', code, kernels.__file__], env=env, stdout=subprocess.PIPE, text=True)
    for _ in range(3)
  ]
  paths = {p.communicate(timeout=120)[0].strip() for p in procs}
  assert [p.returncode for p in procs] == [0, 0, 0]
  assert len(paths) == 1 and log.read_text() == 'compile\n'
  assert pathlib.Path(paths.pop()).read_text() == 'library\n'


@pytest.mark.parametrize(
  'gemm,dtype', [('avx512_bf16', 'bfloat16'), ('float32', 'float32'), ('float32', 'bfloat16')], ids=lambda v: v
)
def test_a_decode_loop_packs_its_gemm_weights_once_outside_the_loop(gemm, dtype):
  """decode_matmuls(True, prepack=True) in a loop's body: XLA computes the weights' packing before the loop (the
  weights are the same every step) and the loop's steps only read the panels; the result equals the unpacked
  GEMM's. Were the packing left in the body, every step would pack W again (slower, not wrong). AVX-512 BF16's
  bfloat16 GEMM, and the float32 GEMM's (float32 sums) over float32 and bfloat16 panels."""
  pack, packed_gemm = {
    'avx512_bf16': ('shardzoo_pack_bf16', 'shardzoo_gemm_packed'),
    'float32': ('shardzoo_pack_f32', 'shardzoo_gemm_f32_packed'),
  }[gemm]
  if not (kernels.bf16_gemm() if gemm == 'avx512_bf16' else kernels.f32_gemm()):
    pytest.skip(f'{packed_gemm} does not run on this CPU')
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((96, 96)) * 0.1, dtype)
  head = jnp.asarray(rng.standard_normal((40, 96)) * 0.1, dtype)  # [N, K], as a tied head: 8 columns of tail
  act = jnp.dtype(dtype if gemm == 'avx512_bf16' else jnp.float32)  # bfloat16 pairs take the bfloat16 GEMM
  x = jnp.asarray(rng.standard_normal((12, 96)), act)

  def loop(prepack):
    def body(i, h):
      with kernels.decode_matmuls(True, prepack=prepack):
        h = kernels.matmul('md,dk->mk', h, w, act)
        logits = kernels.matmul('mk,vk->mv', h, head, jnp.float32)
      return ((h + logits[:, :1] * i.astype(jnp.float32)) / 2).astype(act)

    return jax.jit(lambda x: jax.lax.fori_loop(0, 3, body, x))

  packed = loop(True)
  got, want = np.asarray(packed(x), np.float32), np.asarray(loop(False)(x), np.float32)
  if gemm == 'avx512_bf16':  # the same sums, rounded to 8 bits the same way
    np.testing.assert_array_equal(got, want)
  else:  # the head's sums in another order (dot products unpacked, panels packed), then rounded to the dtype
    tol = 1e-5 if act == jnp.float32 else 2.0**-7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
  hlo = packed.lower(x).compile().as_text()
  bodies = [c for c in hlo.split('\n\n') if packed_gemm in c]
  assert bodies and all(pack not in c for c in bodies), 'the packing runs inside the loop'
  assert hlo.count(f'custom_call_target="{pack}"') == 2


def argmax_cases():
  """Rows of logits with what jnp.argmax decides: ties (the first wins, across lanes and blocks), a NaN (the first
  NaN), all -inf (index 0), a maximum in the tail of 16, rows shorter than a register; float32 and bfloat16."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((7, 53)).astype(np.float32)
  x[0, [5, 21, 40]] = 9.0  # equal maxima in three lanes and blocks
  x[1, [30, 3]] = np.nan, 99.0
  x[2] = -np.inf
  x[3, 52] = 50.0  # the last element, in the tail
  x[4, [17, 1]] = 8.0  # the same lane's tie, later block second
  x[5, 0] = np.inf
  x[6, [50, 2]] = 7.0  # a tie between a register's lane and the tail past the last whole register (AVX2: 8 lanes)
  return [
    jnp.asarray(x),
    jnp.asarray(x, jnp.bfloat16),
    jnp.asarray(x[:, :16].reshape(7, 2, 8)),
    jnp.asarray(x[:, :5]),  # shorter than one register
  ]


def check_argmax():
  for x in argmax_cases():
    with kernels.decode_matmuls(True):
      got = jax.jit(kernels.argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
  with kernels.decode_matmuls(False):
    assert kernels.argmax(x) is None


def test_greedy_argmax_is_jnp_argmax():
  check_argmax()


def test_a_decode_loop_looks_up_a_bfloat16_table_by_its_bytes():
  """layers.table_rows inside decode_matmuls: a 16-bit table's rows copied as they are (kernels.take_rows), no
  float32 copy of the table in the compiled loop; an id outside the table gives NaNs, as jnp.take's; a float32
  table is left to jnp.take."""
  from models import layers

  table = jnp.asarray(np.random.default_rng(0).standard_normal((512, 64)), jnp.bfloat16)
  ids = jnp.asarray([[3, 511], [0, 512]], jnp.int32)

  @jax.jit
  def loop(table, ids):
    def body(i, acc):
      with kernels.decode_matmuls(True):
        return acc + layers.table_rows(table, ids).astype(jnp.float32) * i

    return jax.lax.fori_loop(0, 3, body, jnp.zeros((*ids.shape, 64), jnp.float32))

  hlo = loop.lower(table, ids).compile().as_text()
  assert 'shardzoo_take_rows' in hlo and 'f32[512,64]' not in hlo
  got = np.asarray(loop(table, ids))
  want = 3 * np.asarray(jnp.take(table, ids, axis=0), np.float32)  # 0 + 1 + 2 times the rows
  np.testing.assert_array_equal(got[:, :1], want[:, :1])
  np.testing.assert_array_equal(got[0, 1], want[0, 1])
  assert np.isnan(got[1, 1]).all()  # id 512: outside
  with kernels.decode_matmuls(True):
    assert kernels.take_rows(table.astype(jnp.float32), ids) is None


@pytest.mark.parametrize('name', ['gelu_new', 'gelu_tanh', 'gelu_erf', 'silu'])
def test_a_bfloat16_activation_is_looked_up_with_xla_s_bits(name):
  """layers' activations of a bfloat16 x inside decode_matmuls(True): one lookup (kernels.elementwise16) in place of
  XLA's loop, with its bits on every bfloat16 (NaNs, infinities and subnormals among them) and on a shape of three
  chunks and a tail; float32 is left to XLA. Against transformers: tests/test_activations.py."""
  from models import layers

  f = getattr(layers, name)

  @jax.jit
  def looked_up(x):
    with kernels.decode_matmuls(True):
      return f(x)

  every = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(16, 4096))
  rows = jnp.asarray(np.random.default_rng(0).standard_normal((3, 17001)) * 4, jnp.bfloat16)
  for x in (every, rows):
    hlo = looked_up.lower(x).compile().as_text()
    assert kernels.LOOKUP_TARGET in hlo and 'tanh' not in hlo and 'exp' not in hlo
    np.testing.assert_array_equal(np.asarray(looked_up(x)).view(np.uint16), np.asarray(jax.jit(f)(x)).view(np.uint16))
  assert kernels.LOOKUP_TARGET not in looked_up.lower(every.astype(jnp.float32)).as_text()


ATTENTION_CASES = [
  # B, H, G, K, C slots, S positions, index, window, softcap, sinks, cache dtype
  (3, 4, 2, 20, 10, 10, 6, None, None, False, 'float32'),  # grouped heads, K tails of 16 and 8, left pads
  (1, 2, 1, 32, 12, 12, 9, 4, None, False, 'bfloat16'),  # one row (the cache without its batch axis), a window
  (2, 4, 4, 16, 4, 12, 9, 4, 5.0, True, 'float32'),  # a ring of 4 slots, soft cap, sinks
  (2, 6, 2, 64, 16, 16, 15, None, None, True, 'bfloat16'),  # the last slot, three heads per group
  (2, 8, 2, 72, 40, 40, 37, None, None, False, 'float32'),  # 38 slots: two blocks of 16 and 6; four heads a group
  (2, 4, 2, 136, 80, 80, 70, None, None, False, 'bfloat16'),  # 71 slots: blocks of 64 slots and of 64 columns
]


@pytest.mark.parametrize('case', ATTENTION_CASES, ids=lambda c: f'B{c[0]}H{c[1]}G{c[2]}C{c[4]}:{c[10]}')
def test_decode_attention_is_the_xla_path(case):
  """layers.Attention's cached step through the kernel equals its XLA path: the output and the written cache, which
  the kernel's attention writes itself (no call of write_slots)."""
  check_attention(case)


def kernel_and_xla(attn, target, logits, q, k, v, cache, d, sinks_H, absent=()):
  """attn._cached jitted inside decode_matmuls(True), whose program must call `target` and none of `absent`, and
  inside decode_matmuls(False): (output, cache) of each."""
  args = q, k, v, cache, d, sinks_H

  def run(fast):
    def cached(q, k, v, cache, d, sinks_H):
      with kernels.decode_matmuls(fast):
        return attn._cached(q, k, v, cache, d, logits, sinks_H)

    return jax.jit(cached)

  text = run(True).lower(*args).as_text()
  assert target in text and not [a for a in absent if a in text], absent
  return run(True)(*args), run(False)(*args)


def check_attention(case):
  from flax import nnx

  from models import attention, layers

  B, H, G, K, C, S, index, window, softcap, sinks, dtype = case
  rng = np.random.default_rng(C + index)
  attn = layers.Attention(H * K, H, num_kv_heads=G, head_dim=K, rngs=nnx.Rngs(0))
  q = jnp.asarray(rng.standard_normal((B, 1, H, K)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((B, 1, G, K)), dtype) for _ in range(2))
  cache = tuple(jnp.asarray(rng.standard_normal((B, G, C, K)), dtype) for _ in range(2))
  valid = np.ones((B, S), bool)
  valid[0, : min(3, index)] = False  # a left-padded prompt
  sinks_H = jnp.asarray(rng.standard_normal(H), jnp.float32) if sinks else None
  d = layers.Decoding(index=jnp.int32(index), valid_BS=jnp.asarray(valid))
  logits = attention.Logits(softcap=softcap, window=window)

  (got, got_cache), (want, want_cache) = kernel_and_xla(
    attn, kernels.ATTENTION_TARGET, logits, q, k, v, cache, d, sinks_H, absent=(kernels.WRITE_TARGET,)
  )
  assert got.dtype == want.dtype and got.shape == want.shape == (B, 1, H, K)
  # float32 throughout against XLA's float32 scores; in bfloat16 XLA rounds the probabilities and the output to 8 bits
  tol = 2.0**-7 if dtype == 'bfloat16' else 1e-5
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
  for a, b in zip(got_cache, want_cache):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize('B,dtype', [(2, 'bfloat16'), (1, 'float32')], ids=['batch2:bfloat16', 'one-row:float32'])
def test_a_decode_loop_writes_its_cache_inside_the_attention_in_place(B, dtype):
  """A decode loop whose carry is the KV cache: each step's kernel attention writes the step's slot into the cache's
  own buffers (its results alias them: no copy of the cache in the compiled loop, no write_slots call); after 3
  steps the caches and outputs equal XLA's. One row's loop carries its cache without the batch axis, as
  generation/engine.py does."""
  from flax import nnx

  from models import attention, layers

  H, G, K, C = 4, 2, 16, 12
  rng = np.random.default_rng(B)
  attn = layers.Attention(H * K, H, num_kv_heads=G, head_dim=K, rngs=nnx.Rngs(0))
  q, k, v = (jnp.asarray(rng.standard_normal((3, B, 1, n, K)), dtype) for n in (H, G, G))
  carried = (G, C, K) if B == 1 else (B, G, C, K)
  cache = tuple(jnp.asarray(rng.standard_normal(carried), dtype) for _ in range(2))
  valid = jnp.ones((B, C), bool)

  def loop(fast):
    def body(i, carry):
      cache, out = carry
      d = layers.Decoding(index=5 + i, valid_BS=valid)
      with kernels.decode_matmuls(fast):
        o, cache = attn._cached(q[i], k[i], v[i], tuple(c.reshape(B, G, C, K) for c in cache), d, attention.Logits())
      return tuple(c.reshape(carried) for c in cache), out + o.astype(jnp.float32)

    return jax.jit(lambda c: jax.lax.fori_loop(0, 3, body, (c, jnp.zeros((B, 1, H, K)))), donate_argnums=0)

  kernel = loop(True)
  hlo = kernel.lower(cache).compile().as_text()
  calls = [ln for ln in hlo.splitlines() if 'shardzoo_decode_attention' in ln and 'custom-call(' in ln]
  assert calls and all('output_to_operand_aliasing={{1}: (1, {}), {2}: (2, {})}' in ln for ln in calls), calls
  assert 'shardzoo_write_slots' not in hlo
  shape = f'{"bf16" if dtype == "bfloat16" else "f32"}[{",".join(map(str, carried))}]'
  assert not [ln for ln in hlo.splitlines() if f'= {shape}' in ln and ' copy(' in ln], hlo
  (got_cache, got), (want_cache, want) = kernel(tuple(map(jnp.array, cache))), loop(False)(tuple(map(jnp.array, cache)))
  tol = 2.0**-7 if dtype == 'bfloat16' else 1e-5
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
  for a, b in zip(got_cache, want_cache):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


PREFILL_CASES = [
  # B, T prompt, H, G, K, C slots, S positions, window, softcap, sinks, dtype
  (3, 19, 4, 2, 20, 24, 24, None, None, False, 'float32'),  # grouped heads, K tails, left pads, T not a tile's multiple
  # three heads a group, keys in registers of 16 and 8 (AVX-512 BF16: its dot products, registers of 32 and 16)
  (2, 40, 6, 2, 64, 48, 48, None, None, True, 'bfloat16'),
  (2, 23, 4, 4, 16, 7, 30, 7, 5.0, True, 'float32'),  # a window of 7 (a ring of 7 slots), soft cap, sinks
  (1, 13, 2, 1, 136, 16, 16, 5, None, False, 'bfloat16'),  # one row, a window, 136 columns: blocks of 64 and a tail
  # bfloat16 dot products (AVX-512 BF16): 96 columns (registers of 64 and 32), a window, a soft cap, an odd span
  (2, 37, 4, 2, 96, 40, 40, 9, 4.0, False, 'bfloat16'),
]


@pytest.mark.parametrize('case', PREFILL_CASES, ids=lambda c: f'B{c[0]}T{c[1]}H{c[2]}G{c[3]}:{c[10]}')
def test_prefill_attention_is_the_xla_path(case):
  """layers.Attention's prefill (the prompt attending to itself) through the kernel equals attention.attend's XLA
  path at every position with a key to see, and writes the same cache; a left pad's position gets zeros."""
  check_prefill(case)


def check_prefill(case):
  from flax import nnx

  from models import attention, layers

  B, T, H, G, K, C, S, window, softcap, sinks, dtype = case
  rng = np.random.default_rng(T + K)
  attn = layers.Attention(H * K, H, num_kv_heads=G, head_dim=K, rngs=nnx.Rngs(0))
  q = jnp.asarray(rng.standard_normal((B, T, H, K)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((B, T, G, K)), dtype) for _ in range(2))
  cache = tuple(jnp.zeros((B, G, C, K), dtype) for _ in range(2))
  valid = np.ones((B, S), bool)
  valid[0, :3] = False  # a left-padded prompt
  sinks_H = jnp.asarray(rng.standard_normal(H), jnp.float32) if sinks else None
  d = layers.Decoding(index=jnp.int32(0), valid_BS=jnp.asarray(valid), prefill=True)
  logits = attention.Logits(softcap=softcap, window=window)

  (got, got_cache), (want, want_cache) = kernel_and_xla(
    attn, kernels.PREFILL_TARGET, logits, q, k, v, cache, d, sinks_H
  )
  assert got.dtype == want.dtype and got.shape == want.shape == (B, T, H, K)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  tol = 2.0**-7 if dtype == 'bfloat16' else 1e-5  # XLA rounds bfloat16 probabilities to 8 bits
  np.testing.assert_allclose(got[:, 3:], want[:, 3:], rtol=tol, atol=tol)
  np.testing.assert_allclose(got[1:], want[1:], rtol=tol, atol=tol)
  assert not got[0, :3].any()  # the pads see no key: zeros, which nothing reads
  for a, b in zip(got_cache, want_cache):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@functools.cache
def _targets_for(march: str, isa: bytes) -> tuple[str, str, str, str, str]:
  """The library built for `march`, whose loops are `isa`'s, registered under targets of its own."""
  lib = ctypes.cdll.LoadLibrary(str(kernels.build(march)))
  lib.shardzoo_matvec_isa.restype = ctypes.c_char_p
  assert lib.shardzoo_matvec_isa() == isa and not lib.shardzoo_has_bf16_gemm()
  pairs = [
    (kernels.TARGET, lib.ShardzooMatvec),
    (kernels.ATTENTION_TARGET, lib.ShardzooDecodeAttention),
    (kernels.ARGMAX_TARGET, lib.ShardzooArgmax),
    (kernels.PREFILL_TARGET, lib.ShardzooPrefillAttention),
    (kernels.MATVEC3_TARGET, lib.ShardzooMatvec3),
  ]
  for target, fn in pairs:
    jax.ffi.register_ffi_target(f'{target}_{march}', jax.ffi.pycapsule(fn), platform='cpu')
  return tuple(f'{target}_{march}' for target, _ in pairs)


@functools.cache
def _gemm_targets_for(march: str) -> tuple[str, str, int]:
  """The float32 GEMM's packing and packed targets of the library built for `march`, and its panel width."""
  lib = ctypes.cdll.LoadLibrary(str(kernels.build(march)))
  assert lib.shardzoo_has_gemm()
  names = (f'{kernels.PACK_F32_TARGET}_{march}', f'{kernels.PACKED_F32_TARGET}_{march}')
  for name, fn in zip(names, (lib.ShardzooPackF32, lib.ShardzooGemmF32Packed)):
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform='cpu')
  return (*names, lib.shardzoo_gemm_panel())


@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'), reason='x86 targets')
@pytest.mark.parametrize('march,isa', [('x86-64-v2', b'portable C++'), ('x86-64-v3', b'AVX2')])
def test_builds_for_cpus_without_avx512_compute_the_same(monkeypatch, march, isa):
  """The library for a CPU without AVX-512 (AVX2 and FMA: x86-64-v3; neither: x86-64-v2's portable C++ loops)
  gives the einsums, the cached and the prompt's attention and the argmax above, and the AVX2 one its float32 GEMM's
  (W packed as it goes, and packed once); one for AVX-512 without BF16 (Skylake: no bfloat16 GEMM) builds."""
  if march == 'x86-64-v3' and not {'avx2', 'fma'} <= set(kernels._cpu_flags().split()):
    pytest.skip('this CPU has no AVX2 and FMA to run it')
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    skylake = pool.submit(kernels.build, 'skylake-avx512')
    matvec, attention_target, argmax_target, prefill_target, matvec3 = _targets_for(march, isa)
    assert skylake.result().exists()
  monkeypatch.setattr(kernels, 'TARGET', matvec)
  monkeypatch.setattr(kernels, 'MATVEC3_TARGET', matvec3)
  monkeypatch.setattr(kernels, 'ATTENTION_TARGET', attention_target)
  monkeypatch.setattr(kernels, 'ARGMAX_TARGET', argmax_target)
  monkeypatch.setattr(kernels, 'PREFILL_TARGET', prefill_target)
  for case in CASES:
    if case[1][0] * case[1][1] <= kernels.MAX_ROWS:
      test_the_kernel_is_the_einsum(*case, prepack=False)
  if march == 'x86-64-v3':  # its float32 GEMM (tiles of 6 rows, panels of 16 columns), activations in float32
    pack, packed, panel = _gemm_targets_for(march)
    assert panel == 16
    monkeypatch.setattr(kernels, 'PACK_F32_TARGET', pack)
    monkeypatch.setattr(kernels, 'PACKED_F32_TARGET', packed)
    monkeypatch.setattr(kernels, 'f32_gemm', lambda: True)
    monkeypatch.setattr(kernels, 'f32_panel', lambda: panel)
    for case in [c for c in F32_GEMM_CASES + F32_PACKED_CASES if c[3] == 'float32']:
      for prepack in (False, True):
        test_the_kernel_is_the_einsum(*case, prepack=prepack)
  for case in ATTENTION_CASES[:3]:
    check_attention(case)
  for case in PREFILL_CASES[:3]:
    check_prefill(case)
  check_argmax()
  for case in MATMULS_CASES[:2]:
    check_matmuls(*case)


def test_a_bfloat16_cache_is_written_without_widening_it():
  """layers.write_slots: the slots a plain dynamic_update_slice writes, and on a CPU no float32 copy of a bfloat16
  cache in the compiled loop (XLA's CPU compiler widens the whole cache to write a bfloat16 slice)."""
  from models import layers

  cache = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 16, 8)), jnp.bfloat16)
  new = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 1, 8)), jnp.bfloat16)

  def loop(write):
    return jax.jit(lambda c, x: jax.lax.fori_loop(0, 4, lambda i, c: write(c, x * i, i + 3, 2), c))

  got = loop(layers.write_slots)
  np.testing.assert_array_equal(
    np.asarray(got(cache, new), np.float32),
    np.asarray(
      loop(lambda c, x, at, axis: jax.lax.dynamic_update_slice_in_dim(c, x, at, axis))(cache, new), np.float32
    ),
  )
  assert 'f32[2,3,16,8]' not in got.lower(cache, new).compile().as_text()


@pytest.mark.parametrize(
  'cache_shape,x_shape,axis,at',
  [
    ((3, 16, 8), (3, 1, 8), 1, 5),  # a decode step of one row: the cache without its batch axis
    ((2, 3, 16, 8), (2, 3, 1, 8), 2, 15),  # the last slot
    ((2, 3, 16, 8), (2, 3, 4, 8), 2, 14),  # a prompt's 4 slots from 14: clamped to 12, as dynamic_update_slice
  ],
)
def test_the_kernel_writes_a_16bit_cache_in_place(cache_shape, x_shape, axis, at):
  """kernels.write_slots: the slots dynamic_update_slice writes, in a decode loop whose cache is its carry, with no
  copy of the cache (XLA's write of a bfloat16 slice copied the whole cache every step); a float32 cache is left to
  XLA, whose write is in place."""
  rng = np.random.default_rng(0)
  cache = jnp.asarray(rng.standard_normal(cache_shape), jnp.bfloat16)
  new = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)

  def loop(use):
    def body(i, c):
      with kernels.decode_matmuls(use):
        got = kernels.write_slots(c, new * (i + 1), at + i - 2, axis) if use else None
      return got if got is not None else jax.lax.dynamic_update_slice_in_dim(c, new * (i + 1), at + i - 2, axis)

    return jax.jit(lambda c: jax.lax.fori_loop(0, 3, body, c), donate_argnums=0)

  kernel = loop(True)
  hlo = kernel.lower(cache).compile().as_text()
  calls = [ln for ln in hlo.splitlines() if 'shardzoo_write_slots' in ln]
  assert calls and all('output_to_operand_aliasing={{}: (0, {})}' in ln for ln in calls), calls
  shape = f'bf16[{",".join(map(str, cache_shape))}]'
  assert not [ln for ln in hlo.splitlines() if f'= {shape}' in ln and (' copy(' in ln or 'fusion(' in ln)], hlo
  want = np.asarray(loop(False)(jnp.array(cache)), np.float32)
  np.testing.assert_array_equal(np.asarray(kernel(jnp.array(cache)), np.float32), want)
  with kernels.decode_matmuls(True):
    assert kernels.write_slots(cache.astype(jnp.float32), new.astype(jnp.float32), at, axis) is None


def test_a_decode_masks_the_padded_vocabulary_in_place():
  """layers.mask_padded_vocab inside a decode (kernels.mask_columns): the logits the select gives, written by a
  dynamic_update_slice of the padded columns alone, not a select over all of them."""
  from models import layers

  logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 40)), jnp.float32)
  want = layers.mask_padded_vocab(logits, 37)

  def decode(x):
    with kernels.decode_matmuls(True):
      return layers.mask_padded_vocab(x * 1.0, 37)

  run = jax.jit(decode)
  np.testing.assert_array_equal(np.asarray(run(logits)), np.asarray(want))
  hlo = run.lower(logits).compile().as_text()
  assert 'dynamic-update-slice' in hlo and 'select(' not in hlo, hlo
