"""The decoding engine: a language model continued token by token with a KV cache placed by the rules.

Prompts are left-padded to a common length P (a bucket: a power of two, at least 8), so every row's last prompt
token sits in slot P-1 and every row writes the same cache slot at each step; each row keeps its own positions
(slot - its padding) and its pads are masked as keys. One prefill forward pass writes the prompts' keys and values
into the cache and gives the first token; one jitted `lax.while_loop` then decodes a token per step until
`max_new_tokens` or every row has emitted its stop token. One compile per (rows, P, S, sampling kind): S, the cache
slots, is P + max_new_tokens rounded up (`cache_slots`), and max_new_tokens itself is a traced bound.

The cache (per layer: keys and values, (B, G, S, K) each; scanned stacks add a leading 'layers' axis) names the
logical axes of models/layers.CACHE_AXES: 'cache_batch', 'cache_heads', 'cache_length', 'cache_kv'. The config's
`logical_axis_rules` place it (the presets map them like 'batch', None, 'kv_heads', 'kv'), or `config.decode_rules`,
a whole rule list used instead of the training rules for decoding (generation/loading.py loads the parameters in
its layout too).

Sampling (`Sampling`): greedy at temperature 0; else softmax(logits / temperature), optionally cut to the top_k
tokens and to the smallest set whose probability reaches top_p, sampled with a key folded from the seed, the step
and the row: the same seed gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import partitioning
from errors import ConfigError
from models import kernels, mla
from models.layers import CACHE_AXES, Attention, Decoding

MIN_PROMPT_BUCKET = 8
# Decode steps from which a batch's loop packs its weights into the GEMM's panels before it runs
# (kernels.decode_matmuls(prepack=True)): GPT-2 124M's packing took about 300 ms a call in float32 on a Zen 3, what
# 7-8 of its batch-32 steps saved, and XLA computes it even where the loop then runs no step.
PREPACK_MIN_STEPS = 8


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen: temperature 0 is greedy (argmax); top_k 0 and top_p 1 cut nothing."""

  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def check(self) -> None:
    if self.max_new_tokens < 1:
      raise ConfigError(f'max_new_tokens={self.max_new_tokens}: must be at least 1')
    if not self.temperature >= 0:
      raise ConfigError(f'temperature={self.temperature}: must be >= 0 (0 is greedy)')
    if self.top_k < 0:
      raise ConfigError(f'top_k={self.top_k}: must be >= 0 (0 keeps every token)')
    if not 0 < self.top_p <= 1:
      raise ConfigError(f'top_p={self.top_p}: must be in (0, 1] (1 keeps every token)')


def bucket(n: int, least: int = 1) -> int:
  """The power of two at or above n (at least `least`): one compile serves every length up to it."""
  return max(least, 1 << max(0, n - 1).bit_length())


