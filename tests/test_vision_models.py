"""Vision models (MLP, CNN, ResNet, ViT): names, counts, sharded == 1 device, BatchNorm over the global
batch, train vs eval, scan == unrolled, bf16 compute, Hugging Face ViT layout, bad configs.

To keep compiles few, each model is initialised once (`single_device`) and other tests rebuild it from
those arrays (`build`); jitted forwards are cached by model structure.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models
import partitioning
import training
from configs import mnist
from configs import resnet as resnet_config
from configs import vit as vit_config
from errors import ConfigError, ShardingError
from models import attention, resnet, simple, vit
from tests.conftest import assert_every_leaf_named, build_trainer, stack_layers, unstack_layers
from training import tasks

TINY = {
  'cnn': (mnist, 'tiny'),
  'mlp': (mnist, 'mlp_tiny'),
  'resnet': (resnet_config, 'tiny'),
  'vit': (vit_config, 'tiny'),
}
FORMULA = {'cnn': simple, 'mlp': simple, 'resnet': resnet, 'vit': vit}
# fp32, sharded vs 1 device. Logits: rtol 1e-5, atol 1e-5; ResNet's atol 5e-5 (measured worst 1.8e-5: the
# all-reduced batch statistics sum in another order, and the tiny ResNet's last stage normalises 8 values
# per channel, which amplifies that). Running mean/var: rtol 1e-5, atol 1e-6 (measured 1.5e-6 relative).
RTOL, ATOL, ATOL_RESNET = 1e-5, 1e-5, 5e-5


def tiny(name, preset=None, **model):
  module, size = TINY[name]
  cfg = module.get_config(f'{preset},{size}' if preset else size)
  cfg.model.update(model)
  return cfg


def images(cfg, batch=8, seed=0):
  d = cfg.dataset
  x = jax.random.normal(jax.random.key(seed), (batch, d.image_size, d.image_size, d.channels))
  return x + jnp.arange(batch, dtype=x.dtype)[:, None, None, None]  # each row's mean is offset differently


def abstract(model_cfg):
  return nnx.eval_shape(lambda: models.create(model_cfg, nnx.Rngs(0)))


def build(model_cfg, params, state):
  return nnx.merge(nnx.graphdef(abstract(model_cfg)), params, state)


def split(model):
  """(parameters, other state) as the trainer's pure dicts, on the host."""
  return jax.device_get(
    (nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))
  )


def count(model_cfg):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract(model_cfg), nnx.Param)))


apply = nnx.jit(lambda model, x: model(x))  # train mode updates the model's BatchNorm statistics


@functools.cache
def single_device(name):
  """Initial (params, state), a batch of 8, and the 1-device train-mode logits and updated state."""
  cfg = tiny(name)
  # One jit with the 'rbg' generator: compiles several times faster than threefry on CPU.
  model = nnx.jit(lambda: models.create(cfg.model, nnx.Rngs(jax.random.key(0, impl='rbg'))))()
  params, state = split(model)
  image = images(cfg)
  logits = apply(model, image)
  return params, state, image, logits, split(model)[1]


def sharded(name, preset):
  cfg = tiny(name, preset)
  cfg.batch_size = 8
  return build_trainer(cfg)


def sharded_forward(trainer, params, state, image):
  """Train-mode logits and updated state under the trainer's rules, inputs placed by its shardings."""

  def f(params, state, image):
    with partitioning.use_rules(trainer.rules, trainer.mesh):
      model = nnx.merge(trainer.graphdef, params, state)
      return model(image), nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))

  shardings = (trainer.shardings.params, trainer.shardings.model_state, trainer.batch_shardings['image'])
  return jax.jit(f, in_shardings=shardings)(params, state, image)


def assert_close_tree(a, b, rtol=RTOL, atol=1e-6):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize('name', sorted(TINY))
def test_every_parameter_and_statistic_has_logical_names(name):
  state = nnx.state(abstract(tiny(name).model))  # parameters and BatchNorm statistics
  assert_every_leaf_named(state)


@pytest.mark.parametrize('name', sorted(TINY))
def test_parameter_count_matches_formula(name):
  cfg = tiny(name).model
  assert count(cfg) == FORMULA[name].num_params(cfg)


def test_formula_and_model_give_published_counts():
  # Published: torchvision resnet18 11,689,512 and resnet50 25,557,032; ViT-B/16 (224, 1000 classes)
  # 86,567,656 (google/vit-base-patch16-224). Flax's MNIST CNN example: 824,458.
  for module, size, published, formula in [
    (resnet_config, 'resnet18', 11_689_512, resnet),
    (resnet_config, 'resnet50', 25_557_032, resnet),
    (vit_config, 'b16', 86_567_656, vit),
    (mnist, 'cnn', 824_458, simple),
  ]:
    cfg = module.get_config(size).model
    assert formula.num_params(cfg) == published, size
    assert count(cfg) == published, size


