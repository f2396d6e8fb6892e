"""Input pipelines on grain: per-process slices of a deterministic global batch, assembled into jax.Arrays.

Global batch g holds examples [g*B, (g+1)*B) of the shuffled stream, whatever the number of
processes: each process reads only the rows its devices hold (`partitioning.local_rows`), so the
batches are the same on 1 device or 8, on 1 process or many.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from partitioning import ConfigError


def _check_rows(rows: slice, global_batch: int) -> int:
  local = rows.stop - rows.start
  if global_batch % local or rows.start % local:
    raise ValueError(f'process rows {rows} do not tile a global batch of {global_batch}')
  return local


def train_dataset(source: Any, global_batch: int, rows: slice, seed: int,
                  transform: Callable[[np.ndarray], Mapping[str, np.ndarray]],
                  prefetch: int = 4) -> grain.IterDataset:
  """Infinite, reshuffled-per-epoch stream of this process's part of each global batch.

  The returned dataset's iterator supports get_state()/set_state() for exact resumption.
  """
  local = _check_rows(rows, global_batch)
  if len(source) < global_batch:
    raise ConfigError(f'the training split has {len(source)} examples, fewer than one global batch ({global_batch})')
  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat()
  ds = ds.batch(local, drop_remainder=True)[rows.start // local::global_batch // local]
  ds = ds.map(transform)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch))


def eval_batches(source: Any, global_batch: int, rows: slice,
                 transform: Callable[[np.ndarray], Mapping[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
  """The whole split in order; the last global batch is padded and its padding rows get mask 0."""
  local = _check_rows(rows, global_batch)
  n = len(source)
  for start in range(0, n, global_batch):
    idx = np.arange(start + rows.start, start + rows.start + local)
    valid = idx < n
    examples = np.stack([np.asarray(source[int(i)]) for i in np.where(valid, idx, 0)])
    batch = dict(transform(examples))
    batch['mask'] = batch['mask'] * valid.reshape((-1,) + (1,) * (batch['mask'].ndim - 1))
    yield batch


def to_global(local_batch: Mapping[str, np.ndarray], shardings: Mapping[str, NamedSharding],
              global_batch: int) -> dict[str, jax.Array]:
  """Assembles per-process numpy batches into global jax.Arrays on the batch sharding."""
  return {k: jax.make_array_from_process_local_data(shardings[k], v, (global_batch,) + v.shape[1:])
          for k, v in local_batch.items()}
