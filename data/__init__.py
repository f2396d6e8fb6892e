"""Datasets and input pipelines. `config.dataset.name` picks the dataset; `build(config)` returns a Dataset.

Offline datasets (no files; deterministic from config.dataset.seed):
  'markov'            LM on an order-2 Markov language with a known entropy floor (task 'lm')
  'synthetic_images'  class patterns + noise (task 'classification')
  'markov_text'       labelled strings from several Markov languages, variable lengths
                      (tasks 'lm', 'mlm', 'text_classification')
TFDS datasets, prepared in config.dataset.data_dir (see README): mnist, cifar10, imagenet2012
('classification'), lm1b, c4 ('lm', 'mlm'), and any other TFDS dataset with 'image' + 'label' or a
text feature (`text_key`, default 'text'; plus 'label' for 'text_classification').

Batch fields per task (per global batch of B; the task in training/tasks.py owns this contract, and
`Dataset.example_spec()` says what a dataset makes, for the task's `check_data`):
  lm                   inputs, targets int32 (B, L); mask float32 (B, L); packed text
                       (config.dataset.pack=True) adds segment_ids (1, 2, .. per document in a row,
                       0 = padding) and positions (within the document), int32 (B, L)
  classification       image float32 (B, H, W, C) normalised; label int32 (B,); mask float32 (B,)
  mlm                  inputs (with [MASK]s), targets (original), input_mask (1 = real token),
                       token_types int32 (B, L); mask float32 (B, L) (1 = predict here)
  text_classification  inputs, input_mask, token_types int32 (B, L); label int32 (B,); mask float32 (B,)
In eval batches, padding rows have mask 0.

config.dataset fields: name, data_dir, train_split, eval_split, seq_len, image_size, channels,
num_classes, tokenizer ('byte' or a local Hugging Face tokenizer directory), pack, augment, text_key,
mlm_probability, num_threads, prefetch, and the offline datasets' own (num_train, num_eval, seed, ...).
Missing fields take the dataset's defaults.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grain
import ml_collections
import numpy as np

from errors import ConfigError
from data import pipeline, text, tfds_source, vision
from data.markov import MarkovLanguage, MarkovText
from data.pipeline import eval_batches, to_global, train_dataset

__all__ = ['Dataset', 'MarkovLanguage', 'MarkovText', 'build', 'eval_batches', 'lm_example', 'to_global',
           'train_dataset']

OFFLINE = ('markov', 'markov_text', 'synthetic_images')
TEXT_TASKS = ('lm', 'mlm', 'text_classification')
# Defaults for well-known TFDS datasets (any field can be set in config.dataset instead).
TFDS_DEFAULTS = {
    'mnist': dict(eval_split='test', augment='none', mean=(0.1307,), std=(0.3081,)),
    'cifar10': dict(eval_split='test', augment='crop_flip', mean=(0.4914, 0.4822, 0.4465),
                    std=(0.2470, 0.2435, 0.2616)),
    'imagenet2012': dict(eval_split='validation', augment='inception_crop', image_size=224,
                         mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    'lm1b': dict(eval_split='test'),
    'c4': dict(eval_split='validation'),
}


def lm_example(seqs: np.ndarray) -> dict[str, np.ndarray]:
  """Next-token prediction: inputs are tokens[:-1], targets tokens[1:], every target counted."""
  seqs = np.asarray(seqs)
  return {'inputs': seqs[..., :-1].astype(np.int32), 'targets': seqs[..., 1:].astype(np.int32),
          'mask': np.ones(seqs[..., 1:].shape, np.float32)}


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
  num_threads: int = 1
  prefetch: int = 4
  description: str = ''
  language: MarkovLanguage | None = None  # 'markov': the true language (entropy floor, sample NLL)
  tokenizer: Any = None
  vocab: tuple[int, str] | None = None  # token datasets: (number of ids, what emits them)
  num_classes: int | None = None  # labelled datasets: labels are below this

  def train_dataset(self, global_batch: int, rows: slice, seed: int) -> grain.IterDataset:
    """This process's `rows` of every global batch, forever; `iter()` of it has get_state/set_state."""
    if self.pack_len:
      return pipeline.packed_train_dataset(self.train, global_batch, rows, seed, self.transform, self.pack_len,
                                           prefetch=self.prefetch)
    return pipeline.train_dataset(self.train, global_batch, rows, seed, self.transform,
                                  num_threads=self.num_threads, prefetch=self.prefetch)

  def eval_batches(self, global_batch: int, rows: slice) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of the whole eval split; padding rows have mask 0."""
    t = self.eval_transform or self.transform
    if self.pack_len:
      return pipeline.packed_eval_batches(self.eval, global_batch, rows, t, self.pack_len)
    return pipeline.eval_batches(self.eval, global_batch, rows, t, num_threads=self.num_threads,
                                 prefetch=self.prefetch)

  def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Field -> (shape, dtype) of one example as the pipelines make it, measured on the first train and
    eval examples (their transforms must agree)."""
    train = pipeline.example_spec(self.train, self.transform, self.pack_len)
    eval_ = pipeline.example_spec(self.eval, self.eval_transform or self.transform, self.pack_len)
    if train != eval_:
      raise ConfigError(f'dataset {self.name!r} makes train examples {train} but eval examples {eval_}')
    return train


