"""Optimizers and schedules from `config.optim`."""
from __future__ import annotations

import jax
import ml_collections
import optax

from partitioning import ConfigError


def make_schedule(cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: ml_collections.ConfigDict, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Gradient clipping, then the optimizer. Weight decay skips vectors (norms, biases)."""
  schedule = make_schedule(cfg, total_steps)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  if cfg.name == 'adamw':
    opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
  elif cfg.name == 'sgd':
    opt = optax.sgd(schedule, momentum=cfg.get('momentum', 0.9) or None)
  else:
    raise ConfigError(f"config.optim.name={cfg.name!r} is not known; known: ['adamw', 'sgd']")
  chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  return optax.chain(*chain, opt), schedule