def cache_slots(P: int, new: int) -> int:
  """The cache slots of a decode of `new` tokens after a prompt bucket of P: P + new rounded up to a power of two,
  or P + new's power-of-two bucket where that is fewer (128 + 64 -> 192, not 256). A decode step attends to every
  slot, so the slots past the last token are read for nothing: at batch 32 the cache outweighs the weights."""
  return min(bucket(P + new), P + bucket(new, MIN_PROMPT_BUCKET))


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """A model's KV cache: layers, kv heads, head dim, dtype, whether the layers are scanned (stacked), and the
  sliding window of each place in the model's layer pattern (`windows`, cycled over the layers; None: global).

  A global layer keeps every slot; a local one min(window, slots), a ring of its window's last tokens
  (models/layers.Attention._cached), so its memory does not grow with the decode. Scanned, the cache is laid out
  as the stack runs (layers.Stack.decode): one (keys, values) pair per place of the pattern, stacked over the
  layers // period groups, then the pairs of the layers % period layers left over.

  Latent attention (models/mla.py) caches a pair of other widths: the latent (head_dim: kv_lora_rank) and the
  rotary key (value_dim), one 'head' each, named `names`; `full_kv` (heads, key dim, value dim) is what full keys
  and values would hold instead (the cache table compares). `first` layers (dense layers first, models/moe.py)
  are a stack of their own, laid out the same way before the others (paths 'dense/...'), all global."""

  layers: int
  kv_heads: int
  head_dim: int
  dtype: Any
  scanned: bool
  windows: tuple[int | None, ...] = (None,)
  value_dim: int | None = None  # None: head_dim
  names: tuple[str, str] = ('key', 'value')
  first: int = 0
  full_kv: tuple[int, int, int] | None = None

  @property
  def period(self) -> int:
    return len(self.windows)

  def slots(self, place: int, slots: int) -> int:
    """The slots of a layer at `place` in the pattern, for a decode of `slots` slots."""
    w = self.windows[place]
    return slots if w is None else min(w, slots)

  def kind(self, place: int) -> str:
    return 'global' if self.windows[place] is None else f'local (window {self.windows[place]})'

  def _shapes(self, rows: int, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The pair's shapes for a global layer."""
    one = lambda dim: (rows, self.kv_heads, slots, dim)
    return one(self.head_dim), one(self.head_dim if self.value_dim is None else self.value_dim)

  def _stack(self, layers: int, period: int, rows: int, slots: int, prefix: str = ''):
    """(path, shape, logical axes, place) of a stack's arrays, in its cache's order."""
    pair = lambda j: zip(self.names, self._shapes(rows, self.slots(j, slots)))
    out = []
    if not self.scanned:
      for i in range(layers):
        out += [(f'{prefix}{i}/{k}', shape, CACHE_AXES, i % period) for k, shape in pair(i % period)]
      return out
    groups = layers // period
    for j in range(period if groups else 0):
      where = '' if period == 1 else f'{j}/'
      out += [(f'{prefix}{where}{k}', (groups, *shape), ('layers', *CACHE_AXES), j) for k, shape in pair(j)]
    for j in range(layers % period):
      out += [(f'{prefix}rest/{j}/{k}', shape, CACHE_AXES, j) for k, shape in pair(j)]
    return out

  def _entries(self, rows: int, slots: int) -> list[tuple[str, tuple[int, ...], tuple, int]]:
    """(path, shape, logical axes, place) of every array, in the cache's order."""
    dense = self._stack(self.first, 1, rows, slots, 'dense/') if self.first else []
    return dense + self._stack(self.layers - self.first, self.period, rows, slots)

  def abstract(self, rows: int, slots: int) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, tuple]]:
    """(shapes, logical axes) of the whole cache, by path, for the sharding table."""
    entries = self._entries(rows, slots)
    return (
      {path: jax.ShapeDtypeStruct(shape, self.dtype) for path, shape, _, _ in entries},
      {path: names for path, _, names, _ in entries},
    )

  def kinds(self, rows: int, slots: int) -> dict[str, list[str]]:
    """Each layer kind (global, local (window W)) -> the cache paths of its layers."""
    out: dict[str, list[str]] = {}
    for path, _, _, place in self._entries(rows, slots):
      out.setdefault(self.kind(place), []).append(path)
    return out

  def zeros(self, rows: int, slots: int) -> Any:
    """The empty cache, constrained to its logical axes (under partitioning.use_rules)."""
    zero = lambda shape, names: partitioning.shard_logical(jnp.zeros(shape, self.dtype), names)

    def stack(layers: int, period: int) -> Any:
      pair = lambda j, lead=(): tuple(
        zero((*lead, *shape), (*(('layers',) if lead else ()), *CACHE_AXES))
        for shape in self._shapes(rows, self.slots(j, slots))
      )
      if not self.scanned:
        return [pair(i % period) for i in range(layers)]
      groups = layers // period
      return tuple(pair(j, (groups,)) for j in range(period)), tuple(pair(j) for j in range(layers % period))

    main = stack(self.layers - self.first, self.period)
    return (stack(self.first, 1), main) if self.first else main