def _opt(cfg: ml_collections.ConfigDict, key: str, default: Any = None) -> Any:
  value = cfg.get(key)
  return default if value is None else value


def _seq_len(cfg: ml_collections.ConfigDict, task: str) -> int:
  """LM needs one input and one target; BERT rows need [CLS] and [SEP] around at least one token."""
  L, minimum = cfg.get('seq_len'), 2 if task == 'lm' else 3
  if not isinstance(L, int) or L < minimum:
    raise ConfigError(f'config.dataset.seq_len={L!r}: must be an integer >= {minimum}')
  return L


def _check_task(name: str, task: str, serves: tuple[str, ...]) -> None:
  if task not in serves:
    raise ConfigError(f'config.task={task!r} does not fit dataset {name!r}, which serves {list(serves)}')


def _text_dataset(cfg, task: str, name: str, train: Any, eval_: Any, where: str,
                  num_classes: int | None = None) -> Dataset:
  """Tokenizer, then the task's transform: packed or per-row LM documents, MLM masking, or classification."""
  L = _seq_len(cfg, task)
  tok = text.tokenizer(_opt(cfg, 'tokenizer', 'byte'))
  key = _opt(cfg, 'text_key', 'text')
  pack = bool(cfg.get('pack', False))
  if pack and task != 'lm':
    raise ConfigError(f'config.dataset.pack=True packs documents for task lm, not {task!r}')
  if task == 'lm':
    if tok.eos_id is None:
      raise ConfigError(f'tokenizer {tok.name!r} has no end-of-text token: LM documents need one')
    transform = text.LMDocument(tok, key) if pack else text.LMRow(tok, L, key)
    layout = f'packed rows of {L} tokens' if pack else f'one document per row (truncated to {L} tokens)'
  elif task == 'mlm':
    if tok.mask_id is None:
      raise ConfigError(f'tokenizer {tok.name!r} has no mask token: task mlm needs one')
    prob = _opt(cfg, 'mlm_probability', 0.15)
    transform, layout = text.MaskTokens(tok, L, prob, key), f'rows of {L} tokens, {prob:.0%} masked'
  else:
    transform, layout = text.ClassifyText(tok, L, key), f'rows of {L} tokens'
  return Dataset(name, train, eval_, transform, pack_len=L if pack else None,
                 num_threads=_opt(cfg, 'num_threads', 1), prefetch=_opt(cfg, 'prefetch', 4), tokenizer=tok,
                 vocab=(tok.vocab_size, f'the {tok.name} tokenizer'),
                 num_classes=num_classes if task == 'text_classification' else None,
                 description=f'{name} ({where}): train {len(train):,} / eval {len(eval_):,} documents; '
                             f'{tok.name} tokenizer ({tok.vocab_size} ids); {layout}')


def _image_dataset(cfg, name: str, train: Any, eval_: Any, where: str, *, size: int, channels: int,
                   num_classes: int, augment: str, mean: Any, std: Any) -> Dataset:
  for key, actual in (('channels', channels), ('num_classes', num_classes)):
    if cfg.get(key) is not None and cfg.get(key) != actual:
      raise ConfigError(f'config.dataset.{key}={cfg.get(key)} but {name} has {actual}')
  if augment not in vision.AUGMENTATIONS:
    raise ConfigError(f'config.dataset.augment={augment!r}; choose one of {list(vision.AUGMENTATIONS)}')
  if not isinstance(size, int) or size < 1:
    raise ConfigError(f'config.dataset.image_size={size!r}: must be a positive integer')
  return Dataset(name, train, eval_,
                 vision.TrainImages(size, augment, mean, std), vision.EvalImages(size, augment, mean, std),
                 num_threads=_opt(cfg, 'num_threads', 1), prefetch=_opt(cfg, 'prefetch', 4), num_classes=num_classes,
                 description=f'{name} ({where}): train {len(train):,} / eval {len(eval_):,} images, '
                             f'{size}x{size}x{channels}, {num_classes} classes; train augmentation {augment}')


