"""Each family's MLP activation in bfloat16 against its transformers peer's, on every bfloat16 input in [-12, 12]:
bit for bit on all but a few in 10,000 of those in [-4, 4], where jax's own operations on bfloat16 arrays differed on
0.27-3.4% of them. Float32 is the formula as before."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.activations import ACT2FN

from configs import schema
from models import bert, decoder, gpt2, kernels, layers, moe, vit

SMALLEST_NORMAL = float(jnp.finfo(jnp.bfloat16).tiny)


def every_bfloat16(low: float = -12.0, high: float = 12.0) -> np.ndarray:
  """Every finite bfloat16 in [low, high], as float32."""
  x = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
  return x[np.isfinite(x) & (x >= low) & (x <= high)]


def check(ours: np.ndarray, peer: np.ndarray, x: np.ndarray, at_most: float) -> None:
  """Where |x| <= 4, at most `at_most` of the results differ from the peer's. Beyond, both are the cancellation of
  1 + tanh (or erf) near -1, whose 1-ulp differences between torch's and XLA's float32 functions stay: there, and
  everywhere, within 2^-7 |x|. Subnormal inputs and results aside: XLA on CPU flushes them to zero, torch keeps
  some, so the two differ there by at most the smallest normal."""
  d = np.abs(ours - peer)
  differ = d > SMALLEST_NORMAL
  inner = np.abs(x) <= 4
  where = np.flatnonzero(differ & inner)[:5]
  assert differ[inner].mean() <= at_most, (differ[inner].mean(), [(x[i], ours[i], peer[i]) for i in where])
  assert (d <= np.maximum(2.0**-7 * np.abs(x), SMALLEST_NORMAL)).all()


def bf16(x: np.ndarray) -> tuple[jax.Array, torch.Tensor]:
  return jnp.asarray(x, jnp.bfloat16), torch.tensor(x).to(torch.bfloat16)


ACTIVATIONS = {  # zoo function -> transformers' (the hidden_act its families' configs name)
  'silu': (layers.silu, 'silu'),
  'gelu_new': (layers.gelu_new, 'gelu_new'),
  'gelu_tanh': (layers.gelu_tanh, 'gelu_pytorch_tanh'),
  'gelu_erf': (layers.gelu_erf, 'gelu'),
}


@pytest.mark.parametrize('path', ['xla', 'lookup'])
@pytest.mark.parametrize('name', list(ACTIVATIONS))
def test_an_activation_in_bfloat16_equals_transformers(name, path):
  """Both ways a bfloat16 activation runs: XLA's loop, and inside a CPU decode (models/kernels) a table of its values
  looked up."""
  ours, peer = ACTIVATIONS[name]
  if path == 'lookup':
    if not kernels.available():
      pytest.skip(f'the decode kernel is not available here: {kernels._loaded()[1]}')
    plain = ours

    def ours(x):
      with kernels.decode_matmuls(True):
        return plain(x)

  x = every_bfloat16()
  xj, xt = bf16(x)
  assert (kernels.LOOKUP_TARGET in jax.jit(ours).lower(xj).as_text()) == (path == 'lookup')
  got = np.asarray(jax.jit(ours)(xj).astype(jnp.float32))
  # jax's bfloat16 operations differed on 0.27% (gelu_new) to 3.4% (silu) of [-4, 4]
  check(got, ACT2FN[peer](xt).float().numpy(), x, at_most=5e-4)


def test_gpt_oss_s_clamped_swiglu_in_bfloat16_equals_transformers():
  """models.moe.clamped_swiglu against GptOssExperts._apply_gate (its gate and up interleaved) on a grid of gates
  and ups that crosses the clamp."""
  from transformers import GptOssConfig
  from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

  config = GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=1)
  experts = GptOssExperts(config)
  g = every_bfloat16(-9, 9)[::40]
  gate, up = (a.ravel() for a in np.meshgrid(g, g[::7], indexing='ij'))
  interleaved = torch.stack([torch.tensor(gate), torch.tensor(up)], -1).reshape(1, -1).to(torch.bfloat16)
  with torch.no_grad():
    peer = experts._apply_gate(interleaved).float().numpy().ravel()
  got = moe.clamped_swiglu(*(jnp.asarray(a, jnp.bfloat16) for a in (gate, up)), config.swiglu_limit)
  check(np.asarray(got.astype(jnp.float32)), peer, np.maximum(np.abs(gate), np.abs(up)), at_most=5e-4)


@pytest.mark.parametrize('name', list(ACTIVATIONS))
def test_an_activation_in_float32_is_its_formula(name):
  """In float32 the rounding is a no-op: each is the formula jax computes, within float32's rounding."""
  ours = ACTIVATIONS[name][0]
  ref = {
    'silu': jax.nn.silu,
    'gelu_new': functools.partial(jax.nn.gelu, approximate=True),
    'gelu_tanh': functools.partial(jax.nn.gelu, approximate=True),
    'gelu_erf': functools.partial(jax.nn.gelu, approximate=False),
  }[name]
  x = jnp.asarray(np.linspace(-12, 12, 4001), jnp.float32)
  assert ours(x).dtype == jnp.float32
  np.testing.assert_allclose(ours(x), ref(x), rtol=1e-6, atol=1e-7)


def test_each_family_uses_its_peer_s_activation():
  model = dict(name='gpt2', num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2, norm_eps=1e-5)
  cfg = schema.complete(ml_collections.ConfigDict(dict(model=model))).model
  block = lambda family: family.Block(cfg, rngs=nnx.Rngs(0)).mlp.activation
  assert block(gpt2) is layers.gelu_new and block(vit) is block(bert) is layers.gelu_erf
  for family, options in decoder.FAMILIES.items():
    want = layers.gelu_tanh if family.startswith('gemma') else layers.silu
    assert decoder.ACTIVATIONS[options.activation] is want, family
