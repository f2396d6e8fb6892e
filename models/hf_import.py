"""Hugging Face safetensors -> zoo parameters, streamed straight into their shardings.

Each model family declares, as data, how its parameters come from a Hugging Face checkpoint
(`HF` in the family's file): a function from config.json to the zoo's model config, and a table of
`Param(zoo path, HF key, ops)` rows, where `ops` is a short list of array operations (T transpose,
R reshape, Slice of a fused tensor, Pad of rows) turning the HF tensor into the zoo's layout. Reading
a table (what an exporter inverts):

* `{i}` (layers): a zoo path with '/{i}' names one layer of a stack. When the model is scanned the
  zoo leaf is the path without '/{i}' and has a leading 'layers' axis: its entry i is HF key `{i}` =
  i + `Param.first_layer` (0 except where the zoo keeps a stack's first layer elsewhere, e.g. ResNet's
  `first` block). When unrolled, the zoo paths with {i} = 0, 1, ... that the model has are filled
  one by one from the same keys.
* `{e}` (experts): an HF key with `{e}` is one tensor per expert; the zoo leaf has an 'expert' axis
  of as many entries, leading (after the 'layers' axis when scanned), whose entry e is that key with
  {e} = e pushed through `ops`. So stacking adds leading axes in the order layers, experts; the ops
  act on one HF tensor (one layer, one expert).
* `Param.state`: the row fills a leaf of the model state (non-parameter variables, e.g. BatchNorm's
  running mean/var, the trainer's `model_state`) instead of a parameter; same paths, ops and streaming.
* Several rows may name one zoo path with different HF keys (alternative file layouts: BERT's
  weight/gamma, Mixtral's per-expert and fused experts): the row whose keys the file has is used.
  Rows naming a zoo path the model does not have (an untied head on a tied model, a fifth ResNet
  stage) are skipped.
* `Family.prefixes` are tried in front of every HF key; `Family.ignore` lists HF keys that are not
  weights of the model (buffers, other heads); `Family.tied` names a head the model may tie to its
  embedding (a file's copy of it is read once and must equal the embedding).

Rules: every zoo parameter and model-state leaf is explained by a row (or excluded by `dont_load`:
left to fresh initialisation), every HF tensor is used or ignored, and a shape mismatch names the
HF key and the zoo path. Anything else is an HFImportError.

Quantized checkpoints (config.json's `quantization_config`) are read as the float tensors they stand for, so the
tables name the same keys as for a bfloat16 file: `fp8` (DeepSeek-V3): an e4m3 `X.weight` times its float32
`X.weight_scale_inv`, one scale per block of `weight_block_size` (128 x 128) over the last two dims, the grid
ceil(rows / 128) x ceil(cols / 128) (edge blocks partial); `mxfp4` (GPT-OSS experts): `X_blocks` (uint8 [..., out,
G, 16], two e2m1 values per byte, the low nibble first) and `X_scales` (uint8 e8m0 exponents + 127, one per 32
values) read as `X` [..., in, out] (transformers' layout, integrations/mxfp4.py). A slice reads only the blocks and
scales its region covers and is dequantized in float32, then cast to the leaf's dtype.

Streaming: every leaf is created with `jax.make_array_from_callback` on its target NamedSharding.
The callback for one device maps that device's slice of the zoo tensor back through the ops to a
region of the HF tensor and reads only that region with safetensors' `get_slice` (a reshape that
merges dims is read whole along the merged dims). So each process reads only what its devices hold,
and the host never holds more than one tensor's slice. Stacked leaves read only the layers and
experts their slice covers (a device holding experts 2..3 reads those experts' tensors), one at a time.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from absl import logging
from flax import traverse_util
from safetensors import safe_open

from errors import HFImportError
from partitioning import path_str

Region = list[tuple[int, int]]  # (start, stop) per dimension


# --- Ops: forward on arrays, backward on regions ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class T:
  """Transpose by `perm` (as np.transpose)."""

  perm: tuple[int, ...]

  def shape(self, s):
    return tuple(s[p] for p in self.perm)

  def back(self, region, s):
    out = [None] * len(s)
    for i, p in enumerate(self.perm):
      out[p] = region[i]
    return out

  def fwd(self, x, region, want, s):
    return np.transpose(x, self.perm), [region[p] for p in self.perm]

  def __call__(self, x):
    return np.transpose(x, self.perm)


@dataclasses.dataclass(frozen=True)
class R:
  """Reshape to `to` (may contain one -1). `src`, the Hugging Face side's shape (may contain one -1), is
  what the exporter reshapes back to (a reshape cannot be inverted from its output alone). `shape` refuses
  (ValueError) an input whose element count `to` does not hold (or that a -1 does not divide)."""

  to: tuple[int, ...]
  src: tuple[int, ...] | None = None

  def shape(self, s):
    n = math.prod(s)
    known = math.prod(d for d in self.to if d != -1)
    if not (n % known == 0 if -1 in self.to and known else n == known and -1 not in self.to):
      raise ValueError(f'cannot reshape {tuple(s)} to {tuple(self.to)}')
    return tuple(n // known if d == -1 else d for d in self.to)

  def _groups(self, s):
    """Pairs (input dims, output dims) with equal products, in order."""
    out_s = self.shape(s)
    groups, i, j = [], 0, 0
    while i < len(s) or j < len(out_s):
      gi, gj = [i], [j]
      pi, pj = s[i] if i < len(s) else 1, out_s[j] if j < len(out_s) else 1
      while pi != pj:
        if pi < pj:
          i += 1
          gi.append(i)
          pi *= s[i]
        else:
          j += 1
          gj.append(j)
          pj *= out_s[j]
      groups.append(([d for d in gi if d < len(s)], [d for d in gj if d < len(out_s)]))
      i, j = i + 1, j + 1
    return out_s, groups

  def back(self, region, s):
    """The smallest input region that is one contiguous block: an input dim split into output dims
    is read as a range when only its first partial output dim is partial (e.g. a range of heads);
    anything else (merged dims) is read whole."""
    out_s, groups = self._groups(s)
    src: Region = [None] * len(s)
    for gi, gj in groups:
      if len(gi) == 1 and gj:
        sizes = [out_s[d] for d in gj]
        parts = [region[d] for d in gj]
        p = next((k for k, (a, b) in enumerate(parts) if (a, b) != (0, sizes[k])), len(parts) - 1)
        if all(parts[k] == (0, sizes[k]) for k in range(p + 1, len(parts))) and all(b - a == 1 for a, b in parts[:p]):
          stride = math.prod(sizes[p + 1 :])
          offset = sum(a * math.prod(sizes[k + 1 :]) for k, (a, _) in enumerate(parts[:p]))
          src[gi[0]] = (offset + parts[p][0] * stride, offset + parts[p][1] * stride)
          continue
      for d in gi:
        src[d] = (0, s[d])
    return src

  def fwd(self, x, region, want, s):
    out_s, groups = self._groups(s)
    out: Region = [None] * len(out_s)
    for gi, gj in groups:
      if len(gi) == 1 and gj and region[gi[0]] != (0, s[gi[0]]):
        a, b = region[gi[0]]
        sizes = [out_s[d] for d in gj]
        for p in range(len(gj)):
          stride = math.prod(sizes[p + 1 :])
          if a % stride == 0 and b % stride == 0 and (a // stride) // sizes[p] == ((b - 1) // stride) // sizes[p]:
            lead = np.unravel_index((a // stride) // sizes[p], sizes[:p]) if p else ()
            for k, d in enumerate(gj[:p]):
              out[d] = (int(lead[k]), int(lead[k]) + 1)
            lo = (a // stride) % sizes[p]
            out[gj[p]] = (lo, lo + (b - a) // stride)
            for k, d in enumerate(gj[p + 1 :], start=p + 1):
              out[d] = (0, sizes[k])
            break
      else:
        for d in gj:
          out[d] = (0, out_s[d])
    return x.reshape([b - a for a, b in out]), out

  def __call__(self, x):
    return x.reshape(self.to)


@dataclasses.dataclass(frozen=True)
class Slice:
  """x[start:stop] along `axis` (one part of a fused tensor, e.g. GPT-2's q|k|v)."""

  axis: int
  start: int
  stop: int

  def shape(self, s):
    return tuple(self.stop - self.start if d == self.axis else n for d, n in enumerate(s))

  def back(self, region, s):
    return [(a + self.start, b + self.start) if d == self.axis else (a, b) for d, (a, b) in enumerate(region)]

  def fwd(self, x, region, want, s):
    return x, [(a - self.start, b - self.start) if d == self.axis else (a, b) for d, (a, b) in enumerate(region)]

  def __call__(self, x):
    return np.take(x, np.arange(self.start, self.stop), axis=self.axis)


@dataclasses.dataclass(frozen=True)
class Pad:
  """Zero rows appended along `axis` up to `size` (a padded vocabulary); `src` is the real length there
  (the exporter drops the padding rows). `shape` refuses (ValueError) an input of another length there
  (without `src`: a longer one), which would be padded or cut silently."""

  axis: int
  size: int
  src: int | None = None

  def shape(self, s):
    got = s[self.axis]
    if self.src is None and got > self.size:
      raise ValueError(f'holds {got} entries along axis {self.axis}, more than the {self.size} it is padded to')
    if self.src is not None and got != self.src:
      raise ValueError(
        f'holds {got} entries along axis {self.axis}, not {self.src}'
        + (f' (padded to {self.size})' if self.src != self.size else '')
      )
    return tuple(self.size if d == self.axis else n for d, n in enumerate(s))

  def back(self, region, s):
    return [(min(a, s[d]), min(b, s[d])) if d == self.axis else (a, b) for d, (a, b) in enumerate(region)]

  def fwd(self, x, region, want, s):
    (a, b), stop = region[self.axis], want[self.axis][1]
    widths = [(0, max(0, stop - b)) if d == self.axis else (0, 0) for d in range(x.ndim)]
    return np.pad(x, widths), [(a, max(b, stop)) if d == self.axis else r for d, r in enumerate(region)]

  def __call__(self, x):
    widths = [(0, self.size - x.shape[d]) if d == self.axis else (0, 0) for d in range(x.ndim)]
    return np.pad(x, widths)


Op = T | R | Slice | Pad


@dataclasses.dataclass(frozen=True)
class Param:
  """One zoo leaf from HF tensors: `zoo` may contain '{i}' (layer), `hf` '{i}' and '{e}' (expert); see the
  module docstring. `state`: the leaf is model state (e.g. BatchNorm running statistics), not a parameter.
  `first_layer`: the HF layer index of the zoo's layer 0."""

  zoo: str
  hf: str
  ops: Callable[[Any], Sequence[Op]] | Sequence[Op] = ()
  state: bool = False
  first_layer: int = 0

  def ops_for(self, cfg: Any) -> Sequence[Op]:
    return self.ops(cfg) if callable(self.ops) else self.ops


@dataclasses.dataclass(frozen=True)
class Family:
  """How one zoo family maps to Hugging Face checkpoints."""

  model_types: tuple[str, ...]  # config.json "model_type" values this family imports
  config: Callable[[dict], dict]  # config.json -> zoo model config fields
  # The rows; a function of config.model where they depend on it (a stack starting at another layer).
  params: Sequence[Param] | Callable[[Any], Sequence[Param]]
  prefixes: tuple[str, ...] = ('',)  # tried in order in front of every HF key (e.g. 'transformer.')
  ignore: tuple[str, ...] = ()  # regexes of HF keys that are not parameters (buffers, unused heads)
  to_config: Callable[[Any], dict] | None = None  # config.model -> config.json (the inverse of `config`)
  # Export (models/hf_export.py) writes every key with prefixes[0] (the head model's layout, e.g.
  # GPT2LMHeadModel's 'transformer.') except keys matching these regexes (heads: 'lm_head.', 'classifier.').
  unprefixed: tuple[str, ...] = ()
  # Export only: HF key -> array for buffers the layout has but no zoo tensor holds, given the keys written
  # (e.g. BatchNorm's num_batches_tracked beside each running_mean).
  constants: Callable[[Sequence[str]], Mapping[str, Any]] | None = None
  # Fields where config.model may differ from config.json: field -> check(ours, theirs) giving None when our
  # value works with the checkpoint (it is kept), else why not. Every other field comes from config.json.
  keep: Mapping[str, Callable[[Any, Any], str | None]] = dataclasses.field(default_factory=dict)
  # Tied heads: (head HF key, embedding HF key) pairs, unprefixed (GPT-2: ('lm_head.weight', 'wte.weight')). A
  # file may hold the head even when the model ties it to the embedding (no row fills it): that tensor is
  # accepted only when it equals the embedding (a tied checkpoint's copy); else it is an HFImportError (an
  # untied head, which the model would drop).
  tied: tuple[tuple[str, str], ...] = ()
  # Export only: config.json keys whose value in the config.json a run started from stays in the exported one,
  # where config.model may narrow them without changing the model (Llama's max_position_embeddings: a shorter
  # max_len trains on the same rotary positions, and the export can still take the checkpoint's length).
  base_keeps: tuple[str, ...] = ()
  # Export only: the config.json a run started from as this family's own (Gemma 3's vision-language checkpoints
  # hold the language model's in text_config; the export writes the language model alone).
  own_config: Callable[[dict], dict] | None = None
  # config.json -> (regex of HF keys of parts the model does not build, why) or None: those tensors are skipped
  # with one log line saying why (DeepSeek-V3's multi-token-prediction layer).
  skip: Callable[[dict], tuple[str, str] | None] | None = None

  def rows(self, model_cfg: Any) -> Sequence[Param]:
    """The table for this config.model."""
    return self.params(model_cfg) if callable(self.params) else self.params


# --- Reading a directory ----------------------------------------------------------------------


class HFDir:
  """A Hugging Face model directory: config.json and one or several *.safetensors files."""

  def __init__(self, path: str):
    self.path = path
    cfg_file = os.path.join(path, 'config.json')
    if not os.path.isfile(cfg_file):
      raise HFImportError(f'{path!r} is not a Hugging Face model directory: no config.json there')
    with open(cfg_file) as f:
      self.config = json.load(f)
    index = os.path.join(path, 'model.safetensors.index.json')
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)['weight_map']
    else:
      files = sorted(glob.glob(os.path.join(path, '*.safetensors')))
      if not files:
        raise HFImportError(
          f'{path!r} has no *.safetensors files (PyTorch .bin checkpoints are not read: '
          'convert them with transformers save_pretrained(safe_serialization=True))'
        )
      weight_map = {}
      for file in files:
        weight_map.update({k: os.path.basename(file) for k in _open(file).keys()})
    self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
    missing = sorted({v for v in self.files.values() if not os.path.isfile(v)})
    if missing:
      raise HFImportError(f'{path!r}: the index names {missing[0]!r}, which is not there')
    self._shapes: dict[str, tuple[int, ...]] = {}
    self._dtypes: dict[str, str] = {}
    self.quantization = Quantization.of(self.config, cfg_file)
    # key -> (its packed tensors: fp8 (weight, scale_inv), mxfp4 (blocks, scales)); those are not keys themselves
    self.packed: dict[str, tuple[str, str]] = {}
    if self.quantization:
      self.packed = self.quantization.packed(set(self.files))
    hidden = {k for pair in self.packed.values() for k in pair}
    self._keys = (set(self.files) - hidden) | set(self.packed)

  def keys(self) -> set[str]:
    return set(self._keys)

  def _raw_shape(self, key: str) -> tuple[int, ...]:
    if key not in self._shapes:
      with _open(self.files[key]) as f:
        self._shapes[key] = tuple(f.get_slice(key).get_shape())
        self._dtypes[key] = f.get_slice(key).get_dtype()
    return self._shapes[key]

  def shape(self, key: str) -> tuple[int, ...]:
    """A quantized tensor's shape is that of the float tensor it stands for."""
    if key in self.packed:
      return self.quantization.shape(self, key, *self.packed[key])
    return self._raw_shape(key)

  def dtype(self, key: str) -> str:
    """The safetensors dtype tag ('F32', 'BF16', 'I64', ...); 'F32' for a quantized tensor (read dequantized)."""
    return 'F32' if key in self.packed else self._raw_dtype(key)

  def read(self, key: str, region: Region) -> np.ndarray:
    """Only `region` of tensor `key` is read from disk (of a quantized one: the blocks and scales it covers)."""
    if key in self.packed:
      return self.quantization.read(self, region, *self.packed[key])
    return self._read_raw(key, region)

  def __contains__(self, key: str) -> bool:
    return key in self._keys

  def _raw_dtype(self, key: str) -> str:
    self._raw_shape(key)
    return self._dtypes[key]

  def _read_raw(self, key: str, region: Region) -> np.ndarray:
    if self._raw_dtype(key).startswith('F8'):
      _float8_on_numpy()
    with _open(self.files[key]) as f:
      return f.get_slice(key)[tuple(slice(a, b) for a, b in region)]


