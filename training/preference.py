"""Preference tuning as a task (`config.task='dpo'`): DPO and its kin on pairs of answers to one prompt.

A batch holds each pair as two rows, chosen and rejected (prompt + answer, the loss mask on the answer's tokens and
its end-of-text), and a 'mask' per pair (0: an eval padding row). Both rows run through the model in one forward
pass; a row's log-probability is the sum of its answer tokens' log-probabilities. The losses follow TRL
(`config.dpo.loss`), with Δ = (policy chosen - reference chosen) - (policy rejected - reference rejected):

  sigmoid  -log σ(β Δ)                          DPO (Rafailov et al.); TRL's default
  hinge    relu(1 - β Δ)                        SLiC's hinge on the same margin
  ipo      (Δ - 1 / 2β)², log-probs as per-token means of each answer (IPO)
  simpo    -log σ(β (c - r) - γ), per-token mean log-probs, no reference (TRL's CPOTrainer, loss_type='simpo')
  orpo     NLL(chosen) - β log σ(log odds(c) - log odds(r)), per-token means, no reference (TRL's ORPOTrainer)

The reference is the starting weights, frozen: with LoRA (config.lora.rank > 0) the same model with its adapters
switched off (`nnx.view(model, adapters=False)`: no second copy); otherwise a copy of the starting parameters in
the train state (`TrainState.task_state['reference']`), sharded by the parameters' own rules and checkpointed with
them. simpo and orpo need none and keep none. With config.dpo.precompute_reference, the reference's log-probs of
every pair are computed once before training (`pass_over`, training/run.py) and stored beside the data; each batch
then carries them (ref_chosen_logps, ref_rejected_logps) and the step neither keeps nor runs a reference.

Logged as TRL logs them: rewards/chosen and rewards/rejected (β times the policy-reference log-ratio; simpo and orpo:
β times the policy's log-prob), rewards/margins, rewards/accuracies (chosen's reward strictly above rejected's: 0 at
the start, where the two are equal; also the task's `accuracy`), logps/* (summed log-probs), logits/* (the mean
logit over the answers' tokens), and for orpo nll_loss and log_odds_ratio.

The loss is a mean over pairs (sums over pairs, divided by the batch's pairs: exact under gradient accumulation),
but orpo's NLL is a mean over the chosen answers' tokens, as TRL's: under config.grad_accum_steps > 1 each
micro-batch's tokens normalise its own share.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import data
import partitioning
from configs import schema
from errors import ConfigError
from training import tasks, xent

LOSSES = ('sigmoid', 'hinge', 'ipo', 'simpo', 'orpo')
REFERENCE_FREE = ('simpo', 'orpo')
MEAN_LOGPS = ('ipo', 'simpo', 'orpo')  # log-probs as per-token means of each answer
schema.register('dpo.loss', LOSSES)

SIDES = ('chosen', 'rejected')
ROW_FIELDS = ('inputs', 'targets', 'mask')
REF_FIELDS = ('ref_chosen_logps', 'ref_rejected_logps')  # precomputed: the reference's summed log-probs per pair


def needs_reference(config: Any) -> bool:
  return config.dpo.loss not in REFERENCE_FREE


def precomputed(config: Any) -> bool:
  """Whether the batches carry the reference's log-probs (config.dpo.precompute_reference, a loss with a
  reference)."""
  return needs_reference(config) and bool(config.dpo.precompute_reference)


def pair_losses(
  loss: str, chosen: jax.Array, rejected: jax.Array, ref_chosen: Any, ref_rejected: Any, beta: float, gamma: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss per pair, chosen reward, rejected reward) from the pairs' log-probs (summed or per-token means, as
  `loss` takes them; the reference's are ignored by simpo and orpo)."""
  if loss in REFERENCE_FREE:
    cr, rr = beta * chosen, beta * rejected
    if loss == 'simpo':
      return -jax.nn.log_sigmoid(beta * (chosen - rejected) - gamma), cr, rr
    # log odds = log p - log(1 - p) of the mean per-token probability p = exp(logp) < 1.
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -beta * jax.nn.log_sigmoid(log_odds), cr, rr
  cr, rr = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
  delta = (chosen - ref_chosen) - (rejected - ref_rejected)
  if loss == 'sigmoid':
    return -jax.nn.log_sigmoid(beta * delta), cr, rr
  if loss == 'hinge':
    return jax.nn.relu(1 - beta * delta), cr, rr
  if loss == 'ipo':
    return (delta - 1 / (2 * beta)) ** 2, cr, rr
  raise ConfigError(f'config.dpo.loss={loss!r}: choose one of {list(LOSSES)}')


