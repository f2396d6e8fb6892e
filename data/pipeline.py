"""Input pipelines on grain: per-process slices of a deterministic global batch, assembled into jax.Arrays.

Why grain on random-access sources (`tfds.data_source`, or arrays in memory) rather than
`tfds.load` + tf.data:
* Random access makes the batch layout a pure function of (seed, step): global batch g holds
  examples [g*B, (g+1)*B) of one shuffled index stream (grain's index shuffle, reshuffled each
  epoch), whatever the number of processes or devices. Each process reads only the rows its
  devices hold (`local_rows`) and nothing else. tf.data shards by files or by
  `shard(process_count)`, which changes the order when the number of processes changes.
* Resumption is exact and cheap: the iterator state is a few integers (the next index; for
  packed text, also the position inside one document), JSON-serialisable, so a resumed run sees
  exactly the batches an uninterrupted run would have. tf.data checkpoints whole shuffle buffers.
* The pipelines never import TensorFlow: `tfds.data_source` reads array_record files and decodes
  with numpy/PIL (checked for JPEG images and text). TensorFlow is still needed to prepare datasets
  (`tfds build`), and train.py loads it anyway, through clu's TensorBoard metric writer.

Sharding, shuffling, repetition, batching, threads and prefetching are grain's; this module only
chooses the indices. Global batches become jax.Arrays with `jax.make_array_from_process_local_data`.

Packed text (language modelling): a row of the global batch is a stream of its own. Row r of every
global batch is cut from documents r, r+B, r+2B, ... of the shuffled document stream by grain's
ConcatThenSplit packer (documents are concatenated into rows of `seq_len`, a document that does not
fit continues in the next row of the same stream). So the packing depends on the seed and the
global batch size only, never on the number of processes, and a process packs only the documents
of its own rows. (Packing one global stream and slicing rows would make every process read every
document; packing per process would make the batches depend on the process count.) Documents with a loss
mask (prompt/completion pairs, chats) are packed whole instead: one that does not fit the rest of a row
starts the next (grain's first-fit packer with one bin), so an answer never loses its prompt.

Language-model documents are read from their token cache where they have one (token_cache.py: ids tokenized
once, memory-mapped), so the packers do no tokenizing, and packing.py's numpy packer makes those rows with no Python
per document; the batches are the same either way. packing.py also packs the rows in worker processes
(config.dataset.num_workers).

Mixtures: several sources, each shuffled and repeated on its own, interleaved by weight (grain's
MapDataset.mix); the result is one random-access stream, so all of the above holds for it unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from grain import experimental as grain_exp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

import partitioning
from data import packing
from errors import CheckpointError, ConfigError, ShardingError

# A per-example transform: a callable or grain.transforms.Map (example -> dict of arrays), or a
# grain.transforms.RandomMap, whose numpy Generator is seeded by (seed, index in the stream).
Transform = Callable[[Any], Mapping[str, np.ndarray]] | grain.transforms.Map | grain.transforms.RandomMap


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
  """The rows of a global batch this process reads: the contiguous range of leading-axis rows its
  devices hold of an array of `global_shape` with `sharding` (the batch field's)."""
  starts, one_block = partitioning.leading_rows(
    sharding.addressable_devices_indices_map(global_shape).values(), global_shape[0]
  )
  if not one_block:
    raise ShardingError(
      f'this process holds non-contiguous batch rows {starts} of a global batch of {global_shape[0]}; '
      'order the mesh so each process owns a contiguous block of the batch axes'
    )
  return slice(starts[0][0], starts[-1][1])


def _spans(rows: Sequence[int]) -> list[tuple[int, int]]:
  """[0, 1, 2, 5] -> [(0, 3), (5, 6)]: sorted rows as half-open runs."""
  runs = []
  for r in rows:
    if runs and runs[-1][1] == r:
      runs[-1] = (runs[-1][0], r + 1)
    else:
      runs.append((r, r + 1))
  return runs


def _check_rows(rows: slice, global_batch: int) -> int:
  local = rows.stop - rows.start
  if global_batch % local or rows.start % local:
    raise ValueError(f'process rows {rows} do not tile a global batch of {global_batch}')
  return local


class Mixture:
  """Several training sources drawn from in proportion to `weights`, each shuffled (reshuffled every epoch) and
  repeated on its own, then interleaved by grain's MapDataset.mix: still a random-access stream, so per-process
  rows and data positions work as for one source. Indexing it directly (example_spec) reads the sources one after
  another."""

  def __init__(self, sources: Sequence[Any], weights: Sequence[float]):
    self.sources, self.weights = list(sources), [float(w) for w in weights]
    self._starts = np.cumsum([0] + [len(s) for s in self.sources])

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, i: int) -> Any:
    k = int(np.searchsorted(self._starts, int(i), side='right')) - 1
    return self.sources[k][int(i) - int(self._starts[k])]


