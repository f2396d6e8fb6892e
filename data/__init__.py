"""Datasets and input pipelines. `config.dataset.name` picks the dataset.

Offline datasets (no downloads): 'markov', an order-2 Markov language with a known entropy floor.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np

from data.markov import MarkovLanguage
from data.pipeline import eval_batches, to_global, train_dataset
from partitioning import ConfigError

__all__ = ['Dataset', 'MarkovLanguage', 'build', 'eval_batches', 'lm_example', 'to_global', 'train_dataset']


def lm_example(seqs: np.ndarray) -> dict[str, np.ndarray]:
  """Next-token prediction: inputs are tokens[:-1], targets tokens[1:], every target counted."""
  seqs = np.asarray(seqs)
  return {'inputs': seqs[..., :-1].astype(np.int32), 'targets': seqs[..., 1:].astype(np.int32),
          'mask': np.ones(seqs[..., 1:].shape, np.float32)}


@dataclasses.dataclass
class Dataset:
  train: Any  # random-access source of examples
  eval: Any
  transform: Callable[[np.ndarray], Mapping[str, np.ndarray]]
  language: MarkovLanguage | None = None


def build(cfg: ml_collections.ConfigDict) -> Dataset:
  if cfg.name == 'markov':
    lang = MarkovLanguage(cfg.vocab_size, cfg.branching, cfg.smoothing, cfg.seed)
    n = cfg.seq_len + 1
    return Dataset(train=lang.sample(cfg.num_train, n, seed=cfg.seed + 1),
                   eval=lang.sample(cfg.num_eval, n, seed=cfg.seed + 2),
                   transform=lm_example, language=lang)
  raise ConfigError(f"config.dataset.name={cfg.name!r} is not a known dataset; known: ['markov']")
