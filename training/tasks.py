"""Tasks: what a batch holds, its logical axes, and the loss/metrics a model is trained on."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from partitioning import ConfigError

Metrics = dict[str, jax.Array]


class LanguageModeling:
  """Next-token prediction on {'inputs', 'targets', 'mask'}, each (batch, length)."""

  batch_axes = {'inputs': ('batch', 'length'), 'targets': ('batch', 'length'), 'mask': ('batch', 'length')}
  unit = 'tokens'  # what throughput is counted in: every target position
  unit_field = 'targets'

  @staticmethod
  def example_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Per-example shape and dtype of each batch field, from the config alone (no data loaded)."""
    L = config.dataset.seq_len
    if L > config.model.max_len:
      raise ConfigError(f'config.dataset.seq_len={L} exceeds config.model.max_len={config.model.max_len}')
    if config.dataset.vocab_size > config.model.vocab_size:
      raise ConfigError(f'config.dataset.vocab_size={config.dataset.vocab_size} exceeds '
                        f'config.model.vocab_size={config.model.vocab_size}: token ids would fall outside the embedding')
    return {k: ((L,), jnp.float32 if k == 'mask' else jnp.int32) for k in LanguageModeling.batch_axes}

  @staticmethod
  def metric_sums(model: Any, batch: dict[str, jax.Array]) -> Metrics:
    """Sums over the batch (so eval over many batches is exact): loss, correct, weight."""
    logits_BLV = model(batch['inputs']).astype(jnp.float32)
    mask_BL = batch['mask']
    loss_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch['targets'])
    correct_BL = (jnp.argmax(logits_BLV, -1) == batch['targets']).astype(jnp.float32)
    return {'loss_sum': (loss_BL * mask_BL).sum(), 'correct_sum': (correct_BL * mask_BL).sum(),
            'weight': mask_BL.sum()}

  def loss(self, model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
    m = self.metric_sums(model, batch)
    w = jnp.maximum(m['weight'], 1.0)
    return m['loss_sum'] / w, {'loss': m['loss_sum'] / w, 'accuracy': m['correct_sum'] / w}

  @staticmethod
  def generate(graphdef: Any, params: Any, model_state: Any, prompt_BP: np.ndarray, length: int,
               seed: int, out_sharding: Any = None) -> jax.Array:
    """Samples `length` tokens after the prompt at temperature 1 (fixed shapes: one compile)."""
    P = prompt_BP.shape[1]

    @functools.partial(jax.jit, out_shardings=out_sharding)
    def run(params, model_state, prompt_BP, key):
      model = nnx.merge(graphdef, params, model_state)
      tokens_BL = jnp.zeros((prompt_BP.shape[0], P + length), jnp.int32).at[:, :P].set(prompt_BP)

      def body(i, carry):
        tokens_BL, key = carry
        key, sub = jax.random.split(key)
        nxt_B = jax.random.categorical(sub, model(tokens_BL)[:, i - 1].astype(jnp.float32))
        return tokens_BL.at[:, i].set(nxt_B), key
      return jax.lax.fori_loop(P, P + length, body, (tokens_BL, key))[0]
    return run(params, model_state, prompt_BP, jax.random.key(seed))


TASKS = {'lm': LanguageModeling}


def get(name: str):
  if name not in TASKS:
    raise ConfigError(f'config.task={name!r} is not a known task; known: {sorted(TASKS)}')
  return TASKS[name]()
