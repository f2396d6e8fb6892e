"""config.model.loss_chunks: a language model's head, float32 softmax cross-entropy and argmax accuracy computed
chunk by chunk along the length (training/xent.chunked_softmax_xent), each chunk's gradients made as it is
scored. Against the whole-logits path: equal loss, accuracy, MoE aux losses and gradients (1 device, and
sharded over batch, length and vocab on 8 devices), no (B, L, V) array in the chunked program, the same matmul
FLOPs (nothing recomputed), and compiled temporaries smaller by more than the logits' size; a chunk count the
length does not divide is one error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import partitioning
import training
from configs import common, schema
from errors import ConfigError
from tests.conftest import all_eqns, build_trainer

B, L, V, CHUNKS = 4, 16, 40, 4  # V: a vocabulary no other dimension of the tiny models shares


def _tiny(name, preset='dp', **model):
  from configs import gpt2, llama, moe

  cfg = {'gpt2': gpt2, 'llama': llama, 'moe': moe}[name].get_config(f'{preset},tiny')
  cfg.update(batch_size=B)
  cfg.dataset.update(seq_len=L)
  cfg.model.update({**dict(num_layers=1, scan_layers=False, vocab_size=V, loss_chunks=CHUNKS), **model})
  if name == 'moe':
    cfg.model.group_size = L
  return cfg


def _abstract(cfg):
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: models.create(cfg.model, nnx.Rngs(0))), nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), rest


def _loss_fn(graphdef, rest, batch, chunks):
  """(loss, metrics) of the lm task with model.loss_chunks = chunks, as a function of the parameters."""

  def loss(params):
    model = nnx.merge(graphdef, params, rest)
    model.loss_chunks = chunks
    return training.tasks.get('lm').loss(model, batch)

  return loss


@functools.cache
def _one_device(name):
  """Random parameters (no init program to compile), one synthetic batch, and (loss, metrics) with gradients
  of the whole-logits path and of the chunked one, both in one compiled program on 1 device."""
  cfg = _tiny(name)
  graphdef, abstract, rest = _abstract(cfg)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), abstract)
  batch = training.tasks.get('lm').synthetic_batch(cfg, seed=1)
  batch['mask'][0, -5:] = 0.0  # a padded tail: weights reach the chunked sums too
  both = lambda p: [jax.value_and_grad(_loss_fn(graphdef, rest, batch, c), has_aux=True)(p) for c in (0, CHUNKS)]
  return cfg, params, batch, jax.jit(both)(params)


def _assert_equal(got, want):
  (loss, metrics), grads = got
  (want_loss, want_metrics), want_grads = want
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  assert metrics.keys() == want_metrics.keys()
  for k in metrics:
    np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, want_grads)


@pytest.mark.parametrize('name', ['gpt2', 'llama', 'moe'])
def test_chunked_loss_equals_whole_logits(name):
  """float32, 1 device: loss, accuracy, MoE's aux losses and every gradient; the chunked program holds no
  (B, L, V) array (the whole-logits one does), so the chunked path is the one that ran."""
  cfg, params, batch, (whole, chunked) = _one_device(name)
  _assert_equal(chunked, whole)
  assert 0 < float(whole[0][1]['accuracy']) < 1
  if name == 'moe':
    assert float(chunked[0][1]['aux_loss']) > 0

  graphdef, _, rest = _abstract(cfg)

  def shapes(chunks):
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: _loss_fn(graphdef, rest, batch, chunks)(p)[0]))(params)
    return {tuple(v.aval.shape) for e in all_eqns(jaxpr.jaxpr) for v in e.outvars}

  assert (B, L, V) in shapes(0) and (B, L, V) not in shapes(CHUNKS)
  assert (B, L // CHUNKS, V) in shapes(CHUNKS)


def test_sharded_chunked_loss_equals_one_device():
  """GPT-2 on 8 devices, fsdp=2 x context=2 x tensor=2: the 'cp' preset's rules (batch over fsdp, each row's
  length over context, parameters over fsdp x context) with 'vocab', 'mlp' and 'heads' over tensor, so the
  chunks are split along batch, length and vocab at once. Chunked loss, accuracy and gradients equal the
  1-device whole-logits path; the config's loss_chunks reaches the model."""
  cfg, params, batch, (whole, _) = _one_device('gpt2')
  cfg = cfg.copy_and_resolve_references()
  cfg.mesh = common.mesh(dict(data=1, fsdp=2, context=2, tensor=2))
  cfg.logical_axis_rules = [
    (n, 'tensor' if n in ('vocab', 'mlp', 'heads') else a) for n, a in common.TRANSFORMER_RULES['cp']
  ]
  trainer = build_trainer(cfg)
  assert trainer.batch_shardings['targets'].spec == jax.P(('data', 'fsdp'), 'context')
  graphdef, _, rest = _abstract(cfg)
  assert nnx.merge(graphdef, params, rest).loss_chunks == CHUNKS
  assert training.tasks.eval_view(nnx.merge(graphdef, params, rest)).loss_chunks == CHUNKS  # eval takes it too

  def loss_and_grads(params, batch):
    with partitioning.use_rules(trainer.rules, trainer.mesh):
      loss = lambda p: training.tasks.get('lm').loss(nnx.merge(graphdef, p, rest), batch)
      return jax.value_and_grad(loss, has_aux=True)(params)

  step = jax.jit(loss_and_grads, in_shardings=(trainer.shardings.params, trainer.batch_shardings))
  _assert_equal(step(params, batch), whole)


