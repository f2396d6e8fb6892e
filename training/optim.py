"""Optimizers and schedules from `config.optim`."""

from __future__ import annotations

import re
from typing import Any

import jax
import ml_collections
import optax

from configs import schema
from errors import ConfigError
from partitioning import path_str


def make_schedule(cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.lr,
    warmup_steps=warmup,
    decay_steps=max(total_steps, warmup + 1),
    end_value=cfg.lr * cfg.min_lr_ratio,
  )


def trainable_labels(params: Any, freeze: str | None, train_only: str | None) -> Any:
  """'train' / 'frozen' per parameter from regexes over its path: `freeze` freezes what matches,
  `train_only` freezes everything that does not match (e.g. LoRA adapters or a new head)."""

  def label(path, _):
    p = path_str(path)
    frozen = bool(freeze and re.search(freeze, p)) or bool(train_only and not re.search(train_only, p))
    return 'frozen' if frozen else 'train'

  paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  if freeze and not any(re.search(freeze, p) for p in paths):
    raise ConfigError(
      f'config.freeze={freeze!r} matches no parameter path (it would freeze nothing); paths are '
      f'e.g. {example_paths(paths)}'
    )
  labels = jax.tree_util.tree_map_with_path(label, params)
  if 'train' not in jax.tree.leaves(labels):
    raise ConfigError(f'config.freeze={freeze!r} / train_only={train_only!r} freeze every parameter: nothing to train')
  return labels


def example_paths(paths: list[str], n: int = 4) -> str:
  """A few of `paths`, spread over the list, for an error message about a regex over them."""
  picked = [paths[i * (len(paths) - 1) // (n - 1)] for i in range(n)] if len(paths) > n else paths
  return ', '.join(map(repr, picked)) + (f' ({n} of {len(paths)})' if len(paths) > n else '')


OPTIMIZERS = ('adamw', 'sgd')
schema.register('optim.name', OPTIMIZERS)


def schedule_step(opt_state: Any, default: Any) -> Any:
  """The step the optimizer's learning-rate schedule is at: its own count of applied updates, which a skipped
  non-finite step does not advance (the train step keeps the old optimizer state); `default` where the
  optimizer keeps no count."""
  counts = [
    v
    for path, v in optax.tree_utils.tree_get_all_with_path(opt_state, 'count')
    if getattr(path[-1], 'tuple_name', None) == 'ScaleByScheduleState'
  ]
  return counts[0] if counts else default


def make_optimizer(
  cfg: ml_collections.ConfigDict,
  total_steps: int,
  labels: Any = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Gradient clipping, then the optimizer. Weight decay skips vectors (norms, biases). A non-finite step is
  not this chain's business: the train step (training/trainer.py) keeps the old state when the loss or a
  trained gradient is not finite.

  With `labels` (see trainable_labels), frozen parameters get zero updates and no optimizer state.
  """
  schedule = make_schedule(cfg, total_steps)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  if cfg.name == 'adamw':
    opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
  elif cfg.name == 'sgd':
    opt = optax.sgd(schedule, momentum=cfg.momentum or None)
  else:
    raise ConfigError(f'config.optim.name={cfg.name!r} is not known; known: {list(OPTIMIZERS)}')
  chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  tx = optax.chain(*chain, opt)
  if labels is not None and 'frozen' in jax.tree.leaves(labels):
    tx = optax.multi_transform({'train': tx, 'frozen': optax.set_to_zero()}, labels)
  return tx, schedule
