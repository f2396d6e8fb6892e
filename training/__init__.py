"""Training machinery shared by train.py and the tests: state, shardings, steps, optimizers, tasks."""

from training.optim import make_optimizer, make_schedule
from training.trainer import (
  FIRST_NONFINITE,
  NonFiniteGuard,
  Trainer,
  TrainState,
  build,
  compile_step,
  eval_step_fn,
  init_state,
  jit_eval_step,
  jit_init,
  jit_train_step,
  loss_of,
  num_params,
  sums_of,
  trace,
  train_step_fn,
)

__all__ = [
  'FIRST_NONFINITE',
  'NonFiniteGuard',
  'TrainState',
  'Trainer',
  'build',
  'compile_step',
  'eval_step_fn',
  'init_state',
  'jit_eval_step',
  'jit_init',
  'jit_train_step',
  'loss_of',
  'make_optimizer',
  'make_schedule',
  'num_params',
  'sums_of',
  'trace',
  'train_step_fn',
]