def test_data_parallel_chunks_all_reduce_the_head_gradient_once():
  """GPT-2 on data=4 x tensor=2 ('tp' rules: batch over data, vocab, heads and mlp over tensor): the head's
  weights are broadcast over 'data' and each device group accumulates its own partial gradient through the
  chunk loop, so the gradient all-reduces over 'data' move the same bytes as the whole-logits step's (not
  once per chunk); loss, accuracy and gradients equal the 1-device whole-logits path."""
  from partitioning import hlo

  cfg, params, batch, (whole, _) = _one_device('gpt2')
  cfg = cfg.copy_and_resolve_references()
  cfg.mesh = common.mesh(dict(data=4, tensor=2))
  cfg.logical_axis_rules = common.TRANSFORMER_RULES['tp']
  trainer = build_trainer(cfg)
  graphdef, _, rest = _abstract(cfg)
  data_bytes = {}
  for chunks in (0, CHUNKS):

    def loss_and_grads(params, batch, chunks=chunks):
      with partitioning.use_rules(trainer.rules, trainer.mesh):
        return jax.value_and_grad(_loss_fn(graphdef, rest, batch, chunks), has_aux=True)(params)

    step = jax.jit(loss_and_grads, in_shardings=(trainer.shardings.params, trainer.batch_shardings))
    if chunks:
      _assert_equal(step(params, batch), whole)
    text = step.lower(params, batch).compile().as_text()
    data_bytes[chunks] = sum(
      c.times * c.bytes for c in hlo.collectives(text, 8) if hlo.mesh_axes(c.groups, trainer.mesh.shape) == ('data',)
    )
  assert data_bytes[CHUNKS] == data_bytes[0] > 0, data_bytes


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_chunks_recompute_nothing(name):
  """The gradient program of the chunked loss runs the same matmul FLOPs as the whole-logits one: the head
  once forward, once backward (chunks checkpointed and recomputed in the backward pass would add a forward)."""
  from training import flops

  cfg = _tiny(name)
  graphdef, params, rest = _abstract(cfg)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in training.tasks.get('lm').synthetic_batch(cfg).items()}
  count = lambda chunks: flops.matmul_flops(
    jax.make_jaxpr(jax.grad(lambda p, b: _loss_fn(graphdef, rest, b, chunks)(p)[0]))(params, batch).jaxpr
  )
  whole, chunked = count(0), count(CHUNKS)
  assert chunked == whole > 0, (whole, chunked)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_chunk_loop_converts_the_head_table_once(name, monkeypatch):
  """Under bf16 compute the float32 head table is converted to bf16 once, before the chunk loop (in it, XLA
  converted the whole table again for every chunk); loss and gradients are bit-equal to converting it inside."""
  cfg = _tiny(name, dtype='bfloat16')
  graphdef, params, rest = _abstract(cfg)
  batch = training.tasks.get('lm').synthetic_batch(cfg, seed=3)
  step = lambda p: jax.value_and_grad(_loss_fn(graphdef, rest, batch, CHUNKS), has_aux=True)(p)
  loops = [e for e in all_eqns(jax.make_jaxpr(step)(params).jaxpr) if e.primitive.name == 'scan']
  assert loops
  in_loop = [
    e
    for loop in loops
    for e in all_eqns(loop.params['jaxpr'].jaxpr)
    if e.primitive.name == 'convert_element_type'
    and e.invars[0].aval.dtype == jnp.float32
    and e.invars[0].aval.ndim == 2
    and e.invars[0].aval.shape[0] >= V
  ]  # the (vocab, embed) table
  assert not in_loop, in_loop
  concrete = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(0).normal(0, 0.02, a.shape), a.dtype), params)
  ours = jax.jit(step)(concrete)
  monkeypatch.setattr(training.xent, '_only_cast_to', lambda jaxpr, var: None)  # converted inside the loop
  inside = jax.jit(step)(concrete)
  jax.tree.map(np.testing.assert_array_equal, ours, inside)


