"""Post-training runs end to end, in process: a GRPO run stopped mid-way and resumed ends bitwise equal to an
uninterrupted one (the sampling seed and the prompts' data position included), and its reward rises on a task the
model cannot do at the start (writing digits after '3+9=')."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import data
import generation
import models
import partitioning
import train
import training
from configs import llama_grpo
from training import rollout
from training import run as run_lib

EVAL = ''.join(f'{{"prompt": "{a}+{b}=", "answer": {a + b}}}\n' for a, b in ((3, 9), (1, 2), (7, 5), (4, 4)))


def _grpo_config(eval_file, iterations):
  c = llama_grpo.get_config('tiny')
  c.update(total_steps=6, log_every=2, eval_every=6, checkpoint_every=4, batch_size=8)
  c.grpo.update(group_size=4, iterations=iterations)
  c.dataset.eval_files = eval_file
  return c


def _run(tmp_path_factory, iterations):
  tmp = tmp_path_factory.mktemp('grpo')
  (tmp / 'eval.jsonl').write_text(EVAL)
  config = _grpo_config(str(tmp / 'eval.jsonl'), iterations)
  return config, train.train_and_evaluate(config, str(tmp / 'full'))


@pytest.fixture(scope='module')
def grpo_run(tmp_path_factory):
  """(config, result) of an uninterrupted 6-step GRPO run on examples/arith, 2 prompts x 4 completions a step."""
  return _run(tmp_path_factory, 1)


@pytest.fixture(scope='module')
def grpo_run_reusing(tmp_path_factory):
  """The same with iterations=2: samples drawn at steps 1, 3 and 5, each batch serving two updates (a stop inside
  one waits for it)."""
  return _run(tmp_path_factory, 2)


def test_grpo_resumes_bitwise_mid_run(grpo_run_reusing, tmp_path, monkeypatch):
  """A SIGTERM at step 3, inside the batch sampled at step 3: the run finishes that batch's second update, saves at
  step 4 (between the periodic saves) and stops; resumed, every rollout after the stop samples the prompts and the
  seed the uninterrupted run did, so parameters, optimizer and step are bitwise equal."""
  config, full = grpo_run_reusing

  class StopAt3(run_lib.Preemption):
    def requested(self, step):
      return step >= 3  # a signal stays received

  workdir = str(tmp_path / 'stopped')
  monkeypatch.setattr(run_lib, 'Preemption', StopAt3)
  assert train.train_and_evaluate(config.copy_and_resolve_references(), workdir)['preempted_at'] == 4
  monkeypatch.undo()
  resumed = train.train_and_evaluate(config.copy_and_resolve_references(), workdir)
  assert 'preempted_at' not in resumed
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed['state']), jax.device_get(full['state']))


def test_grpo_reward_rises_from_what_the_start_cannot_do(grpo_run):
  """The greedy completions of the eval prompts by the starting weights (the run's own initialisation) hold no
  digits; after 6 steps they are all digits: the digits reward went 0 -> 1 (the sums stay wrong at this size)."""
  config, full = grpo_run
  c = config.copy_and_resolve_references()
  ds = data.build(c)
  t = training.build(c, partitioning.make_mesh(c.mesh), lambda rngs: models.create(c.model, rngs, c.lora))
  sample = generation.policy_sampler(t.graphdef, rules=t.rules, mesh=t.mesh, max_len=c.model.max_len,
                                     vocab=c.model.vocab_size)  # fmt: skip
  before = rollout.Rollout(t, ds, sample).evaluate(training.init_state(t))
  digits = 'reward/examples.arith.rewards:digits'
  assert before[digits] == 0.0, before
  assert full['eval'][digits] == 1.0, full['eval']
  assert full['eval']['reward'] > before['reward'] + 0.4
