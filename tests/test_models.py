"""Every model names the logical axes of every parameter; shapes, counts and dtypes behave."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import partitioning
from models import gpt2 as gpt
from tests.conftest import tiny_config


@pytest.mark.parametrize('name', sorted(models.MODELS))
def test_every_parameter_has_logical_names(name):
  cfg = tiny_config().model
  cfg.name = name
  abstract = nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0)))
  state = nnx.state(abstract)
  axes = partitioning.nnx_logical_axes(state)
  flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
  assert flat
  for path, leaf in flat:
    names = axes
    for k in path:
      names = names[k.key]
    assert names is not None, f'{name}: {partitioning.path_str(path)} has no logical axis names'
    assert len(names) == len(leaf.shape), partitioning.path_str(path)
    assert all(isinstance(n, str) for n in names), partitioning.path_str(path)


def test_gpt_parameter_count_matches_formula():
  cfg = tiny_config().model
  model = nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0)))
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == gpt.num_params(cfg)
  # GPT-2 small layout (124M): V=50257, L=1024, D=768, F=3072, 12 layers.
  small = dict(vocab_size=50257, max_len=1024, embed_dim=768, mlp_dim=3072, num_layers=12)
  assert gpt.num_params(type('C', (), small)) == 124_439_808


def test_gpt_is_causal_and_logits_are_float32_under_bf16_compute():
  cfg = tiny_config().model
  cfg.dtype = 'bfloat16'
  model = models.create(cfg, nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  logits = model(tokens)
  assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
  assert model.blocks.layers[0].mlp.up.layer.kernel[...].dtype == jnp.float32  # params stay f32
  changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % cfg.vocab_size)
  diff = np.abs(np.asarray(model(changed) - logits)).max(-1)
  assert (diff[:, :10] == 0).all() and (diff[:, 10:] > 0).all()


def test_sequence_longer_than_max_len():
  cfg = tiny_config().model
  model = models.create(cfg, nnx.Rngs(0))
  with pytest.raises(ValueError, match='sequence length 17 exceeds the model max_len 16'):
    model(jnp.zeros((1, 17), jnp.int32))


def test_unknown_model_name():
  cfg = tiny_config().model
  cfg.name = 'gtp'
  known = sorted(models.MODELS)
  with pytest.raises(ValueError, match=re.escape(f"config.model.name='gtp' is not a known model; known: {known}")):
    models.create(cfg, nnx.Rngs(0))
