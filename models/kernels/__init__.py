"""Hand-written CPU kernels behind jax.ffi for a decode on one CPU device, with XLA as the fallback (matvec.cc).

* `matmul`, up to MAX_ROWS rows: a decode step must read every weight once, so its time is the weights' bytes over
  the memory's read rate. XLA's CPU dot reads float32 weights below that rate and widens bfloat16 weights into a
  float32 copy before it multiplies; the kernel streams them in order, widens bfloat16 in registers and splits the
  rows of W between the caller and XLA's thread pool. `matmuls`: three such matmuls of one x (a layer's query, key
  and value projections) in one call.
* `matmul`, more rows of bfloat16 against bfloat16 (the prefill) where the CPU has AVX-512 BF16 (`bf16_gemm`):
  bfloat16 pairs multiplied by vdpbf16ps, where XLA widens both operands first. One row of bfloat16 values against
  a bfloat16 [K, N] weight takes the same instruction, in a third of the widening loop's instructions.
* `matmul`, up to GEMM_MAX_ROWS rows against float32 or bfloat16 weights where the library is built for AVX2 or
  AVX-512 (`f32_gemm`): float32 sums in register tiles over packed panels of W. XLA's CPU dot ran such matmuls at
  about a third of an AVX2 machine's matmul rate, and at 32 rows at two thirds of an AVX-512 one's. In a decode loop
  (`prepack`), the weights are packed into those panels once, outside the loop, so that each step reads them in
  order.
* `decode_attention`: a decode step's attention of one new query per row over its KV cache (float32 or bfloat16),
  each cached key and value read once for the query heads that share it, the step's own key and value written into
  the cache in place first. XLA's CPU compiler widens a bfloat16 cache into a float32 copy every step and runs the
  products as batched one-row dots.
* `elementwise16`: a bfloat16 MLP's activation looked up in a table of its 65,536 values (XLA's, computed once), where
  XLA's CPU loops compute it at the instruction rate.
* `argmax`: a greedy decode's choice of token, which XLA's CPU compiler runs one element at a time.
* `take_rows`: a decode's lookup of a 16-bit table, its bytes copied (XLA's CPU compiler gathers bfloat16 in
  float32, and widened the whole table once per generate call).
* `write_slots`: a prompt's keys and values written into a 16-bit KV cache, in place (XLA's CPU compiler copied
  the whole cache to write one slot).
* `huge_pages`: a generator's weights moved onto 2 MB pages (Linux's MADV_COLLAPSE). XLA allocates them on 4 KB
  pages, where a stream of reads crosses a page every 64 cache lines; a batch-1 decode step, which reads every
  weight once, took 7% longer on them.

The library is compiled from source on first use (a C++17 compiler: $CXX, else g++ or c++) into a cache directory
($SHARDZOO_CACHE, else ~/.cache/shardzoo), keyed by the source, the compiler, the flags and the CPU. Where it does not
build, or does not apply (weights sharded over devices, a GPU, an einsum that is not one matmul, more than
GEMM_MAX_ROWS rows but bfloat16 pairs on AVX-512 BF16, more than MAX_ROWS where the CPU has neither AVX2 nor
AVX-512), XLA runs.
`decode_matmuls(True)` turns it on for what is traced inside (generation/engine.py does, for the prefill and the
decode step on one CPU device); `status()` says what runs, and why (docs/generation.md, "The decode kernel")."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

try:
  import fcntl
except ImportError:  # Windows: no advisory locks; concurrent builds each compile and rename into place
  fcntl = None

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = pathlib.Path(__file__).with_name('matvec.cc')
TARGET = 'shardzoo_matvec'
MATVEC3_TARGET = 'shardzoo_matvec3'
GEMM_TARGET = 'shardzoo_gemm_bf16'
TAKE_TARGET = 'shardzoo_take_rows'
WRITE_TARGET = 'shardzoo_write_slots'
ATTENTION_TARGET = 'shardzoo_decode_attention'
PREFILL_TARGET = 'shardzoo_prefill_attention'
ARGMAX_TARGET = 'shardzoo_argmax'
PACK_TARGET = 'shardzoo_pack_bf16'
PACKED_GEMM_TARGET = 'shardzoo_gemm_packed'
PACK_F32_TARGET = 'shardzoo_pack_f32'
PACKED_F32_TARGET = 'shardzoo_gemm_f32_packed'
LOOKUP_TARGET = 'shardzoo_lookup16'
PANEL = 32  # matvec.cc: the bfloat16 GEMM's panels of W are 32 columns wide
MAX_ROWS = 8  # matvec.cc kMaxRows: each weight is loaded once for all rows; beyond a few rows a GEMM's tiles win
MATVEC3_MAX_N = 4 * 4096  # matvec.cc kBand * 4: wider weights take bands of columns, a call each
# Chunks of K a weight of up to MAX_ROWS rows is split into (matvec.cc kn_split; up to 16): 0 for one per worker of
# XLA's pool, each a fixed share of K summed up a fixed tree. Tests set more, to run that tree on a 2-core machine.
SPLIT_CHUNKS = 0
GEMM_MAX_ROWS = 4096  # the float32 GEMM's rows, as measured (a prefill of 32 x 128 tokens); XLA's dot beyond
FLAGS = (
  '-O3',
  '-march=native',
  # Reassociation lets the dot products vectorise; NaN and infinity keep their meaning (no -ffast-math).
  '-fno-math-errno',
  '-fassociative-math',
  '-fno-signed-zeros',
  '-fno-trapping-math',
  '-std=c++17',
  '-shared',
  '-fPIC',
  '-w',
)
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_active = contextvars.ContextVar('shardzoo_decode_matmuls', default=False)
_prepack = contextvars.ContextVar('shardzoo_prepack', default=False)


def _compiler() -> str | None:
  for name in (os.environ.get('CXX'), 'g++', 'c++'):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_flags() -> str:
  """The CPU's feature flags (part of the cache key: the library is built for this CPU, -march=native)."""
  try:
    with open('/proc/cpuinfo') as f:
      return next((line for line in f if line.startswith(('flags', 'Features'))), platform.processor())
  except OSError:
    return platform.processor()


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get('SHARDZOO_CACHE') or pathlib.Path.home() / '.cache' / 'shardzoo') / 'kernels'