def _float8_on_numpy() -> None:
  """safetensors (0.8.0) finds a float8 tensor's numpy dtype as an attribute of numpy (numpy.float8_e4m3fn), which
  numpy lacks; ml_dtypes (jax's dependency) defines them, so they are set there once (bfloat16 it finds by name)."""
  for name in ('float8_e4m3fn', 'float8_e5m2'):
    if not hasattr(np, name):
      setattr(np, name, getattr(ml_dtypes, name))


FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # by nibble
QUANT_METHODS = ('fp8', 'mxfp4')


@dataclasses.dataclass(frozen=True)
class Quantization:
  """config.json's quantization_config: how the file's quantized tensors are laid out (module docstring)."""

  method: str
  block: tuple[int, int] = (128, 128)  # fp8: rows x cols of one scale

  @classmethod
  def of(cls, config: Mapping[str, Any], cfg_file: str) -> Quantization | None:
    q = config.get('quantization_config')
    if not q:
      return None
    method = q.get('quant_method')
    if method not in QUANT_METHODS:
      raise HFImportError(
        f'{cfg_file}: quantization_config.quant_method={method!r} is not one the zoo reads (it dequantizes '
        f'{" and ".join(QUANT_METHODS)} checkpoints); dequantize the checkpoint to bfloat16 first'
      )
    if method == 'fp8':
      fmt, block = q.get('fmt', 'e4m3'), q.get('weight_block_size') or (128, 128)
      if fmt != 'e4m3' or len(block) != 2:
        raise HFImportError(
          f'{cfg_file}: quantization_config fmt={fmt!r}, weight_block_size={block!r}: the zoo reads fp8 e4m3 '
          'weights with 2-d block scales (weight_block_size [rows, cols])'
        )
      return cls(method, tuple(int(b) for b in block))
    return cls(method)

  def packed(self, keys: set[str]) -> dict[str, tuple[str, str]]:
    """The quantized tensors among `keys`: name -> its two packed tensors."""
    if self.method == 'fp8':
      return {k: (k, k + '_scale_inv') for k in keys if k + '_scale_inv' in keys}
    return {
      k[: -len('_blocks')]: (k, k[: -len('_blocks')] + '_scales')
      for k in keys
      if k.endswith('_blocks') and k[: -len('_blocks')] + '_scales' in keys
    }

  def shape(self, hf: HFDir, key: str, a: str, b: str) -> tuple[int, ...]:
    """The float tensor's shape, after checking the packed tensors' shapes agree (an HFImportError naming them)."""
    sa, sb = hf._raw_shape(a), hf._raw_shape(b)
    if self.method == 'fp8':
      grid = (*sa[:-2], *(-(-n // blk) for n, blk in zip(sa[-2:], self.block, strict=True)))
      if len(sa) < 2 or sb != grid:
        raise HFImportError(
          f'{hf.path}: {b} has shape {sb}, but {a} {sa} in blocks of {self.block} (weight_block_size) needs {grid}'
        )
      if hf._raw_dtype(a) != 'F8_E4M3':
        raise HFImportError(f'{hf.path}: {a} holds {hf._raw_dtype(a)} values, not fp8 e4m3 (F8_E4M3), beside {b}')
      return sa
    if len(sa) < 3 or sb != sa[:-1] or hf._raw_dtype(a) != 'U8' or hf._raw_dtype(b) != 'U8':
      raise HFImportError(
        f'{hf.path}: mxfp4 {a} {hf._raw_dtype(a)} {sa} and {b} {hf._raw_dtype(b)} {sb}: expected uint8 '
        'blocks [..., out, groups, 16] and uint8 scales [..., out, groups]'
      )
    return (*sa[:-3], sa[-2] * sa[-1] * 2, sa[-3])

  def read(self, hf: HFDir, region: Region, a: str, b: str) -> np.ndarray:
    if self.method == 'fp8':
      *lead, (r0, r1), (c0, c1) = region
      bm, bn = self.block
      s0, t0 = r0 // bm, c0 // bn
      w = hf._read_raw(a, region).astype(np.float32)
      s = hf._read_raw(b, [*lead, (s0, -(-r1 // bm)), (t0, -(-c1 // bn))]).astype(np.float32)
      s = np.repeat(np.repeat(s, bm, axis=-2), bn, axis=-1)
      return w * s[..., r0 - s0 * bm : r1 - s0 * bm, c0 - t0 * bn : c1 - t0 * bn]
    *lead, (i0, i1), (o0, o1) = region
    per = 2 * hf._raw_shape(a)[-1]  # values per scale
    g0, g1 = i0 // per, -(-i1 // per)
    packed = hf._read_raw(a, [*lead, (o0, o1), (g0, g1), (0, per // 2)])
    exps = hf._read_raw(b, [*lead, (o0, o1), (g0, g1)]).astype(np.int32) - 127
    x = np.stack([FP4_E2M1[packed & 0x0F], FP4_E2M1[packed >> 4]], axis=-1).reshape(*packed.shape[:-1], per)
    x = np.ldexp(x, exps[..., None]).reshape(*packed.shape[:-2], -1)[..., i0 - g0 * per : i1 - g0 * per]
    return np.swapaxes(x, -1, -2)


def _open(file: str) -> Any:
  """safe_open, with a damaged file (truncated, not safetensors) as one HFImportError naming it."""
  try:
    return safe_open(file, 'np')
  except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError, OSError, ...)
    raise HFImportError(
      f'{file} is not a readable safetensors file (truncated or damaged?): '
      f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
    ) from None


FLOAT_TAGS = ('F16', 'BF16', 'F32', 'F64')


def _read_through(hf: HFDir, key: str, ops: Sequence[Op], index: tuple[slice, ...], dtype: Any) -> np.ndarray:
  """The zoo tensor's slice `index`: the HF region it needs is read, pushed through `ops`, cut to size."""
  shapes = [hf.shape(key)]
  for op in ops:
    shapes.append(op.shape(shapes[-1]))
  want: Region = [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shapes[-1], strict=True)]
  wants = [want]  # the region needed in each intermediate space, last op first
  for op, s in zip(reversed(ops), reversed(shapes[:-1]), strict=True):
    wants.append(op.back(wants[-1], s))
  wants.reverse()
  region = wants[0]
  x = hf.read(key, region)
  for k, op in enumerate(ops):
    x, region = op.fwd(x, region, wants[k + 1], shapes[k])
  cut = tuple(slice(a - h0, b - h0) for (a, b), (h0, _) in zip(want, region, strict=True))
  return np.asarray(x[cut], dtype=dtype)


# --- Import -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Imported:
  """What `import_weights` read: pure-dict trees of sharded arrays, and the zoo paths left out (dont_load)."""

  params: dict
  model_state: dict
  skipped: set[str]


def _resolve_key(hf: HFDir, family: Family, template: str, index: Mapping[str, int]) -> str | None:
  name = template.format(**index)
  for prefix in family.prefixes:
    if prefix + name in hf:
      return prefix + name
  return None


def row_targets(row: Param, flat: Mapping[str, Any]) -> list[tuple[str, dict[str, int], tuple[str, ...]]]:
  """The zoo leaves a row fills among `flat` (zoo paths; a path not there is returned, then skipped) as
  (zoo path, HF template indices fixed for the leaf (an unrolled layer's {i}, first_layer added), the
  template names of its leading stacked axes in order ('i': layers, 'e': experts)). The importer and the
  exporter (models/hf_export.py) read tables through this."""
  experts = ('e',) if '{e}' in row.hf else ()
  if '{i}' not in row.zoo:
    return [(row.zoo, {}, experts)]
  stacked = row.zoo.replace('/{i}', '')
  if stacked in flat:
    return [(stacked, {}, ('i',) + experts)]
  out = []
  while row.zoo.format(i=len(out)) in flat:  # unrolled: the layers the model has
    out.append((row.zoo.format(i=len(out)), {'i': len(out) + row.first_layer}, experts))
  return out


def import_weights(
  hf: HFDir,
  family: Family,
  model_cfg: Any,
  abstract: Any,
  shardings: Any,
  state_abstract: Any = None,
  state_shardings: Any = None,
  dont_load: str | None = None,
) -> Imported:
  """Builds the zoo's params and model-state trees from `hf`, each leaf born in its sharding.

  `abstract`/`shardings`: the model's params (pure dict of ShapeDtypeStructs / NamedShardings);
  `state_abstract`/`state_shardings`: its model state likewise (None: a model without state, when
  the family's `state` rows' tensors are unused, which is an error).
  Leaves whose path matches `dont_load` are skipped (returned paths, to be initialised fresh).
  Raises HFImportError listing zoo leaves nothing explains and HF tensors nothing uses.
  """
  if hf.quantization:
    logging.info(
      "%s: %d %s tensors dequantized to the parameters' dtype as each slice is read",
      hf.path,
      len(hf.packed),
      hf.quantization.method,
    )
  kinds = {False: (abstract, shardings), True: (state_abstract or {}, state_shardings or {})}
  flat = {
    state: {path_str(p): (p, leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    for state, (tree, _) in kinds.items()
  }
  flat_sh = {
    state: {path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(sh)} for state, (_, sh) in kinds.items()
  }
  skip = re.compile(dont_load) if dont_load else None
  out: dict[bool, dict[str, jax.Array]] = {False: {}, True: {}}
  used: set[str] = set()
  dropped: set[str] = set()  # the HF keys of zoo leaves not loaded (dont_load)
  for row in family.rows(model_cfg):
    ops = row.ops_for(model_cfg)
    for zoo, fixed, stack in row_targets(row, flat[row.state]):
      if zoo not in flat[row.state]:
        continue
      leaf, sharding = flat[row.state][zoo][1], flat_sh[row.state][zoo]
      sizes = tuple(leaf.shape[: len(stack)])
      at = lambda idx: {**fixed, **{n: k + (row.first_layer if n == 'i' else 0) for n, k in zip(stack, idx)}}
      keys = {idx: _resolve_key(hf, family, row.hf, at(idx)) for idx in itertools.product(*map(range, sizes))}
      if skip and skip.search(zoo):  # deliberately not loaded (e.g. a head for other classes): its tensors
        used.update(k for k in keys.values() if k is not None)  # are explained, whatever their shapes
        dropped.update(k for k in keys.values() if k is not None)
        continue
      if None in keys.values():
        found = [k for k in keys.values() if k is not None]
        if found:  # some layers or experts there, others not: a damaged or truncated checkpoint
          absent = next(idx for idx, k in keys.items() if k is None)
          raise HFImportError(
            f'{hf.path}: has {found[0]} but not {row.hf.format(**at(absent))} '
            f'(with any of the prefixes {list(family.prefixes)}) for zoo parameter {zoo!r}'
          )
        continue  # reported below as unexplained if nothing else provides it
      expect = tuple(leaf.shape[len(stack) :])
      for key in keys.values():
        got = hf.shape(key)
        try:
          for op in ops:
            got = op.shape(got)
        except ValueError as e:  # an op refuses the HF tensor (R: element counts, Pad: its real length)
          raise HFImportError(
            f'{hf.path}: {key} {hf.shape(key)}: {e}, for zoo parameter {zoo!r}, which expects '
            f'{expect}; does config.json match the model config?'
          ) from None
        if tuple(got) != expect:
          raise HFImportError(
            f'{hf.path}: {key} {hf.shape(key)} gives shape {tuple(got)} for zoo parameter '
            f'{zoo!r}, which expects {expect}; does config.json match the model config?'
          )
        if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and hf.dtype(key) not in FLOAT_TAGS:  # bf16 too
          raise HFImportError(
            f'{hf.path}: {key} holds {hf.dtype(key)} values, but zoo parameter {zoo!r} is '
            f'{np.dtype(leaf.dtype).name}: weights must be floating point ({", ".join(FLOAT_TAGS)})'
          )
      used.update(keys.values())
      out[row.state][zoo] = _stream(hf, keys, sizes, ops, leaf, sharding)
  for head, embedding in family.tied:  # a tied model's head: the file's copy must be the embedding
    h, e = _resolve_key(hf, family, head, {}), _resolve_key(hf, family, embedding, {})
    if h is None or h in used or e is None:
      continue  # no copy, an untied model's own head, or no embedding (reported below)
    if e not in dropped and not _equal(hf, h, e):
      tie = hf.config.get('tie_word_embeddings')
      raise HFImportError(
        f'{hf.path}: {h} {hf.shape(h)} is not a copy of the embedding {e} {hf.shape(e)}, but the '
        f'model ties its head to the embedding (config.json tie_word_embeddings='
        f"{'unset' if tie is None else tie}): the checkpoint's own head would be dropped"
      )
    used.add(h)
  ignored = [re.compile(r) for r in family.ignore]
  if extra := family.skip and family.skip(hf.config):
    pattern = re.compile(extra[0])
    if n := sum(1 for k in hf.keys() if pattern.search(k)):
      logging.warning('%s: %d tensors not imported: %s', hf.path, n, extra[1])
      ignored.append(pattern)
  unused = sorted(k for k in hf.keys() - used if not any(r.search(k) for r in ignored))
  every = set(flat[False]) | set(flat[True])
  skipped = {z for z in every if skip and skip.search(z)}
  missing = sorted(every - set(out[False]) - set(out[True]) - skipped)
  if missing or unused:
    raise HFImportError(
      f'{hf.path}: cannot map the checkpoint onto the model. '
      + (
        f'Zoo parameters with no HF tensor ({len(missing)}): {missing[:6]}{" ..." if len(missing) > 6 else ""}. '
        'Exclude them with config.dont_load (regex) to initialise them fresh, e.g. a new head. '
        if missing
        else ''
      )
      + (
        f'HF tensors the model does not use ({len(unused)}): {unused[:6]}{" ..." if len(unused) > 6 else ""}.'
        if unused
        else ''
      )
    )
  trees = {
    state: traverse_util.unflatten_dict(
      {tuple(_key(k) for k in flat[state][zoo][0]): arr for zoo, arr in out[state].items()}
    )
    for state in (False, True)
  }
  return Imported(trees[False], trees[True], skipped)


def _equal(hf: HFDir, a: str, b: str) -> bool:
  """Whether HF tensors a and b hold the same values (read a block of rows at a time, not whole)."""
  shape = hf.shape(a)
  if shape != hf.shape(b):
    return False
  if not shape:
    return bool(np.array_equal(hf.read(a, []), hf.read(b, [])))
  rows = max(1, 2**22 // max(1, math.prod(shape[1:])))
  for start in range(0, shape[0], rows):
    region = [(start, min(start + rows, shape[0]))] + [(0, n) for n in shape[1:]]
    if not np.array_equal(hf.read(a, region), hf.read(b, region)):
      return False
  return True


def import_params(
  hf: HFDir, family: Family, model_cfg: Any, abstract: Any, shardings: Any, dont_load: str | None = None
) -> tuple[dict, set[str]]:
  """import_weights for a model without model state: (params tree, skipped paths)."""
  got = import_weights(hf, family, model_cfg, abstract, shardings, dont_load=dont_load)
  return got.params, got.skipped


def _key(k):
  return getattr(k, 'key', getattr(k, 'idx', k))


def _stream(
  hf: HFDir, keys: Mapping[tuple[int, ...], str], sizes: tuple[int, ...], ops: Sequence[Op], leaf: Any, sharding: Any
) -> jax.Array:
  """The leaf, each device's slice read from the HF tensors it covers: the leading `sizes` axes are stacked
  (layers, experts), one HF tensor per entry, read one at a time."""
  n = len(sizes)

  def read(index: tuple[slice, ...]) -> np.ndarray:
    ranges = [range(*s.indices(size)) for s, size in zip(index[:n], sizes, strict=True)]
    parts = [_read_through(hf, keys[idx], ops, index[n:], leaf.dtype) for idx in itertools.product(*ranges)]
    if not n:
      return parts[0]
    return np.stack(parts).reshape(*map(len, ranges), *parts[0].shape)

  return jax.make_array_from_callback(tuple(leaf.shape), sharding, read)


HUB_ID = re.compile(r'^[A-Za-z0-9][\w.-]*/[\w.-]+$')  # 'openai-community/gpt2', 'meta-llama/Llama-3.2-1B'
# The files of a Hugging Face tokenizer (glob patterns): fetched with a hub id, copied by the export.
TOKENIZER_FILES = (
  'tokenizer*',
  'special_tokens_map.json',
  'added_tokens.json',
  'chat_template.jinja',
  'vocab.*',
  'merges.txt',
  '*.model',
)
HUB_FILES = (
  'config.json',
  '*.safetensors',
  'model.safetensors.index.json',
  'generation_config.json',
  *TOKENIZER_FILES,
)  # no *.bin, *.h5, ...


def resolve(init_from: str, *, download: bool = True) -> str:
  """init_from as given when it is a path that exists (or not a hub id); a Hugging Face hub id -> its snapshot
  directory in huggingface_hub's cache (HF_HOME / HF_HUB_CACHE), downloading the safetensors weights, config
  and tokenizer files when they are not there yet. Offline (HF_HUB_OFFLINE=1 or no network) a cached id
  resolves; a missing one is one HFImportError naming the id, the cache and the command that fetches it.
  download=False (dry runs) never touches the network and returns a missing id unchanged."""
  if not init_from or os.path.exists(init_from) or not HUB_ID.match(init_from):
    return init_from
  import huggingface_hub  # only for hub ids

  try:
    path = huggingface_hub.snapshot_download(init_from, allow_patterns=list(HUB_FILES), local_files_only=not download)
  except Exception as e:  # noqa: BLE001  (offline, unknown or gated id: all one message)
    if not download:
      return init_from
    why = (str(e).strip().splitlines() or [''])[0][:200]
    include = ' '.join(repr(p) for p in HUB_FILES)
    raise HFImportError(
      f'init_from={init_from!r}: no such directory, and as a hub id not in the Hugging Face cache '
      f'{huggingface_hub.constants.HF_HUB_CACHE} and not downloadable ({type(e).__name__}: {why}); fetch it '
      f'where the hub can be reached with `hf download {init_from} --include {include}` into that cache '
      '(HF_HOME / HF_HUB_CACHE), or give a local directory'
    ) from None
  if not is_hf_dir(path):
    raise HFImportError(
      f'init_from={init_from!r} ({path}): no config.json with safetensors weights there '
      '(the zoo reads safetensors only)'
    )
  return path


def is_hf_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, 'config.json')) and (
    bool(glob.glob(os.path.join(path, '*.safetensors')))
    or os.path.isfile(os.path.join(path, 'model.safetensors.index.json'))
  )