def cache_layout(model: nnx.Module) -> CacheLayout:
  """The KV cache a language model decodes with; ConfigError for a model that cannot decode."""
  blocks = getattr(model, 'blocks', None)
  if not hasattr(model, 'decode') or blocks is None:
    raise ConfigError(
      f'{type(model).__name__} is not a decoder language model: generation needs a causal LM (gpt2, llama, qwen3, '
      'gemma3, moe, ...)'
    )
  attn = next(m for _, m in nnx.iter_graph(blocks) if isinstance(m, (Attention, mla.MLA)))
  first = blocks.layers if blocks.scan else blocks.layers[0]
  windows = tuple(w for w, _ in getattr(first, 'places', ((None, None),)))  # decoder blocks: models/decoder.py
  dense = getattr(model, 'dense_blocks', None)
  lead = dict(first=dense.num) if dense is not None else {}
  if isinstance(attn, mla.MLA):
    H, R, N, P, V = attn.dims
    return CacheLayout(
      blocks.num + (dense.num if dense is not None else 0),
      1,
      R,
      jnp.dtype(attn.dtype),
      blocks.scan,
      windows,
      value_dim=P,
      names=mla.CACHE_NAMES,
      full_kv=(H, N + P, V),
      **lead,
    )
  layers = blocks.num + (dense.num if dense is not None else 0)
  return CacheLayout(layers, attn.kv_heads, attn.head_dim, jnp.dtype(attn.dtype), blocks.scan, windows, **lead)


def _choose(logits_BV, key, step, temperature, top_p, *, greedy: bool, top_k: int, nucleus: bool) -> jax.Array:
  """The next token of every row (see Sampling)."""
  if greedy:  # inside decode_matmuls(True): the kernel's argmax (models/kernels)
    fast = kernels.argmax(logits_BV)
    return fast if fast is not None else jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  x_BV = logits_BV.astype(jnp.float32) / temperature
  if top_k:
    kth_B1 = jax.lax.top_k(x_BV, min(top_k, x_BV.shape[-1]))[0][:, -1:]
    x_BV = jnp.where(x_BV >= kth_B1, x_BV, -jnp.inf)
  if nucleus:  # keep the most probable tokens until their mass reaches top_p (at least one)
    sorted_BV = -jnp.sort(-x_BV, axis=-1)
    p_BV = jax.nn.softmax(sorted_BV, axis=-1)
    kept_BV = jnp.cumsum(p_BV, axis=-1) - p_BV < top_p
    least_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    x_BV = jnp.where(x_BV >= least_B1, x_BV, -jnp.inf)
  keys = jax.random.split(jax.random.fold_in(key, step), x_BV.shape[0])
  return jax.vmap(jax.random.categorical)(keys, x_BV).astype(jnp.int32)


@dataclasses.dataclass
class Generated:
  """One prompt's result: its ids, the generated ids (up to and with the stop token), and per-step logits
  (keep_logits only: (len(ids), V))."""

  prompt_ids: list[int]
  ids: list[int]
  logits: np.ndarray | None = None


_logged: set[str] = set()  # the decode's choices (matmuls, pages) logged once per process


def _say_once(said: str, level: int = logging.INFO) -> None:
  if said not in _logged:
    _logged.add(said)
    logging.log(level, '%s', said)


