"""GRPO as a task (`config.task='grpo'`): a policy trained on its own samples, scored by reward functions.

Each step's batch is made by a rollout (training/rollout.py, driven by the spine): config.batch_size /
config.grpo.group_size prompts, config.grpo.group_size completions of each sampled from the current parameters, the
rewards of `config.grpo.reward`, and each completion's advantage, its reward normalised within its group
(`advantages`). The train step then sees a batch of rows, prompt + completion, with:

  inputs, targets, mask   (batch, length): the row; mask 1 on the completion's tokens (its end-of-text included)
  advantages              (batch,): the completion's advantage
  old_logps               (batch, length): the completion tokens' log-probs under the parameters that sampled it

and the loss is TRL's GRPO loss per completion token: with ρ = exp(logp - old_logp),
  -min(ρ A, clip(ρ, 1 - ε, 1 + ε) A) + β k3,   k3 = exp(ref - logp) - (ref - logp) - 1
(ref: the reference's log-prob; with LoRA the model with its adapters off, else the starting parameters kept in the
train state), summed over the completion tokens of the batch and divided by their number
(config.grpo.loss_aggregation='dapo', TRL's default), or averaged per completion and then over completions ('grpo').
Both are sums over rows divided by a weight, so gradient accumulation gives the same update. With
config.grpo.iterations > 1 one batch of samples serves that many steps; ρ then moves away from 1 and the clip acts.

Logged (TRL's names): kl (the mean k3 over completion tokens), clip_ratio/low_mean and clip_ratio/high_mean (the
tokens whose ratio was clipped below or above), and from the rollout reward, reward/<function>, reward_std (the
spread within groups), frac_reward_zero_std, completions/mean_length and completions/clipped_ratio.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from errors import ConfigError
from training import tasks, xent


def group_advantages(rewards: np.ndarray, group_size: int, scale: str = 'group') -> tuple[np.ndarray, np.ndarray]:
  """(advantages, the standard deviation within each completion's group) of rewards (prompts x group_size
  completions, flattened prompt-major), as TRL's: the group mean subtracted; divided by the group's standard
  deviation (Bessel-corrected) + 1e-4 ('group'), the whole batch's ('batch'), or not at all ('none')."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  std = r.std(axis=1, ddof=1, keepdims=True)
  centred = r - r.mean(axis=1, keepdims=True)
  if scale == 'group':
    centred = centred / (std + 1e-4)
  elif scale == 'batch':
    centred = centred / (r.std(ddof=1) + 1e-4)
  return centred.reshape(-1).astype(np.float32), np.broadcast_to(std, r.shape).reshape(-1)


