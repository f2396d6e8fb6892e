"""Fine-tuning mechanics: frozen parameters do not move and carry no optimizer state; LoRA trains
only its adapters (sharded by the rules), and merged weights reproduce base + adapter outputs (also
exported to Hugging Face)."""

import importlib
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

import models
import partitioning
import training
from models import lora
from tests.conftest import build_trainer, load_exported, tiny_config, train_on_random_batches
from training import tasks


def _steps(trainer, n=3):
  start, state = train_on_random_batches(trainer, n)
  return start.params, jax.device_get(state.params), state


def _flat(tree):
  return {partitioning.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_frozen_parameters_do_not_change_and_have_no_optimizer_state():
  cfg = tiny_config('fsdp_tp', freeze='^(tok|pos|blocks/layers/0/)')
  trainer = build_trainer(cfg)
  start, end, state = _steps(trainer)
  for path, before in _flat(start).items():
    frozen = path.startswith(('tok', 'pos', 'blocks/layers/0/'))
    same = np.array_equal(before, _flat(end)[path])
    assert same == frozen, path
  opt_paths = ' '.join(_flat(state.opt_state))
  assert 'tok/embed' not in opt_paths and 'blocks/layers/0/' not in opt_paths and 'blocks/layers/1/' in opt_paths


def _lora_config(**lora_overrides):
  cfg = tiny_config('fsdp_tp')
  cfg.logical_axis_rules = [*cfg.logical_axis_rules, ('lora_rank', None)]
  cfg.lora = {'rank': 4, 'alpha': 8.0, 'targets': r'attn/(query|value)$|mlp/up$', **lora_overrides}
  return cfg


def test_lora_trains_only_adapters_sharded_by_the_rules_and_exports_merged(tmp_path):
  cfg = _lora_config()
  trainer = training.build(cfg, partitioning.make_mesh(cfg.mesh), lambda rngs: models.create(cfg.model, rngs, cfg.lora))
  specs = _flat(trainer.specs.params)
  assert specs['blocks/layers/0/attn/query/lora_a'] == jax.sharding.PartitionSpec('fsdp')  # (embed, lora_rank)
  assert specs['blocks/layers/0/attn/query/lora_b'] == jax.sharding.PartitionSpec(None, 'tensor')  # (rank, heads, kv)
  assert specs['blocks/layers/0/mlp/up/lora_b'] == jax.sharding.PartitionSpec(None, 'tensor')
  start, end, state = _steps(trainer)
  changed = {p for p, x in _flat(start).items() if not np.array_equal(x, _flat(end)[p])}
  assert changed and all(lora.LORA_PARAM.search(p) for p in changed), sorted(changed)
  assert any(p.endswith('lora_b') for p in changed)
  # Exported to Hugging Face merged (a GPT2LMHeadModel, several files): transformers gives the adapted logits.
  transformers, torch = pytest.importorskip('transformers'), pytest.importorskip('torch')
  hf = load_exported(trainer, state, tmp_path / 'hf', transformers.AutoModelForCausalLM, max_shard_size='100KB')
  assert len([f for f in os.listdir(tmp_path / 'hf') if f.endswith('.safetensors')]) > 1
  assert not any('lora' in k for k in hf.state_dict())
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16))
  ours = nnx.jit(lambda m, t: tasks.eval_view(m)(t))(
    nnx.merge(trainer.graphdef, state.params, state.model_state), tokens
  )
  with torch.no_grad():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize('scan', [False, True])
def test_merged_adapters_equal_base_plus_adapter(scan):
  cfg = _lora_config()
  cfg.model.scan_layers = scan
  model = models.create(cfg.model, nnx.Rngs(0), cfg.lora)
  # Give B non-zero values so the adapters matter.
  for _, node in nnx.iter_graph(model):
    if isinstance(node, lora.LoRADense):
      node.lora_b[...] = jax.random.normal(jax.random.key(1), node.lora_b.shape) * 0.05
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 16)
  adapted = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
  base = models.create(cfg.model, nnx.Rngs(0))
  assert not np.allclose(adapted, np.asarray(base(tokens)), atol=1e-3)
  merged = lora.merge(model)
  params = nnx.to_pure_dict(nnx.state(merged, nnx.Param))
  assert not any(lora.LORA_PARAM.search(p) for p in _flat(params))
  nnx.update(base, params)
  np.testing.assert_allclose(np.asarray(base(tokens)), adapted, rtol=1e-5, atol=1e-5)