class Generator:
  """Decodes a model (graphdef + weights: pure dicts of its parameters and other variables, as nnx.split gives
  them) with a KV cache. With `rules` and `mesh` the model runs under them (parameters already placed so);
  without, on whatever the weights live on."""

  def __init__(
    self,
    graphdef: Any,
    params: Any,
    model_state: Any,
    *,
    rules: partitioning.AxisRules | None = None,
    mesh: jax.sharding.Mesh | None = None,
    max_len: int | None = None,
    vocab: int | None = None,
    matmul: str = 'auto',
  ):
    self.graphdef, self.params, self.model_state = graphdef, params, model_state
    self.rules, self.mesh, self.max_len, self.vocab = rules, mesh, max_len, vocab
    self.matmul = matmul  # config.decode_matmul: 'auto' (the CPU kernel where it applies) or 'xla'
    self.layout = cache_layout(nnx.merge(graphdef, params, model_state, copy=True))
    self._programs: dict[tuple, Any] = {}

  def row_multiple(self) -> int:
    """Rows are padded to a multiple of the devices 'batch' and 'cache_batch' are split over."""
    if self.rules is None:
      return 1
    sizes = [
      partitioning.entry_size(spec[0], self.mesh.shape) if len(spec) else 1
      for spec in (self.rules.spec((name,), what='the decoding batch') for name in ('batch', 'cache_batch'))
    ]
    return math.lcm(*sizes)

  def shapes(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> tuple[int, int, int]:
    """(rows, prompt bucket P, cache slots S) for these prompts; ConfigError for a prompt that does not fit."""
    for i, p in enumerate(prompts):
      if not len(p):
        raise ConfigError(f'prompt {i} is empty: generation needs at least one prompt token')
      if self.vocab and not all(0 <= t < self.vocab for t in p):
        raise ConfigError(
          f"prompt {i} has token ids outside the model's vocabulary of {self.vocab} (e.g. "
          f'{next(t for t in p if not 0 <= t < self.vocab)}): another tokenizer than the model was trained with?'
        )
      if self.max_len and len(p) + sampling.max_new_tokens > self.max_len:
        raise ConfigError(
          f'prompt {i} has {len(p)} tokens: with max_new_tokens={sampling.max_new_tokens} that is '
          f"{len(p) + sampling.max_new_tokens}, over the model's {self.max_len} positions (config.model.max_len); "
          + _fix(len(p), sampling.max_new_tokens, self.max_len)
        )
    m = self.row_multiple()
    rows = -(-len(prompts) // m) * m
    P = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET)
    return rows, P, cache_slots(P, sampling.max_new_tokens)

  def cache_table(self, rows: int, slots: int) -> str:
    """The cache's sharding table (path, shape, logical axes, spec, bytes per device) under the rules."""
    shapes, names = self.layout.abstract(rows, slots)
    rules = self.rules or partitioning.AxisRules([])
    mesh_shape = dict(self.mesh.shape) if self.mesh is not None else {}
    specs = {
      k: (rules.spec(names[k], s.shape, mesh_shape, what=f'KV cache {k}') if self.rules else PartitionSpec())
      for k, s in shapes.items()
    }
    table = partitioning.sharding_table(shapes, names, specs, mesh_shape, what='KV cache')
    if self.layout.full_kv is not None:  # latent attention: what full keys and values would take
      H, K, V = self.layout.full_kv
      ours = partitioning.tree_bytes_per_device(shapes, specs, mesh_shape)
      per_token = lambda width: width * self.layout.dtype.itemsize * self.layout.layers
      latent = per_token(self.layout.head_dim + (self.layout.value_dim or 0))
      full = per_token(H * (K + V))
      table += (
        f'\nlatent cache: {latent:,} bytes per token ({self.layout.layers} layers x (latent {self.layout.head_dim} + '
        f'rotary key {self.layout.value_dim})); full keys and values would take {full:,} bytes per token '
        f'({H} heads x ({K} + {V})): {full / latent:.1f}x; this cache {partitioning.fmt_bytes(ours)} per device, '
        f'full keys and values about {partitioning.fmt_bytes(ours * full // latent)}'
      )
    kinds = self.layout.kinds(rows, slots)
    if len(kinds) == 1 and 'global' in kinds:
      return table
    per_device = lambda paths: partitioning.tree_bytes_per_device(
      {p: shapes[p] for p in paths}, {p: specs[p] for p in paths}, mesh_shape
    )
    lines = [f'  {kind}: {partitioning.fmt_bytes(per_device(paths))} per device' for kind, paths in kinds.items()]
    return table + f'\nKV cache by layer kind ({slots} slots):\n' + '\n'.join(lines)

  def cache_bytes_per_device(self, rows: int, slots: int) -> int:
    shapes, names = self.layout.abstract(rows, slots)
    if self.rules is None:
      return sum(math.prod(s.shape) * s.dtype.itemsize for s in shapes.values())
    specs = {k: self.rules.spec(names[k], s.shape, self.mesh.shape) for k, s in shapes.items()}
    return partitioning.tree_bytes_per_device(shapes, specs, self.mesh.shape)

  def decode_kernel(self) -> bool:
    """Whether decode steps run their weight matmuls through models/kernels' CPU kernel (said once in the log)."""
    if self.matmul == 'xla':
      use, said, warn = False, "decode matmuls: XLA's dot (config.decode_matmul='xla')", False
    else:
      devices = list(self.mesh.devices.flat if self.mesh is not None else jax.tree.leaves(self.params)[0].devices())
      (use, said), warn = kernels.status(devices), kernels.missing(devices)
    # a kernel that would run but did not build is a warning: the decode is slower
    _say_once(said, logging.WARNING if warn else logging.INFO)
    return use

  def huge_pages(self) -> None:
    """Moves weights held on a CPU onto 2 MB pages, which a decode step, reading each weight once, streams faster
    (models/kernels.huge_pages); what it did is said once in the log."""
    backed, total, why = kernels.huge_pages(self.params)
    if not total:
      return
    said = (
      f'decode weights on 2 MB pages: {partitioning.fmt_bytes(backed)} of {partitioning.fmt_bytes(total)} '
      '(madvise MADV_COLLAPSE)'
      if backed
      else f'decode weights on 4 KB pages: {why}'
    )
    _say_once(said)

  def _program(
    self, rows: int, P: int, S: int, greedy: bool, top_k: int, nucleus: bool, keep_logits: bool, prepack: bool
  ):
    key = (rows, P, S, greedy, top_k, nucleus, keep_logits, prepack)
    if key in self._programs:
      return self._programs[key]
    fast = self.decode_kernel()
    graphdef, layout, N = self.graphdef, self.layout, S - P
    choose = lambda logits, key, step, t, p: _choose(
      logits, key, step, t, p, greedy=greedy, top_k=top_k, nucleus=nucleus
    )

    # One row's loop carries its cache without the batch axis, as the attention then runs (models/layers.py
    # Attention._cached): with a 4-d carry XLA's CPU compiler still copies the caches every step.
    one = rows == 1
    squeeze = lambda cache: jax.tree.map(lambda c: c.squeeze(c.ndim - 4), cache) if one else cache
    unsqueeze = lambda cache: jax.tree.map(lambda c: jnp.expand_dims(c, c.ndim - 3), cache) if one else cache

    def run(params, model_state, tokens_BP, pad_B, stop_B, live_B, key, temperature, top_p, max_new):
      def model():  # merged where it runs: a scanned stack's nnx.scan refuses Variables of an outer trace level
        return inference(nnx.merge(graphdef, params, model_state, copy=True))

      valid_BS = jnp.arange(S)[None, :] >= pad_B[:, None]  # the slots of real tokens (as they are written)
      pos_BP = jnp.maximum(jnp.arange(P)[None, :] - pad_B[:, None], 0)
      with kernels.decode_matmuls(fast):  # the prefill's bfloat16 matmuls (models/kernels bf16_gemm)
        logits_BV, cache = model().decode(
          tokens_BP, pos_BP, layout.zeros(rows, S), Decoding(jnp.int32(0), valid_BS, prefill=True)
        )
        tok_B = choose(logits_BV, key, 0, temperature, top_p)
      V = logits_BV.shape[-1]
      out_BN = jnp.zeros((rows, N), jnp.int32).at[:, 0].set(tok_B)
      kept_BNV = jnp.zeros((rows, N, V) if keep_logits else (0,), jnp.float32)
      if keep_logits:
        kept_BNV = kept_BNV.at[:, 0].set(logits_BV.astype(jnp.float32))

      def cond(c):
        i, _, _, _, done_B, _ = c
        return (i < max_new) & ~jnp.all(done_B)

      def body(c):
        i, tok_B, cache, out_BN, done_B, kept_BNV = c
        index = P + i - 1  # the slot of tok_B
        with kernels.decode_matmuls(fast, prepack=prepack):  # the same weights every step: packed once, outside
          logits_BV, cache = model().decode(
            tok_B[:, None], (index - pad_B)[:, None], unsqueeze(cache), Decoding(index, valid_BS)
          )
          chosen_B = choose(logits_BV, key, i, temperature, top_p)
        cache = squeeze(cache)
        nxt_B = jnp.where(done_B, stop_B, chosen_B)  # done rows repeat it
        out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, nxt_B[:, None], i, axis=1)
        if keep_logits:
          kept_BNV = jax.lax.dynamic_update_slice_in_dim(kept_BNV, logits_BV[:, None].astype(jnp.float32), i, axis=1)
        return i + 1, nxt_B, cache, out_BN, done_B | (nxt_B == stop_B), kept_BNV

      done_B = (tok_B == stop_B) | ~live_B
      i, _, _, out_BN, _, kept_BNV = jax.lax.while_loop(
        cond, body, (jnp.int32(1), tok_B, squeeze(cache), out_BN, done_B, kept_BNV)
      )
      return out_BN, i, kept_BNV

    def traced(*args):
      if self.rules is None:
        return run(*args)
      with partitioning.use_rules(self.rules, self.mesh):
        return run(*args)

    out = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
    self._programs[key] = jax.jit(traced, out_shardings=out)
    return self._programs[key]

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    stop_ids: int | Sequence[int | None] | None = None,
    *,
    keep_logits: bool = False,
  ) -> list[Generated]:
    """Continues every prompt (lists of token ids) by up to sampling.max_new_tokens tokens, stopping a row at its
    stop token (`stop_ids`: one id for all rows, or one per row; None: no stop), which is kept in its ids."""
    sampling.check()
    rows, P, S = self.shapes(prompts, sampling)
    stops = list(stop_ids) if isinstance(stop_ids, (list, tuple)) else [stop_ids] * len(prompts)
    tokens_BP = np.zeros((rows, P), np.int32)
    pad_B, stop_B, live_B = np.full(rows, P - 1, np.int32), np.full(rows, -1, np.int32), np.zeros(rows, bool)
    for b, p in enumerate(prompts):
      tokens_BP[b, P - len(p) :] = p
      pad_B[b], live_B[b] = P - len(p), True
      stop_B[b] = -1 if stops[b] is None else stops[b]
    greedy = sampling.temperature == 0
    prepack = sampling.max_new_tokens - 1 >= PREPACK_MIN_STEPS
    top_k = 0 if greedy else sampling.top_k
    program = self._program(rows, P, S, greedy, top_k, sampling.top_p < 1, keep_logits, prepack)
    out_BN, steps, kept_BNV = jax.device_get(
      program(
        self.params,
        self.model_state,
        tokens_BP,
        pad_B,
        stop_B,
        live_B,
        jax.random.key(sampling.seed),
        np.float32(max(sampling.temperature, 1e-6)),
        np.float32(sampling.top_p),
        np.int32(sampling.max_new_tokens),
      )
    )
    results = []
    for b, p in enumerate(prompts):
      ids = [int(t) for t in out_BN[b, : int(steps)]]
      if stop_B[b] >= 0 and stop_B[b] in ids:
        ids = ids[: ids.index(stop_B[b]) + 1]
      results.append(Generated(list(map(int, p)), ids, kept_BNV[b, : len(ids)] if keep_logits else None))
    return results


