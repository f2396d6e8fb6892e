"""Post-training (training/preference.py, training/rl.py, training/rollout.py, data/preference.py): the losses equal
TRL's formulas (written here in torch from TRL's trainers, independently of ours), gradients included; the reference
costs no second copy under LoRA; sharded runs equal one device; bad input is one line naming it."""

from __future__ import annotations

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

import data
import models
import partitioning
import training
from configs import llama_dpo, llama_grpo, schema
from errors import ConfigError
from models import lora
from training import preference, rl, rollout

LOSSES = preference.LOSSES


# --- TRL's formulas (trl f2cd577: dpo_trainer._compute_loss, experimental/cpo simpo, experimental/orpo) ----------


def trl_sequence_logps(logits, labels, mask, average):
  """Summed (or per-token mean) log-probs of the labels where mask is 1: TRL's get_batch_logps."""
  per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
  s = (per_token * mask).sum(-1)
  return s / mask.sum(-1) if average else s


def trl_loss(kind, pc, pr, rc, rr, beta, gamma):
  """(losses per pair, chosen rewards, rejected rewards) as TRL computes them."""
  if kind == 'simpo':  # CPOTrainer, loss_type='simpo', label_smoothing 0
    logits = (pc - pr) - gamma / beta
    return -F.logsigmoid(beta * logits), beta * pc, beta * pr
  if kind == 'orpo':  # ORPOTrainer.odds_ratio_loss; the trainer's loss is nll - losses.mean()
    log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
    return -beta * F.logsigmoid(log_odds), beta * pc, beta * pr
  logits = (pc - rc) - (pr - rr)
  losses = {
    'sigmoid': lambda: -F.logsigmoid(beta * logits),
    'hinge': lambda: torch.relu(1 - beta * logits),
    'ipo': lambda: (logits - 1 / (2 * beta)) ** 2,
  }[kind]()
  return losses, beta * (pc - rc), beta * (pr - rr)


def trl_grpo_loss(logp, old, ref, adv, mask, beta, eps, aggregation):
  """GRPOTrainer._compute_loss: per-token clipped surrogate + beta * k3; 'dapo' and 'grpo' aggregation."""
  ratio = torch.exp(logp - old)
  per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 1 - eps, 1 + eps) * adv[:, None])
  if beta:
    per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
  if aggregation == 'grpo':
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
  return (per_token * mask).sum() / mask.sum().clamp(min=1)


def trl_advantages(rewards, G):
  r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
  return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


# --- The losses on fixed log-probs, gradients included -------------------------------------------------------------


