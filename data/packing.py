"""Packed rows of language-model documents: one packer per row of the global batch (pipeline.py says why), the
rows of this process stacked into its local batch, in this process or in worker processes.

Two packers make the same rows with the same data positions (tested): grain's (ConcatThenSplit for plain text,
first-fit with one bin for documents with a loss mask, kept whole) over any documents, and a numpy one over a token
cache's ids (token_cache.TokenDocs), which never builds a document: a row is a few array operations over the
documents' offsets and one gather of their ids. Short documents (lm1b's are ~15-30 tokens) are where grain's costs
per document (its index pipeline, the transform's dict, the packer's Python per element) bound the rate; the
numpy packer has no Python per document. `rows_of` picks it wherever the documents come from one token cache, and
logs the choice once.

Worker processes (config.dataset.num_workers, `InWorkers`): worker w packs rows w, w+W, ... of this process's (the
per-row streams are independent, so this splits the work without changing a row), and this process merges their
parts into the local batch. The data position is the rows' packer states, as without workers, so a run resumes
with any number of workers or processes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from absl import flags as absl_flags
from grain import experimental as grain_exp

from data import text, token_cache

_EMPTY = (-1, -1)  # grain's ConcatThenSplit: no remainder slice
_logged: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    logging.info(message)


class _JsonSafeState(grain.IterDataset):
  """Passes elements through; restores a packer state that went through JSON.

  grain 0.2.18's ConcatThenSplit compares its `remainder_slices` with a tuple, but JSON (which
  grain.checkpoint and orbax use) turns tuples into lists, and the restored packer would then
  resume at the wrong token. This turns them back into tuples.
  """

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonSafeStateIterator(self._parent.__iter__())


class _JsonSafeStateIterator(grain.DatasetIterator):
  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    slices = {k: tuple(v) for k, v in state['remainder_slices'].items()}
    self._parent.set_state({**state, 'remainder_slices': slices})


def grain_row(docs: grain.MapDataset, seq_len: int, whole: bool) -> grain.IterDataset:
  """grain's packer over one row's documents (`docs`: {'inputs', 'targets'[, 'mask']} each). `whole`: a document
  that does not fit the rest of a row starts the next (first-fit with one bin: rows in stream order)."""
  ds = docs.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if whole:
    length = {'inputs': seq_len, 'targets': seq_len, 'mask': seq_len}
    return grain_exp.FirstFitPackIterDataset(ds, length_struct=length, num_packing_bins=1, shuffle_bins=False)
  return _JsonSafeState(grain_exp.ConcatThenSplitIterDataset(ds, length_struct={'inputs': seq_len, 'targets': seq_len}))


def grain_rows(docs: grain.MapDataset, global_batch: int, rows: slice, seq_len: int, whole: bool = False) -> list:
  """grain_row of each row r of `rows`: documents r, r+B, r+2B, ... of `docs`."""
  return [grain_row(docs[r::global_batch], seq_len, whole) for r in range(rows.start, rows.stop)]


def stack_rows(rows: Sequence[dict[str, np.ndarray] | None], seq_len: int) -> dict[str, np.ndarray]:
  """Local batch from packed rows (None = padding row): mask 1 on every packed target, or the documents' own
  loss mask where they carry one; 0 on padding."""
  pad = np.zeros(seq_len, np.int32)
  get = lambda r, k: pad if r is None else r[k]
  seg = np.stack([get(r, 'inputs_segment_ids') for r in rows]).astype(np.int32)
  loss = np.stack([(r or {}).get('mask', np.ones(seq_len)) for r in rows])
  return {
    'inputs': np.stack([get(r, 'inputs') for r in rows]).astype(np.int32),
    'targets': np.stack([get(r, 'targets') for r in rows]).astype(np.int32),
    'mask': ((seg > 0) * loss).astype(np.float32),
    'segment_ids': seg,
    'positions': np.stack([get(r, 'inputs_positions') for r in rows]).astype(np.int32),
  }


# --- The numpy packer ----------------------------------------------------------------------------------------------


class NumpyRow(grain.IterDataset):
  """Row r's packed rows from a token cache, as grain_row makes them from the same documents (tested), with grain's
  state of that packer (so a position resumes on either).

  Row r reads documents r, r+B, r+2B, ... of the shuffled, repeated stream of `docs` (pipeline._stream: grain's
  index shuffle, reshuffled every epoch; computed here by grain's own index_shuffle, as its ShuffleMapDataset does).
  A document is ids[:-1] as inputs and ids[1:] as targets (text.CachedDocument); `whole` documents are first cut to
  seq_len + 1 ids (counted by `truncations`) and never split."""

  def __init__(self, docs: token_cache.TokenDocs, seed: int, row: int, global_batch: int, seq_len: int, whole: bool,
               truncations: text.Truncations | None = None):  # fmt: skip
    super().__init__()
    self.docs, self.seed, self.row, self.global_batch = docs, seed, row, global_batch
    self.seq_len, self.whole, self.truncations = seq_len, whole, truncations

  def __iter__(self) -> grain.DatasetIterator:
    return _NumpyRowIterator(self)


class _NumpyRowIterator(grain.DatasetIterator):
  def __init__(self, ds: NumpyRow):
    super().__init__()
    self.ds, docs = ds, ds.docs
    self._n, L = len(docs), ds.seq_len
    # Enough documents per read for a row or two (fewer reads of the index stream for short documents).
    self._chunk = int(max(16, 2 * L * self._n // max(docs.num_tokens, 1) + 8))
    self._base, self._index, self._len = 0, np.zeros(0, np.int64), np.zeros(0, np.int64)
    self._t, self._o = 0, 0  # the next row starts at token _o of document _t of this row's stream
    self._start, self._count = (0, 0), 0  # grain's state: where the last row started, rows since

  # The row's documents: their cache index and inputs length, read `_chunk` at a time.
  def _read(self, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    end = self._base + len(self._index)
    if not self._base <= t <= t + n <= end:
      keep = self._index[t - self._base :] if self._base <= t <= end else np.zeros(0, np.int64)
      at = np.arange(t + len(keep), max(t + n, t + self._chunk), dtype=np.int64) * self.ds.global_batch + self.ds.row
      epoch, j = np.divmod(at, self._n)
      new = np.fromiter(
        (
          grain_exp.index_shuffle(int(i), max_index=self._n - 1, seed=int(s) % 2**32, rounds=4)
          for i, s in zip(j, self.ds.seed + epoch)
        ),
        np.int64,
        len(at),
      )
      self._index, self._base = np.concatenate([keep, new]), t
      offsets = self.ds.docs.offsets
      length = np.maximum(offsets[self._index + 1] - offsets[self._index] - 1, 0)
      self._len = np.minimum(length, self.ds.seq_len) if self.ds.whole else length
    a = t - self._base
    return self._index[a : a + n], self._len[a : a + n]

  def _take(self, t: int, o: int, last: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents t, t+1, ... (the first from token o) up to `last(cumulative lengths)`, which must see the document
    after it: (cache indices, lengths, cumulative lengths)."""
    n = self._chunk
    while True:
      index, length = self._read(t, n)
      length = length.copy()
      length[0] -= o
      cum = np.cumsum(length)
      k = last(cum)
      if k < n - 1:
        return index[: k + 1], length[: k + 1], cum[: k + 1]
      n *= 2

  def _row(self) -> dict[str, np.ndarray]:
    L, t, o = self.ds.seq_len, self._t, self._o
    if self.ds.whole:
      # First fit, one bin: the documents whose lengths add up to at most L (zero-length ones always fit); the
      # first that does not starts the next row.
      index, length, cum = self._take(t, 0, lambda c: int(np.searchsorted(c, L, side='right')))
      index, length = index[:-1], length[:-1]
      self._t, self._o = t + len(index), 0
      starts = np.zeros(len(index), np.int64)
      if self.ds.truncations is not None:
        offsets = self.ds.docs.offsets
        for i in np.flatnonzero(offsets[index + 1] - offsets[index] > L + 1):
          self.ds.truncations.note(
            int(offsets[index[i] + 1] - offsets[index[i]]), functools.partial(self.ds.docs.where, int(index[i]))
          )
    else:
      # Concatenate, then split: documents until L tokens (the last one split), and after an exact fill the
      # zero-length documents that follow (grain adds them to the full row before the next document starts one).
      def count(c):
        k = int(np.searchsorted(c, L, side='left'))
        if k < len(c) and c[k] == L:
          k += int(np.searchsorted(c[k:], L, side='right')) - 1
        return k

      index, length, cum = self._take(t, o, count)
      starts = np.zeros(len(index), np.int64)
      starts[0] = o
      over = int(cum[-1]) - L
      if over > 0:  # the last document continues in the next row
        length[-1] -= over
        self._t, self._o = t + len(index) - 1, int(starts[-1] + length[-1])
      else:
        self._t, self._o = t + len(index), 0
    offsets, ids = self.ds.docs.offsets, self.ds.docs.ids
    total = int(length.sum())
    first = np.cumsum(length) - length
    within = np.arange(total) - np.repeat(first, length)
    at = np.repeat(offsets[index] + starts, length) + within
    row = {k: np.zeros(L, np.int32) for k in ('inputs', 'targets', 'inputs_segment_ids', 'inputs_positions')}
    row['inputs'][:total] = ids[at]
    row['targets'][:total] = ids[at + 1]
    row['inputs_segment_ids'][:total] = np.repeat(np.arange(1, len(index) + 1, dtype=np.int32), length)
    row['inputs_positions'][:total] = within
    if self.ds.docs.loss is not None:
      row['mask'] = np.zeros(L, np.float32)
      row['mask'][:total] = self.ds.docs.loss[at + 1]
    return row

  def __next__(self) -> dict[str, np.ndarray]:
    start = (self._t, self._o)
    row = self._row()
    self._start, self._count = start, (self._count + 1 if self.ds.whole else 1)
    return row

  def get_state(self) -> dict[str, Any]:
    t, o = self._start if not self.ds.whole else (self._t, 0)
    if self.ds.whole:  # grain's first-fit packer: where the next row starts, rows made
      return {'parent': {'next_index': t}, 'next_row': 0, 'counter': self._count}
    if o:
      n = int(self._read(t, 1)[1][0])
      slices = {'inputs': (o, n), 'targets': (o, n)}
    else:
      slices = {'inputs': _EMPTY, 'targets': _EMPTY}
    return {
      'parent_state': {'next_index': t},
      'remainder_slices': slices,
      'elements_from_buffer_after_checkpoint': self._count,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    if self.ds.whole:
      self._t, self._o, self._count = int(state['parent']['next_index']), 0, int(state['counter'])
      return
    t, o = int(state['parent_state']['next_index']), int(tuple(state['remainder_slices']['inputs'])[0])
    self._t, self._o = t, max(o, 0)
    self._start, self._count = (self._t, self._o), 0
    for _ in range(int(state['elements_from_buffer_after_checkpoint'])):
      next(self)


def numpy_packs(source: Any, transform: Any) -> bool:
  """Whether the numpy packer reads `source`: one token cache, read by text.CachedDocument (a mixture of caches and
  documents tokenized as they are read go through grain's packer)."""
  return isinstance(source, token_cache.TokenDocs) and isinstance(transform, text.CachedDocument)


def rows_of(
  source: Any,
  transform: Any,
  docs: grain.MapDataset | None,
  seed: int,
  global_batch: int,
  rows: slice,
  seq_len: int,
  whole: bool,
) -> list[grain.IterDataset]:
  """One packer per row of `rows`: the numpy packer over a token cache, else grain's over `docs` (the stream of
  documents `transform` makes of `source`)."""
  if numpy_packs(source, transform):
    _log_once('data: packing rows from the token cache with numpy (no Python per document)')
    return [
      NumpyRow(source, seed, r, global_batch, seq_len, whole, transform.truncations)
      for r in range(rows.start, rows.stop)
    ]
  _log_once("data: packing rows with grain's packer (documents tokenized as they are read, or a mixture)")
  return grain_rows(docs, global_batch, rows, seq_len, whole)


# --- This process's rows, in this process or in workers -----------------------------------------------------------


class PackedRows(grain.IterDataset):
  """The local batch from one packer per row; state {'parents': [each row's packer state]}. `states`: where the
  rows start (a data position); `with_states`: elements are (batch, the rows' states after it), for InWorkers.
  set_slice is what grain's mp_prefetch calls to give a worker its share (rows[slice])."""

  def __init__(self, rows: Sequence[grain.IterDataset], seq_len: int, states: Sequence[Any] | None = None,
               with_states: bool = False):  # fmt: skip
    super().__init__()
    self.rows, self.seq_len, self.states, self.with_states = list(rows), seq_len, states, with_states

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice  # rows are independent streams: any share packs the same rows
    self.rows = self.rows[sl]
    self.states = None if self.states is None else list(self.states)[sl]

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedRowsIterator(self)


class _PackedRowsIterator(grain.DatasetIterator):
  def __init__(self, ds: PackedRows):
    super().__init__([iter(r) for r in ds.rows])
    self.ds = ds
    if ds.states is not None:
      for it, s in zip(self._parents, ds.states):
        it.set_state(s)

  def __next__(self):
    batch = stack_rows([next(it) for it in self._parents], self.ds.seq_len)
    return (batch, [it.get_state() for it in self._parents]) if self.ds.with_states else batch

  def get_state(self) -> dict[str, Any]:
    return {'parents': [it.get_state() for it in self._parents]}

  def set_state(self, state: dict[str, Any]) -> None:
    for it, s in zip(self._parents, state['parents']):
      it.set_state(s)


def mark_flags_parsed() -> None:
  """grain reads its absl flags to start workers; a library caller's are unparsed."""
  if not absl_flags.FLAGS.is_parsed():
    absl_flags.FLAGS.mark_as_parsed()


class InWorkers(grain.IterDataset):
  """PackedRows in `workers` processes (grain's mp_prefetch): worker w packs rows w, w+W, ... of `rows`, each
  local batch is their parts merged, in order. The state is PackedRows' (the rows' packer states), whatever the
  number of workers; set_state starts the workers again from it."""

  def __init__(self, rows: Sequence[grain.IterDataset], seq_len: int, workers: int, buffer: int = 1):
    super().__init__()
    self.rows, self.seq_len, self.workers, self.buffer = list(rows), seq_len, workers, max(buffer, 1)

  def __iter__(self) -> grain.DatasetIterator:
    return _InWorkersIterator(self)


class WorkersIterator(grain.DatasetIterator):
  """An iterator over a grain pipeline started in worker processes on first use (`_start`, which sets `_it`) and
  restarted from its own state after set_state: its subclasses keep the 0-worker data position, not grain's."""

  _it: grain.DatasetIterator | None = None

  def _start(self) -> grain.DatasetIterator:
    raise NotImplementedError

  def start_prefetch(self) -> None:
    it = self._start()
    if hasattr(it, 'start_prefetch'):
      it.start_prefetch()

  def close(self) -> None:
    if self._it is not None:
      self._it.close()
      self._it = None


class _InWorkersIterator(WorkersIterator):
  def __init__(self, ds: InWorkers):
    super().__init__()
    self.ds, self._it, self._states = ds, None, None

  def _start(self) -> grain.DatasetIterator:
    if self._it is None:
      mark_flags_parsed()
      ds = PackedRows(self.ds.rows, self.ds.seq_len, self._states, with_states=True)
      options = grain.MultiprocessingOptions(num_workers=self.ds.workers, per_worker_buffer_size=self.ds.buffer)
      self._it = iter(ds.mp_prefetch(options))
    return self._it

  def __next__(self) -> dict[str, np.ndarray]:
    it, W = self._start(), self.ds.workers
    parts = [next(it) for _ in range(W)]  # one from each worker, in turn (grain interleaves them in order)
    n = len(self.ds.rows)
    batch = {k: np.empty((n, *v.shape[1:]), v.dtype) for k, v in parts[0][0].items()}
    states = [None] * n
    for w, (part, part_states) in enumerate(parts):
      for k, v in part.items():
        batch[k][w::W] = v
      states[w::W] = part_states
    self._states = states
    return batch

  def get_state(self) -> dict[str, Any]:
    if self._states is None:
      self._states = [iter(r).get_state() for r in self.ds.rows]
    return {'parents': list(self._states)}

  def set_state(self, state: dict[str, Any]) -> None:
    self.close()
    self._states = list(state['parents'])
