"""Tasks: what a batch holds, its logical axes, and the loss/metrics a model is trained on.

A task owns its batch contract: the fields, their logical axes (`fields`), their per-example shapes
and dtypes (`example_shapes`), and whether a dataset's token ids and labels fit the model
(`check_data`). Datasets (the `data` package) declare none of it: they say what they make, and
`check_data` compares.

A model returns logits, or (logits, aux) where aux is a dict of scalars; `aux['aux_loss']` (e.g. an
MoE load-balancing loss, already weighted) is added to the training loss, every aux entry is logged.

Language models with `config.model.loss_chunks` > 1 (`model.loss_chunks`) are scored in chunks along the
length (`xent.chunked_softmax_xent`): the model gives its final hidden states (`model.hidden_states`, the same
(x, aux) convention) and its output head as a function of them (`model.head`), so the (B, L, V) logits
never exist in full, in the forward pass or the backward.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import schema
from errors import ConfigError
from partitioning import context
from training import xent

Metrics = dict[str, jax.Array]
FieldSpec = dict[str, tuple[tuple[int, ...], Any]]


def split_output(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
  return out if isinstance(out, tuple) else (out, {})


def eval_view(model: nnx.Module) -> nnx.Module:
  """The model in inference mode: BatchNorm uses running statistics, dropout is off."""
  return nnx.view(model, use_running_average=True, deterministic=True, raise_if_not_found=False)


class Task:
  """Subclasses define `batch_axes`, `example_shapes`, `forward` (model, batch) -> (logits, aux)
  and `per_example` (logits, batch) -> (loss, correct, weight) arrays of the mask's shape."""

  batch_axes: dict[str, tuple[str, ...]]
  unit = 'examples'  # what throughput is counted in
  unit_field = 'mask'
  progress: tuple[str, ...] = ()  # logged metrics the progress line shows after loss and accuracy

  def __init__(self, config: Any = None):
    self.config = config

  def data_batch(self, config: Any) -> int:
    """Examples the dataset gives per step (the global batch; GRPO: prompts, each sampled group_size times)."""
    return config.batch_size

  def task_state(self, config: Any) -> tuple[str, ...]:
    """What the train state keeps for this task besides the model and optimizer (TrainState.task_state's keys):
    'reference', a frozen copy of the starting parameters; 'rollout', the batch of samples being trained on."""
    return ()

  def fields(self, config: Any) -> dict[str, tuple[str, ...]]:
    """Batch field -> its logical axes (the first is 'batch')."""
    return dict(self.batch_axes)

  def check_data(
    self, config: Any, produced: FieldSpec, vocab: tuple[int, str] | None = None, num_classes: int | None = None
  ) -> None:
    """The one check of a dataset against this task and the model, before anything compiles.

    `produced`: field -> (shape, dtype) of one example as the dataset makes it; `vocab`: (number of
    token ids it emits, what emits them); `num_classes`: how many labels it has. Raises ConfigError
    for fields other than this task's, another shape or dtype, more ids than config.model.vocab_size,
    more classes than config.model.num_classes.
    """
    name, want = config.dataset.name, self.example_shapes(config)
    missing, unused = sorted(want.keys() - produced.keys()), sorted(produced.keys() - want.keys())
    if missing or unused:
      raise ConfigError(
        f'dataset {name!r} makes batch fields {sorted(produced)}, but task {config.task!r} takes '
        f'{sorted(want)} (missing {missing}, unused {unused})'
      )
    for k, (shape, dtype) in want.items():
      got_shape, got_dtype = produced[k]
      if tuple(got_shape) != tuple(shape) or np.dtype(got_dtype) != np.dtype(dtype):
        raise ConfigError(
          f'dataset {name!r} makes {k!r} as {np.dtype(got_dtype).name} {tuple(got_shape)} per '
          f'example, but task {config.task!r} takes {np.dtype(dtype).name} {tuple(shape)}'
        )
    model_vocab = config.model.get('vocab_size')
    if vocab is not None and model_vocab is not None and vocab[0] > model_vocab:
      raise ConfigError(
        f'{vocab[1]} has {vocab[0]} ids but config.model.vocab_size={model_vocab}: set '
        f'config.model.vocab_size >= {vocab[0]} (token ids would fall outside the embedding)'
      )
    model_classes = config.model.get('num_classes')
    if num_classes is not None and model_classes is not None and num_classes > model_classes:
      raise ConfigError(
        f'dataset {name!r} has {num_classes} classes but config.model.num_classes={model_classes}: '
        'labels would fall outside the classifier'
      )

  def synthetic_batch(self, config: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """A random global batch of this task's fields (benchmarks): token ids below the model's vocabulary,
    labels below its classes, standard-normal images, every example counted (mask 1), one document
    per row (segment id 1, positions 0..L-1), no padding (input_mask 1), MLM targets at 15%."""
    rng = np.random.default_rng(seed)
    vocab = config.model.get('vocab_size') or config.dataset.get('vocab_size')
    classes = config.model.get('num_classes') or config.dataset.get('num_classes')
    out = {}
    for name, (shape, dtype) in self.example_shapes(config).items():
      shape = (config.batch_size, *shape)
      if name == 'image':
        x = rng.standard_normal(shape)
      elif name in ('inputs', 'targets'):
        x = rng.integers(0, vocab, shape)
      elif name == 'label':
        x = rng.integers(0, classes, shape)
      elif name == 'positions':
        x = np.broadcast_to(np.arange(shape[-1]), shape)
      elif name == 'token_types':
        x = np.zeros(shape)
      elif name == 'mask' and isinstance(self, MaskedLanguageModeling) and len(shape) == 2:
        x = rng.random(shape) < config.dataset.mlm_probability
      else:  # mask, input_mask, segment_ids
        x = np.ones(shape)
      out[name] = np.asarray(x, dtype)
    return out

  def metric_sums(self, model: Any, batch: dict[str, jax.Array], **task_state: Any) -> Metrics:
    """Sums over the batch (so eval over many batches is exact): loss, correct, weight (+ aux)."""
    logits, aux = self.forward(model, batch)
    return _sums(*self.per_example(logits.astype(jnp.float32), batch), aux)

  def loss(self, model: Any, batch: dict[str, jax.Array], **task_state: Any) -> tuple[jax.Array, Metrics]:
    m = self.metric_sums(model, batch, **task_state)
    w = jnp.maximum(m['weight'], 1.0)
    loss = m['loss_sum'] / w
    metrics = {'loss': loss, 'accuracy': m['correct_sum'] / w}
    aux = {k[4:]: v for k, v in m.items() if k.startswith('aux/')}
    if 'aux_loss' in aux:
      loss = loss + aux['aux_loss']
    return loss, {**metrics, **aux}


def _sums(loss: jax.Array, correct: jax.Array, weight: jax.Array, aux: dict[str, jax.Array]) -> Metrics:
  return sums_of((loss * weight).sum(), (correct * weight).sum(), weight.sum(), aux)


def sums_of(loss_sum: jax.Array, correct_sum: jax.Array, weight: jax.Array, aux: dict[str, jax.Array]) -> Metrics:
  """A task's metric sums in the form the train and eval loops add up (every task returns this from metric_sums)."""
  return {'loss_sum': loss_sum, 'correct_sum': correct_sum, 'weight': weight, **{f'aux/{k}': v for k, v in aux.items()}}


def check_length(config: Any) -> int:
  L = config.dataset.seq_len
  max_len = config.model.get('max_len')
  if max_len is not None and L > max_len:
    raise ConfigError(f'config.dataset.seq_len={L} exceeds config.model.max_len={max_len}')
  return L


class LanguageModeling(Task):
  """Next-token prediction on {'inputs', 'targets', 'mask'} (batch, length); packed datasets
  (`config.dataset.pack=True`) add 'segment_ids' and 'positions' so documents do not attend to each other.
  'mask' is each target's weight in the loss and accuracy: the loss mask times the padding mask (SFT datasets
  give prompt tokens 0, data/text.py), so the batch's total weight counts exactly the tokens trained on."""

  batch_axes = {'inputs': ('batch', 'length'), 'targets': ('batch', 'length'), 'mask': ('batch', 'length')}
  packed_axes = {'segment_ids': ('batch', 'length'), 'positions': ('batch', 'length')}
  unit = 'tokens'
  unit_field = 'targets'

  def fields(self, config: Any) -> dict[str, tuple[str, ...]]:
    return {**self.batch_axes, **(self.packed_axes if config.dataset.pack else {})}

  def example_shapes(self, config: Any) -> FieldSpec:
    L = check_length(config)
    chunks = config.model.loss_chunks
    if chunks > 1:
      xent.check_loss_chunks(chunks, L)
    return {k: ((L,), jnp.float32 if k == 'mask' else jnp.int32) for k in self.fields(config)}

  @staticmethod
  def forward(model: Any, batch: dict[str, jax.Array]):
    return split_output(model(batch['inputs'], **LanguageModeling._packed(batch)))

  @staticmethod
  def _packed(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {f'{k}_BL': batch[k] for k in ('positions', 'segment_ids') if k in batch}

  def metric_sums(self, model: Any, batch: dict[str, jax.Array]) -> Metrics:
    """As Task's; with model.loss_chunks > 1 the head and the loss run chunk by chunk (chunked_softmax_xent).
    Under causal load balancing (config.context_load_balance, partitioning/context.py) the fields are first put
    in zigzag order over the context shards, with every token's natural position, and the model runs in it."""
    B, L = batch['inputs'].shape
    shards = context.balanced_shards(B, L)
    if shards == 1:
      return self._metric_sums(model, batch)
    positions = batch.get('positions', jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
    batch = {k: context.to_zigzag(v, shards) for k, v in {**batch, 'positions': positions}.items()}
    with context.zigzag(shards):
      return self._metric_sums(model, batch)

  def _metric_sums(self, model: Any, batch: dict[str, jax.Array]) -> Metrics:
    chunks = getattr(model, 'loss_chunks', 0)
    if chunks <= 1:
      return super().metric_sums(model, batch)
    x_BLD, aux = split_output(model.hidden_states(batch['inputs'], **self._packed(batch)))
    weight = batch['mask'].sum()
    loss_sum, correct_sum = xent.chunked_softmax_xent(model, x_BLD, batch['targets'], batch['mask'], weight, chunks)
    return sums_of(loss_sum, correct_sum, weight, aux)

  @staticmethod
  def per_example(logits, batch):
    return xent.loss_and_hits(logits, batch['targets'], batch['mask'])


class Classification(Task):
  """Image classification on {'image' (B,H,W,C) float32, 'label' (B,) int32, 'mask' (B,) float32}."""

  batch_axes = {'image': ('batch', 'height', 'width', 'channels'), 'label': ('batch',), 'mask': ('batch',)}

  def example_shapes(self, config: Any) -> FieldSpec:
    d, m = config.dataset, config.model
    if m.get('image_size') is not None and d.image_size != m.image_size:
      raise ConfigError(
        f'config.dataset.image_size={d.image_size} does not match config.model.image_size='
        f'{m.image_size} (the model was built for that size)'
      )
    if m.get('channels') is not None and d.channels != m.channels:
      raise ConfigError(f'config.dataset.channels={d.channels} does not match config.model.channels={m.channels}')
    return {
      'image': ((d.image_size, d.image_size, d.channels), jnp.float32),
      'label': ((), jnp.int32),
      'mask': ((), jnp.float32),
    }

  @staticmethod
  def forward(model: Any, batch: dict[str, jax.Array]):
    return split_output(model(batch['image']))

  @staticmethod
  def per_example(logits, batch):
    return xent.loss_and_hits(logits, batch['label'], batch['mask'])


class MaskedLanguageModeling(Task):
  """BERT-style MLM: predict 'targets' where 'mask' is 1, from 'inputs' with padding ('input_mask')."""

  batch_axes = {
    'inputs': ('batch', 'length'),
    'targets': ('batch', 'length'),
    'mask': ('batch', 'length'),
    'input_mask': ('batch', 'length'),
    'token_types': ('batch', 'length'),
  }
  unit = 'tokens'
  unit_field = 'inputs'

  def example_shapes(self, config: Any) -> FieldSpec:
    L = check_length(config)
    return {k: ((L,), jnp.float32 if k == 'mask' else jnp.int32) for k in self.batch_axes}

  @staticmethod
  def forward(model: Any, batch: dict[str, jax.Array]):
    return split_output(model(batch['inputs'], valid_BL=batch['input_mask'], token_types_BL=batch['token_types']))

  @staticmethod
  def per_example(logits, batch):
    return xent.loss_and_hits(logits, batch['targets'], batch['mask'])


class TextClassification(MaskedLanguageModeling):
  """Sequence classification (BERT's pooled [CLS] head): one 'label' per row."""

  batch_axes = {
    'inputs': ('batch', 'length'),
    'input_mask': ('batch', 'length'),
    'token_types': ('batch', 'length'),
    'label': ('batch',),
    'mask': ('batch',),
  }
  unit = 'examples'
  unit_field = 'mask'

  def example_shapes(self, config: Any) -> FieldSpec:
    L = check_length(config)
    return {
      k: (() if k in ('label', 'mask') else (L,), jnp.float32 if k == 'mask' else jnp.int32) for k in self.batch_axes
    }

  @staticmethod
  def per_example(logits, batch):
    return xent.loss_and_hits(logits, batch['label'], batch['mask'])


# Post-training's tasks live in their own modules, built on Task (they import this one).
from training import preference, rl  # noqa: E402

TASKS = {
  'lm': LanguageModeling,
  'classification': Classification,
  'mlm': MaskedLanguageModeling,
  'text_classification': TextClassification,
  'dpo': preference.Preference,
  'grpo': rl.GroupRelative,
}
schema.register('task', sorted(TASKS))


def get(name: str, config: Any = None) -> Task:
  if name not in TASKS:
    raise ConfigError(f'config.task={name!r} is not a known task; known: {sorted(TASKS)}')
  return TASKS[name](config)
