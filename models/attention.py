"""The attention kernel: a fused flash attention where one applies (cuDNN or Pallas on GPUs, splash on TPUs), XLA
everywhere else, or `blockwise` flash attention written in JAX on any backend.

`config.model.attention` picks it ('auto', 'xla', 'cudnn', 'pallas', 'splash', 'blockwise'); 'auto' logs each
distinct choice and its reason once (`decisions()`), and a named kernel that cannot run is a ConfigError saying why.
Under a mesh the fused kernels run per shard in `jax.shard_map`; a sharded sequence (context parallelism) runs per
shard with keys and values all-gathered (`per_shard_context`), rows optionally in zigzag order
(partitioning/context.py). What each kernel takes and when to use it: docs/model_options.md.

What a query's logits are besides q . k is a `Logits` (the scale, Gemma 2's tanh soft cap, a sliding window of the
last W keys): every kernel that cannot take one of them is passed over for one that can ('auto'), or refused by
name; the XLA path takes all of them, so it stays the reference the fused ones are tested against.

Shape suffixes: B batch, L length, H query heads, G kv heads, K head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from configs import schema
from errors import ConfigError
from partitioning import active_mesh, entry_size, logical_spec
from partitioning.context import from_zigzag, zigzag_positions, zigzag_shards

IMPLEMENTATIONS = ('auto', 'xla', 'cudnn', 'pallas', 'splash', 'blockwise')
schema.register('model.attention', IMPLEMENTATIONS)
PALLAS_BLOCK = 128  # the Pallas kernel's query/key block: lengths must be a multiple
SPLASH_FORWARD = 'attn_splash_forward'  # the splash kernel's output and log-sum-exp, named for remat policies
SPLASH_BLOCK = 128  # splash attention's query/key block (its default block sizes): lengths must be a multiple
CUDNN_LENGTH_MULTIPLE = 8  # non-causal lengths that are not a multiple are padded (masked keys): cuDNN rejects them
Q_AXES, KV_AXES = ('batch', 'length', 'heads', 'kv'), ('batch', 'length', 'kv_heads', 'kv')


@dataclasses.dataclass(frozen=True)
class Logits:
  """How q . k becomes a logit: times `scale` (None: head_dim**-0.5), then `softcap` * tanh(x / softcap) where set
  (Gemma 2), then masked; `window`: a causal query sees its last `window` keys, itself included (kv > q - W, as
  transformers' sliding_window; Mistral, Gemma 2/3's local layers). Static: each value is its own compiled kernel."""

  scale: float | None = None
  softcap: float | None = None
  window: int | None = None
  sinks: bool = False  # a learned per-head logit joins every row's softmax (GPT-OSS); its values come with attend

  def scale_for(self, head_dim: int) -> float:
    return head_dim**-0.5 if self.scale is None else self.scale

  def cap(self, s: jax.Array) -> jax.Array:
    """Soft-capped scores (already scaled), in their dtype."""
    return s if self.softcap is None else self.softcap * jnp.tanh(s / self.softcap)

  def describe(self) -> list[str]:
    return (
      ([f'window {self.window}'] if self.window else [])
      + ([f'softcap {self.softcap:g}'] if self.softcap else [])
      + (['sinks'] if self.sinks else [])
    )


PLAIN = Logits()
_decisions: dict[str, None] = {}  # every distinct choice made while tracing, in order
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar('shardzoo_attention_forced', default=None)
_per_shard_xla: contextvars.ContextVar[bool] = contextvars.ContextVar('shardzoo_attention_per_shard_xla', default=False)
_gpu_stand_in: contextvars.ContextVar[bool] = contextvars.ContextVar('shardzoo_attention_gpu_stand_in', default=False)
_splash_interpret: contextvars.ContextVar[bool] = contextvars.ContextVar(
  'shardzoo_attention_splash_interpret', default=False
)


@contextlib.contextmanager
def per_shard_xla():
  """Runs XLA attention on a sharded sequence per shard in shard_map, the path cuDNN takes on GPUs (tests,
  benchmarks/context_memory.py); without it XLA attention is left to GSPMD, which needs fewer temporaries."""
  token = _per_shard_xla.set(True)
  try:
    yield
  finally:
    _per_shard_xla.reset(token)


@contextlib.contextmanager
def gpu_stand_in():
  """Traces attention as it would run on a GPU, on whatever device is here: the choice is made as on a GPU,
  and where it would pick a fused kernel (cuDNN, Pallas), 'blockwise' runs in its place, with the same
  sharding and a fused kernel's memory (no L x S scores; the output and log-sum-exp kept for the backward).
  The plan search compiles so for GPU targets on CPU (planning/search.py)."""
  token = _gpu_stand_in.set(True)
  try:
    yield
  finally:
    _gpu_stand_in.reset(token)


@contextlib.contextmanager
def splash_interpret():
  """Runs splash attention (a TPU kernel) in Pallas' TPU interpreter on whatever device is here, and lets 'auto'
  pick it as on a TPU: how the tests check the kernel and its wiring on the CPU. Slow; small shapes only."""
  token = _splash_interpret.set(True)
  try:
    yield
  finally:
    _splash_interpret.reset(token)


def decisions() -> list[str]:
  """The distinct attention choices made so far in this process, e.g. 'cudnn: causal, bfloat16, head_dim 64'."""
  return list(_decisions)


@contextlib.contextmanager
def forced(impl: str):
  """Traces every attention with `impl`, whatever the config says (FLOP counting uses 'xla')."""
  token = _forced.set(impl)
  try:
    yield
  finally:
    _forced.reset(token)


def _record(decision: str) -> None:
  if decision not in _decisions:
    _decisions[decision] = None  # printed by the entry points (decisions()), once


def _platform() -> str:
  return 'gpu' if _gpu_stand_in.get() else _device().platform


def _local_specs(q_BLHK, k_BLGK) -> tuple[P, P, P] | str:
  """PartitionSpecs (q, kv, (batch, length)) for running a kernel per shard, or why it cannot. A sharded
  length (context parallelism) shows in q_spec[1]; keys and values then arrive split like the queries."""
  q_spec, kv_spec = logical_spec(Q_AXES, q_BLHK.shape), logical_spec(KV_AXES, k_BLGK.shape)
  q_spec, kv_spec = (tuple(s) + (None,) * (4 - len(s)) for s in (q_spec, kv_spec))
  if q_spec[1] != kv_spec[1]:
    return f'queries and keys are sharded differently along the sequence ({q_spec[1]!r} vs {kv_spec[1]!r})'
  if q_spec[3] is not None or kv_spec[3] is not None:
    return 'the head dim (kv) is sharded'
  if q_spec[0] != kv_spec[0] or q_spec[2] != kv_spec[2]:
    return (
      f'queries and keys are sharded differently (heads {q_spec[2]!r} vs kv_heads {kv_spec[2]!r}): '
      'shard kv_heads like heads'
    )
  return P(*q_spec), P(*kv_spec), P(q_spec[0], q_spec[1])


def _device() -> Any:
  mesh = active_mesh()
  return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def pallas_support() -> str:
  """'' where JAX's Pallas (Triton) kernels can run on this device, else why not."""
  if _gpu_stand_in.get():
    return ''
  capability = getattr(_device(), 'compute_capability', None)
  try:
    major = int(str(capability).split('.')[0])
  except ValueError:
    return f'device compute capability {capability!r} unknown'
  return '' if major >= 8 else f'compute capability {capability} (Pallas/Triton needs >= 8.0)'


