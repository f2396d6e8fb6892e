"""GRPO's rollouts: prompts -> sampled completions -> rewards -> advantages -> the batch the train step takes
(training/rl.py says what it holds).

Sampling is not done here: training never imports generation. The spine (train.py) hands a `sample` function to
the rollout (generation.policy_sampler: the KV-cache sampler on the training mesh, reading the training parameters
as they are: no second copy of the weights). A rollout's sampling seed is a function of config.seed and the step,
and its prompts come from the checkpointed data iterator, so a resumed run samples what the uninterrupted one did.

Rewards (config.grpo.reward): 'module:function' names, comma-separated, each optionally '*weight' (default 1),
imported when the run starts; each is called as function(prompt, completion, row) -> a number, with the prompt as
the row has it (a text or a chat), the completion's text (without its end-of-text) and the whole row (a dict). The
reward of a completion is the weighted sum.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

import data
import partitioning
from errors import ConfigError
from training import rl

# (params, model_state, prompts: lists of ids, max_new_tokens, temperature, seed, stop id) -> completions' ids
Sample = Callable[[Any, Any, list[list[int]], int, float, int, int], list[list[int]]]


@dataclasses.dataclass
class Reward:
  name: str  # 'module:function'
  fn: Callable[..., Any]
  weight: float


def rewards(spec: str) -> list[Reward]:
  """config.grpo.reward parsed and imported: one ConfigError naming the entry that does not import."""
  if not spec.strip():
    raise ConfigError("config.grpo.reward is empty: name a reward function, e.g. 'examples.arith.rewards:correct'")
  out = []
  for entry in (e.strip() for e in spec.split(',') if e.strip()):
    name, _, weight = entry.partition('*')
    module, _, function = name.strip().partition(':')
    if not module or not function:
      raise ConfigError(f'config.grpo.reward: {entry!r} is not module:function (e.g. examples.arith.rewards:correct)')
    try:
      w = float(weight) if weight else 1.0
    except ValueError:
      raise ConfigError(f'config.grpo.reward: {entry!r}: the weight after * is not a number') from None
    try:
      fn = getattr(importlib.import_module(module), function)
    except ImportError as e:
      raise ConfigError(f'config.grpo.reward: {name!r}: module {module!r} cannot be imported ({e})') from None
    except AttributeError:
      raise ConfigError(f'config.grpo.reward: {name!r}: module {module!r} has no {function!r}') from None
    if not callable(fn):
      raise ConfigError(f'config.grpo.reward: {name!r} is not a function')
    out.append(Reward(name.strip(), fn, w))
  return out


def score(reward: Reward, prompt: Any, completion: str, row: dict, where: str) -> float:
  """One reward, checked: a function that raises, or returns something other than a finite number, is one line."""
  try:
    value = reward.fn(prompt, completion, row)
  except Exception as e:
    raise ConfigError(
      f'reward {reward.name} raised {type(e).__name__}: {e} (on {where}, completion {completion!r})'
    ) from None
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
    raise ConfigError(
      f'reward {reward.name} returned {value!r} on {where} (completion {completion!r}): a reward is a finite number'
    )
  return float(value)


class Rollout:
  """Makes each step's GRPO batch from a batch of prompts (`__call__`), and scores greedy completions of the eval
  prompts (`evaluate`)."""

  def __init__(self, trainer: Any, ds: Any, sample: Sample):
    c = trainer.config
    rl.check_group(c)
    if jax.process_count() > 1:
      raise ConfigError('config.task=grpo runs in one process (its rollouts gather every prompt on the host)')
    self.trainer, self.ds, self.sample, self.g = trainer, ds, sample, c.grpo
    self.rewards = rewards(c.grpo.reward)
    self.tok, self.L = ds.tokenizer, c.dataset.seq_len
    self.key = c.dataset.prompt_key
    t = trainer
    rules, mesh = t.rules, t.mesh

    def logps(params, model_state, batch):
      with partitioning.use_rules(rules, mesh):
        model = nnx.merge(t.graphdef, params, model_state)
        return rl.token_logps(model, batch['inputs'], batch['targets'])[0]

    fields = {k: t.batch_shardings[k] for k in ('inputs', 'targets')}
    self._logps = jax.jit(
      logps,
      in_shardings=(t.shardings.params, t.shardings.model_state, fields),
      out_shardings=t.batch_shardings['old_logps'],
    )

  def _completions(self, state: Any, local: dict[str, np.ndarray], group: int, temperature: float, seed: int):
    prompts = [list(map(int, p[:n])) for p, n in zip(local['prompt'], local['prompt_len'])]
    asked = [p for p in prompts for _ in range(group)]
    return prompts, self.sample(
      state.params, state.model_state, asked, self.g.max_new_tokens, temperature, seed, self.tok.eos_id
    )

  def _scores(self, source: Any, local: dict[str, np.ndarray], completions: list[list[int]], group: int):
    """(per reward, per completion) rewards, and each completion's text."""
    out = np.zeros((len(self.rewards), len(completions)))
    for j, ids in enumerate(completions):
      index = int(local['index'][j // group])
      row = source.rows[index]
      where = row.pop('_where', f'row {index}')
      text = self.tok.decode([i for i in ids if i != self.tok.eos_id])
      for k, r in enumerate(self.rewards):
        out[k, j] = score(r, row[self.key], text, row, where)
    return out

  def __call__(self, state: Any, local: dict[str, np.ndarray], step: int) -> tuple[dict[str, jax.Array], dict]:
    """The batch of step `step` (sampled from `state`'s parameters) and what the rollout logs."""
    G, c = self.g.group_size, self.trainer.config
    prompts, completions = self._completions(state, local, G, self.g.temperature, c.seed * 1_000_003 + step)
    per_reward = self._scores(self.ds.train, local, completions, G)
    weights = np.asarray([r.weight for r in self.rewards])
    total = weights @ per_reward
    adv, std = rl.group_advantages(total, G, self.g.scale_rewards)
    batch = self._rows(prompts, completions, G)
    batch['advantages'] = adv
    placed = data.to_global(batch, self.trainer.batch_shardings, c.batch_size)
    placed['old_logps'] = self._logps(state.params, state.model_state, {k: placed[k] for k in ('inputs', 'targets')})
    lengths = np.asarray([len(x) for x in completions])
    stopped = np.asarray([bool(x) and x[-1] == self.tok.eos_id for x in completions])
    stats = {
      'reward': float(total.mean()),
      **{f'reward/{r.name}': float(per_reward[k].mean()) for k, r in enumerate(self.rewards)},
      'reward_std': float(std.reshape(-1, G)[:, 0].mean()),
      'frac_reward_zero_std': float((std.reshape(-1, G)[:, 0] == 0).mean()),
      'completions/mean_length': float(lengths.mean()),
      'completions/clipped_ratio': float(1 - stopped.mean()),
    }
    return placed, stats

  def _rows(self, prompts: list[list[int]], completions: list[list[int]], G: int) -> dict[str, np.ndarray]:
    """prompt + completion per row, inputs/targets shifted by one, mask 1 on the completion's targets."""
    B, L = len(completions), self.L
    out = {'inputs': np.zeros((B, L), np.int32), 'targets': np.zeros((B, L), np.int32)}
    out['mask'] = np.zeros((B, L), np.float32)
    out['old_logps'] = np.zeros((B, L), np.float32)  # filled on the devices
    for j, ids in enumerate(completions):
      p = prompts[j // G]
      row = np.asarray(p + ids, np.int32)[: L + 1]
      n = len(row) - 1
      out['inputs'][j, :n], out['targets'][j, :n] = row[:-1], row[1:]
      out['mask'][j, len(p) - 1 : n] = 1.0
    return out

  def evaluate(self, state: Any) -> dict[str, float]:
    """Mean rewards of greedy completions of every eval prompt (one per prompt); as every task's eval has them,
    'loss' is minus the weighted reward, 'accuracy' the share of prompts the first reward gives at least 1 (solved),
    'weight' the prompts."""
    n = self.trainer.task.data_batch(self.trainer.config)
    totals, count, solved = np.zeros(len(self.rewards)), 0, 0
    for local in self.ds.eval_batches(n, slice(0, n)):
      keep = local['mask'] > 0
      local = {k: v[keep] for k, v in local.items()}
      if not len(local['mask']):
        continue
      _, completions = self._completions(state, local, 1, 0.0, 0)
      per_reward = self._scores(self.ds.eval, local, completions, 1)
      totals += per_reward.sum(1)
      count += len(completions)
      solved += int((per_reward[0] >= 1).sum())
    weights = np.asarray([r.weight for r in self.rewards])
    means = totals / max(count, 1)
    reward = float(weights @ means)
    per = {f'reward/{r.name}': float(m) for r, m in zip(self.rewards, means)}
    return {'reward': reward, **per, 'loss': -reward, 'accuracy': solved / max(count, 1), 'weight': float(count)}