def _offline(cfg, task: str) -> Dataset:
  name, seed = cfg.name, _opt(cfg, 'seed', 0)
  if name == 'markov':
    _check_task(name, task, ('lm',))
    if cfg.get('pack'):
      raise ConfigError("config.dataset.pack=True: 'markov' rows are single sequences, there is nothing to pack")
    lang = MarkovLanguage(cfg.vocab_size, cfg.branching, cfg.smoothing, seed)
    n = cfg.seq_len + 1
    return Dataset(name, lang.sample(cfg.num_train, n, seed=seed + 1),
                   lang.sample(cfg.num_eval, n, seed=seed + 2), lm_example, language=lang,
                   vocab=(lang.vocab_size, 'the markov language (config.dataset.vocab_size)'),
                   description=f'markov: {cfg.num_train:,} train / {cfg.num_eval:,} eval sequences of {n} tokens')
  num_train, num_eval = _opt(cfg, 'num_train', 8192), _opt(cfg, 'num_eval', 1000)
  num_classes = _opt(cfg, 'num_classes', 2 if name == 'markov_text' else 10)
  if name == 'synthetic_images':
    _check_task(name, task, ('classification',))
    size, channels = _opt(cfg, 'image_size', 32), _opt(cfg, 'channels', 3)
    make = lambda num, split: vision.SyntheticImages(num, size, channels, num_classes, seed, split,
                                                     _opt(cfg, 'noise', 1.0), _opt(cfg, 'max_shift', 2))
    return _image_dataset(cfg, name, make(num_train, 0), make(num_eval, 1), 'offline', size=size,
                          channels=channels, num_classes=num_classes, augment=_opt(cfg, 'augment', 'none'),
                          mean=(0.5,) * channels, std=(0.25,) * channels)
  _check_task(name, task, TEXT_TASKS)
  L = _seq_len(cfg, task)
  max_len = _opt(cfg, 'max_text_len', L if task == 'lm' else max(1, L - 2))
  make = lambda num, split: MarkovText(num, _opt(cfg, 'min_text_len', max(1, max_len // 4)), max_len, num_classes,
                                       seed, split, _opt(cfg, 'vocab_size', 16), _opt(cfg, 'branching', 4),
                                       _opt(cfg, 'smoothing', 0.03))
  return _text_dataset(cfg, task, name, make(num_train, 0), make(num_eval, 1), 'offline', num_classes)


def _tfds(cfg, task: str) -> Dataset:
  name = cfg.name
  b = tfds_source.builder(name, cfg.get('data_dir') or None, OFFLINE)
  preset, features = TFDS_DEFAULTS.get(name.split('/')[0], {}), b.info.features
  splits = list(b.info.splits)
  default_eval = 'test' if not splits or 'test' in splits else 'validation'
  train_split = _opt(cfg, 'train_split', 'train')
  eval_split = _opt(cfg, 'eval_split', preset.get('eval_split', default_eval))
  key = _opt(cfg, 'text_key', 'text')
  open_ = lambda: (tfds_source.open_split(b, name, train_split, 'train_split'),
                   tfds_source.open_split(b, name, eval_split, 'eval_split'))
  if 'image' in features and 'label' in features:
    _check_task(name, task, ('classification',))
    shape = features['image'].shape
    train, eval_ = open_()
    native = shape[0] if shape[0] is not None and shape[0] == shape[1] else None
    return _image_dataset(cfg, name, train, eval_, f'TFDS, {b.data_dir}',
                          size=_opt(cfg, 'image_size', native or preset.get('image_size', 224)), channels=shape[-1],
                          num_classes=features['label'].num_classes,
                          augment=_opt(cfg, 'augment', preset.get('augment', 'inception_crop' if native is None else 'none')),
                          mean=preset.get('mean', (0.5,) * shape[-1]), std=preset.get('std', (0.5,) * shape[-1]))
  if key in features:
    labelled = 'label' in features
    _check_task(name, task, TEXT_TASKS if labelled else ('lm', 'mlm'))
    if task == 'text_classification' and cfg.get('num_classes') not in (None, features['label'].num_classes):
      raise ConfigError(f"config.dataset.num_classes={cfg.num_classes} but {name} has {features['label'].num_classes}")
    return _text_dataset(cfg, task, name, *open_(), f'TFDS, {b.data_dir}',
                         features['label'].num_classes if labelled else None)
  raise ConfigError(f'TFDS dataset {name!r} has neither image+label nor a {key!r} text feature '
                    f'(its features: {sorted(features)}); set config.dataset.text_key for text datasets')


def build(config: ml_collections.ConfigDict) -> Dataset:
  """The dataset of `config.dataset` for `config.task` (`config.model` is not read: the task checks
  the dataset against the model, `Task.check_data`).

  Passing `config.dataset` alone is accepted for the LM task. Raises ConfigError,
  before anything is read, for an unknown dataset, split, task or a bad size; an unprepared TFDS
  dataset fails at once with the command that prepares it.
  """
  whole = 'dataset' in config
  cfg = config.dataset if whole else config
  task = config.get('task', 'lm') if whole else 'lm'
  ds = _offline(cfg, task) if cfg.name in OFFLINE else _tfds(cfg, task)
  if not len(ds.eval):
    raise ConfigError(f'the eval split of {cfg.name!r} is empty')
  return ds