def _stream(source: Any, seed: int) -> grain.MapDataset:
  """The endless training stream of `source`: shuffled, reshuffled every epoch (a Mixture: per source)."""
  if isinstance(source, Mixture):
    parts = [grain.MapDataset.source(s).shuffle(seed=seed + k).repeat() for k, s in enumerate(source.sources)]
    return grain.MapDataset.mix(parts, source.weights)
  return grain.MapDataset.source(source).shuffle(seed=seed).repeat()


def _apply(ds: grain.MapDataset, transform: Transform, seed: int) -> grain.MapDataset:
  if isinstance(transform, grain.transforms.RandomMap):
    return ds.random_map(transform, seed=seed)
  return ds.map(transform)


def _stack(examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """A batch of examples, field by field; examples whose fields differ in shape or dtype (a bad record) are one
  ConfigError naming the field and both layouts, instead of numpy's stacking error deep in a prefetch thread."""
  first = examples[0]
  for i, ex in enumerate(examples[1:], start=1):
    if ex.keys() != first.keys():
      raise ConfigError(f'examples of one batch have different fields: {sorted(first)} and {sorted(ex)}')
    for k, v in ex.items():
      a, b = np.asarray(first[k]), np.asarray(v)
      if a.shape != b.shape or a.dtype != b.dtype:
        raise ConfigError(
          f'examples of one batch differ in field {k!r}: {a.dtype.name} {a.shape} and {b.dtype.name} '
          f'{b.shape} (example {i} of the batch): a record of the dataset does not transform to '
          'the layout of the others'
        )
  return {k: np.stack([np.asarray(ex[k]) for ex in examples]) for k in first}


def _read_options(num_threads: int, prefetch: int) -> grain.ReadOptions:
  return grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)


class BatchesInWorkers(grain.IterDataset):
  """Local batches (`batches[i]`: the i-th this process reads) made in `workers` processes (grain's mp_prefetch:
  worker w makes batches w, w+W, ...; they come back in order), with the position a thread-made stream of them has
  ({'next_index': batches read}), so that it resumes with any number of workers; set_state starts them again
  there."""

  def __init__(self, batches: grain.MapDataset, workers: int):
    super().__init__()
    self.batches, self.workers = batches, workers

  def __iter__(self) -> grain.DatasetIterator:
    return _BatchesInWorkersIterator(self)


