"""Zoo parameters -> Hugging Face safetensors: the import tables (models/hf_import.py) read backwards.

Every row (zoo path, HF key, ops) of a family's table is inverted op by op, last op first: a transpose
by the inverse permutation, a reshape back to the row's `src` shape, a padded vocabulary cut to its real
length, and a slice of a fused tensor (GPT-2's q|k|v) written into its place in the fused tensor. The
first row naming a zoo parameter is its export (later rows are alternative spellings the importer also
reads, e.g. BERT's LayerNorm gamma/beta). Keys take the family's first prefix (the head model's layout,
e.g. 'transformer.h.0...') except the family's `unprefixed` heads ('lm_head.', 'classifier.'). Stacked
zoo tensors are split back into one HF tensor per layer and per expert (the importer's `{i}` with
`first_layer`, and `{e}`); model-state rows (ResNet's running statistics) are written like parameters
(`zoo_shapes` holds both).

Streaming: the output files (one, or several with model.safetensors.index.json, split by
huggingface_hub's planner at `max_shard_size`) are laid out first from shapes alone; then the zoo
tensors are fetched one at a time (`fetch(path)`, e.g. one gathered jax.Array), turned into their HF
tensors and written straight into their place in the files (numpy memmaps). The host holds one zoo
tensor and its HF pieces at a time, never the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from huggingface_hub import split_state_dict_into_shards_factory

from errors import HFExportError
from models import hf_import as hf

# numpy dtype name -> safetensors dtype tag
_DTYPES = {
  'float64': 'F64',
  'float32': 'F32',
  'float16': 'F16',
  'bfloat16': 'BF16',
  'int64': 'I64',
  'int32': 'I32',
  'int16': 'I16',
  'int8': 'I8',
  'uint8': 'U8',
  'bool': 'BOOL',
}


# --- Inverting one row's ops ------------------------------------------------------------------------


def _inv_shape(op: hf.Op, out: tuple[int, ...], key: str) -> tuple[int, ...]:
  if isinstance(op, hf.T):
    shape = [0] * len(out)
    for i, p in enumerate(op.perm):
      shape[p] = out[i]
    return tuple(shape)
  if isinstance(op, hf.R):
    if op.src is None:
      raise HFExportError(f'{key}: the table reshapes it without saying its Hugging Face shape (hf.R.src)')
    known = math.prod(d for d in op.src if d != -1)
    return tuple(math.prod(out) // known if d == -1 else d for d in op.src)
  if isinstance(op, hf.Pad):
    if op.src is None:
      raise HFExportError(f'{key}: the table pads it without saying its real length (hf.Pad.src)')
    return tuple(op.src if d == op.axis else n for d, n in enumerate(out))
  raise HFExportError(f'{key}: cannot invert {op}')


def _inv(op: hf.Op, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """x (op's output) -> op's input of `shape`."""
  if isinstance(op, hf.T):
    return np.transpose(x, np.argsort(op.perm))
  if isinstance(op, hf.R):
    return x.reshape(shape)
  return x[(slice(None),) * op.axis + (slice(0, shape[op.axis]),)]  # hf.Pad: the padding rows go (a view)


@dataclasses.dataclass(frozen=True)
class Piece:
  """One zoo tensor (or entry `index` of its leading stacked axes: layer, expert) -> `region` of HF tensor `key`."""

  key: str
  index: tuple[int, ...]  # () for the whole zoo tensor
  ops: tuple[hf.Op, ...]  # the row's ops after a leading Slice
  shapes: tuple[tuple[int, ...], ...]  # the input shape of each op in `ops`
  region: tuple[slice, ...] | None  # where a sliced (fused) piece goes; None: the whole tensor

  def tensor(self, x: np.ndarray) -> np.ndarray:
    x = x[self.index]
    for op, shape in zip(reversed(self.ops), reversed(self.shapes), strict=True):
      x = _inv(op, x, shape)
    return x


@dataclasses.dataclass
class Plan:
  """What to write: every HF tensor's shape, and the pieces each zoo tensor becomes."""

  shapes: dict[str, tuple[int, ...]]  # HF key -> shape, in writing order
  pieces: dict[str, list[Piece]]  # zoo path -> its pieces


def hf_key(family: hf.Family, template: str, index: Mapping[str, int]) -> str:
  name = template.format(**index)
  bare = any(re.search(r, name) for r in family.unprefixed)
  return name if bare else family.prefixes[0] + name


def plan(family: hf.Family, model_cfg: Any, zoo_shapes: Mapping[str, tuple[int, ...]]) -> Plan:
  """Maps every zoo tensor (path -> shape; a scanned stack's tensors have the leading 'layers' axis) onto HF
  keys. Raises HFExportError naming a zoo tensor no row exports, or a fused HF tensor left partly unwritten.
  Layers and experts as the importer reads them (hf_import's docstring): a scanned stack's entry i is HF layer
  i + row.first_layer, an unrolled one's zoo path {i} likewise, and an HF key with {e} gets one tensor per
  entry of the zoo tensor's expert axis (after the layers axis)."""
  shapes: dict[str, tuple[int, ...]] = {}
  pieces: dict[str, list[Piece]] = {}
  slices: dict[str, list[tuple[int, hf.Slice, tuple[int, ...]]]] = {}  # fused key -> its parts
  exported_by: dict[str, int] = {}  # zoo path -> the row that exports it
  for r, row in enumerate(family.rows(model_cfg)):
    ops = tuple(row.ops_for(model_cfg))
    targets = []  # (zoo path, index into the zoo tensor's leading axes, HF key indices)
    for zoo, fixed, stack in hf.row_targets(row, zoo_shapes):
      if zoo not in zoo_shapes or exported_by.setdefault(zoo, r) != r:
        continue  # not in this model (e.g. an untied head), or exported by an earlier row
      for idx in itertools.product(*map(range, zoo_shapes[zoo][: len(stack)])):
        targets.append(
          (zoo, idx, {**fixed, **{n: k + (row.first_layer if n == 'i' else 0) for n, k in zip(stack, idx)}})
        )
    for zoo, index, at in targets:
      key = hf_key(family, row.hf, at)
      out = tuple(zoo_shapes[zoo][len(index) :])
      cut = ops[0] if ops and isinstance(ops[0], hf.Slice) else None
      rest = ops[1:] if cut else ops
      if any(isinstance(op, hf.Slice) for op in rest):
        raise HFExportError(f'{row.hf}: a slice is only invertible as the first op of a row')
      op_shapes = []
      for op in reversed(rest):
        out = _inv_shape(op, out, key)
        op_shapes.append(out)
      op_shapes.reverse()
      region = None
      if cut is not None:
        region = tuple(slice(cut.start, cut.stop) if d == cut.axis else slice(None) for d in range(len(out)))
        slices.setdefault(key, []).append((len(pieces.get(zoo, [])), cut, out))
      elif key in shapes and shapes[key] != out:
        raise HFExportError(f'{key}: rows give it shapes {shapes[key]} and {out}')
      shapes.setdefault(key, out)
      pieces.setdefault(zoo, []).append(Piece(key, index, rest, tuple(op_shapes), region))
  for key, parts in slices.items():  # a fused tensor: its parts' spans must tile it
    axis = parts[0][1].axis
    spans = sorted((cut.start, cut.stop) for _, cut, _ in parts)
    if spans[0][0] != 0 or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
      raise HFExportError(f'{key}: the zoo tensors cover {spans} of its axis {axis}, not all of it')
    full = list(parts[0][2])
    full[axis] = spans[-1][1]
    shapes[key] = tuple(full)
  missing = sorted(set(zoo_shapes) - set(pieces))
  if missing:
    raise HFExportError(
      f'zoo tensor(s) {missing[:6]} have no Hugging Face counterpart in the '
      f'{family.model_types[0]} table (models/hf_import.py rows), so they cannot be exported'
    )
  return Plan(shapes, pieces)


# --- Writing safetensors files ----------------------------------------------------------------------


def _layout(tensors: Sequence[tuple[str, tuple[int, ...], np.dtype]]) -> tuple[bytes, dict[str, int]]:
  """The safetensors header (8-byte length + JSON, padded to 8 bytes) and each tensor's byte offset."""
  header, offsets, pos = {'__metadata__': {'format': 'pt'}}, {}, 0
  for key, shape, dtype in tensors:
    n = math.prod(shape) * dtype.itemsize
    header[key] = {'dtype': _DTYPES[dtype.name], 'shape': list(shape), 'data_offsets': [pos, pos + n]}
    offsets[key], pos = pos, pos + n
  text = json.dumps(header, separators=(',', ':')).encode()
  text += b' ' * (-len(text) % 8)
  head = struct.pack('<Q', len(text)) + text
  return head, {k: len(head) + v for k, v in offsets.items()}


def write(
  family: hf.Family,
  model_cfg: Any,
  zoo_shapes: Mapping[str, tuple[int, ...]],
  fetch: Callable[[str], np.ndarray],
  out_dir: str,
  *,
  dtype: Any = np.float32,
  max_shard_size: int | str = '5GB',
  order: Iterable[str] | None = None,
  is_writer: bool = True,
) -> dict[str, Any]:
  """Writes `out_dir`/model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json)
  in the family's Hugging Face layout. `fetch(zoo path)` gives one zoo tensor as a numpy array; it is called
  once per tensor, in `order` (default: zoo_shapes'), also on processes that do not write (`is_writer`
  False: multi-host gathers are collective). The family's `constants` (buffers no zoo tensor holds, e.g.
  BatchNorm's num_batches_tracked) are written as they are. Returns {'files', 'tensors', 'bytes'}."""
  dtype = np.dtype(dtype)
  if dtype.name not in _DTYPES:
    raise HFExportError(f'cannot write dtype {dtype.name} to safetensors; one of {sorted(_DTYPES)}')
  p = plan(family, model_cfg, zoo_shapes)
  constants = {k: np.asarray(v) for k, v in (family.constants(list(p.shapes)) if family.constants else {}).items()}
  specs = {k: (shape, dtype) for k, shape in p.shapes.items()} | {k: (v.shape, v.dtype) for k, v in constants.items()}
  size = lambda spec: math.prod(spec[0]) * spec[1].itemsize
  split = split_state_dict_into_shards_factory(
    specs, get_storage_size=size, filename_pattern='model{suffix}.safetensors', max_shard_size=max_shard_size
  )
  offsets, file_of = {}, split.tensor_to_filename

  def place(key: str) -> np.memmap:
    return np.memmap(
      os.path.join(out_dir, file_of[key]), dtype=specs[key][1], mode='r+', offset=offsets[key], shape=specs[key][0]
    )

  if is_writer:
    os.makedirs(out_dir, exist_ok=True)
    for name, keys in split.filename_to_tensors.items():
      head, offs = _layout([(k, *specs[k]) for k in keys])
      with open(os.path.join(out_dir, name), 'wb') as f:
        f.write(head)
        f.truncate(len(head) + sum(size(specs[k]) for k in keys))
      offsets.update(offs)
    for key, value in constants.items():
      out = place(key)
      out[...] = value
      out.flush()
  for zoo in order or zoo_shapes:
    x = fetch(zoo)
    if not is_writer:
      continue
    if tuple(x.shape) != tuple(zoo_shapes[zoo]):
      raise HFExportError(f'zoo tensor {zoo!r} has shape {tuple(x.shape)}, expected {tuple(zoo_shapes[zoo])}')
    for piece in p.pieces[zoo]:
      out = place(piece.key)
      out[piece.region if piece.region is not None else ...] = piece.tensor(x)  # views where the ops allow;
      out.flush()  # the cast happens here
      del out
  total = sum(size(spec) for spec in specs.values())
  if is_writer and split.is_sharded:
    with open(os.path.join(out_dir, 'model.safetensors.index.json'), 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': dict(sorted(file_of.items()))}, f, indent=2)
  return {'files': sorted(split.filename_to_tensors), 'tensors': len(specs), 'bytes': total}


def config_json(family: hf.Family, model_cfg: Any, dtype: Any, base: Mapping[str, Any] | None = None) -> dict:
  """config.json: `family.to_config(config.model)` (the architecture the zoo trained), over `base` (the
  config.json the run started from, when it did: its token ids, labels and other non-architecture fields
  stay, and so do `family.base_keeps`), with the weights' dtype. Labels named for another number of classes
  than the model's (a classifier fine-tuned to a new task) are dropped: transformers names them LABEL_i."""
  if family.to_config is None:
    raise HFExportError(f'the {family.model_types[0]} family has no config.json writer (Family.to_config)')
  ours = family.to_config(model_cfg)
  if base is not None and family.own_config is not None:
    base = family.own_config(base)
  out = dict(base or {})
  out.update(
    {k: v for k, v in ours.items() if (v is not None or k not in out) and not (k in family.base_keeps and k in out)}
  )
  if 'num_labels' in ours and len(out.get('id2label') or ()) not in (0, out['num_labels']):
    out.pop('id2label')
    out.pop('label2id', None)
  out['dtype'] = np.dtype(dtype).name
  out.pop('torch_dtype', None)
  out.pop('quantization_config', None)  # a quantized checkpoint's: the export writes its weights unquantized
  return out