def _fused_blockers(dtype: Any, head_dim: int) -> list[str]:
  """What rules out every fused kernel (cuDNN and Pallas) here, whatever the sequence: the platform, the compute
  dtype, the head dim. Empty where they may run."""
  why = []
  if _platform() != 'gpu':
    why.append(f'{_platform()} backend (cuDNN and Pallas run on GPUs)')
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    why.append(f'{jnp.dtype(dtype).name} compute (fused kernels take bfloat16/float16: config.model.dtype)')
  if head_dim % 8 or head_dim > 256:
    why.append(f'head_dim {head_dim} (fused kernels take a multiple of 8, at most 256)')
  return why


def choose(
  impl: str,
  q_BLHK: jax.Array,
  k_BLGK: jax.Array,
  *,
  causal: bool,
  packed: bool,
  padded: bool,
  kv_length: int | None = None,
  logits: Logits = PLAIN,
) -> tuple[str, Any]:
  """(kernel, local specs or None): kernel 'cudnn', 'pallas', 'splash', 'blockwise' or 'xla'; records the
  decision and why.
  `padded`: a per-token padding mask; `kv_length`: only the first kv_length keys of every row are real; `logits`:
  the scale, soft cap and sliding window (a kernel that lacks one is passed over)."""
  forced_impl = _forced.get()
  if forced_impl is not None:
    return forced_impl, None
  if impl not in IMPLEMENTATIONS:
    raise ConfigError(f'config.model.attention={impl!r} is not known; choose one of {list(IMPLEMENTATIONS)}')
  if logits.window is not None and not causal:
    raise ValueError(f"a sliding window ({logits.window}) is a causal attention's")
  what = ', '.join(
    ['causal' if causal else 'full']
    + logits.describe()
    + (['packed'] if packed else [])
    + (['padding'] if padded else [])
    + [f'{jnp.dtype(q_BLHK.dtype).name}', f'L={q_BLHK.shape[1]}']
    + ([f'{kv_length} real keys'] if kv_length is not None else [])
    + [f'head_dim {q_BLHK.shape[-1]}']
  )
  if impl == 'xla':
    _record(f'xla ({what}): config.model.attention=xla')
    return 'xla', None
  if logits.sinks:  # a sink is a logit column no kernel here takes: XLA, partitioned by GSPMD
    if impl != 'auto':
      raise ConfigError(
        f"config.model.attention={impl} cannot run this attention ({what}): attention sinks run on 'xla' only"
      )
    _record(f'xla ({what}): attention sinks (no fused kernel here takes a sink logit)')
    return 'xla', None
  mesh = active_mesh()
  specs = _local_specs(q_BLHK, k_BLGK) if mesh is not None and mesh.size > 1 else None
  if impl == 'blockwise':  # any backend and dtype; per shard (shard_map) only for a sharded sequence
    if isinstance(specs, tuple) and specs[0][1] is not None:
      _record(f'blockwise ({what}) {_context_where(specs[0][1], causal)[0]}')
      return 'blockwise', specs
    if isinstance(specs, str) and 'along the sequence' in specs:
      raise ConfigError(f'config.model.attention=blockwise cannot run this attention ({what}): {specs}')
    _record(f'blockwise ({what}): config.model.attention=blockwise')
    return 'blockwise', None
  fused = _fused_blockers(q_BLHK.dtype, q_BLHK.shape[-1])  # what rules out every fused kernel
  K = q_BLHK.shape[-1]
  if logits.softcap is not None:  # jax.nn.dot_product_attention (cuDNN) and JAX's Pallas kernel have no soft cap
    fused = fused + ['attention logit soft-capping (cuDNN and Pallas have none)']
  if isinstance(specs, tuple) and specs[0][1] is not None:  # the sequence is sharded: context parallelism
    return _choose_context(impl, what, fused, specs, q_BLHK.shape[1], causal, logits.window)
  if _splash_wanted(impl):
    why = _splash_blockers(q_BLHK.shape[1]) or ([specs] if isinstance(specs, str) else [])
    if why and impl == 'splash':
      raise ConfigError(f'config.model.attention=splash cannot run this attention ({what}): {"; ".join(why)}')
    if why:
      _record(f'xla ({what}): splash: ' + '; '.join(why))
      return 'xla', None
    _record(f'splash ({what})' + (' per shard (shard_map)' if specs else '') + _interpreted())
    return 'splash', specs
  cudnn_why, pallas_why = list(fused), list(fused)
  if padded and impl == 'auto':
    cudnn_why.append(
      "a per-token padding mask (cuDNN takes lengths; attention='cudnn' uses them for right-padded rows)"
    )
  if packed:  # JAX's cuDNN packed layout allocates as if every segment were a full row
    cudnn_why.append('packed documents (segment ids; cuDNN through JAX has no memory-sane packed layout)')
  if not fused and (why := pallas_support()):
    pallas_why.append(why)
  L = q_BLHK.shape[1]
  if L % PALLAS_BLOCK:
    pallas_why.append(f'length {L} (Pallas takes a multiple of {PALLAS_BLOCK})')
  if K & (K - 1):
    pallas_why.append(f'head_dim {K} (Pallas takes a power of two)')
  if logits.window is not None:
    pallas_why.append("a sliding window (JAX's Pallas GPU kernel has no local mask)")
  if impl == 'auto':
    choice = 'cudnn' if not cudnn_why else 'pallas' if packed and not pallas_why else None
  else:
    choice = impl
    why = cudnn_why if impl == 'cudnn' else pallas_why
    if why:
      raise ConfigError(f'config.model.attention={impl} cannot run this attention ({what}): {"; ".join(why)}')
  if choice is not None and isinstance(specs, str):  # a layout the per-shard kernels cannot take
    if impl != 'auto':
      raise ConfigError(f'config.model.attention={impl} cannot run this attention ({what}): {specs}')
    cudnn_why.append(specs)
    choice = None
  if choice is None:
    _record(f'xla ({what}): ' + '; '.join(cudnn_why + (['Pallas: ' + '; '.join(pallas_why)] if packed else [])))
    return 'xla', None
  _record(f'{choice} ({what})' + (' per shard (shard_map)' if specs else ''))
  return _stand_in(choice, what), specs