def token_losses(
  logp: jax.Array, old: jax.Array, ref: Any, advantages: jax.Array, beta: float, epsilon: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(per-token loss, k3, clipped low, clipped high) for (batch, length) log-probs and (batch,) advantages."""
  ratio = jnp.exp(logp - old)
  a = advantages[:, None]
  loss = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a)
  k3 = jnp.zeros_like(logp)
  if beta:
    k3 = jnp.exp(ref - logp) - (ref - logp) - 1
    loss = loss + beta * k3
  low = ((ratio < 1 - epsilon) & (a < 0)).astype(jnp.float32)
  high = ((ratio > 1 + epsilon) & (a > 0)).astype(jnp.float32)
  return loss, k3, low, high


def token_logps(model: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
  """(log-prob of each target, whether it is the argmax, aux) under `model`."""
  logits, aux = tasks.split_output(model(inputs))
  loss, hits, _ = xent.loss_and_hits(logits.astype(jnp.float32), targets, None)
  return -loss, hits, aux


class GroupRelative(tasks.Task):
  """GRPO's train step on rollouts (module docstring)."""

  batch_axes = {
    'inputs': ('batch', 'length'),
    'targets': ('batch', 'length'),
    'mask': ('batch', 'length'),
    'old_logps': ('batch', 'length'),
    'advantages': ('batch',),
  }
  unit = 'tokens'
  unit_field = 'targets'
  progress = ('reward', 'kl', 'clip_ratio/region_mean')

  def example_shapes(self, config: Any) -> tasks.FieldSpec:
    L = tasks.check_length(config)
    ints = ('inputs', 'targets')
    return {k: ((), jnp.float32) if k == 'advantages' else ((L,), jnp.int32 if k in ints else jnp.float32)
            for k in self.batch_axes}  # fmt: skip

  def task_state(self, config: Any) -> tuple[str, ...]:
    return ('reference',) if config.grpo.beta and not config.lora.rank else ()

  def data_batch(self, config: Any) -> int:
    check_group(config)
    return config.batch_size // config.grpo.group_size

  def check_data(self, config: Any, produced: tasks.FieldSpec, vocab: Any = None, num_classes: Any = None) -> None:
    """The dataset gives prompts (data/preference.py Prompt); the rollout makes the train step's rows of them."""
    P = config.dataset.seq_len - config.grpo.max_new_tokens
    want = {'prompt': ((P,), np.int32), 'prompt_len': ((), np.int32), 'index': ((), np.int32), 'mask': ((), np.float32)}
    got = {k: (tuple(s), np.dtype(d)) for k, (s, d) in produced.items()}
    if got != {k: (s, np.dtype(d)) for k, (s, d) in want.items()}:
      raise ConfigError(f'dataset {config.dataset.name!r} makes {got}, but task grpo takes prompts {want}')
    model_vocab = config.model.get('vocab_size')
    if vocab is not None and model_vocab is not None and vocab[0] > model_vocab:
      raise ConfigError(f'{vocab[1]} has {vocab[0]} ids but config.model.vocab_size={model_vocab}')

  def metric_sums(self, model: Any, batch: dict[str, jax.Array], task_state: Any = None) -> tasks.Metrics:
    c = self.config.grpo
    logp, hits, aux = token_logps(model, batch['inputs'], batch['targets'])
    ref = None
    if c.beta:
      if task_state and 'reference' in task_state:
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        ref_model = nnx.merge(graphdef, task_state['reference'], rest)
      else:
        ref_model = nnx.view(model, adapters=False)
      ref = jax.lax.stop_gradient(token_logps(ref_model, batch['inputs'], batch['targets'])[0])
    loss, k3, low, high = token_losses(logp, batch['old_logps'], ref, batch['advantages'], c.beta, c.epsilon)
    mask = batch['mask']
    tokens = jnp.maximum(mask.sum(), 1.0)
    token_mean = lambda x: (x * mask).sum() / tokens
    logged = {
      'kl': token_mean(k3),
      'clip_ratio/low_mean': token_mean(low),
      'clip_ratio/high_mean': token_mean(high),
      'clip_ratio/region_mean': token_mean(low + high),
    }
    if c.loss_aggregation == 'dapo':  # every completion token of the batch weighs the same
      return tasks.sums_of((loss * mask).sum(), (hits * mask).sum(), mask.sum(), {**aux, **logged})
    n = mask.sum(-1)  # 'grpo': each completion's token mean, then the mean over completions
    rows = (n > 0).astype(jnp.float32)
    per_row = lambda x: ((x * mask).sum(-1) / jnp.maximum(n, 1.0) * rows).sum()
    return tasks.sums_of(per_row(loss), per_row(hits), rows.sum(), {**aux, **logged})


def check_group(config: Any) -> None:
  """config.batch_size counts completions: whole groups of config.grpo.group_size."""
  B, G = config.batch_size, config.grpo.group_size
  if B % G:
    raise ConfigError(
      f'config.batch_size={B} is not a multiple of config.grpo.group_size={G}: the batch counts completions, '
      f'{G} per prompt (e.g. --config.batch_size={max(G, B - B % G)})'
    )