def inference(model: nnx.Module) -> nnx.Module:
  """The model in inference mode (flax's Module.eval: dropout off, BatchNorm on its averages), in place: call it on
  a merged copy."""
  model.eval()
  return model


def sample(request: Any) -> np.ndarray:
  """The end-of-run sample train.py asks for (training/run.py SampleRequest: the trained weights under the
  trainer's rules, prompt rows, new_tokens, seed): the new_tokens ids sampled after each row (temperature 1)."""
  gen = Generator(
    request.graphdef,
    request.params,
    request.model_state,
    rules=request.rules,
    mesh=request.mesh,
    max_len=request.max_len,
    vocab=request.vocab,
  )
  out = gen.generate(request.prompts.tolist(), Sampling(request.new_tokens, temperature=1.0, seed=request.seed))
  return np.asarray([g.ids for g in out], np.int32)


def _fix(prompt_len: int, new: int, max_len: int) -> str:
  """What makes a prompt of `prompt_len` tokens and `new` new ones fit `max_len` positions."""
  fixes = []
  if max_len - new >= 1:
    fixes.append(f'shorten the prompt to {max_len - new} tokens')
  if prompt_len < max_len:
    fixes.append(f'ask for at most --max_new_tokens={max_len - prompt_len}')
  else:
    fixes.append(f'shorten the prompt below {max_len} tokens and ask for fewer new ones')
  return ' or '.join(fixes)


def policy_sampler(graphdef: Any, *, rules: Any, mesh: Any, max_len: int | None, vocab: int | None):
  """A sampler of a model in training (GRPO's rollouts, training/rollout.py Sample): called with the current
  parameters as the train state holds them (placed by the training rules, on the training mesh: no copy), the
  prompts, and the sampling settings; one Generator, so one compile per shape for the whole run."""
  gen: Generator | None = None

  def sample(params, model_state, prompts, max_new_tokens, temperature, seed, stop_id):
    nonlocal gen
    if gen is None:
      gen = Generator(graphdef, params, model_state, rules=rules, mesh=mesh, max_len=max_len, vocab=vocab)
    gen.params, gen.model_state = params, model_state
    out = gen.generate(prompts, Sampling(max_new_tokens, temperature=temperature, seed=seed), stop_id)
    return [g.ids for g in out]

  return sample