def build(march: str = 'native') -> pathlib.Path:
  """The compiled library (built now if the cache has none) for `march` (-march: this CPU, or another target such
  as x86-64-v2, whose library takes the portable loops); RuntimeError saying why it could not be built."""
  flags = [f'-march={march}' if f == '-march=native' else f for f in FLAGS]
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError('no C++ compiler found ($CXX, g++ or c++)')
  include = jax.ffi.include_dir()
  version = subprocess.run([cxx, '--version'], capture_output=True, text=True, timeout=30).stdout
  key = hashlib.sha256(
    '\0'.join([SOURCE.read_text(), cxx, version, ' '.join(flags), jax.__version__, _cpu_flags()]).encode()
  ).hexdigest()[:16]
  out = cache_dir() / f'matvec-{key}.so'
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # Processes that need the library at once (a multi-process launch on one host, a test session's workers) compile
  # it once: the others wait on this lock, then find it built.
  with open(out.with_suffix('.lock'), 'w') as lock:
    if fcntl is not None:
      fcntl.flock(lock, fcntl.LOCK_EX)
    if out.exists():
      return out
    # Built beside its final name and renamed into place, so a process that does not lock never loads a partial file.
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=out.parent)
    os.close(fd)
    try:
      done = subprocess.run(
        [cxx, *flags, f'-I{include}', str(SOURCE), '-o', tmp], capture_output=True, text=True, timeout=300
      )
      if done.returncode:
        lines = [ln for ln in done.stderr.splitlines() if 'error' in ln] or done.stderr.splitlines() or ['(no output)']
        raise RuntimeError(f'{pathlib.Path(cxx).name} failed on {SOURCE.name}: {lines[0].strip()}')
      os.replace(tmp, out)
    finally:
      if os.path.exists(tmp):
        os.unlink(tmp)
  return out