@pytest.mark.parametrize('kind', LOSSES)
def test_pair_losses_and_their_gradients_equal_trls(kind):
  rng = np.random.default_rng(0)
  lp = -rng.uniform(0.05, 3.0, (4, 6))  # policy chosen, policy rejected, reference chosen, reference rejected
  beta, gamma = 0.3, 0.5
  f = lambda x: preference.pair_losses(kind, x[0], x[1], x[2], x[3], beta, gamma)
  ours, (cr, rr) = jax.value_and_grad(lambda x: f(x)[0].mean())(jnp.asarray(lp)), f(jnp.asarray(lp))[1:]
  t = torch.tensor(lp, requires_grad=True)
  losses, tcr, trr = trl_loss(kind, t[0], t[1], t[2], t[3], beta, gamma)
  losses.mean().backward()
  np.testing.assert_allclose(float(ours[0]), losses.mean().item(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(ours[1]), t.grad.numpy(), rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(np.asarray(cr), tcr.detach().numpy(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(rr), trr.detach().numpy(), rtol=1e-6)


class FixedLogits(nnx.Module):
  """A 'model' whose output is its parameter: the task's gradient with respect to it is the logits' gradient."""

  def __init__(self, logits):
    self.logits = nnx.Param(jnp.asarray(logits))

  def __call__(self, inputs):
    return self.logits[...]


def _pairs(rng, B, L, V):
  """A batch of B pairs with answers of different lengths (the loss on them), one eval padding pair (mask 0)."""
  batch = {}
  for side in preference.SIDES:
    batch[f'{side}_inputs'] = rng.integers(0, V, (B, L)).astype(np.int32)
    batch[f'{side}_targets'] = rng.integers(0, V, (B, L)).astype(np.int32)
    start, end = rng.integers(1, L // 2, B), rng.integers(L // 2 + 1, L + 1, B)
    batch[f'{side}_mask'] = ((np.arange(L) >= start[:, None]) & (np.arange(L) < end[:, None])).astype(np.float32)
  batch['mask'] = np.ones(B, np.float32)
  batch['mask'][-1] = 0.0
  return batch


def _config(kind, beta=0.2, gamma=0.5):
  c = llama_dpo.get_config('tiny')
  c.dpo.update(loss=kind, beta=beta, gamma=gamma)
  c.model.vocab_size = 260  # the byte tokenizer's (a run sets it from the data)
  return c


@pytest.mark.parametrize('kind', LOSSES)
def test_the_task_loss_and_its_logits_gradient_equal_trls(kind):
  """From logits: log-softmax, the answers' tokens, per-token means for ipo/simpo/orpo, the reference's logits from
  another set, orpo's chosen NLL; the padding pair counts nowhere. Value and gradient with respect to the logits."""
  rng = np.random.default_rng(1)
  B, L, V, beta, gamma = 5, 7, 11, 0.2, 0.5
  batch = _pairs(rng, B, L, V)
  policy, reference = rng.normal(size=(2, 2 * B, L, V)).astype(np.float64) * 2
  task = training.tasks.get('dpo', _config(kind, beta, gamma))
  model = FixedLogits(policy.astype(np.float32))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ref_params = jax.tree.map(lambda _: jnp.asarray(reference, jnp.float32), params)
  state = {} if kind in preference.REFERENCE_FREE else {'task_state': {'reference': ref_params}}

  def loss(p):
    return task.loss(nnx.merge(graphdef, p, rest), jax.tree.map(jnp.asarray, batch), **state)

  (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)

  keep = slice(0, B - 1)  # TRL's batch: the real pairs only
  tb = {k: torch.tensor(v[keep]) for k, v in batch.items() if k != 'mask'}
  logits = torch.tensor(policy, requires_grad=True)
  avg = kind in preference.MEAN_LOGPS
  side = lambda x, s: x[:B][keep] if s == 'chosen' else x[B:][keep]
  lp = {
    s: trl_sequence_logps(side(logits, s), tb[f'{s}_targets'].long(), tb[f'{s}_mask'], avg)
    for s in ('chosen', 'rejected')
  }
  ref = torch.tensor(reference)
  rp = {
    s: trl_sequence_logps(side(ref, s), tb[f'{s}_targets'].long(), tb[f'{s}_mask'], avg) for s in ('chosen', 'rejected')
  }
  losses, cr, rr = trl_loss(kind, lp['chosen'], lp['rejected'], rp['chosen'], rp['rejected'], beta, gamma)
  total = losses.mean()
  if kind == 'orpo':
    labels = tb['chosen_targets'].long().masked_fill(tb['chosen_mask'] == 0, -100)
    total = total + F.cross_entropy(side(logits, 'chosen').reshape(-1, V), labels.reshape(-1), ignore_index=-100)
  total.backward()
  np.testing.assert_allclose(float(value), float(total), rtol=2e-5)
  np.testing.assert_allclose(np.asarray(grads['logits']), logits.grad.numpy(), rtol=2e-4, atol=1e-7)
  np.testing.assert_allclose(float(metrics['rewards/chosen']), float(cr.mean()), rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics['rewards/margins']), float((cr - rr).mean()), rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics['accuracy']), float((cr > rr).double().mean()), rtol=1e-6)


# --- GRPO's loss and advantages --------------------------------------------------------------------------------------


def test_group_advantages_equal_trls():
  rewards = np.random.default_rng(2).uniform(0, 1, 12)
  rewards[4:8] = 0.5  # a group of equal rewards: advantage 0, spread 0
  adv, std = rl.group_advantages(rewards, 4)
  np.testing.assert_allclose(adv, trl_advantages(rewards, 4).numpy(), rtol=1e-5, atol=1e-6)
  assert np.all(adv[4:8] == 0) and np.all(std[4:8] == 0)


@pytest.mark.parametrize('aggregation', ['dapo', 'grpo'])
def test_the_grpo_task_loss_and_its_logits_gradient_equal_trls(aggregation):
  """Fixed completions and old log-probs away from the current ones (ratios clipped both ways), KL against a
  reference: value and gradient with respect to the logits, and the logged KL and clip fraction."""
  rng = np.random.default_rng(3)
  B, L, V, beta, eps = 6, 5, 9, 0.04, 0.2
  c = llama_dpo.get_config('tiny')
  c.task = 'grpo'
  c.grpo = schema.ml_collections.ConfigDict(dict(beta=beta, epsilon=eps, loss_aggregation=aggregation))
  schema.complete(c)
  task = training.tasks.get('grpo', c)
  policy, reference = rng.normal(size=(2, B, L, V)) * 2
  targets = rng.integers(0, V, (B, L)).astype(np.int32)
  mask = (np.arange(L) >= rng.integers(1, 3, B)[:, None]).astype(np.float32)
  logp_now = np.take_along_axis(jax.nn.log_softmax(policy), targets[..., None], -1)[..., 0]
  old = logp_now + rng.normal(scale=0.4, size=(B, L))
  adv = rng.normal(size=B).astype(np.float32)
  batch = {'inputs': targets, 'targets': targets, 'mask': mask, 'old_logps': old.astype(np.float32), 'advantages': adv}
  model = FixedLogits(policy.astype(np.float32))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ref_params = jax.tree.map(lambda _: jnp.asarray(reference, jnp.float32), params)
  (value, metrics), grads = jax.value_and_grad(
    lambda p: task.loss(
      nnx.merge(graphdef, p, rest), jax.tree.map(jnp.asarray, batch), task_state={'reference': ref_params}
    ),
    has_aux=True,
  )(params)
  logits = torch.tensor(policy, requires_grad=True)
  tt = torch.tensor(targets).long()
  logp = torch.gather(logits.log_softmax(-1), 2, tt[..., None])[..., 0]
  ref = torch.gather(torch.tensor(reference).log_softmax(-1), 2, tt[..., None])[..., 0]
  m = torch.tensor(mask, dtype=torch.float64)
  total = trl_grpo_loss(logp, torch.tensor(old), ref, torch.tensor(adv, dtype=torch.float64), m, beta, eps, aggregation)
  total.backward()
  np.testing.assert_allclose(float(value), float(total), rtol=2e-5)
  np.testing.assert_allclose(np.asarray(grads['logits']), logits.grad.numpy(), rtol=2e-4, atol=1e-7)
  kl = ((torch.exp(ref - logp) - (ref - logp) - 1) * m).sum() / m.sum()
  np.testing.assert_allclose(float(metrics['kl']), float(kl), rtol=1e-4)
  ratio = torch.exp(logp - torch.tensor(old)).detach()
  a = torch.tensor(adv, dtype=torch.float64)[:, None]
  clipped = (((ratio < 1 - eps) & (a < 0)) | ((ratio > 1 + eps) & (a > 0))).double()
  assert float((clipped * m).sum()) > 0  # the test reaches the clip
  np.testing.assert_allclose(float(metrics['clip_ratio/region_mean']), float((clipped * m).sum() / m.sum()), rtol=1e-6)


# --- The reference -----------------------------------------------------------------------------------------------


def _trainer(config, devices=None):
  mesh = partitioning.make_mesh(config.mesh, devices)
  return training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))