def _stand_in(choice: str, what: str) -> str:
  """Under gpu_stand_in, 'blockwise' in place of a fused GPU kernel."""
  if not (_gpu_stand_in.get() and choice in ('cudnn', 'pallas')):
    return choice
  _record(f'blockwise ({what}) standing in for {choice} (gpu_stand_in)')
  return 'blockwise'


def _choose_context(
  impl: str, what: str, fused: list[str], specs: tuple[P, P, P], L: int, causal: bool, window: int | None
) -> tuple[str, Any]:
  """The kernel for attention whose sequence is sharded (context parallelism): it runs per shard in shard_map
  (`per_shard_context`) on cuDNN where the fused conditions hold, else on XLA; Pallas cannot (module doc)."""
  axes = specs[0][1]
  where, shards = _context_where(axes)
  if _splash_wanted(impl):
    splash_why = _splash_blockers(L // shards)  # the shard's queries; its keys, all L of them, then fit too
    if splash_why and impl == 'splash':
      raise ConfigError(
        f'config.model.attention=splash cannot run this attention ({what}, {where}): ' + '; '.join(splash_why)
      )
    if not splash_why:
      mask = 'causal mask per shard from positions' if zigzag_shards() > 1 else 'causal offset per shard'
      mask = mask.replace('causal', 'local' if window else 'causal', 1)
      _record(f'splash ({what}) {where}, {mask}{_interpreted()}')
      return 'splash', specs
    fused = fused + ['splash: ' + '; '.join(splash_why)]
  if impl == 'pallas':
    raise ConfigError(
      f'config.model.attention=pallas cannot run this attention ({what}): the sequence is sharded '
      f'over {axes!r} and the Pallas kernel cannot offset causality to a shard of the queries; '
      "use 'cudnn' or 'auto'"
    )
  cudnn_why = list(fused)
  chunks = 2 if causal and zigzag_shards() > 1 else 1  # a shard's two query chunks attend separately
  if (L // shards // chunks) % CUDNN_LENGTH_MULTIPLE:
    cudnn_why.append(
      f'{L // shards // chunks} queries per {"chunk" if chunks > 1 else "shard"} (cuDNN takes a '
      f'multiple of {CUDNN_LENGTH_MULTIPLE})'
    )
  where = _context_where(axes, causal)[0]  # what the per-shard XLA and cuDNN paths do
  if impl == 'cudnn' and cudnn_why:
    raise ConfigError(
      f'config.model.attention=cudnn cannot run this attention ({what}, {where}): ' + '; '.join(cudnn_why)
    )
  if not cudnn_why:
    _record(f'cudnn ({what}) {where}, mask as bias')
    return _stand_in('cudnn', what), specs
  if _per_shard_xla.get():
    _record(f'xla ({what}) {where} (per_shard_xla): ' + '; '.join(cudnn_why))
    return 'xla', specs
  zigzag = ' (rows in zigzag order: causal mask from positions)' if zigzag_shards() > 1 else ''
  _record(f'xla ({what}): sequence sharded over {axes!r}{zigzag}, partitioned by GSPMD: ' + '; '.join(cudnn_why))
  return 'xla', None


def _context_where(axes: Any, prefixes: bool = False) -> tuple[str, int]:
  """What a context-parallel decision logs about its layout, and the number of context shards; rows in zigzag
  order (context_load_balance) must be balanced over exactly these shards. `prefixes`: causal attention whose
  query chunks attend only their keys' prefix (`per_shard_context`)."""
  shards = entry_size(axes, active_mesh().shape)
  where = f'per shard over {axes!r}: shard_map, keys/values all-gathered'
  zigzag = zigzag_shards()
  if zigzag > 1:
    if zigzag != shards:
      raise ConfigError(
        f'the rows are load-balanced over {zigzag} context shards (config.context_load_balance), '
        f"but this attention's sequence is split over {shards} ({axes!r}): shard its 'length' like "
        "the batch fields' 'length'"
      )
    where += f', rows in zigzag order (load-balanced over {shards} shards)'
    if prefixes:
      where += ', first query chunk against the first half of the keys'
  return where, shards


def per_shard_context(
  q_BCHK, k_BCGK, v_BCGK, rows: dict, *, axes: Any, causal: bool, implementation: str, logits: Logits = PLAIN
):
  """One shard of context-parallel attention (inside shard_map): this shard's C queries against the S keys.
  Keys, values and the key-side rows are all-gathered over `axes`; one mask from positions holds causality
  (the shard's queries start at axis_index * C), a sliding window, packed documents and padding. Rows in zigzag
  order (context_load_balance): the shard's first chunk of queries attends only the first half of the keys, all it
  can see, its second chunk every key: 3/4 of the dense work and scores, the same on every shard."""
  C = q_BCHK.shape[1]
  zigzag = zigzag_shards()  # > 1: rows in zigzag order (partitioning/context.py); gathered keys put back in order
  gather = lambda x: None if x is None else from_zigzag(jax.lax.all_gather(x, axes, axis=1, tiled=True), zigzag)
  k_BSGK, v_BSGK = gather(k_BCGK), gather(v_BCGK)
  S, shard = k_BSGK.shape[1], jax.lax.axis_index(axes)
  seg_BC, valid_BC = rows.get('segment_ids_BL'), rows.get('valid_BL')
  seg_k_BS, valid_k_BS = gather(seg_BC), gather(valid_BC)
  if implementation == 'splash':
    return _splash(
      q_BCHK,
      k_BSGK,
      v_BSGK,
      seg_BC,
      valid_BC,
      causal=causal,
      logits=logits,
      shard=shard,
      seg_k_BS=seg_k_BS,
      valid_k_BS=valid_k_BS,
      zigzag=zigzag,
    )

  def prefix(q_BQHK, q_pos_Q, seg_BQ, n: int):  # queries at global positions q_pos_Q against the first n keys
    cut = lambda x: None if x is None else x[:, :n]
    k, v, seg_k, valid_k = cut(k_BSGK), cut(v_BSGK), cut(seg_k_BS), cut(valid_k_BS)
    if implementation == 'blockwise':
      return _blockwise(q_BQHK, k, v, seg_BQ, valid_k, causal=causal, logits=logits, q_pos_L=q_pos_Q, seg_k_BS=seg_k)
    mask = _document_mask(seg_BQ, seg_k, valid_k)
    if causal:
      later = _causal_mask(q_pos_Q, jnp.arange(n), logits.window)[None, None]
      mask = later if mask is None else mask & later
    return _dense(q_BQHK, k, v, mask, False, logits, implementation)

  if zigzag == 1 or not causal:  # every key (natural order: the last shard needs them all anyway)
    return prefix(q_BCHK, shard * C + jnp.arange(C), seg_BC, S)
  # Zigzag: the shard's first chunk of queries (chunk `shard` < c) comes before every key of the row's second half,
  # so it attends the first half only; its second chunk (2c - 1 - shard) attends every key. Static shapes, no
  # branch per shard: 3/4 of the dense work and scores on every shard.
  h = C // 2
  first = prefix(q_BCHK[:, :h], shard * h + jnp.arange(h), None if seg_BC is None else seg_BC[:, :h], S // 2)
  second = prefix(
    q_BCHK[:, h:], (2 * zigzag - 1 - shard) * h + jnp.arange(h), None if seg_BC is None else seg_BC[:, h:], S
  )
  return jnp.concatenate([first, second], axis=1)


def _causal_mask(q_pos_L: jax.Array, k_pos_S: jax.Array, window: int | None) -> jax.Array:
  """(L, S) bool: key at or before the query, and within its last `window` keys where set."""
  seen = q_pos_L[:, None] >= k_pos_S[None, :]
  return seen if window is None else seen & (q_pos_L[:, None] - k_pos_S[None, :] < window)


def _dense(
  q_BLHK, k_BSGK, v_BSGK, mask, is_causal: bool, logits: Logits, implementation: str = 'xla', sinks_H: Any = None
) -> jax.Array:
  """Attention with the whole (L, S) score matrix: jax.nn.dot_product_attention ('xla' or 'cudnn', its softmax in
  float32), or with a soft cap or sinks (which it has no argument for) the same steps written out: scores in
  float32, scaled, capped, masked, softmax (with each head's sink logit as one more column, dropped after), then
  the values in the compute dtype."""
  K = q_BLHK.shape[-1]
  if logits.softcap is None and sinks_H is None:
    return jax.nn.dot_product_attention(
      q_BLHK, k_BSGK, v_BSGK, mask=mask, is_causal=is_causal, scale=logits.scale, implementation=implementation
    )
  B, L, H, _ = q_BLHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  if is_causal:
    causal = _causal_mask(jnp.arange(L), jnp.arange(S), None)[None, None]
    mask = causal if mask is None else mask & causal
  q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
  s_BGRLS = jnp.einsum('blgrk,bsgk->bgrls', q_BLGRK, k_BSGK, preferred_element_type=jnp.float32)
  s_BGRLS = logits.cap(s_BGRLS * logits.scale_for(K))
  if mask is not None:  # (B|1, 1, L, S): the same for every head
    s_BGRLS = jnp.where(mask[:, :, None], s_BGRLS, jnp.finfo(jnp.float32).min)
  p_BGRLS = softmax_with_sinks(s_BGRLS, None if sinks_H is None else sinks_H.reshape(G, H // G)).astype(q_BLHK.dtype)
  return jnp.einsum('bgrls,bsgk->blgrk', p_BGRLS, v_BSGK).reshape(B, L, H, K)


def softmax_with_sinks(s_BGRLS: jax.Array, sinks_GR: jax.Array | None) -> jax.Array:
  """softmax over the last axis (float32); with sinks, each head's sink logit joins the denominator as one more
  column (not scaled, never masked) that takes its share of the mass and is then dropped, as GPT-OSS's."""
  if sinks_GR is None:
    return jax.nn.softmax(s_BGRLS, axis=-1)
  sink = jnp.broadcast_to(sinks_GR.astype(jnp.float32)[None, :, :, None, None], (*s_BGRLS.shape[:-1], 1))
  return jax.nn.softmax(jnp.concatenate([s_BGRLS, sink], axis=-1), axis=-1)[..., :-1]


def _document_mask(seg_q_BL, seg_k_BS, valid_k_BS) -> jax.Array | None:
  """(B, 1, L, S) bool: query and key in the same packed document, and the key real (not padding); None
  when there are neither segment ids nor padding."""
  mask = None
  if seg_q_BL is not None:
    mask = seg_q_BL[:, None, :, None] == seg_k_BS[:, None, None, :]
  if valid_k_BS is not None:
    keys = valid_k_BS.astype(bool)[:, None, None, :]
    mask = keys if mask is None else mask & keys
  return mask


def _as_segments(segment_ids_BL, valid_BL):
  """Padding as segment 0 (real queries never see padded keys; padded queries' outputs are unused), for the
  Pallas kernels, which take segment ids; None when there are neither."""
  if valid_BL is None:
    return segment_ids_BL
  return jnp.where(valid_BL.astype(bool), 1 if segment_ids_BL is None else segment_ids_BL + 1, 0)


def _every_head(k_BLGK, v_BLGK, H: int):
  """Grouped kv heads repeated to one per query head, for the Pallas kernels."""
  if k_BLGK.shape[2] != H:
    k_BLGK, v_BLGK = (jnp.repeat(x, H // x.shape[2], axis=2) for x in (k_BLGK, v_BLGK))
  return k_BLGK, v_BLGK


def _splash_wanted(impl: str) -> bool:
  """'splash' asked for, or 'auto' where splash is the fused kernel: a TPU (or its interpreter, in tests)."""
  return impl == 'splash' or (impl == 'auto' and (_platform() == 'tpu' or _splash_interpret.get()))


def _interpreted() -> str:
  """What a splash decision adds to the log when it runs in the interpreter."""
  return ' in the Pallas TPU interpreter (splash_interpret)' if _splash_interpret.get() else ''


def _splash_blockers(L: int) -> list[str]:
  """What keeps splash attention from this attention here; empty where it runs."""
  why = []
  if _platform() != 'tpu' and not _splash_interpret.get():
    why.append(f'{_platform()} backend (splash attention is a TPU kernel)')
  if L % SPLASH_BLOCK:
    why.append(f'length {L} (splash takes a multiple of {SPLASH_BLOCK})')
  return why


@functools.lru_cache(maxsize=64)
def _splash_kernel(
  q_len: int,
  kv_len: int,
  heads: int,
  causal: bool,
  offset: int,
  interpret: bool,
  zigzag: int = 1,
  window: int | None = None,
  softcap: float | None = None,
) -> Any:
  """The splash kernel for one example's (heads, q_len, K) queries against kv_len keys, causal with the queries
  starting at key position `offset` (a context shard's); its masks are processed once per shape. With `zigzag` > 1
  the queries are slots offset.. of a row in zigzag order over that many shards: the causal mask compares their
  natural positions (its q_sequence, which the kernel also reads) with the keys'. A sliding `window` is a
  LocalMask((window - 1, 0)): causal and local in one (splash's LocalMask alone looks both ways); `softcap` is the
  kernel's attn_logits_soft_cap."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  shape = (q_len, kv_len)

  def causal_mask(offset: int = 0):
    if window is None:
      return masks.CausalMask(shape, offset=offset)
    return masks.LocalMask(shape, (window - 1, 0), offset=offset)

  if causal and zigzag > 1:
    one = causal_mask()
    one.q_sequence = zigzag_positions(kv_len, zigzag)[offset : offset + q_len]  # hashed and compared with the mask
  else:
    one = causal_mask(offset) if causal else masks.FullMask(shape)
  return splash.make_splash_mha(
    masks.MultiHeadMask([one] * heads),
    head_shards=1,
    q_seq_shards=1,
    block_sizes=splash.BlockSizes.get_default(),
    attn_logits_soft_cap=softcap,
    interpret=interpret,
    residual_checkpoint_name=SPLASH_FORWARD,
  )


def splash_tiles(length: int, shards: int, zigzag: bool) -> list[int]:
  """The (query block, key block) tiles splash's forward kernel computes for each context shard of one causal
  row and head (the mask's non-empty blocks, from the kernel's own mask info): the shards' attention work, rows in
  natural order or in zigzag order (context_load_balance). The length's shards must be multiples of SPLASH_BLOCK."""
  C = length // shards
  return [
    int(
      (
        np.asarray(_splash_kernel(C, length, 1, True, i * C, True, shards if zigzag else 1).fwd_mask_info.block_mask)
        > 0
      ).sum()
    )
    for i in range(shards)
  ]


def _splash(
  q_BLHK,
  k_BSGK,
  v_BSGK,
  segment_ids_BL,
  valid_BL,
  *,
  causal: bool,
  logits: Logits = PLAIN,
  shard: Any = None,
  seg_k_BS: Any = None,
  valid_k_BS: Any = None,
  zigzag: int = 1,
) -> jax.Array:
  """Splash attention, vmapped over the batch; q is scaled here (the kernel does not). Unsharded, the keys are
  the queries' positions. Per context shard (`shard`: its index), the S keys are all the row's (all-gathered, with
  `seg_k_BS` / `valid_k_BS`) and the L queries start at shard * L: one kernel per shard offset, chosen by
  lax.switch (the masks are static). With `zigzag` > 1 (context_load_balance) a shard's queries are its two chunks
  of the row (partitioning/context.py), the keys in natural order."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  B, L, H, K = q_BLHK.shape
  S = k_BSGK.shape[1]
  if shard is None:
    seg_k_BS, valid_k_BS = segment_ids_BL, valid_BL
  seg_q_BL, seg_k_BS = _as_segments(segment_ids_BL, valid_BL), _as_segments(seg_k_BS, valid_k_BS)
  k_BSHK, v_BSHK = _every_head(k_BSGK, v_BSGK, H)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # (B, H, L, K): the kernel's layout per example
  ids = None if seg_q_BL is None else splash.SegmentIds(q=seg_q_BL, kv=seg_k_BS)
  q_BHLK = heads_first(q_BLHK * jnp.asarray(logits.scale_for(K), q_BLHK.dtype))

  def run(offset: int):
    kernel = _splash_kernel(L, S, H, causal, offset, _splash_interpret.get(), zigzag, logits.window, logits.softcap)
    return lambda q, k, v, ids: heads_first(jax.vmap(kernel)(q, k, v, segment_ids=ids))

  args = (q_BHLK, heads_first(k_BSHK), heads_first(v_BSHK), ids)
  if shard is None or not causal:  # full attention sees every key from every shard: one kernel
    return run(0)(*args)
  return jax.lax.switch(shard, [run(i * L) for i in range(S // L)], *args)


def _pallas(
  q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, valid_BL, *, causal: bool, logits: Logits = PLAIN, interpret: bool = False
):
  """JAX's Pallas flash attention (padding as segment 0, grouped kv heads repeated). `interpret` runs it on the
  CPU (tests)."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  B, L, H, K = q_BLHK.shape
  seg, (k_BLHK, v_BLHK) = _as_segments(segment_ids_BL, valid_BL), _every_head(k_BLGK, v_BLGK, H)
  block = min(PALLAS_BLOCK, L)
  sizes = pallas_attention.BlockSizes(
    block_q=block,
    block_k=block,
    block_q_dkv=min(32, L),
    block_kv_dkv=min(32, L),
    block_q_dq=min(32, L),
    block_kv_dq=min(32, L),
  )
  return pallas_attention.mha(
    q_BLHK, k_BLHK, v_BLHK, seg, sm_scale=logits.scale_for(K), causal=causal, block_sizes=sizes, interpret=interpret
  )


def _cudnn(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, valid_BL, *, causal: bool, logits: Logits = PLAIN) -> jax.Array:
  """cuDNN's flash attention through jax.nn.dot_product_attention; a sliding window is its local_window_size
  (W - 1 keys to the left, none to the right), which it aligns top-left: right for queries and keys of one row."""
  del segment_ids_BL  # never set here: packed documents run on Pallas or XLA (see choose)
  B, L = q_BLHK.shape[:2]
  lengths_B = None if valid_BL is None else valid_BL.astype(jnp.int32).sum(-1)
  pad = -L % CUDNN_LENGTH_MULTIPLE
  if pad:  # padded queries are dropped below; padded keys are masked by length (causal: never seen anyway)
    q_BLHK, k_BLGK, v_BLGK = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q_BLHK, k_BLGK, v_BLGK))
    if lengths_B is None and not causal:
      lengths_B = jnp.full((B,), L, jnp.int32)
  o_BLHK = jax.nn.dot_product_attention(
    q_BLHK,
    k_BLGK,
    v_BLGK,
    is_causal=causal,
    scale=logits.scale,
    local_window_size=None if logits.window is None else (logits.window - 1, 0),
    implementation='cudnn',
    query_seq_lengths=None if lengths_B is None else jnp.full((B,), L + pad, jnp.int32),
    key_value_seq_lengths=lengths_B,
  )
  return o_BLHK[:, :L]


# --- 'blockwise': flash attention written in JAX ----------------------------------------------------------------
BLOCKWISE_KEYS = 512  # keys per block: the scores held at once are (B, H, L, BLOCKWISE_KEYS) float32
# What its forward saves for the backward (the output and the softmax's log-sum-exp, as a fused kernel does);
# remat 'dots' keeps them by these names (models/layers.REMAT_POLICIES).
BLOCKWISE_FORWARD = ('attn_flash_out', 'attn_flash_lse')


def _block_mask(q_pos_L, seg_q_BL, key_pos_S, seg_k_BS, valid_k_BS, S: int, causal: bool, window: int | None):
  """(B|1, 1, 1, L, S') bool for one block of keys: real (inside the row, not padding), causal (within the
  window), same document."""
  mask = (key_pos_S < S)[None, :]
  if causal:
    mask = mask & _causal_mask(q_pos_L, key_pos_S, window)
  mask = mask[None]
  if valid_k_BS is not None:
    mask = mask & valid_k_BS.astype(bool)[:, None, :]
  if seg_q_BL is not None:
    mask = mask & (seg_q_BL[:, :, None] == seg_k_BS[:, None, :])
  return mask[:, None, None]


def _key_blocks(block: int, S: int, *arrays):
  """Each (B, S, ...) array (or None) padded to whole blocks and cut into (blocks, B, block, ...) for lax.scan."""
  n = -(-S // block)

  def cut(x):
    if x is None:
      return None
    x = jnp.pad(x, [(0, 0), (0, n * block - S)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)

  return jnp.arange(n * block).reshape(n, block), [cut(x) for x in arrays]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q_BLHK, k_BSGK, v_BSGK, q_pos_L, seg_q_BL, seg_k_BS, valid_k_BS, causal: bool, block: int, logits: Logits):
  return _flash_fwd(q_BLHK, k_BSGK, v_BSGK, q_pos_L, seg_q_BL, seg_k_BS, valid_k_BS, causal, block, logits)[0]


def _flash_fwd(q_BLHK, k_BSGK, v_BSGK, q_pos_L, seg_q_BL, seg_k_BS, valid_k_BS, causal, block, logits):
  B, L, H, K = q_BLHK.shape
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  scale = logits.scale_for(K)
  q = q_BLHK.reshape(B, L, G, H // G, K)
  pos_NS, (k_N, v_N, seg_N, valid_N) = _key_blocks(block, S, k_BSGK, v_BSGK, seg_k_BS, valid_k_BS)

  def step(carry, xs):  # online softmax over one block of keys
    m, l, acc = carry  # running max and sum (B, G, R, L); unnormalised output (B, G, R, L, K), float32
    pos, k, v, seg, valid = xs
    s = logits.cap(jnp.einsum('blgrk,bsgk->bgrls', q, k, preferred_element_type=jnp.float32) * scale)
    s = jnp.where(_block_mask(q_pos_L, seg_q_BL, pos, seg, valid, S, causal, logits.window), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with no key yet
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    acc = acc * corr[..., None] + jnp.einsum(
      'bgrls,bsgk->bgrlk', p.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return (m_new, l * corr + p.sum(-1), acc), None

  R = H // G
  init = (
    jnp.full((B, G, R, L), -jnp.inf, jnp.float32),
    jnp.zeros((B, G, R, L), jnp.float32),
    jnp.zeros((B, G, R, L, K), jnp.float32),
  )
  (m, l, acc), _ = jax.lax.scan(step, init, (pos_NS, k_N, v_N, seg_N, valid_N))
  seen = l > 0  # a row whose every key is masked (a padded query) gives 0
  o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
  o_BLHK = jnp.moveaxis(o, 3, 1).reshape(B, L, H, K).astype(q_BLHK.dtype)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)  # a row with a key has a finite max
  o_BLHK = checkpoint_name(o_BLHK, BLOCKWISE_FORWARD[0])
  lse = checkpoint_name(lse, BLOCKWISE_FORWARD[1])
  return o_BLHK, (q_BLHK, k_BSGK, v_BSGK, q_pos_L, seg_q_BL, seg_k_BS, valid_k_BS, o_BLHK, lse)


def _flash_bwd(causal, block, logits, res, do_BLHK):
  q_BLHK, k_BSGK, v_BSGK, q_pos_L, seg_q_BL, seg_k_BS, valid_k_BS, o_BLHK, lse = res
  B, L, H, K = q_BLHK.shape
  scale = logits.scale_for(K)
  S, G = k_BSGK.shape[1], k_BSGK.shape[2]
  R, dtype = H // G, q_BLHK.dtype
  q, do = (x.reshape(B, L, G, R, K) for x in (q_BLHK, do_BLHK.astype(dtype)))
  delta = jnp.einsum('blgrk,blgrk->bgrl', do.astype(jnp.float32), o_BLHK.reshape(B, L, G, R, K).astype(jnp.float32))
  pos_NS, (k_N, v_N, seg_N, valid_N) = _key_blocks(block, S, k_BSGK, v_BSGK, seg_k_BS, valid_k_BS)

  def step(dq, xs):  # one block of keys: its dk, dv whole; its share of dq
    pos, k, v, seg, valid = xs
    s = jnp.einsum('blgrk,bsgk->bgrls', q, k, preferred_element_type=jnp.float32) * scale
    mask = _block_mask(q_pos_L, seg_q_BL, pos, seg, valid, S, causal, logits.window)
    capped = logits.cap(s)
    p = jnp.where(mask, jnp.exp(capped - lse[..., None]), 0.0)
    dv = jnp.einsum('bgrls,blgrk->bsgk', p.astype(dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum('blgrk,bsgk->bgrls', do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    if logits.softcap is not None:  # d(c tanh(s / c))/ds = 1 - tanh^2
      ds = ds * (1 - jnp.square(capped / logits.softcap))
    ds = ds.astype(dtype)
    dq = dq + jnp.einsum('bgrls,bsgk->blgrk', ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum('bgrls,blgrk->bsgk', ds, q, preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  dq, (dk_N, dv_N) = jax.lax.scan(step, jnp.zeros((B, L, G, R, K), jnp.float32), (pos_NS, k_N, v_N, seg_N, valid_N))
  whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, G, K)[:, :S].astype(dtype)
  return dq.reshape(B, L, H, K).astype(dtype), whole(dk_N), whole(dv_N), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _blockwise(
  q_BLHK,
  k_BLGK,
  v_BLGK,
  segment_ids_BL,
  valid_BL,
  *,
  causal: bool,
  logits: Logits = PLAIN,
  q_pos_L: Any = None,
  seg_k_BS=None,
) -> jax.Array:
  """Flash attention in JAX (any backend): keys in blocks of BLOCKWISE_KEYS under an online softmax, with a
  custom VJP whose forward keeps only the output and the log-sum-exp, like a fused kernel. Temporaries are
  O(L x block), not O(L x S); p and ds enter their matmuls in the compute dtype, as flash kernels do.
  `q_pos_L`: the queries' positions among the keys' (a context shard's; default 0..L-1); `seg_k_BS`: key-side
  segment ids when they are not the queries' (context shards; valid_BL is then key-side too)."""
  L, S = q_BLHK.shape[1], k_BLGK.shape[1]
  seg_k = segment_ids_BL if seg_k_BS is None else seg_k_BS
  return _flash(
    q_BLHK,
    k_BLGK,
    v_BLGK,
    jnp.arange(L) if q_pos_L is None else q_pos_L,
    segment_ids_BL,
    seg_k,
    valid_BL,
    causal,
    min(BLOCKWISE_KEYS, S),
    logits,
  )


def _xla(
  q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, valid_BL, *, causal: bool, logits: Logits = PLAIN, sinks_H: Any = None
) -> jax.Array:
  """jax.nn.dot_product_attention (softmax in float32, grouped kv heads), written out with a soft cap (`_dense`);
  causality via is_causal, or with a sliding window or for rows in zigzag order (context_load_balance) from the
  tokens' natural positions (jax's own local window is aligned top-left: right here, but the mask says it)."""
  mask = _document_mask(segment_ids_BL, segment_ids_BL, valid_BL)
  zigzag = zigzag_shards()
  if causal and (zigzag > 1 or logits.window is not None):
    L = q_BLHK.shape[1]
    pos_L = jnp.asarray(zigzag_positions(L, zigzag)) if zigzag > 1 else jnp.arange(L)
    later = _causal_mask(pos_L, pos_L, logits.window)[None, None]
    mask, causal = later if mask is None else mask & later, False
  return _dense(q_BLHK, k_BLGK, v_BLGK, mask, causal, logits, sinks_H=sinks_H)


def length_multiple(impl: str, dtype: Any, head_dim: int) -> int:
  """The multiple a model should pad a non-causal sequence to, with `kv_length` naming its real keys, so the
  kernel `impl` would choose here runs on it unpadded: CUDNN_LENGTH_MULTIPLE where that is cuDNN (a GPU, or
  `gpu_stand_in`; bf16/fp16; head_dim a multiple of 8), else 1. `_cudnn` pads shorter lengths itself, but per
  layer: ViT-B/16's 197 tokens cost a pad of q, k and v and a slice of the output in every layer, forward and
  backward; padded once by the model, that traffic is gone."""
  if _forced.get() is not None or impl not in ('auto', 'cudnn') or _fused_blockers(dtype, head_dim):
    return 1
  return CUDNN_LENGTH_MULTIPLE


def attend(
  q_BLHK: jax.Array,
  k_BLGK: jax.Array,
  v_BLGK: jax.Array,
  *,
  causal: bool,
  impl: str = 'auto',
  segment_ids_BL: jax.Array | None = None,
  valid_BL: jax.Array | None = None,
  kv_length: int | None = None,
  logits: Logits = PLAIN,
  sinks_H: jax.Array | None = None,
) -> jax.Array:
  """softmax(q k^T / sqrt(K) [+ masks]) v for every head; grouped-query when G < H. Masks: causal, packed
  documents (attend within the same segment id), padding (valid_BL: 1 = real key), and `kv_length` (a Python
  int): every row's keys from that position on are padding the model appended (`length_multiple`). Unlike a
  valid_BL mask, which 'auto' keeps off cuDNN (it cannot know the mask is right-padding), that is cuDNN's
  key lengths exactly. `logits`: another scale than 1 / sqrt(K), a soft cap, a sliding window (Logits)."""
  B, L = q_BLHK.shape[:2]
  masked = valid_BL is not None
  logits = dataclasses.replace(logits, sinks=sinks_H is not None)  # `sinks_H`: each head's sink logit (H,)
  if kv_length is not None:
    if not 0 < kv_length <= L or k_BLGK.shape[1] != L:
      raise ValueError(f'kv_length={kv_length} for {L} queries and {k_BLGK.shape[1]} keys')
    real_BL = jnp.broadcast_to(jnp.arange(L) < kv_length, (B, L))
    valid_BL = real_BL if valid_BL is None else real_BL & valid_BL.astype(bool)
  kind, specs = choose(
    impl,
    q_BLHK,
    k_BLGK,
    causal=causal,
    packed=segment_ids_BL is not None,
    padded=masked,
    kv_length=kv_length,
    logits=logits,
  )
  q_BLHK, k_BLGK, v_BLGK = (
    checkpoint_name(x, n) for x, n in ((q_BLHK, 'attn_q'), (k_BLGK, 'attn_k'), (v_BLGK, 'attn_v'))
  )
  kernel = functools.partial(
    {'cudnn': _cudnn, 'pallas': _pallas, 'splash': _splash, 'xla': _xla, 'blockwise': _blockwise}[kind],
    causal=causal,
    logits=logits,
    **({'sinks_H': sinks_H} if sinks_H is not None else {}),
  )
  # Named so FLOP counting (training/flops.py) can tell causal attention's matmuls from the rest.
  with jax.named_scope('causal_attention' if causal else 'attention'):
    if specs is None:
      if causal and kind != 'xla' and zigzag_shards() > 1:  # only a forced kernel gets here
        raise ConfigError(
          f'attention {kind!r} over a whole row cannot take rows in zigzag order '
          '(config.context_load_balance): it runs per context shard, or XLA'
        )
      o_BLHK = kernel(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, valid_BL)
    else:
      q_spec, kv_spec, bl_spec = specs
      rows = {k: x for k, x in (('segment_ids_BL', segment_ids_BL), ('valid_BL', valid_BL)) if x is not None}
      if q_spec[1] is not None:  # context parallelism
        local = functools.partial(per_shard_context, axes=q_spec[1], causal=causal, implementation=kind, logits=logits)
      else:
        local = lambda q, k, v, rows: kernel(q, k, v, rows.get('segment_ids_BL'), rows.get('valid_BL'))
      o_BLHK = jax.shard_map(
        local,
        mesh=active_mesh(),
        in_specs=(q_spec, kv_spec, kv_spec, {k: bl_spec for k in rows}),
        out_specs=q_spec,
        check_vma=False,
      )(q_BLHK, k_BLGK, v_BLGK, rows)
  return checkpoint_name(o_BLHK, 'attn_out')