def test_lora_targets_matching_nothing_is_an_error():
  cfg = _lora_config(targets='attn/qkv$')
  with pytest.raises(
    ValueError,
    match=r"config.lora.targets='attn/qkv\$' matches no Dense layer; Dense layers are "
    r"e.g. \['blocks/layers/0/attn/key'",
  ):
    models.create(cfg.model, nnx.Rngs(0), cfg.lora)


def test_lora_step_computes_no_frozen_weight_gradients():
  """The logged grad norm is the adapters' (what clipping sees), so XLA drops the frozen weights' gradients:
  the compiled step's FLOPs fall by about a third (measured 0.74x of the step that also takes their norm)."""
  import dataclasses

  cfg = _lora_config()
  trainer = training.build(cfg, partitioning.make_mesh(cfg.mesh), lambda rngs: models.create(cfg.model, rngs, cfg.lora))
  flops = lambda t: training.compile_step(t, training.jit_train_step(t)).cost_analysis()['flops']
  assert flops(trainer) < 0.8 * flops(dataclasses.replace(trainer, labels=None))
  state = training.init_state(trainer)
  batch = {k: np.ones(v.shape, v.dtype) for k, v in trainer.batch_abstract.items()}
  grad_of = jax.jit(jax.grad(lambda p, b: trainer.task.loss(nnx.merge(trainer.graphdef, p, state.model_state), b)[0]))
  grads = _flat(jax.device_get(grad_of(state.params, batch)))
  expected = np.sqrt(sum(np.sum(np.square(g)) for p, g in grads.items() if '/lora_' in p))
  _, metrics = training.jit_train_step(trainer)(state, jax.device_put(batch, trainer.batch_shardings))
  np.testing.assert_allclose(float(metrics['grad_norm']), expected, rtol=1e-5)


def _tiny_hf_model(name, path):
  import torch
  import transformers

  torch.manual_seed(0)
  if name == 'gpt2_finetune':
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
  else:
    cfg = transformers.LlamaConfig(
      vocab_size=16,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
  return str(path)


@pytest.mark.parametrize('name', ['gpt2_finetune', 'llama_lora'])
def test_finetune_configs_take_their_lengths_from_the_imported_model(name, tmp_path):
  """The fine-tune configs fit any imported model: max_len and the training length follow its config.json
  (32 positions here, not the real models' 1024), unless the command line sets them."""
  import train

  module = importlib.import_module(f'configs.{name}')
  path = _tiny_hf_model(name, tmp_path / 'hf')
  cfg = module.get_config()
  cfg.init_from = path
  train.train_and_evaluate(cfg, None, dry_run=True)
  assert (cfg.model.max_len, cfg.dataset.seq_len) == (32, 32)
  cfg = module.get_config()
  cfg.init_from, cfg.dataset.seq_len = path, 16  # what --config.dataset.seq_len=16 does
  train.train_and_evaluate(cfg, None, dry_run=True)
  assert (cfg.model.max_len, cfg.dataset.seq_len) == (32, 16)


def test_a_wrong_init_from_path_is_named_before_anything_is_built(tmp_path, monkeypatch):
  """Not reported later as an unprepared dataset or a bad tokenizer directory: the path, at once."""
  import data
  import errors
  import train
  from configs import gpt2_finetune

  monkeypatch.setattr(training, 'build', lambda *a: pytest.fail('the model was built before init_from was checked'))
  monkeypatch.setattr(data, 'build', lambda *a: pytest.fail('the dataset was built before init_from was checked'))
  cfg = gpt2_finetune.get_config()
  cfg.init_from = missing = str(tmp_path / 'no_such_model')
  with pytest.raises(errors.ConfigError, match=rf"^config.init_from='{re.escape(missing)}' is neither "):
    train.train_and_evaluate(cfg, str(tmp_path / 'run'))