def test_the_reference_is_a_frozen_copy_without_lora_and_the_base_with_it():
  full = _trainer(_config('sigmoid', 0.1))
  assert jax.tree.structure(full.abstract.task_state['reference']) == jax.tree.structure(full.abstract.params)
  with_lora = _config('sigmoid', 0.1)
  with_lora.lora.update(rank=4, alpha=8.0, targets=r'self_attn/(query|value)$')
  t = _trainer(with_lora)
  assert t.abstract.task_state == {}  # no second copy of the weights
  assert not _trainer(_config('simpo')).abstract.task_state  # reference-free: nothing kept
  # The view with the adapters off is the base model, while the adapted one differs.
  model = models.create(with_lora.model, nnx.Rngs(0), with_lora.lora)
  base = models.create(with_lora.model, nnx.Rngs(0))
  for _, m in nnx.iter_graph(model):
    if isinstance(m, lora.LoRADense):
      m.lora_b[...] = jnp.ones_like(m.lora_b[...])
  x = jnp.arange(16, dtype=jnp.int32)[None] % 200
  np.testing.assert_array_equal(np.asarray(nnx.view(model, adapters=False)(x)), np.asarray(base(x)))
  assert not np.allclose(np.asarray(model(x)), np.asarray(base(x)))


# --- Sharded equals one device -----------------------------------------------------------------------------------