class _BatchesInWorkersIterator(packing.WorkersIterator):
  def __init__(self, ds: BatchesInWorkers):
    super().__init__()
    self.ds, self._it, self._next = ds, None, 0

  def _start(self) -> grain.DatasetIterator:
    if self._it is None:
      packing.mark_flags_parsed()
      read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)
      ds = self.ds.batches[self._next :].to_iter_dataset(read)
      self._it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.ds.workers)))
    return self._it

  def __next__(self) -> Any:
    batch = next(self._start())
    self._next += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {'next_index': self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    self.close()
    self._next = int(state['next_index'])


def train_dataset(
  source: Any,
  global_batch: int,
  rows: slice,
  seed: int,
  transform: Transform,
  *,
  num_threads: int = 1,
  prefetch: int = 4,
  num_workers: int = 0,
) -> grain.IterDataset:
  """Infinite, reshuffled-per-epoch stream of this process's rows of each global batch.

  `transform` runs per example, only on the examples this process reads (grain is lazy), in
  `num_threads` background threads with `prefetch` local batches buffered, or with `num_workers` > 0 in that many
  worker processes (BatchesInWorkers: each makes every num_workers-th local batch, in order), for
  transforms that hold the GIL (image decoding and augmentation in PIL and numpy) and so do not scale with threads.
  The iterator supports get_state()/set_state() (JSON-serialisable: the number of batches read) for exact
  resumption with any num_workers.
  """
  local = _check_rows(rows, global_batch)
  if len(source) < global_batch:
    raise ConfigError(f'the training split has {len(source)} examples, fewer than one global batch ({global_batch})')
  ds = _apply(_stream(source, seed), transform, seed)
  ds = ds.batch(local, drop_remainder=True, batch_fn=_stack)[rows.start // local :: global_batch // local]
  if num_workers:
    return BatchesInWorkers(ds, num_workers)
  return ds.to_iter_dataset(_read_options(num_threads, prefetch))


def eval_batches(
  source: Any,
  global_batch: int,
  rows: slice,
  transform: Transform,
  *,
  seed: int = 0,
  num_threads: int = 1,
  prefetch: int = 4,
) -> Iterator[dict[str, np.ndarray]]:
  """The whole split in order; the last global batch is padded and its padding rows get mask 0."""
  local = _check_rows(rows, global_batch)
  examples = _apply(grain.MapDataset.source(source), transform, seed)
  n = len(examples)

  def masked(i: int) -> dict[str, np.ndarray]:
    ex = dict(examples[min(i, n - 1)])
    ex['mask'] = ex['mask'] * np.float32(i < n)
    return ex

  ds = grain.MapDataset.range(math.ceil(n / global_batch) * global_batch).map(masked)
  ds = ds.batch(local, batch_fn=_stack)[rows.start // local :: global_batch // local]
  return iter(ds.to_iter_dataset(_read_options(num_threads, prefetch)))


def packed_train_dataset(
  source: Any,
  global_batch: int,
  rows: slice,
  seed: int,
  tokenize: Transform,
  seq_len: int,
  *,
  prefetch: int = 4,
  whole: bool = False,
  num_workers: int = 0,
) -> grain.IterDataset:
  """Infinite stream of this process's rows of packed global batches (see the module docstring).

  `tokenize` maps an example to one document {'inputs': ids[:-1], 'targets': ids[1:]}; rows hold
  inputs, targets, mask, segment_ids (1, 2, .. per document in a row, 0 = padding) and positions
  (within the document). `whole`: documents carry a loss mask ('mask') and are never split (packing.grain_row).
  Packing runs in one background thread with `prefetch` batches buffered, or with `num_workers` > 0 in that many
  worker processes (at most one per row; packing.InWorkers): the same batches and data positions either way.
  """
  local = _check_rows(rows, global_batch)
  if len(source) < global_batch:
    raise ConfigError(
      f'the training split has {len(source)} documents, fewer than one global batch '
      f'({global_batch}): every row of a batch packs documents of its own'
    )
  docs = _apply(_stream(source, seed), tokenize, seed)
  packers = packing.rows_of(source, tokenize, docs, seed, global_batch, rows, seq_len, whole)
  if num_workers:
    return packing.InWorkers(packers, seq_len, min(num_workers, local), prefetch)
  return grain_exp.ThreadPrefetchIterDataset(packing.PackedRows(packers, seq_len), prefetch_buffer_size=prefetch)


def packed_eval_batches(
  source: Any, global_batch: int, rows: slice, tokenize: Transform, seq_len: int, *, seed: int = 0, whole: bool = False
) -> Iterator[dict[str, np.ndarray]]:
  """Every document of the split, packed in order; rows whose stream has ended are padding (mask 0).

  Streams end at different batches, so the processes agree on the last batch (one tiny
  all-gather per batch when there are several processes): every process runs every eval step.
  """
  _check_rows(rows, global_batch)
  docs = _apply(grain.MapDataset.source(source), tokenize, seed)
  streams = [iter(s) for s in packing.grain_rows(docs, global_batch, rows, seq_len, whole)]
  while True:
    batch = tuple(next(s, None) for s in streams)
    more = any(r is not None for r in batch)
    if jax.process_count() > 1:
      more = bool(np.any(multihost_utils.process_allgather(np.int32(more))))
    if not more:
      return
    yield packing.stack_rows(batch, seq_len)


def example_spec(
  source: Any,
  transform: Transform,
  pack_len: int | None = None,
  *,
  seed: int = 0,
  what: str = 'the split',
  whole: bool = False,
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Field -> (shape, dtype) of the first example of `source` as the pipeline makes it (for packed
  text, `transform` makes a document and the example is the first packed row)."""
  examples = _apply(grain.MapDataset.source(source), transform, seed)
  if not len(examples):
    raise ConfigError(f'{what} is empty: no examples to train or evaluate on')
  if pack_len:
    row = next(iter(packing.grain_rows(examples, 1, slice(0, 1), pack_len, whole)[0]))
    example = {k: v[0] for k, v in packing.stack_rows((row,), pack_len).items()}
  else:
    example = examples[0]
  return {k: (np.shape(v), np.asarray(v).dtype) for k, v in example.items()}


def to_global(
  local_batch: Mapping[str, np.ndarray], shardings: Mapping[str, NamedSharding], global_batch: int
) -> dict[str, jax.Array]:
  """Assembles per-process numpy batches into global jax.Arrays on the batch sharding."""
  return {
    k: jax.make_array_from_process_local_data(shardings[k], v, (global_batch,) + v.shape[1:])
    for k, v in local_batch.items()
  }


class RowsIterator:
  """This process's rows of every global batch (an iterator of a train_dataset or packed_train_dataset), with a
  data position that any number of processes can resume.

  get_state() says which rows of which global batch size it holds: {'global_batch', 'rows': [lo, hi], 'packed',
  'state': grain's state}. set_state() takes those of every process of the run that saved them (in any
  layout) and picks this process's rows: unpacked, the position is the number of global batches consumed,
  the same in every process; packed, each row is a stream of its own (the packer's state per row).
  """

  def __init__(self, dataset: grain.IterDataset, rows: slice, global_batch: int, packed: bool):
    self._it = iter(dataset)
    self.rows, self.global_batch, self.packed = rows, global_batch, packed

  def __iter__(self) -> RowsIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def close(self) -> None:
    self._it.close()

  def start_prefetch(self) -> None:
    if hasattr(self._it, 'start_prefetch'):
      self._it.start_prefetch()

  def get_state(self) -> dict[str, Any]:
    return {
      'global_batch': self.global_batch,
      'rows': [self.rows.start, self.rows.stop],
      'packed': self.packed,
      'state': self._it.get_state(),
    }

  def set_grain_state(self, state: Any) -> None:
    """grain's own state of this iterator (a checkpoint written before positions named their rows)."""
    self._it.set_state(state)

  def check_batch(self, saved: Iterable[Mapping[str, Any]]) -> None:
    """CheckpointError where a saved position is for another global batch or packing than this run reads."""
    for s in saved:
      if s.get('global_batch') != self.global_batch or bool(s.get('packed')) != self.packed:
        raise CheckpointError(
          f'the saved data position is for a global batch of {s.get("global_batch")} '
          f'({"packed" if s.get("packed") else "unpacked"}); this run reads {self.global_batch} '
          f'({"packed" if self.packed else "unpacked"}): resume with the batch size it was saved with'
        )

  def set_state(self, saved: Sequence[Mapping[str, Any]]) -> None:
    """`saved`: the get_state() of every process that saved (each covers some rows). CheckpointError, naming what
    differs, when they are not one position of this dataset and global batch."""
    self.check_batch(saved)
    # Processes whose devices hold the same rows (a batch not split over an axis that spans processes: tensor or
    # context parallelism across hosts) each saved those rows; they must agree on them.
    per_row = {}  # row -> its packer's state (packed) or None
    for s in saved:
      span = range(*s['rows'])
      for r, state in zip(span, s['state']['parents'] if self.packed else [None] * len(span)):
        if r in per_row and per_row[r] != state:
          raise CheckpointError(
            f'two processes that read row {r} of the global batch saved different data '
            f'positions for it: {per_row[r]} and {state}'
          )
        per_row[r] = state
    missing = [r for r in range(self.global_batch) if r not in per_row]
    if missing or len(per_row) != self.global_batch:
      covered = sorted({(s['rows'][0], s['rows'][1]) for s in saved})
      raise CheckpointError(
        f'the saved data position covers rows {covered} of a global batch of {self.global_batch}'
        + (
          f', not rows {_spans(missing)} (a process file missing?)'
          if missing
          else ', rows beyond it (a file of another run?)'
        )
      )
    if not self.packed:  # the next global batch, the same for every process
      positions = {json.dumps(s['state'], sort_keys=True) for s in saved}
      if len(positions) > 1:
        raise CheckpointError(f'the processes saved different data positions: {sorted(positions)}')
      self._it.set_state(saved[0]['state'])
      return
    self._it.set_state({**saved[0]['state'], 'parents': [per_row[r] for r in range(self.rows.start, self.rows.stop)]})