@functools.cache
def _loaded() -> tuple[str | None, str]:
  """(the kernel's instruction set, '') once built, loaded and registered with XLA; else (None, why not)."""
  if os.environ.get('SHARDZOO_DECODE_KERNEL', '1') == '0':
    return None, 'SHARDZOO_DECODE_KERNEL=0'
  try:
    lib = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ShardzooMatvec), platform='cpu')
    jax.ffi.register_ffi_target(MATVEC3_TARGET, jax.ffi.pycapsule(lib.ShardzooMatvec3), platform='cpu')
    jax.ffi.register_ffi_target(TAKE_TARGET, jax.ffi.pycapsule(lib.ShardzooTakeRows), platform='cpu')
    jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(lib.ShardzooWriteSlots), platform='cpu')
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(lib.ShardzooArgmax), platform='cpu')
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.ShardzooDecodeAttention), platform='cpu')
    jax.ffi.register_ffi_target(PREFILL_TARGET, jax.ffi.pycapsule(lib.ShardzooPrefillAttention), platform='cpu')
    jax.ffi.register_ffi_target(LOOKUP_TARGET, jax.ffi.pycapsule(lib.ShardzooLookup16), platform='cpu')
    lib.shardzoo_matvec_isa.restype = ctypes.c_char_p
    isa = lib.shardzoo_matvec_isa().decode()
    if lib.shardzoo_has_gemm():
      isa += ' with its GEMM'  # f32_gemm() reads it from here
      jax.ffi.register_ffi_target(PACK_F32_TARGET, jax.ffi.pycapsule(lib.ShardzooPackF32), platform='cpu')
      jax.ffi.register_ffi_target(PACKED_F32_TARGET, jax.ffi.pycapsule(lib.ShardzooGemmF32Packed), platform='cpu')
    if lib.shardzoo_has_bf16_gemm():
      jax.ffi.register_ffi_target(GEMM_TARGET, jax.ffi.pycapsule(lib.ShardzooGemmBf16), platform='cpu')
      jax.ffi.register_ffi_target(PACK_TARGET, jax.ffi.pycapsule(lib.ShardzooPackBf16), platform='cpu')
      jax.ffi.register_ffi_target(PACKED_GEMM_TARGET, jax.ffi.pycapsule(lib.ShardzooGemmPacked), platform='cpu')
      isa += ' and AVX-512 BF16'
    return isa, ''
  except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
    return None, str(e)


def bf16_gemm() -> bool:
  """Whether bfloat16 matmuls of more than MAX_ROWS rows run through the kernel too (a CPU with AVX-512 BF16)."""
  return (_loaded()[0] or '').endswith('AVX-512 BF16')


def f32_gemm() -> bool:
  """Whether matmuls of more than MAX_ROWS rows (up to GEMM_MAX_ROWS) run through the kernel's float32 GEMM, against
  float32 or bfloat16 weights (a library built for AVX2 or AVX-512, where XLA's dot runs them below the machine's
  rate); bfloat16 activations against bfloat16 weights take the bfloat16 GEMM instead where it runs."""
  return ' with its GEMM' in (_loaded()[0] or '')


@functools.cache
def f32_panel() -> int:
  """Columns of W in a panel of the float32 GEMM (matvec.cc kPanel: two vector registers, 16 floats with AVX2 and 32
  with AVX-512), the shape its packing returns; 0 where it does not run."""
  if not f32_gemm():
    return 0
  lib = ctypes.cdll.LoadLibrary(str(build()))  # the library _loaded() loaded: the same handle
  return int(lib.shardzoo_gemm_panel())


def available() -> bool:
  return _loaded()[0] is not None