def test_chunks_shrink_the_compiled_temporaries():
  """Loss and gradients of a 1-layer GPT-2 whose logits dominate (8 x 512 tokens x 8192 vocabulary: 128 MiB
  float32), compiled abstractly on 1 device: 8 chunks need less temporary memory than the whole logits by
  more than the logits' size (they and their gradient no longer exist at full size)."""

  def temporaries(chunks):
    cfg = _tiny('gpt2', vocab_size=8192, max_len=512, embed_dim=32, mlp_dim=64, num_heads=2, loss_chunks=chunks)
    cfg.update(batch_size=8)
    cfg.dataset.seq_len = 512
    graphdef, params, rest = _abstract(cfg)
    batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in training.tasks.get('lm').synthetic_batch(cfg).items()
    }
    step = jax.jit(lambda p, b: jax.value_and_grad(_loss_fn(graphdef, rest, b, chunks), has_aux=True)(p))
    return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  logits = 8 * 512 * 8192 * 4
  whole, chunked = temporaries(0), temporaries(8)
  assert whole - chunked > logits, (whole / 2**20, chunked / 2**20)


def test_bad_loss_chunks_are_one_error_naming_the_field():
  cfg = _tiny('llama', loss_chunks=3)
  cfg.batch_size = 8
  with pytest.raises(
    ConfigError,
    match=r'config.model.loss_chunks=3 does not divide the sequence length 16 '
    r'\(config.dataset.seq_len\)',
  ):
    build_trainer(cfg)  # when the trainer is built: before tracing or compiling
  cfg.model.loss_chunks = -1
  with pytest.raises(ConfigError, match=r'config.model.loss_chunks=-1: must be an integer >= 0'):
    schema.check(cfg)
  # Context parallelism (fsdp=2 x context=4): 8 chunks leave 2 positions per chunk for 4 shards of the length.
  cfg = _tiny('llama', preset='cp', loss_chunks=8)
  trainer = build_trainer(cfg)
  with pytest.raises(
    ConfigError,
    match=r'config.model.loss_chunks=8: a chunk holds 2 positions of each row, which '
    r"the 4 shards of the sequence \('length' over mesh axes context\) do not "
    r'divide; use a loss_chunks that divides 4',
  ):
    training.trace(trainer, training.jit_eval_step(trainer))
