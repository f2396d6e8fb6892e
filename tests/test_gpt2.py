"""GPT-2: parameter count, causality, packing, padded vocabulary, dtypes, scan == unrolled."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import gpt2 as gpt2_config
from models import gpt2
from tests.conftest import stack_layers, unstack_layers


def tiny(**overrides):
  cfg = gpt2_config.get_config('tiny').model
  cfg.update(max_len=16, **overrides)
  return cfg


def count(cfg):
  model = nnx.eval_shape(lambda: models.create(cfg, nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize('overrides', [{}, {'pad_vocab_to': 128}, {'scan_layers': False}])
def test_parameter_count_matches_formula(overrides):
  cfg = tiny(**overrides)
  assert count(cfg) == gpt2.num_params(cfg)


def test_formula_gives_gpt2_small():
  # Published GPT-2 small: 124,439,808 parameters (V=50257, L=1024, D=768, F=3072, 12 layers).
  small = gpt2_config.get_config('real').model
  small.pad_vocab_to = 1
  assert gpt2.num_params(small) == 124_439_808


def test_causal_and_float32_logits_under_bf16_compute():
  cfg = tiny(dtype='bfloat16')
  model = models.create(cfg, nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  logits = model(tokens)
  assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
  assert model.blocks.layers.mlp.up.layer.kernel[...].dtype == jnp.float32  # params stay f32
  changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % cfg.vocab_size)
  diff = np.abs(np.asarray(model(changed) - logits)).max(-1)
  assert (diff[:, :10] == 0).all() and (diff[:, 10:] > 0).all()


def test_packed_documents_do_not_see_each_other():
  model = models.create(tiny(), nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, 16)
  seg = jnp.array([[1] * 6 + [2] * 10])
  pos = jnp.array([list(range(6)) + list(range(10))])
  packed = model(tokens, positions_BL=pos, segment_ids_BL=seg)
  # Document 2 alone, at positions 0..9, gives the same logits as inside the packed row.
  alone = model(tokens[:, 6:])
  np.testing.assert_allclose(packed[:, 6:], alone, rtol=1e-5, atol=1e-5)
  # Changing document 1 leaves document 2 untouched.
  other = model(tokens.at[:, :6].set(3), positions_BL=pos, segment_ids_BL=seg)
  np.testing.assert_array_equal(np.asarray(other[:, 6:]), np.asarray(packed[:, 6:]))


def test_padded_vocabulary_rows_get_no_probability():
  cfg = tiny(vocab_size=13, pad_vocab_to=8)
  model = models.create(cfg, nnx.Rngs(0))
  assert model.tok.embed.embedding.shape == (16, 64)
  probs = jax.nn.softmax(model(jnp.zeros((1, 4), jnp.int32)), -1)
  assert float(probs[..., 13:].max()) == 0.0


def test_scan_equals_unrolled():
  unrolled = models.create(tiny(scan_layers=False), nnx.Rngs(0))
  scanned = models.create(tiny(scan_layers=True), nnx.Rngs(1))
  params = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
  nnx.update(scanned, stack_layers(params))
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 16)
  np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-5, atol=1e-5)
  back = unstack_layers(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), 2)
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_sequence_longer_than_max_len():
  model = models.create(tiny(), nnx.Rngs(0))
  with pytest.raises(ValueError, match='sequence length 17 exceeds the model max_len 16'):
    model(jnp.zeros((1, 17), jnp.int32))


def test_unknown_model_name():
  cfg = tiny(name='gtp')
  known = sorted(models.MODELS)
  with pytest.raises(ValueError, match=re.escape(f"config.model.name='gtp' is not a known model; known: {known}")):
    models.create(cfg, nnx.Rngs(0))


def test_scanned_optimizer_state_is_sharded_like_the_params():
  # flax#5112: nnx.Optimizer dropped the stacked 'layers' axis from mu/nu's sharding. Ours must not.
  from tests.conftest import build_trainer

  cfg = gpt2_config.get_config('fsdp_tp,tiny')
  trainer = build_trainer(cfg)
  kernel = trainer.specs.params['blocks']['layers']['mlp']['up']['layer']['kernel']
  assert kernel == jax.sharding.PartitionSpec(None, 'fsdp', 'tensor')
  adam = trainer.specs.opt_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState(count, mu, nu)
  for moment in (adam.mu, adam.nu):
    assert moment == trainer.specs.params


def test_sampling_runs_on_scanned_and_unrolled_layers_alike():
  # train.py samples after training; a scanned stack (nnx.scan) once refused the Params merged outside the
  # sampling loop ("Cannot extract graph node from different trace level").
  import generation

  out, scanned = {}, None
  for scan in (True, False):
    model = models.create(tiny(scan_layers=scan), nnx.Rngs(0))
    if not scan:  # the same weights as the scanned model
      nnx.update(model, unstack_layers(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), 2))
    scanned = model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prompt = np.array([[1, 2], [3, 4]], np.int32)
    got = generation.Generator(graphdef, params, rest).generate(prompt.tolist(), generation.Sampling(6, seed=0))
    out[scan] = np.asarray([g.ids for g in got])
    assert out[scan].shape == (2, 6)
  np.testing.assert_array_equal(out[True], out[False])