def _elsewhere(devices: Any) -> str | None:
  """Why weights on `devices` (None: the default device) decode without the kernel whether or not it built; None
  for one CPU device."""
  devices = list(devices) if devices is not None else jax.devices()[:1]
  if any(d.platform != 'cpu' for d in devices):
    return f'the kernel is for CPUs; the weights are on {devices[0].platform}'
  if len(devices) > 1:
    return f'the kernel runs on one device; the weights are on {len(devices)}'
  return None


def status(devices: Any = None) -> tuple[bool, str]:
  """(whether decode steps on `devices` run the kernel, a line saying what runs and why) for weights on
  `devices` (a mesh's or the arrays' devices)."""
  if (why := _elsewhere(devices)) is not None:
    return False, f"decode matmuls: XLA's dot ({why})"
  isa, why = _loaded()
  if isa is None:
    return False, f"decode matmuls: XLA's dot (the kernel is not available: {why})"
  wide = ''
  if f32_gemm():
    wide = (
      f"; matmuls of up to {GEMM_MAX_ROWS} rows (prefill, batches) by its float32 GEMM, a decode loop's weights "
      'packed into its panels once'
    )
  if bf16_gemm():
    wide += (
      "; bfloat16 matmuls of more rows (prefill, batches), a bfloat16 row's [K, N] matmuls and a bfloat16 prompt's "
      'attention by AVX-512 BF16 dot products'
    )
  return True, (
    f'decode matmuls: the kernel ({isa}, models/kernels/matvec.cc) for <= {MAX_ROWS} rows, the attention over '
    f"the prompt and over the KV cache, greedy decoding's argmax and bfloat16 activations by a table{wide}"
  )


MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1+): back a range with transparent huge pages now, copying it
HUGE_PAGE = 2 << 20