def _steps(config, devices, batch, n=2):
  t = _trainer(config, devices)
  step = training.compile_step(t, training.jit_train_step(t))
  state, out = training.init_state(t), []
  for _ in range(n):
    state, metrics = step(state, jax.device_put(batch, t.batch_shardings))
    out.append(jax.device_get(metrics))
  return out, jax.device_get(state.params)


def _post_config(task, preset):
  c = (llama_dpo if task == 'dpo' else llama_grpo).get_config(f'{preset},tiny')
  c.model.vocab_size = 260
  c.batch_size = 16
  c.optim.update(warmup_steps=0, lr=1e-3)  # Adam's first steps move a parameter of ~0 gradient by ~lr: keep it small
  return c


def _rollout_rows(rng, B, L, V):
  """A GRPO batch as a rollout makes it: completions after prompts of different lengths, old log-probs near the
  starting model's (ratios near 1), advantages of both signs."""
  mask = (np.arange(L) >= rng.integers(2, L // 2, B)[:, None]).astype(np.float32)
  return {
    'inputs': rng.integers(0, V, (B, L)).astype(np.int32),
    'targets': rng.integers(0, V, (B, L)).astype(np.int32),
    'mask': mask,
    'old_logps': (-np.log(V) + rng.normal(scale=0.1, size=(B, L))).astype(np.float32),
    'advantages': rng.normal(size=B).astype(np.float32),
  }


@pytest.fixture(scope='module')
def post_batches():
  pairs = _pairs(np.random.default_rng(4), 16, 16, 260)
  pairs['mask'][:] = 1.0
  return {'dpo': pairs, 'grpo': _rollout_rows(np.random.default_rng(5), 16, 16, 260)}


@pytest.fixture(scope='module')
def one_device_runs(post_batches):
  out = {}
  for task, batch in post_batches.items():
    c = _post_config(task, 'dp')
    c.mesh = schema.ml_collections.ConfigDict({a: 1 for a in c.mesh}, sort_keys=False)
    out[task] = _steps(c, jax.devices()[:1], batch)
  return out


PROGRESS = {'dpo': 'rewards/margins', 'grpo': 'kl'}


@pytest.mark.parametrize('preset', ['fsdp', 'tp'])
@pytest.mark.parametrize('task', ['dpo', 'grpo'])
def test_post_training_steps_sharded_equal_one_device(task, preset, post_batches, one_device_runs):
  """Two steps of each task (DPO: the reference kept in the train state; GRPO: the reference's KL and the ratio
  against old log-probs) on 8 devices equal one device: metrics and parameters."""
  (m1, p1), (m8, p8) = one_device_runs[task], _steps(_post_config(task, preset), None, post_batches[task])
  for a, b in zip(m1, m8):
    for k in ('loss', PROGRESS[task], 'grad_norm'):
      np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=1e-6, err_msg=k)
  # At step 1 the policy is the reference: every reward is 0 and the KL too, up to rounding (a strict comparison
  # of two zeros is rounding's choice); after an update both are real.
  assert m1[1]['accuracy'] == m8[1]['accuracy']
  assert m1[1]['loss'] != m1[0]['loss'] and m1[1][PROGRESS[task]] != 0
  # Adam moves a parameter whose gradient is near 0 by up to lr (1e-3) on the gradient's sign and size relative to
  # eps: rounding in such gradients shows as ~1e-5 here, far below one step.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=3e-5), p1, p8)


# --- Bad input ---------------------------------------------------------------------------------------------------


def _pairs_file(tmp_path, rows, name='p.jsonl'):
  path = tmp_path / name
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


GOOD_PAIR = {'prompt': '1+1=', 'chosen': ' two', 'rejected': ' three'}
REWARDS = 'def boom(p, c, r):\n  raise ValueError("no")\n\ndef text(p, c, r):\n  return "high"\n\n'
REWARDS += 'def nan(p, c, r):\n  return float("nan")\n\ndef ok(p, c, r):\n  return 1\n'


def _data(tmp_path, task, rows):
  c = (llama_dpo if task == 'dpo' else llama_grpo).get_config('tiny')
  c.dataset.update(cache_dir=str(tmp_path / 'cache'), train_files=_pairs_file(tmp_path, [GOOD_PAIR, *rows]))
  data.build(c)


def _reward(name):
  (r,) = rollout.rewards(f'my_rewards:{name}')
  rollout.score(r, '1+1=', '2', {}, 'f.jsonl line 2')


def _group(batch_size):
  c = llama_grpo.get_config('tiny')
  c.batch_size = batch_size
  rl.check_group(c)


def _several_processes():
  from unittest import mock  # noqa: PLC0415

  c = llama_grpo.get_config('tiny')
  with mock.patch.object(jax, 'process_count', lambda: 2):
    rollout.Rollout(types.SimpleNamespace(config=c), None, None)


BAD_INPUT = {  # what -> (how it is given, the line it must give)
  'identical answers': (
    lambda t: _data(t, 'dpo', [GOOD_PAIR, {'prompt': '2+2=', 'chosen': '4', 'rejected': '4'}]),
    r'p.jsonl line 3: the chosen and the rejected answer are the same',
  ),
  'missing key': (lambda t: _data(t, 'dpo', [{'prompt': '2+2=', 'chosen': '4'}]), r"p.jsonl line 2 has no 'rejected'"),
  'answer not text': (
    lambda t: _data(t, 'dpo', [{'prompt': '2+2=', 'chosen': 4, 'rejected': '5'}]),
    r"p.jsonl line 2: 'chosen' is 4 \(int\), not text",
  ),
  'prompt not text': (
    lambda t: _data(t, 'grpo', [{'prompt': 5, 'answer': 5}]),
    r"p.jsonl line 2: 'prompt' is 5 \(int\), not text",
  ),
  'reward not importable': (
    lambda t: rollout.rewards('no_such_module:f'),
    r"'no_such_module:f': module 'no_such_module' cannot be imported",
  ),
  'reward not in its module': (lambda t: _reward('missing'), r"module 'my_rewards' has no 'missing'"),
  'no reward': (lambda t: rollout.rewards(' '), r'config.grpo.reward is empty'),
  'reward raises': (lambda t: _reward('boom'), r'reward my_rewards:boom raised ValueError: no \(on f.jsonl line 2'),
  'reward not a number': (lambda t: _reward('text'), r"reward my_rewards:text returned 'high' on f.jsonl line 2"),
  'reward not finite': (lambda t: _reward('nan'), r'reward my_rewards:nan returned nan on f.jsonl line 2'),
  'group size': (lambda t: _group(20), r'config.batch_size=20 is not a multiple of config.grpo.group_size=8'),
  'grpo in several processes': (lambda t: _several_processes(), r'config.task=grpo runs in one process'),
}


@pytest.mark.parametrize('what', BAD_INPUT)
def test_bad_post_training_input_is_one_line_naming_it(what, tmp_path, monkeypatch):
  """Pairs and GRPO rows (data/preference.py through data/row_checks.py), reward functions (training/rollout.py)
  and the group size: one ConfigError each, one line, naming the culprit."""
  (tmp_path / 'my_rewards.py').write_text(REWARDS)
  monkeypatch.syspath_prepend(str(tmp_path))
  make, line = BAD_INPUT[what]
  with pytest.raises(ConfigError, match=line) as e:
    make(tmp_path)
  assert '\n' not in str(e.value)


# --- The reference's log-probs precomputed ---------------------------------------------------------------------


def test_precomputed_reference_logps_give_the_losses_of_a_reference_in_the_step(tmp_path, monkeypatch):
  """config.dpo.precompute_reference: one pass of the starting weights, stored beside the data (read back the
  second time, another file for another seq_len or model); the losses of a train batch (shuffled: each row finds
  its own) and an eval batch equal those of the reference run in the step, with the policy moved off the start."""
  from training import run as run_lib

  c = _config('sigmoid', 0.5)
  c.batch_size = 8
  c.dataset.cache_dir = str(tmp_path / 'cache')
  pre = c.copy_and_resolve_references()
  pre.dpo.precompute_reference = True
  t_ref, t_pre = _trainer(c), _trainer(pre)
  assert t_pre.abstract.task_state == {} and 'reference' in t_ref.abstract.task_state
  ds = data.build(c)
  with_ref = run_lib.precompute_reference(pre, t_pre, ds)
  monkeypatch.setattr(preference, 'pass_over', lambda *a: pytest.fail('computed again'))
  again = run_lib.precompute_reference(pre, t_pre, ds)
  np.testing.assert_array_equal(again.transform.reference, with_ref.transform.reference)
  identity = run_lib.reference_identity(pre)
  path = data.preference.reference_path(pre.dataset, identity)
  assert os.path.isfile(path)
  other = pre.copy_and_resolve_references()
  other.dataset.seq_len = 12
  assert data.preference.reference_path(other.dataset, identity) != path
  other_model = dict(identity, model={**identity['model'], 'num_layers': 1})
  assert data.preference.reference_path(pre.dataset, other_model) != path

  state = training.init_state(t_ref)
  moved = jax.tree.map(lambda p: p * 1.5 + 0.01, state.params)  # the policy after some training
  B = c.batch_size
  train_iter = with_ref.train_iterator(B, slice(0, B), c.seed)
  batches = [next(train_iter), next(iter(with_ref.eval_batches(B, slice(0, B))))]
  train_iter.close()
  step_ref = training.compile_step(t_ref, training.jit_eval_step(t_ref))
  step_pre = training.compile_step(t_pre, training.jit_eval_step(t_pre))
  for batch in batches:
    plain = {k: v for k, v in batch.items() if k not in preference.REF_FIELDS}
    a = step_ref(state.replace(params=moved), data.to_global(plain, t_ref.batch_shardings, B))
    b = step_pre(
      state.replace(params=moved, task_state={}, opt_state=state.opt_state),
      data.to_global(batch, t_pre.batch_shardings, B),
    )
    assert abs(float(a['loss_sum']) - B * np.log(2)) > 0.1  # the policy is not the reference
    np.testing.assert_allclose(float(b['loss_sum']), float(a['loss_sum']), rtol=1e-5)
    assert float(a['correct_sum']) == float(b['correct_sum'])
