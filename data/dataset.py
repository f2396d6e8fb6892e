"""A dataset: random-access train/eval splits and the per-example transforms that make batches of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from data import pipeline
from data.markov import MarkovLanguage
from errors import ConfigError


@dataclasses.dataclass
class Cached:
  """A dataset's documents from its token caches (data/token_cache.py), which the pipelines read instead of the rows
  and their transform: the same batches (tested), without tokenizing as they are read."""

  train: Any  # token_cache.TokenDocs (or a pipeline.Mixture of them)
  eval: Any
  transform: pipeline.Transform  # a cached document -> what `Dataset.transform` makes of its row


@dataclasses.dataclass
class Dataset:
  """Random-access train/eval splits and the per-example transforms that make batch fields of them.

  It declares no field list: `example_spec()` measures what it makes, and the task checks that
  (training.tasks.Task.check_data), with `vocab` and `num_classes`, against itself and the model.
  """

  name: str
  train: Any  # random-access examples
  eval: Any
  transform: pipeline.Transform  # per example (for packed text: example -> one tokenized document)
  eval_transform: pipeline.Transform | None = None  # default: transform
  pack_len: int | None = None  # packed text: rows of this many tokens
  pack_whole: bool = False  # packed documents with a loss mask: never split across rows (packing.grain_row)
  cached: Cached | None = None  # token caches, read instead of train/eval and the transforms where set
  num_threads: int = 1
  num_workers: int = 0  # train batches made (packed: their rows packed) in this many worker processes
  prefetch: int = 4
  description: str = ''
  language: MarkovLanguage | None = None  # 'markov': the true language (entropy floor, sample NLL)
  tokenizer: Any = None
  vocab: tuple[int, str] | None = None  # token datasets: (number of ids, what emits them)
  num_classes: int | None = None  # labelled datasets: labels are below this
  prompt: tuple[str, str] | None = None  # language data: generate.py's flag and text for a prompt like its eval rows'

  def reads(self, split: str) -> tuple[Any, pipeline.Transform]:
    """(source, transform) the pipelines read for 'train' or 'eval': the token caches where there are, else the
    rows and their transforms."""
    if self.cached is not None:
      return getattr(self.cached, split), self.cached.transform
    if split == 'eval':
      return self.eval, self.eval_transform or self.transform
    return self.train, self.transform

  def train_dataset(self, global_batch: int, rows: slice, seed: int) -> grain.IterDataset:
    """This process's `rows` of every global batch, forever; `iter()` of it has get_state/set_state."""
    source, transform = self.reads('train')
    if self.pack_len:
      return pipeline.packed_train_dataset(
        source,
        global_batch,
        rows,
        seed,
        transform,
        self.pack_len,
        prefetch=self.prefetch,
        whole=self.pack_whole,
        num_workers=self.num_workers,
      )
    return pipeline.train_dataset(
      source,
      global_batch,
      rows,
      seed,
      transform,
      num_threads=self.num_threads,
      prefetch=self.prefetch,
      num_workers=self.num_workers,
    )

  def train_iterator(self, global_batch: int, rows: slice, seed: int) -> pipeline.RowsIterator:
    """An iterator of train_dataset whose position resumes with any number of processes (checkpointed)."""
    return pipeline.RowsIterator(self.train_dataset(global_batch, rows, seed), rows, global_batch, bool(self.pack_len))

  def eval_batches(self, global_batch: int, rows: slice) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of the whole eval split; padding rows have mask 0."""
    source, t = self.reads('eval')
    if self.pack_len:
      return pipeline.packed_eval_batches(source, global_batch, rows, t, self.pack_len, whole=self.pack_whole)
    return pipeline.eval_batches(source, global_batch, rows, t, num_threads=self.num_threads, prefetch=self.prefetch)

  def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Field -> (shape, dtype) of one example as the pipelines make it, measured on the first train and
    eval examples (their transforms must agree)."""
    whole = self.pack_whole
    train = pipeline.example_spec(
      *self.reads('train'), self.pack_len, what=f'the train split of {self.name!r}', whole=whole
    )
    eval_ = pipeline.example_spec(
      *self.reads('eval'), self.pack_len, what=f'the eval split of {self.name!r}', whole=whole
    )
    if train != eval_:
      raise ConfigError(f'dataset {self.name!r} makes train examples {train} but eval examples {eval_}')
    return train