def huge_pages(tree: Any, least: int = 1 << 20) -> tuple[int, int, str]:
  """Moves the CPU arrays of `tree` of at least `least` bytes onto 2 MB pages, where Linux can: each 2 MB-aligned
  block they touch is collapsed (madvise MADV_COLLAPSE; the contents and addresses stay, neighbours in a block move
  too). Returns (bytes of those arrays now on huge pages, their bytes, why none are: '' when some are). Blocks the
  OS will not collapse (the array shares it with an unmapped range, no free huge page) stay as they are."""
  arrays = [
    shard.data
    for leaf in jax.tree.leaves(tree)
    if isinstance(leaf, jax.Array) and leaf.nbytes >= least
    for shard in leaf.addressable_shards
    if shard.device.platform == 'cpu'
  ]
  total = sum(a.nbytes for a in arrays)
  if not arrays:
    return 0, 0, 'no CPU arrays to move'
  if platform.system() != 'Linux':
    return 0, total, f'huge pages are collapsed on Linux only (this is {platform.system()})'
  libc = ctypes.CDLL(None, use_errno=True)
  libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  done: dict[int, int] = {}  # block -> errno (0: on a huge page)
  backed = 0
  for a in arrays:
    start = a.unsafe_buffer_pointer()
    end = start + a.nbytes
    for block in range(start // HUGE_PAGE * HUGE_PAGE, end, HUGE_PAGE):
      if block not in done:
        done[block] = 0 if libc.madvise(block, HUGE_PAGE, MADV_COLLAPSE) == 0 else ctypes.get_errno()
      if not done[block]:
        backed += min(end, block + HUGE_PAGE) - max(start, block)
  if backed:
    return backed, total, ''
  err = next(e for e in done.values() if e)
  return 0, total, f'madvise(MADV_COLLAPSE): {os.strerror(err)} (it needs Linux 6.1+ and transparent huge pages)'


def missing(devices: Any = None) -> bool:
  """Whether weights on `devices` (one CPU device) would decode through the kernel, but it is not available (no
  compiler, a failed build): a slower decode the log should warn of."""
  return _elsewhere(devices) is None and not available()


@contextlib.contextmanager
def decode_matmuls(enabled: bool, prepack: bool = False):
  """Einsums, 16-bit table lookups, cached attention, 16-bit cache writes and greedy argmaxes traced inside run
  through the kernel where it applies (`matmul`, `take_rows`, `decode_attention`, `write_slots`, `argmax`), and a
  padded vocabulary's logits are masked in place (`mask_columns`); `enabled` comes from status(), which loads the
  kernel (XLA must know its targets before compiling).

  `prepack`: the GEMM's weights (bfloat16 with AVX-512 BF16, float32 or bfloat16 with AVX2) are packed into its
  panels by an operation of their own, which XLA computes once outside a loop whose steps use the same weights (a
  decode loop's body says so). The loop then holds a second, packed copy of those weights; elsewhere each GEMM packs
  its panels as it goes (the prefill: one pass over W)."""
  if enabled and not available():
    raise RuntimeError(f'decode_matmuls(True) without the kernel: {_loaded()[1]}')
  token, packing = _active.set(enabled), _prepack.set(prepack)
  try:
    yield
  finally:
    _active.reset(token)
    _prepack.reset(packing)


def active() -> bool:
  """Whether what is traced now is inside decode_matmuls(True)."""
  return _active.get()


def plan(spec: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> tuple[int, int, int, bool] | None:
  """(rows M, contracted size K, output size N, whether w is [N, K]) where `spec` is one matmul of x's rows with w
  (x's contracted letters last, in w's order; w's contracted letters first or last; the output x's other letters
  then w's other letters); None where it is not."""
  if '...' in spec or '->' not in spec:
    return None
  ins, out = spec.replace(' ', '').split('->')
  if ins.count(',') != 1:
    return None
  xs, ws = ins.split(',')
  shared = [c for c in xs if c in ws]
  if any(c in out for c in shared) or len(set(xs + ws)) != len(xs) + len(ws) - len(shared):
    return None
  rows_x, free_w = xs[: len(xs) - len(shared)], [c for c in ws if c not in shared]
  if xs[len(rows_x) :] != ''.join(shared) or out != rows_x + ''.join(free_w) or not shared:
    return None
  if ws == ''.join(shared) + ''.join(free_w):
    nk = False
  elif ws == ''.join(free_w) + ''.join(shared):
    nk = True
  else:
    return None
  size = dict(zip(xs, x_shape)) | dict(zip(ws, w_shape))
  M, K, N = (math.prod(size[c] for c in letters) for letters in (rows_x, shared, free_w))
  return M, K, N, nk


def matmul(spec: str, x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array | None:
  """einsum(spec, x, w) through the kernel (float32 accumulation, the result in `out_dtype`) inside
  decode_matmuls(True), where it applies: up to MAX_ROWS rows of any x against float32 or bfloat16 weights, more
  rows where x and w are both bfloat16 and the CPU has AVX-512 BF16 (`bf16_gemm`), up to GEMM_MAX_ROWS rows of
  others with AVX2 or AVX-512 (`f32_gemm`); None where it does not (the caller runs XLA's einsum)."""
  if not _active.get() or jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
    return None
  found = plan(spec, x.shape, w.shape)
  if found is None or found[0] == 0:
    return None
  M, K, N, nk = found
  if M <= MAX_ROWS:
    target, x2 = TARGET, x.reshape(M, K).astype(jnp.float32)
  elif x.dtype == w.dtype == jnp.bfloat16 and K % 2 == 0 and bf16_gemm():
    target, x2 = GEMM_TARGET, x.reshape(M, K)
  elif M <= GEMM_MAX_ROWS and f32_gemm():
    target, x2 = TARGET, x.reshape(M, K).astype(jnp.float32)
  else:
    return None
  out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape
  # the GEMM rounds a bfloat16 result itself; the matrix-vector rows' float32 result is small
  y_dtype = jnp.bfloat16 if target == GEMM_TARGET and jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32
  w2, y_struct = w.reshape((N, K) if nk else (K, N)), jax.ShapeDtypeStruct((M, N), y_dtype)
  if target == GEMM_TARGET and _prepack.get():
    panels = jax.ffi.ffi_call(PACK_TARGET, jax.ShapeDtypeStruct((-(-N // PANEL), K, PANEL), jnp.bfloat16))(w2, nk=nk)
    y = jax.ffi.ffi_call(PACKED_GEMM_TARGET, y_struct)(x2, panels)
  elif target == TARGET and M > MAX_ROWS and _prepack.get():
    # panels in W's dtype: a bfloat16 weight's are widened in the tiles
    shape = (-(-N // f32_panel()), K, f32_panel())
    panels = jax.ffi.ffi_call(PACK_F32_TARGET, jax.ShapeDtypeStruct(shape, w.dtype))(w2, nk=nk)
    y = jax.ffi.ffi_call(PACKED_F32_TARGET, y_struct)(x2, panels)
  else:
    split = {'split': np.int64(SPLIT_CHUNKS)} if target == TARGET else {}  # the GEMM's panels take no split of K
    y = jax.ffi.ffi_call(target, y_struct)(x2, w2, nk=nk, **split)
  return y.reshape(out_shape).astype(out_dtype)


def matmuls(spec: str, x: jax.Array, ws: Sequence[jax.Array], out_dtype: Any) -> list[jax.Array] | None:
  """[einsum(spec, x, w) for w in ws] through one call of the kernel inside decode_matmuls(True), where it applies:
  three [K, N] weights (w's contracted letters first) of one dtype, each N below MATVEC3_MAX_N, against up to MAX_ROWS
  rows of x; None elsewhere (the caller runs each matmul on its own). Each result equals `matmul`'s bit for bit. Each
  call pays the pool's hand-off and leaves the memory idle around it: a bfloat16 GPT-2 decode at batch 1 took 3% less
  time a step with its 36 projections in 12 calls (float32, whose weights take twice as long to read, within its
  spread)."""
  if not active() or len(ws) != 3 or len({jnp.dtype(w.dtype) for w in ws}) != 1:
    return None
  if jnp.dtype(ws[0].dtype) not in WEIGHT_DTYPES:
    return None
  plans = [plan(spec, x.shape, w.shape) for w in ws]
  if any(p is None or p[3] or not 0 < p[0] <= MAX_ROWS or p[2] >= MATVEC3_MAX_N for p in plans):
    return None
  M, K = plans[0][:2]
  x2 = x.reshape(M, K).astype(jnp.float32)
  outs = jax.ffi.ffi_call(MATVEC3_TARGET, [jax.ShapeDtypeStruct((M, p[2]), jnp.float32) for p in plans])(
    x2, *(w.reshape(K, p[2]) for w, p in zip(ws, plans)), split=np.int64(SPLIT_CHUNKS)
  )
  shapes = [jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape for w in ws]
  return [y.reshape(shape).astype(out_dtype) for y, shape in zip(outs, shapes)]


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array | None:
  """table[ids] (rows of a 2-d table; an id outside it: a row of NaNs) through the kernel inside
  decode_matmuls(True) for a 16-bit table, the bytes copied as they are; None elsewhere (jnp.take runs). XLA's CPU
  compiler gathers a bfloat16 table in float32: in a decode loop it hoisted the widening of the whole table out of
  the loop, once per generate call (GPT-2 124M's embedding: 154 MB, a third of its time to the first token)."""
  if not _active.get() or table.ndim != 2 or jnp.dtype(table.dtype).itemsize != 2:
    return None
  out = jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), table.dtype)
  return jax.ffi.ffi_call(TAKE_TARGET, out)(table, ids.astype(jnp.int32))


def write_slots(cache: jax.Array, x: jax.Array, at: jax.Array | int, axis: int) -> jax.Array | None:
  """dynamic_update_slice_in_dim(cache, x, at, axis) for a 16-bit cache inside decode_matmuls(True), written in
  place: the result aliases the cache's buffer, and only x's bytes are copied. None elsewhere (the caller runs XLA's
  write, which is in place for a float32 cache; a 16-bit one XLA copies whole to write a slot)."""
  if not _active.get() or jnp.dtype(cache.dtype).itemsize != 2 or x.dtype != cache.dtype or x.ndim != cache.ndim:
    return None
  call = jax.ffi.ffi_call(WRITE_TARGET, jax.ShapeDtypeStruct(cache.shape, cache.dtype), input_output_aliases={0: 0})
  return call(cache, x, jnp.asarray(at, jnp.int32), axis=np.int64(axis))


def mask_columns(logits: jax.Array, keep: int, value: float) -> jax.Array | None:
  """logits with its last axis's columns from `keep` on set to `value` (a padded vocabulary's) inside
  decode_matmuls(True): those columns alone written, in place; None elsewhere (the caller's select runs, which
  fuses into what follows it in training). XLA's CPU compiler runs the select as a pass of its own over the whole
  logits (GPT-2 at batch 32: 0.36 ms a step, its 6.4 MB read and written)."""
  if not _active.get() or not 0 <= keep < logits.shape[-1]:
    return None
  tail = jnp.full((*logits.shape[:-1], logits.shape[-1] - keep), value, logits.dtype)
  return jax.lax.dynamic_update_slice_in_dim(logits, tail, keep, axis=logits.ndim - 1)


@functools.cache
def _table16(f: Any, dtype: Any) -> np.ndarray:
  """f of each of the 65,536 values of a 16-bit float dtype, by XLA on the CPU (as uint16: the results' bits)."""
  every = np.arange(1 << 16, dtype=np.uint16).view(jnp.dtype(dtype))
  token = _active.set(False)  # f's own XLA loop, not this lookup
  try:
    with jax.default_device(jax.devices('cpu')[0]):
      # Compiled and run now, outside the trace that asks (inside it, jit would stage the call into that program).
      out = jax.jit(f).lower(every).compile()(every)
  finally:
    _active.reset(token)
  return np.asarray(out).view(np.uint16)


def elementwise16(f: Any, x: jax.Array) -> jax.Array | None:
  """f(x) for an elementwise f of a bfloat16 x inside decode_matmuls(True): each element looked up in a table of f's
  value at each of bfloat16's 65,536 values, which XLA computes once per process (a program of its own), so the
  values are XLA's bit for bit; None elsewhere (the caller runs f). An MLP's activation: XLA's CPU loops spent about a
  nanosecond an element on GPT-2's gelu_new, every torch operation of which rounds to bfloat16 (13.5 ms over a
  batch-32 prefill's 4,096 x 3,072); the lookup about 4 ms."""
  if not _active.get() or x.dtype != jnp.bfloat16 or _loaded()[0] is None:
    return None
  table = jnp.asarray(_table16(f, x.dtype))
  return jax.ffi.ffi_call(LOOKUP_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, table)


def argmax(logits: jax.Array) -> jax.Array | None:
  """jnp.argmax(logits, axis=-1) as int32 (the first of equal maxima, the first NaN where there is one) through the
  kernel inside decode_matmuls(True), for a greedy decode's choice; None elsewhere. XLA's CPU compiler runs an argmax
  as a variadic reduce, one element at a time: GPT-2's 32 rows of logits took 3.7 ms a step, a tenth of it."""
  if not _active.get() or logits.ndim < 1 or not jnp.issubdtype(logits.dtype, jnp.floating) or logits.shape[-1] == 0:
    return None
  rows = math.prod(logits.shape[:-1])
  x = logits.reshape(rows, logits.shape[-1]).astype(jnp.float32)  # exact for 16-bit floats: the order stays
  return jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct((rows,), jnp.int32))(x).reshape(logits.shape[:-1])


def decode_attention(
  q_BHK: jax.Array,
  k_BGCK: jax.Array,
  v_BGCK: jax.Array,
  k_new: jax.Array,
  v_new: jax.Array,
  at: jax.Array | int,
  mask_BC: jax.Array,
  filled: jax.Array,
  *,
  scale: float,
  softcap: float | None = None,
  sinks_H: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
  """A decode step's attention inside decode_matmuls(True): this step's keys and values, k_new and v_new (the caches'
  shape with one slot), written into slot `at` of the caches (B, G, C, K; one row's may be (G, C, K)) in place, then
  one query per row, q (B, H, K), over the first `filled` slots where mask_BC is set: ((B, H, K) in float32, k, v),
  the scores scaled, soft-capped, masked, softmax in float32 with the sinks' logits in its denominator, as
  layers.Attention's XLA path; None elsewhere (the caller writes, then runs XLA's). Each group's slot is written
  just before its keys are read: in calls of their own, GPT-2's 24 writes a step took 45 us each at batch 32 in
  bfloat16, each of a write's 384 rows of 128 bytes in a 4 KB page of its own."""
  if any(a.dtype != k_BGCK.dtype for a in (k_new, v_new)):
    return None
  masks = (mask_BC.astype(jnp.bool_), jnp.asarray(filled, jnp.int32))
  new_slot = (k_new, v_new, jnp.asarray(at, jnp.int32))
  return _attention(
    ATTENTION_TARGET, q_BHK, k_BGCK, v_BGCK, masks, scale=scale, softcap=softcap, sinks_H=sinks_H, new_slot=new_slot
  )


def prefill_attention(
  q_BTHK: jax.Array,
  k_BTGK: jax.Array,
  v_BTGK: jax.Array,
  valid_BT: jax.Array,
  *,
  scale: float,
  softcap: float | None = None,
  window: int | None = None,
  sinks_H: jax.Array | None = None,
) -> jax.Array | None:
  """A prompt's causal attention inside decode_matmuls(True), q (B, T, H, K) against k, v (B, T, G, K) as the
  projections leave them (no transposes): key s is seen by query t where s <= t, t - s < window and valid_BT[b, s];
  the (B, T, H, K) output in float32 (scores scaled, soft-capped, masked, softmax in float32 with the sinks' logits in
  its denominator, as attention.attend's XLA path; a query that sees no key, a left pad's, gets zeros). A bfloat16 q
  over bfloat16 k and v on AVX-512 BF16 takes bfloat16 dot products, its weights rounded to bfloat16 as the XLA path
  rounds them. None elsewhere (the caller runs attention.attend)."""
  masks = (valid_BT.astype(jnp.bool_),)
  return _attention(
    PREFILL_TARGET,
    q_BTHK,
    k_BTGK,
    v_BTGK,
    masks,
    scale=scale,
    softcap=softcap,
    sinks_H=sinks_H,
    window=np.int64(window or 0),
    q_bf16=q_BTHK.dtype == jnp.bfloat16,  # its products and weights in bfloat16, as the XLA path's
  )


def _attention(target, q, k, v, masks, *, scale, softcap, sinks_H, new_slot=None, **attrs) -> Any:
  """`target`(q in float32, k, v, *masks, the sinks' logits (H,)) -> float32 of q's shape, inside
  decode_matmuls(True) for float32 or bfloat16 k and v alike; None elsewhere. The heads are q's second-to-last axis;
  a model without sinks passes zeros, which has_sinks tells the kernel to ignore. `new_slot` (k_new, v_new, at):
  operands after the sinks' that the kernel writes into k and v, in place; the call then returns (output, k, v),
  k and v in their operands' buffers."""
  if not _active.get() or jnp.dtype(k.dtype) not in WEIGHT_DTYPES or v.dtype != k.dtype:
    return None
  H = q.shape[-2]
  sinks = jnp.zeros((H,), jnp.float32) if sinks_H is None else sinks_H.astype(jnp.float32)
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  if new_slot is not None:
    caches = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    call = jax.ffi.ffi_call(target, (out, *caches), input_output_aliases={1: 1, 2: 2})
  else:
    call = jax.ffi.ffi_call(target, out)
  return call(
    q.astype(jnp.float32),
    k,
    v,
    *masks,
    sinks,
    *(new_slot or ()),
    scale=np.float32(scale),
    softcap=np.float32(softcap or 0.0),
    has_sinks=sinks_H is not None,
    **attrs,
  )
