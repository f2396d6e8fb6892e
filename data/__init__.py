"""Datasets and input pipelines: per-process slices of deterministic global batches (grain on
random-access sources: `tfds.data_source`, your own files through memory-mapped Arrow caches, or arrays in
memory). docs/data.md and docs/your_data.md list the
datasets, the config.dataset fields and the batch of each task.

  ds = data.build(config)                 # config.dataset for config.task (registry.py)
  trainer.task.check_data(config, ds.example_spec(), ds.vocab, ds.num_classes)  # the task's contract
  rows = data.local_rows(batch_sharding, (B, ...))  # the rows of every global batch this process reads
  it = iter(ds.train_dataset(B, rows, seed))
  data.to_global(next(it), shardings, B)  # -> global jax.Arrays

Modules: registry (the datasets and build), dataset (Dataset), pipeline (grain: shuffling, per-process
rows, packing, global arrays), markov (offline Markov languages), tokens (tokenizers, and how text becomes ids for
training and decoding alike), text (text transforms),
vision (image transforms, offline images), tfds_source (opening prepared TFDS datasets, offline), token_cache
(language-model documents tokenized once into memory-mapped ids, which the packers read), files
(JSON Lines, parquet, text and Hugging Face datasets; docs/your_data.md).
The batch fields, their logical axes, shapes and dtypes belong to the tasks (training/tasks.py).
"""

from data.dataset import Dataset
from data.markov import MarkovLanguage, MarkovText
from data.pipeline import eval_batches, local_rows, to_global, train_dataset
from data.registry import build, vocabulary
from data.text import lm_example

__all__ = [
  'Dataset',
  'MarkovLanguage',
  'MarkovText',
  'build',
  'eval_batches',
  'lm_example',
  'local_rows',
  'to_global',
  'train_dataset',
  'vocabulary',
]