@pytest.mark.parametrize('name', sorted(TINY))
def test_sharded_forward_equals_single_device(name):
  """Tensor parallel (data=2 x tensor=4) vs one device, train mode (ResNet: batch statistics too)."""
  params, state, image, logits1, state1 = single_device(name)
  trainer = sharded(name, 'tp')
  assert trainer.mesh.shape['tensor'] == 4
  logits8, state8 = sharded_forward(trainer, params, state, image)
  assert logits8.shape == (8, 10) and logits8.dtype == jnp.float32
  np.testing.assert_allclose(logits8, logits1, rtol=RTOL, atol=ATOL_RESNET if name == 'resnet' else ATOL)
  assert_close_tree(state8, state1)


def test_model_parallel_rules_shard_the_weights():
  specs = sharded('vit', 'tp').specs.params['blocks']['layers']
  assert specs['attn']['query']['layer']['kernel'] == P(None, None, 'tensor')
  assert specs['mlp']['up']['layer']['kernel'] == P(None, None, 'tensor')
  specs = sharded('resnet', 'fsdp').specs
  assert specs.params['stages'][1]['first']['convs'][0]['kernel'] == P(None, None, 'fsdp')
  assert specs.params['stages'][2]['rest']['layers']['convs'][0]['kernel'] == P(None, None, None, 'fsdp')
  assert specs.model_state['bn1']['mean'] == P()  # ('norm',) -> replicated
  specs = sharded('resnet', 'tp').specs
  assert specs.params['stages'][1]['first']['convs'][0]['kernel'] == P(None, None, None, 'tensor')


def test_batchnorm_statistics_are_over_the_global_batch():
  """8-way data parallel: train-mode outputs, and the running mean/var after one train step, equal
  the 1-device ones on the same global batch; they are the whole batch's statistics, not a device's."""
  params, state, image, logits1, state1 = single_device('resnet')
  trainer = sharded('resnet', 'dp')
  assert trainer.batch_shardings['image'].spec == P('data') and trainer.mesh.shape['data'] == 8
  logits8, _ = sharded_forward(trainer, params, state, image)
  np.testing.assert_allclose(logits8, logits1, rtol=RTOL, atol=ATOL_RESNET)

  start = training.TrainState(jnp.zeros((), jnp.int32), params, trainer.tx.init(params), state)
  batch = {'image': image, 'label': jnp.arange(8), 'mask': jnp.ones(8)}
  new, _ = training.jit_train_step(trainer)(
    jax.device_put(start, trainer.shardings), partitioning.shard(batch, trainer.batch_shardings)
  )
  assert_close_tree(jax.device_get(new.model_state), state1)

  # The stem's statistics are those of the whole batch (momentum 0.9 from mean 0, var 1) ...
  h = np.asarray(nnx.merge(trainer.graphdef, params, state).conv1(image), np.float64)
  bn1 = jax.device_get(new.model_state['bn1'])
  np.testing.assert_allclose(bn1['mean'], 0.1 * h.mean((0, 1, 2)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bn1['var'], 0.9 + 0.1 * h.var((0, 1, 2)), rtol=1e-5, atol=1e-6)
  # ... and not those of one device's row.
  assert np.abs(0.1 * h[:1].mean((0, 1, 2)) - bn1['mean']).max() > 0.01


def test_batchnorm_train_and_eval_modes():
  params, state, image, logits1, state1 = single_device('resnet')
  cfg = tiny('resnet')
  model = build(cfg.model, params, state)
  other = image.at[1:].set(images(cfg, 7, seed=1))  # same first example, different batch-mates
  evaluate = tasks.eval_view(model)
  # Eval mode: running averages, so an example's logits do not depend on its batch-mates ...
  np.testing.assert_allclose(apply(evaluate, image)[0], apply(evaluate, other)[0], rtol=1e-5, atol=1e-5)
  assert_close_tree(split(model)[1], state)  # ... and nothing is updated.
  # Train mode: batch statistics, so they do; the running averages move.
  train_logits = apply(model, image)
  np.testing.assert_allclose(train_logits, logits1, rtol=1e-5, atol=1e-5)
  assert_close_tree(split(model)[1], state1)
  assert np.abs(apply(model, other)[0] - train_logits[0]).max() > 1e-3
  assert np.abs(train_logits - apply(evaluate, image)).max() > 1e-3


def unroll(name, tree):
  """Scanned -> unrolled pure dicts: ViT's 2 blocks; ResNet's stacks of stage_size - 1 blocks per stage."""
  if name == 'vit':
    return unstack_layers(tree, tiny(name).model.num_layers)
  sizes = tiny(name).model.stage_sizes
  return {**tree, 'stages': {i: unstack_layers(stage, sizes[i] - 1) for i, stage in tree['stages'].items()}}


@pytest.mark.parametrize('name', ['vit', 'resnet'])
def test_scan_equals_unrolled(name):
  """Same weights stacked ('layers' axis, nnx.scan) and unrolled: same logits and, for ResNet, the same
  updated batch statistics (its tiny size scans stacks of 1 and 2 blocks)."""
  params, state, image, logits1, state1 = single_device(name)
  assert tiny(name).model.scan_layers
  unrolled = build(tiny(name, scan_layers=False).model, unroll(name, params), unroll(name, state))
  np.testing.assert_allclose(apply(unrolled, image), logits1, rtol=1e-5, atol=1e-5)
  new = split(unrolled)[1]
  assert_close_tree(new, unroll(name, state1))
  assert_close_tree(stack_layers(new), state1)


@pytest.mark.parametrize('name', sorted(TINY))
def test_bf16_compute_gives_float32_logits(name):
  params, state, image, logits_f32, _ = single_device(name)
  model = build(tiny(name, dtype='bfloat16').model, params, state)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.float32)}  # params stay f32
  logits = apply(model, image)
  assert logits.dtype == jnp.float32
  err = float(jnp.abs(logits - logits_f32).max())
  assert 0 < err < 0.05 * float(jnp.abs(logits_f32).max()) + 0.05, err  # bf16 rounding, not garbage