def _log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x < 0, accurate near 0 and far from it."""
  return jnp.where(x > -0.693, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def log_odds_ratio(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
  return (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))


def rows(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The pairs as one batch of rows: chosen rows, then rejected rows (one forward pass for both, as TRL's)."""
  return {k: jnp.concatenate([batch[f'chosen_{k}'], batch[f'rejected_{k}']]) for k in ROW_FIELDS}


def row_logps(model: Any, rows_: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
  """(summed answer log-probs, answer tokens, summed answer logits (mean over the vocabulary), aux) per row."""
  logits, aux = tasks.split_output(model(rows_['inputs']))
  logits = logits.astype(jnp.float32)
  mask = rows_['mask']
  logp = -xent.softmax_xent(logits, rows_['targets'])
  return (logp * mask).sum(-1), mask.sum(-1), (logits.mean(-1) * mask).sum(-1), aux


class Preference(tasks.Task):
  """DPO and kin (module docstring) on {chosen,rejected}_{inputs,targets,mask} (batch, length) and 'mask' (batch,);
  with precomputed reference log-probs, 'ref_chosen_logps' and 'ref_rejected_logps' (batch,) too."""

  batch_axes = {f'{s}_{k}': ('batch', 'length') for s in SIDES for k in ROW_FIELDS} | {'mask': ('batch',)}
  unit = 'pairs'
  unit_field = 'mask'
  progress = ('rewards/margins',)

  def fields(self, config: Any) -> dict[str, tuple[str, ...]]:
    return dict(self.batch_axes) | ({k: ('batch',) for k in REF_FIELDS} if precomputed(config) else {})

  def example_shapes(self, config: Any) -> tasks.FieldSpec:
    L = tasks.check_length(config)
    scalar = ('mask', *REF_FIELDS)
    return {
      k: ((), jnp.float32) if k in scalar else ((L,), jnp.float32 if k.endswith('mask') else jnp.int32)
      for k in self.fields(config)
    }

  def task_state(self, config: Any) -> tuple[str, ...]:
    """What the train state holds for this task: the reference's parameters, where it has no other source."""
    return ('reference',) if needs_reference(config) and not config.lora.rank and not precomputed(config) else ()

  def metric_sums(self, model: Any, batch: dict[str, jax.Array], task_state: Any = None) -> tasks.Metrics:
    c = self.config.dpo
    kind, beta = c.loss, c.beta
    both = rows(batch)
    logps, n, logit_sums, aux = row_logps(model, both)
    B = batch['mask'].shape[0]
    per = lambda x: (x[:B], x[B:])
    (lc, lr), (nc, nr) = per(logps), per(n)
    mean_logps = kind in MEAN_LOGPS
    chosen, rejected = (lc / jnp.maximum(nc, 1), lr / jnp.maximum(nr, 1)) if mean_logps else (lc, lr)
    ref_c = ref_r = None
    if kind not in REFERENCE_FREE:
      if REF_FIELDS[0] in batch:
        ref = jnp.concatenate([batch[k] for k in REF_FIELDS])
      else:
        ref = jax.lax.stop_gradient(self.reference_logps(model, both, task_state))
      ref_c, ref_r = per(ref / jnp.maximum(n, 1) if mean_logps else ref)
    losses, cr, rr = pair_losses(kind, chosen, rejected, ref_c, ref_r, beta, c.gamma)
    w = batch['mask']
    pairs = w.sum()
    mean = lambda x: (x * w).sum() / jnp.maximum(pairs, 1.0)
    loss_sum = (losses * w).sum()
    logged = {
      'rewards/chosen': mean(cr),
      'rewards/rejected': mean(rr),
      'rewards/margins': mean(cr - rr),
      'rewards/accuracies': mean((cr > rr).astype(jnp.float32)),
      'logps/chosen': mean(lc),
      'logps/rejected': mean(lr),
      'logits/chosen': (per(logit_sums)[0] * w).sum() / jnp.maximum((nc * w).sum(), 1.0),
      'logits/rejected': (per(logit_sums)[1] * w).sum() / jnp.maximum((nr * w).sum(), 1.0),
    }
    if kind == 'orpo':  # + the chosen answers' token-mean NLL, as a share of the pairs' sum
      nll = -(lc * w).sum() / jnp.maximum((nc * w).sum(), 1.0)
      loss_sum = loss_sum + pairs * nll
      logged |= {'nll_loss': nll, 'log_odds_ratio': mean(jax.nn.log_sigmoid(log_odds_ratio(chosen, rejected)))}
    correct = ((cr > rr).astype(jnp.float32) * w).sum()
    return tasks.sums_of(loss_sum, correct, pairs, {**aux, **logged})

  @staticmethod
  def reference_logps(model: Any, both: dict[str, jax.Array], task_state: Any) -> jax.Array:
    """The reference's summed answer log-probs per row: the stored starting parameters, else the model with its
    adapters off (precomputed ones come with the batch)."""
    if task_state and 'reference' in task_state:
      graphdef, _, rest = nnx.split(model, nnx.Param, ...)
      ref_model = nnx.merge(graphdef, task_state['reference'], rest)
    else:
      ref_model = nnx.view(model, adapters=False)
    return row_logps(ref_model, both)[0]


def pass_over(trainer: Any, params: Any, model_state: Any, ds: Any) -> tuple[np.ndarray, np.ndarray]:
  """The reference (`params`: the starting weights) over every pair of both splits of `ds` in order, one forward
  pass per batch on the training mesh: (train, eval) arrays of (pairs, 2) summed answer log-probs, chosen and
  rejected."""
  t, B = trainer, trainer.config.batch_size
  fields = [f'{s}_{k}' for s in SIDES for k in ROW_FIELDS]

  def logps(params, model_state, batch):
    with partitioning.use_rules(t.rules, t.mesh):
      return row_logps(nnx.merge(t.graphdef, params, model_state), rows(batch))[0]

  jitted = jax.jit(
    logps, in_shardings=(t.shardings.params, t.shardings.model_state, {k: t.batch_shardings[k] for k in fields})
  )
  local = data.local_rows(t.batch_shardings['mask'], t.batch_abstract['mask'].shape)
  out = []
  for split in (ds.train, ds.eval):
    sums = []
    for batch in data.eval_batches(split, B, local, ds.transform):
      both = jitted(params, model_state, data.to_global({k: batch[k] for k in fields}, t.batch_shardings, B))
      sums.append(np.asarray(multihost_utils.process_allgather(both, tiled=True)).reshape(2, B).T)
    out.append(np.concatenate(sums)[: len(split)])
  return out[0], out[1]


def check(config: Any) -> None:
  """The settings no field check sees: a reference-based loss on LoRA adapters needs the base to be the reference
  (nothing else trains)."""
  if needs_reference(config) and config.lora.rank and (config.train_only or config.freeze):
    raise ConfigError(
      f'config.dpo.loss={config.dpo.loss!r} with LoRA uses the base model (adapters off) as the reference, so only '
      f'the adapters may train: config.train_only={config.train_only!r} / config.freeze={config.freeze!r} would '
      'move the reference too; leave them empty'
    )