def test_vit_pads_its_tokens_once_where_fused_attention_wants_it(monkeypatch):
  """Where the attention kernel wants lengths in multiples of 8 (cuDNN on a GPU: attention.length_multiple),
  ViT pads its 17 tokens to 24 before the blocks, the padded keys masked (kv_length): the logits and every
  parameter's gradient equal the unpadded model's (float32, XLA attention on the CPU)."""
  params, state, image, _, _ = single_device('vit')
  cfg = tiny('vit')
  w = jax.random.normal(jax.random.key(1), (8, cfg.model.num_classes))
  run = lambda p: (build(cfg.model, p, state)(image) * w).sum()
  # jitted (op-by-op dispatch of the backward pass costs more than compiling it); each call jits a new function,
  # so the second traces again under the patch
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(run))(params)
  monkeypatch.setattr(attention, 'length_multiple', lambda *a: 8)
  loss, grads = jax.jit(jax.value_and_grad(run))(params)
  assert any('L=24, 17 real keys' in d for d in attention.decisions()), attention.decisions()
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_close_tree(grads, ref_grads, rtol=1e-4, atol=1e-6)


def test_vit_matches_hugging_face_layout():
  """Weights of a Hugging Face ViTForImageClassification, mapped by name, give its logits."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  cfg = tiny('vit', scan_layers=False).model
  hf = transformers.ViTForImageClassification(
    transformers.ViTConfig(
      hidden_size=cfg.embed_dim,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      intermediate_size=cfg.mlp_dim,
      image_size=cfg.image_size,
      patch_size=cfg.patch_size,
      num_channels=cfg.channels,
      num_labels=cfg.num_classes,
    )
  ).eval()
  assert count(cfg) == sum(p.numel() for p in hf.parameters())
  w = {k: v.numpy() for k, v in hf.state_dict().items()}
  H, K, D = cfg.num_heads, cfg.embed_dim // cfg.num_heads, cfg.embed_dim
  dense = lambda k, kernel=None, bias=None: {
    'layer': {'kernel': w[k + '.weight'].T.reshape(kernel or (-1, D)), 'bias': w[k + '.bias'].reshape(bias or (-1,))}
  }
  norm = lambda k: {'scale': w[k + '.weight'], 'bias': w[k + '.bias']}
  layers = {}
  for i in range(cfg.num_layers):
    p = f'vit.layers.{i}.'
    attn = {n: dense(p + f'attention.{n[0]}_proj', (D, H, K), (H, K)) for n in ('query', 'key', 'value')}
    layers[i] = {
      'ln1': norm(p + 'layernorm_before'),
      'ln2': norm(p + 'layernorm_after'),
      'attn': {**attn, 'out': dense(p + 'attention.o_proj', (H, K, D))},
      'mlp': {'up': dense(p + 'mlp.fc1', (D, -1)), 'down': dense(p + 'mlp.fc2')},
    }
  params = {
    'cls': w['vit.embeddings.cls_token'][0, 0],
    'pos': w['vit.embeddings.position_embeddings'][0],
    'patch': {
      'kernel': w['vit.embeddings.patch_embeddings.projection.weight'].transpose(2, 3, 1, 0),
      'bias': w['vit.embeddings.patch_embeddings.projection.bias'],
    },
    'blocks': {'layers': layers},
    'ln': norm('vit.layernorm'),
    'head': dense('classifier', (D, -1)),
  }
  x = np.asarray(single_device('vit')[2])
  with torch.no_grad():
    expected = hf(pixel_values=torch.tensor(x.transpose(0, 3, 1, 2))).logits.numpy()
  np.testing.assert_allclose(apply(build(cfg, params, {}), x), expected, rtol=1e-4, atol=1e-5)


def test_resnet_matches_hugging_face_layout():
  """Weights and running statistics of a Hugging Face ResNetForImageClassification (torchvision's layout),
  mapped by name, give its eval-mode logits."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  cfg = tiny('resnet').model
  hf = transformers.ResNetForImageClassification(
    transformers.ResNetConfig(
      num_channels=cfg.channels,
      embedding_size=cfg.width,
      hidden_sizes=[cfg.width * 2**i for i in range(4)],
      depths=list(cfg.stage_sizes),
      layer_type=cfg.block,
      num_labels=cfg.num_classes,
    )
  )
  assert count(cfg) == sum(p.numel() for p in hf.parameters())
  gen = torch.Generator().manual_seed(0)
  for m in hf.modules():  # non-trivial running statistics
    if isinstance(m, torch.nn.BatchNorm2d):
      m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
      m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
  w = {k: v.numpy() for k, v in hf.eval().state_dict().items()}
  conv = lambda k: {'kernel': w[k + '.convolution.weight'].transpose(2, 3, 1, 0)}
  bn = lambda k: {
    'scale': w[k + '.normalization.weight'],
    'bias': w[k + '.normalization.bias'],
    'mean': w[k + '.normalization.running_mean'],
    'var': w[k + '.normalization.running_var'],
  }

  def block(k):
    n = 2 if cfg.block == 'basic' else 3
    out = {'convs': {i: conv(f'{k}.layer.{i}') for i in range(n)}, 'bns': {i: bn(f'{k}.layer.{i}') for i in range(n)}}
    if f'{k}.shortcut.convolution.weight' in w:
      out.update(downsample_conv=conv(k + '.shortcut'), downsample_bn=bn(k + '.shortcut'))
    return out

  stages = {}
  for i, num in enumerate(cfg.stage_sizes):
    k = f'resnet.encoder.stages.{i}.layers'
    stages[i] = {'first': block(f'{k}.0')}
    if num > 1:
      stages[i]['rest'] = {'layers': {j - 1: block(f'{k}.{j}') for j in range(1, num)}}
  weights = stack_layers(
    {
      'conv1': conv('resnet.embedder.embedder'),
      'bn1': bn('resnet.embedder.embedder'),
      'stages': stages,
      'head': {'layer': {'kernel': w['classifier.1.weight'].T, 'bias': w['classifier.1.bias']}},
    }
  )
  params, state, image, _, _ = single_device('resnet')
  model = build(cfg, params, state)
  nnx.update(model, jax.tree.map(jnp.asarray, weights))
  x = np.asarray(image)
  with torch.no_grad():
    expected = hf(pixel_values=torch.tensor(x.transpose(0, 3, 1, 2))).logits.numpy()
  np.testing.assert_allclose(apply(tasks.eval_view(model), x), expected, rtol=1e-4, atol=1e-5)


def test_bad_configs_name_the_culprit():
  def fails(name, message, **model):
    with pytest.raises(ConfigError, match=re.escape(message)):
      abstract(tiny(name, **model).model)

  fails('vit', 'config.model.image_size=18 is not divisible by config.model.patch_size=4', image_size=18)
  fails(
    'resnet', "config.model.block='wide' is not a ResNet block; choose one of ['basic', 'bottleneck']", block='wide'
  )
  fails('resnet', 'config.model.stage_sizes=(2, 0): need one or more stages of >= 1 block', stage_sizes=(2, 0))
  fails('cnn', 'config.model.features=(8, 8, 8, 8, 8): need 1 to 4 conv layers for image_size 28', features=(8,) * 5)
  fails('mlp', 'config.model.hidden_dims is empty: the MLP needs at least one hidden layer', hidden_dims=())
  with pytest.raises(ConfigError, match='image of 32x32 pixels, but the model was built for image_size 16'):
    nnx.eval_shape(lambda: models.create(tiny('vit').model, nnx.Rngs(0))(jnp.zeros((1, 32, 32, 3))))
  # ViT-S/16's 6 heads do not split over tensor=4: the rules say so before anything compiles.
  with pytest.raises(ShardingError, match=r"\('(kv_)?heads'\) has size 6, not divisible by mesh axes tensor=4"):
    build_trainer(vit_config.get_config('tp,s16'))
