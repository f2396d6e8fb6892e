"""Hugging Face import for Llama, BERT, ViT, ResNet and Mixtral (MoE): logits match transformers (torch,
fp32, eval mode) with the zoo model sharded on 8 simulated devices under a model-parallel preset; scanned
and unrolled stacks; sharded checkpoints (model.safetensors.index.json); Llama 3 rope scaling; a ViT head
replaced for another number of classes; ResNet's running statistics imported as model state; Mixtral's
per-expert hub layout and transformers 5's fused one, each device reading only its experts; unsupported
config.json settings name the field."""

import copy
import json
import os

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import models  # noqa: E402
from checkpointing import hf_config  # noqa: E402
from configs import bert as bert_config  # noqa: E402
from configs import llama as llama_config  # noqa: E402
from configs import moe as moe_config  # noqa: E402
from configs import resnet as resnet_config  # noqa: E402
from configs import vit as vit_config  # noqa: E402
from models import hf_export, hf_import, layers  # noqa: E402
from tests.conftest import assert_hf_round_trip, build_trainer, load_exported, train_steps  # noqa: E402
from training import pretrained, tasks  # noqa: E402

# Max |logits difference| allowed, fp32 on both sides. Measured (2-core CPU, 8 simulated devices; the
# tests print them with -s): llama GQA untied, sharded file 1.8e-7 (logits up to 0.59); llama tied +
# llama3 rope 6.0e-7 (1.40); BERT MLM 1.4e-6 (3.04; real positions); BERT classify 2.4e-7 (0.70);
# ViT 6.6e-7 (2.81); ResNet basic 9.5e-7 (4.34), bottleneck v1 7.2e-7 (2.06); Mixtral hub layout 1.2e-6
# (2.82), fused experts in a sharded file 1.7e-6 (2.82).
PARITY_ATOL = 1e-4
LLAMA3_ROPE = dict(
  rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


def forward(trainer, state, *args, **kwargs):
  """The model's output (eval mode) under the trainer's shardings."""

  def run(params, rest, *a):
    return tasks.eval_view(nnx.merge(trainer.graphdef, params, rest))(*a, **kwargs)

  return np.asarray(jax.jit(run)(state.params, state.model_state, *args))


def zoo_config(config_file, arg, hf_dir, dataset=None, **model):
  """The family's config (preset + tiny size) with the architecture read from hf_dir/config.json."""
  cfg = config_file.get_config(arg)
  cfg.init_from, cfg.dont_load = hf_dir, ''
  cfg.model.update(model)
  cfg.dataset.update(dataset or {})
  hf_config.adopt(cfg, models.HF_FAMILIES)
  return cfg


def import_hf(cfg):
  trainer = build_trainer(cfg)
  return trainer, pretrained.init_state(trainer, models.HF_FAMILIES)


def hf_config_json(path):
  with open(os.path.join(path, 'config.json')) as f:
    return json.load(f)


def save(model, path, **kwargs):
  model.save_pretrained(str(path), **kwargs)
  return str(path), model


# --- Llama ------------------------------------------------------------------------------------------

LLAMA_CASES = {  # name -> (LlamaConfig overrides, save_pretrained kwargs, zoo preset, scan_layers)
  'gqa_untied_sharded_file': (dict(tie_word_embeddings=False), dict(max_shard_size='20KB'), 'fsdp_tp,tiny', True),
  'tied_llama3_rope': (
    dict(tie_word_embeddings=True, rope_parameters=dict(rope_theta=10_000.0, **LLAMA3_ROPE)),
    {},
    'tp,tiny',
    False,
  ),
}


@pytest.fixture(scope='module', params=sorted(LLAMA_CASES))
def llama_case(request, tmp_path_factory):
  overrides, save_kw, arg, scan = LLAMA_CASES[request.param]
  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    **overrides,
  )
  path, model = save(transformers.LlamaForCausalLM(hf_cfg).eval(), tmp_path_factory.mktemp('hf_llama'), **save_kw)
  return request.param, path, model, arg, scan


def test_llama_logits_match_transformers_and_export_back(llama_case, tmp_path):
  name, path, hf_model, arg, scan = llama_case
  tied = hf_model.config.tie_word_embeddings
  if 'sharded' in name:
    assert os.path.isfile(os.path.join(path, 'model.safetensors.index.json'))
    assert len([f for f in os.listdir(path) if f.endswith('.safetensors')]) > 2
  cfg = zoo_config(llama_config, arg, path, scan_layers=scan, num_kv_heads=8, tie_embeddings=not tied)
  m = cfg.model  # from config.json, whatever the preset said
  assert (m.vocab_size, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.norm_eps) == (96, 64, 8, 4, 8, 1e-5)
  assert m.tie_embeddings == tied and m.max_len == 64  # the preset's 64 fits the 128 positions: kept
  trainer, state = import_hf(cfg)
  assert ('lm_head' in state.params) != tied
  q = (
    state.params['blocks']['layers']['self_attn']['query']['layer']['kernel']
    if scan
    else state.params['blocks']['layers'][0]['self_attn']['query']['layer']['kernel']
  )
  assert q.sharding.spec != jax.P() and q.sharding.spec == (
    trainer.specs.params['blocks']['layers']['self_attn']['query']['layer']['kernel']
    if scan
    else trainer.specs.params['blocks']['layers'][0]['self_attn']['query']['layer']['kernel']
  )
  if 'llama3' in name:
    assert dict(m.rope_scaling) == {**LLAMA3_ROPE, 'original_max_position_embeddings': 64.0}
    ours = np.asarray(layers.rope_frequencies(m.head_dim, m.rope_theta, m.rope_scaling))
    theirs = hf_model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    # The case covers all three regimes: kept (high), interpolated (medium) and divided (low frequencies).
    plain = np.asarray(layers.rope_frequencies(m.head_dim, m.rope_theta))
    assert ours[0] == plain[0] and plain[1] / 8 < ours[1] < plain[1] and np.allclose(ours[2:], plain[2:] / 8)
  else:
    assert m.rope_scaling is None
  tokens = np.random.default_rng(0).integers(0, 96, (2, 32))

  def err(state, hf_model, what):
    ours = forward(trainer, state, tokens)
    with torch.no_grad():
      theirs = hf_model(torch.tensor(tokens)).logits.numpy()
    e = float(np.abs(ours - theirs).max())
    print(f'llama {name} {what}: max |logits diff| {e:.2e} (logits up to {np.abs(theirs).max():.2f})')
    return e

  assert err(state, hf_model, 'import') < PARITY_ATOL
  # Export: HF -> zoo -> HF is bitwise; trained -> HF -> transformers gives the zoo's logits (the sharded case
  # is written in several files with an index, like its source).
  shard = dict(max_shard_size='20KB') if 'sharded' in name else {}
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip', **shard)
  if shard:
    assert os.path.isfile(tmp_path / 'round_trip' / 'model.safetensors.index.json')
  trained = train_steps(trainer, state)
  exported = load_exported(trainer, trained, tmp_path / 'trained', transformers.AutoModelForCausalLM, **shard)
  assert err(trained, exported, 'trained -> HF') < PARITY_ATOL
  # trained on 64 positions, it still takes the checkpoint's 128 (rotary: no table)
  assert exported.config.max_position_embeddings == hf_model.config.max_position_embeddings == 128


def test_llama_keeps_a_compatible_max_len_and_refuses_a_longer_one(llama_case):
  _, path, _, arg, _ = llama_case
  cfg = llama_config.get_config(arg)
  cfg.init_from, cfg.model.max_len = path, 32
  taken, kept = hf_config.adopt(cfg, models.HF_FAMILIES)
  assert cfg.model.max_len == 32 and kept == {'max_len': (32, 128)}
  assert taken['embed_dim'] == 64 and taken['num_kv_heads'] == 4 and 'max_len' not in taken  # every field logged
  cfg.model.max_len = 256
  with pytest.raises(
    ValueError,
    match=r'config.model.max_len=256 does not fit .* \(config.json gives 128\): longer '
    'than the 128 positions the checkpoint was trained for',
  ):
    hf_config.adopt(cfg, models.HF_FAMILIES)


def test_llama_rope_scaling_default_is_unchanged():
  """rope_scaling=None (the default) is plain RoPE; llama3 scaling changes only the low frequencies."""
  x = jax.random.normal(jax.random.key(0), (1, 40, 2, 8))
  pos = np.arange(40)[None]
  inv = 1.0 / (10_000.0 ** (np.arange(0, 8, 2) / 8))
  np.testing.assert_allclose(layers.rope_frequencies(8, 10_000.0), inv, rtol=1e-6)
  np.testing.assert_array_equal(layers.rope(x, pos, 10_000.0), layers.rope(x, pos, 10_000.0, None))
  scaled = layers.rope(x, pos, 10_000.0, LLAMA3_ROPE)
  np.testing.assert_array_equal(scaled[..., [0, 4]], layers.rope(x, pos, 10_000.0)[..., [0, 4]])  # highest freq
  assert not np.allclose(scaled, layers.rope(x, pos, 10_000.0))


# --- BERT -------------------------------------------------------------------------------------------

BERT_CASES = {  # head -> (HF class, zoo preset, scan_layers, model overrides)
  'mlm': (transformers.BertForMaskedLM, 'tp,tiny', True, dict(pad_vocab_to=8)),  # 100 rows padded to 104
  'classify': (transformers.BertForSequenceClassification, 'fsdp_tp,tiny,classify', False, dict(num_classes=3)),
}


@pytest.fixture(scope='module', params=sorted(BERT_CASES))
def bert_case(request, tmp_path_factory):
  cls = BERT_CASES[request.param][0]
  torch.manual_seed(0)
  hf_cfg = transformers.BertConfig(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
    type_vocab_size=2,
    num_labels=3,
    initializer_range=0.1,
  )  # logits of O(1)
  path, model = save(cls(hf_cfg).eval(), tmp_path_factory.mktemp('hf_bert'))
  return request.param, path, model


def test_bert_logits_match_transformers_and_export_back(bert_case, tmp_path):
  head, path, hf_model = bert_case
  _, arg, scan, overrides = BERT_CASES[head]
  cfg = zoo_config(bert_config, arg, path, scan_layers=scan, max_len=512, mlp_dim=32, **overrides)
  m = cfg.model
  assert (m.vocab_size, m.embed_dim, m.mlp_dim, m.max_len, m.head) == (100, 64, 128, 64, head)
  trainer, state = import_hf(cfg)
  tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
  valid = (np.arange(16) < np.array([[16], [11]])).astype(np.int32)  # row 2: 5 padded positions
  types = (np.arange(16) >= 6)[None].repeat(2, 0).astype(np.int32)

  def err(state, hf_model, what):
    ours = forward(trainer, state, tokens, valid_BL=valid, token_types_BL=types)
    with torch.no_grad():
      theirs = hf_model(
        input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid), token_type_ids=torch.tensor(types)
      ).logits.numpy()
    if head == 'mlm':  # real positions and real vocabulary only (padded positions are never scored)
      assert ours.shape == (2, 16, 104) and (ours[..., 100:] < -1e8).all()
      ours, theirs = ours[valid == 1][:, :100], theirs[valid == 1]
    e = float(np.abs(ours - theirs).max())
    print(f'bert {head} {what}: max |logits diff| {e:.2e} (logits up to {np.abs(theirs).max():.2f})')
    return e

  assert err(state, hf_model, 'import') < PARITY_ATOL
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip')
  trained = train_steps(trainer, state)
  exported = load_exported(trainer, trained, tmp_path / 'trained', type(hf_model))
  assert err(trained, exported, 'trained -> HF') < PARITY_ATOL


# --- ViT --------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def vit_dir(tmp_path_factory):
  torch.manual_seed(0)
  hf_cfg = transformers.ViTConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    image_size=16,
    patch_size=4,
    num_channels=3,
    num_labels=5,
    initializer_range=0.1,
  )
  return save(transformers.ViTForImageClassification(hf_cfg).eval(), tmp_path_factory.mktemp('hf_vit'))


def images(n=2):
  return np.random.default_rng(0).normal(size=(n, 16, 16, 3)).astype(np.float32)


def test_vit_logits_match_transformers_and_export_back(vit_dir, tmp_path):
  path, hf_model = vit_dir
  cfg = zoo_config(vit_config, 'tp,tiny', path, dataset=dict(num_classes=5), num_classes=5, embed_dim=32, patch_size=8)
  assert (cfg.model.embed_dim, cfg.model.patch_size, cfg.model.num_layers) == (64, 4, 2)
  trainer, state = import_hf(cfg)
  x = images()

  def err(state, hf_model, what):
    ours = forward(trainer, state, x)
    with torch.no_grad():
      theirs = hf_model(pixel_values=torch.tensor(x.transpose(0, 3, 1, 2))).logits.numpy()
    e = float(np.abs(ours - theirs).max())
    print(f'vit {what}: max |logits diff| {e:.2e} (logits up to {np.abs(theirs).max():.2f})')
    return e

  assert err(state, hf_model, 'import') < PARITY_ATOL
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip')
  trained = train_steps(trainer, state)
  exported = load_exported(trainer, trained, tmp_path / 'trained', transformers.AutoModelForImageClassification)
  assert err(trained, exported, 'trained -> HF') < PARITY_ATOL


def test_vit_new_head_for_other_classes(vit_dir):
  """A 5-label checkpoint fine-tuned on 3 classes: the classifier's shapes are the error until
  dont_load leaves the head fresh; everything else is the checkpoint's."""
  path, hf_model = vit_dir
  cfg = zoo_config(vit_config, 'fsdp,tiny', path, dataset=dict(num_classes=3), num_classes=3, scan_layers=False)
  trainer = build_trainer(cfg)
  with pytest.raises(
    hf_import.HFImportError,
    match=r'classifier.weight \(5, 64\) gives shape \(64, 5\) for zoo '
    r"parameter 'head/layer/kernel', which expects \(64, 3\)",
  ):
    pretrained.init_state(trainer, models.HF_FAMILIES)
  cfg.dont_load = '^head/'
  state = pretrained.init_state(trainer, models.HF_FAMILIES)
  kernel, bias = (np.asarray(state.params['head']['layer'][k]) for k in ('kernel', 'bias'))
  assert kernel.shape == (64, 3) and 0.01 < kernel.std() < 0.03 and not bias.any()  # fresh: normal(0.02), zeros
  # Everything before the head is the checkpoint's: the logits are the HF features through the new head.
  x = images()
  with torch.no_grad():
    features = hf_model.vit(pixel_values=torch.tensor(x.transpose(0, 3, 1, 2))).last_hidden_state[:, 0].numpy()
  err = float(np.abs(forward(trainer, state, x) - (features @ kernel + bias)).max())
  assert err < PARITY_ATOL, err
  # Exported, the old task's 5 label names are dropped (transformers names the 3 classes LABEL_i); the rest of
  # the source's config.json stays.
  base = hf_config_json(path)
  assert len(base['id2label']) == 5
  written = hf_export.config_json(models.HF_FAMILIES['vit'], cfg.model, np.float32, base)
  assert written['num_labels'] == 3 and 'id2label' not in written and 'label2id' not in written
  assert transformers.ViTConfig(**written).id2label == {0: 'LABEL_0', 1: 'LABEL_1', 2: 'LABEL_2'}


# --- ResNet ------------------------------------------------------------------------------------------

RESNET_CASES = {  # name -> (layer_type, downsample_in_bottleneck, zoo preset, scan_layers)
  'basic': ('basic', False, 'tp,tiny', True),
  'bottleneck_v1': ('bottleneck', True, 'fsdp,tiny', False),  # stride on the first 1x1 conv
}


@pytest.fixture(scope='module', params=sorted(RESNET_CASES))
def resnet_case(request, tmp_path_factory):
  block, v1, arg, scan = RESNET_CASES[request.param]
  x = 4 if block == 'bottleneck' else 1
  hf_cfg = transformers.ResNetConfig(
    num_channels=3,
    embedding_size=8,
    hidden_sizes=[8 * x, 16 * x, 32 * x],
    depths=[1, 2, 3],
    layer_type=block,
    downsample_in_bottleneck=v1,
    num_labels=5,
  )
  torch.manual_seed(0)
  model = transformers.ResNetForImageClassification(hf_cfg)
  gen = torch.Generator().manual_seed(0)
  for m in model.modules():  # non-trivial BatchNorm weights and running statistics
    if isinstance(m, torch.nn.BatchNorm2d):
      for t, v in (
        (m.running_mean, torch.randn(m.num_features, generator=gen) * 0.1),
        (m.running_var, torch.rand(m.num_features, generator=gen) + 0.5),
        (m.weight.data, torch.rand(m.num_features, generator=gen) + 0.5),
        (m.bias.data, torch.randn(m.num_features, generator=gen) * 0.1),
      ):
        t.copy_(v)
  path, model = save(model.eval(), tmp_path_factory.mktemp('hf_resnet'))
  return request.param, path, model, arg, scan


def test_resnet_logits_match_transformers_and_export_back(resnet_case, tmp_path):
  name, path, hf_model, arg, scan = resnet_case
  cfg = zoo_config(resnet_config, arg, path, dataset=dict(num_classes=5), num_classes=5, scan_layers=scan, width=16)
  m = cfg.model
  assert (m.width, tuple(m.stage_sizes), m.block, m.stride_in_1x1) == (8, (1, 2, 3), *RESNET_CASES[name][:2])
  trainer, state = import_hf(cfg)
  # Running statistics are model state, born in their shardings; num_batches_tracked is ignored.
  rest = state.model_state['stages'][2]['rest']['layers']  # HF's stages.2.layers.2 is the rest stack's layer 1
  mean = rest['bns'][0]['mean'][1] if scan else rest[1]['bns'][0]['mean']
  theirs_mean = hf_model.resnet.encoder.stages[2].layers[2].layer[0].normalization.running_mean.numpy()
  np.testing.assert_array_equal(np.asarray(mean), theirs_mean)
  stem = state.model_state['bn1']['var']
  assert stem.sharding == trainer.shardings.model_state['bn1']['var']
  np.testing.assert_array_equal(np.asarray(stem), hf_model.resnet.embedder.embedder.normalization.running_var.numpy())
  x = np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype(np.float32)
  pixels = torch.tensor(x.transpose(0, 3, 1, 2))

  def err(state, hf_model, what):
    ours = forward(trainer, state, x)
    with torch.no_grad():
      theirs = hf_model(pixel_values=pixels).logits.numpy()
    e = float(np.abs(ours - theirs).max())
    print(f'resnet {name} {what}: max |logits diff| {e:.2e} (logits up to {np.abs(theirs).max():.2f})')
    return e

  assert err(state, hf_model, 'import') < PARITY_ATOL
  theirs = hf_model(pixel_values=pixels).logits.detach().numpy()
  if m.stride_in_1x1:  # the case tells v1 from v1.5: the same weights striding on the 3x3 conv differ
    v15_cfg = copy.deepcopy(hf_model.config)
    v15_cfg.downsample_in_bottleneck = False
    v15 = transformers.ResNetForImageClassification(v15_cfg)
    v15.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
      assert np.abs(v15.eval()(pixel_values=pixels).logits.numpy() - theirs).max() > 100 * PARITY_ATOL
  assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip')  # running statistics included
  # Trained (train-mode BatchNorm moves the running statistics too) -> HF -> transformers: the zoo's eval logits.
  trained = train_steps(trainer, state)
  assert not np.array_equal(trained.model_state['bn1']['mean'], state.model_state['bn1']['mean'])
  exported = load_exported(trainer, trained, tmp_path / 'trained', transformers.AutoModelForImageClassification)
  assert err(trained, exported, 'trained -> HF') < PARITY_ATOL


# --- MoE from Mixtral -------------------------------------------------------------------------------

MIXTRAL_CASES = {  # name -> (save_pretrained kwargs, zoo preset, scan_layers)
  'hub_layout': ({}, 'ep,tiny', True),  # per-expert w1/w2/w3: what save_pretrained writes, and the hub has
  'fused_sharded_file': (dict(save_original_format=False, max_shard_size='20KB'), 'ep_tp,tiny', False),
}


@pytest.fixture(scope='module', params=sorted(MIXTRAL_CASES))
def mixtral_case(request, tmp_path_factory):
  torch.manual_seed(0)
  hf_cfg = transformers.MixtralConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.1,
  )
  save_kw, arg, scan = MIXTRAL_CASES[request.param]
  path, model = save(transformers.MixtralForCausalLM(hf_cfg).eval(), tmp_path_factory.mktemp('hf_mixtral'), **save_kw)
  return request.param, path, model, arg, scan


def test_mixtral_logits_match_transformers_and_export_back(mixtral_case, monkeypatch, tmp_path):
  name, path, hf_model, arg, scan = mixtral_case
  cfg = zoo_config(moe_config, arg, path, scan_layers=scan, pad_vocab_to=64, num_experts=4, head_dim=8)
  m = cfg.model
  assert (m.vocab_size, m.num_experts, m.top_k, m.mlp_dim, m.head_dim, m.num_kv_heads) == (96, 8, 2, 48, 16, 2)
  assert m.capacity_factor == 4.0  # the preset's 1.25 replaced: dropless, like Mixtral (num_experts / top_k)
  reads = {}  # HF key -> the regions read from it
  read = hf_import.HFDir.read
  monkeypatch.setattr(
    hf_import.HFDir,
    'read',
    lambda self, key, region: (reads.setdefault(key, []).append(tuple(region)), read(self, key, region))[1],
  )
  trainer, state = import_hf(cfg)
  # Each device reads only its own experts' tensors: expert e's by the devices holding it, not all 8.
  stack = state.params['blocks']['layers']
  gate, e_dim = (stack['moe']['gate'], 1) if scan else (stack[1]['moe']['gate'], 0)
  slices = [idx[e_dim] for idx in gate.sharding.devices_indices_map(gate.shape).values()]
  holders = [sum(s.start <= e < s.stop for s in slices) for e in range(8)]
  assert holders == [2] * 8  # experts over expert=4: 2 of 8 per device, each on 2 devices
  if name == 'hub_layout':
    assert [len(reads[f'model.layers.1.block_sparse_moe.experts.{e}.w1.weight']) for e in range(8)] == holders
  else:  # one fused tensor: each device reads the rows of its 2 experts (the gate half, then the up half)
    regions = reads['model.layers.1.mlp.experts.gate_up_proj']
    assert len(regions) == 2 * 8 and all(b - a == 2 for (a, b), *_ in regions), regions
  tokens = np.random.default_rng(0).integers(0, 96, (4, 32))

  def run(params, rest, x):
    return tasks.eval_view(nnx.merge(trainer.graphdef, params, rest))(x)

  ours, aux = jax.jit(run)(state.params, state.model_state, tokens)
  assert float(aux['dropped_fraction']) == 0.0
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(ours)
  assert ours.shape == (4, 32, 128) and (ours[..., 96:] < -1e8).all()  # 96 rows padded to 128, masked
  err = float(np.abs(ours[..., :96] - theirs).max())
  print(f'mixtral {name}: max |logits diff| {err:.2e} (logits up to {np.abs(theirs).max():.2f})')
  assert err < PARITY_ATOL, err
  monkeypatch.undo()
  if name == 'hub_layout':  # the export writes the hub's per-expert layout
    assert_hf_round_trip(trainer, state, path, tmp_path / 'round_trip')
  # Trained -> HF (the hub's layout, from either source) -> transformers: the zoo's logits (dropless).
  trained = train_steps(trainer, state)
  exported = load_exported(trainer, trained, tmp_path / 'trained', transformers.AutoModelForCausalLM)
  ours, aux = jax.jit(run)(trained.params, trained.model_state, tokens)
  with torch.no_grad():
    theirs = exported(torch.tensor(tokens)).logits.numpy()
  e = float(np.abs(np.asarray(ours)[..., :96] - theirs).max())
  print(f'mixtral {name} trained -> HF: max |logits diff| {e:.2e}')
  assert float(aux['dropped_fraction']) == 0.0 and e < PARITY_ATOL, e


@pytest.mark.parametrize('mixtral_case', ['hub_layout'], indirect=True)
def test_mixtral_checkpoint_missing_an_expert_names_it(mixtral_case, tmp_path):
  _, path, _, arg, _ = mixtral_case
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  del tensors['model.layers.1.block_sparse_moe.experts.5.w3.weight']
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(hf_config_json(path), f)
  cfg = zoo_config(moe_config, arg, str(tmp_path))
  trainer = build_trainer(cfg)
  with pytest.raises(
    hf_import.HFImportError,
    match=r'has model.layers.0.block_sparse_moe.experts.0.w3.weight but '
    r'not layers.1.block_sparse_moe.experts.5.w3.weight .* '
    r"'blocks/layers/moe/up'",
  ):
    pretrained.init_state(trainer, models.HF_FAMILIES)


# --- config.json settings the zoo does not implement ------------------------------------------------


def test_unsupported_settings_name_the_field(vit_dir, tmp_path):
  llama = hf_config_json(
    save(
      transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
          vocab_size=8, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
      ),
      tmp_path / 'llama',
    )[0]
  )
  resnet = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], layer_type='basic').to_dict()
  mixtral = transformers.MixtralConfig().to_dict()
  gpt2 = transformers.GPT2Config().to_dict()
  assert models.HF_FAMILIES['gpt2'].config(gpt2)['num_layers'] == 12
  assert models.HF_FAMILIES['resnet'].config(resnet)['stage_sizes'] == (3, 4, 6, 3)  # the defaults are supported
  assert models.HF_FAMILIES['moe'].config(mixtral)['num_experts'] == 8
  cases = [
    ('llama', dict(llama, hidden_act='gelu'), r"config.json hidden_act='gelu'"),
    ('llama', dict(llama, attention_bias=True), r'config.json attention_bias=True'),
    (
      'llama',
      dict(llama, rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)),
      r"config.json rope_parameters.rope_type='dynamic'",
    ),
    (
      'llama',
      dict(llama, rope_parameters=dict(rope_type='llama3', rope_theta=1e4, factor=2.0)),
      r"config.json rope_parameters: .*missing \['low_freq_factor', 'high_freq_factor'\]",
    ),
    ('bert', dict(hidden_act='gelu_new'), r"config.json hidden_act='gelu_new'"),
    ('bert', dict(position_embedding_type='relative_key'), r"config.json position_embedding_type='relative_key'"),
    ('vit', dict(hf_config_json(vit_dir[0]), qkv_bias=False), r'config.json qkv_bias=False'),
    ('resnet', dict(resnet, hidden_act='gelu'), r"config.json hidden_act='gelu'"),
    ('resnet', dict(resnet, downsample_in_first_stage=True), r'config.json downsample_in_first_stage=True'),
    (
      'resnet',
      dict(resnet, hidden_sizes=[64, 128, 256, 256]),
      r'config.json hidden_sizes=\[64, 128, 256, 256\]: .* has hidden_sizes \[64, 128, 256, 512\]',
    ),
    ('resnet', dict(resnet, layer_type='preactivation'), r"config.json layer_type='preactivation'"),
    ('moe', dict(mixtral, router_jitter_noise=0.1), r'config.json router_jitter_noise=0.1'),
    ('moe', dict(mixtral, sliding_window=4096), r'config.json sliding_window=4096'),
    ('moe', dict(mixtral, hidden_act='gelu'), r"config.json hidden_act='gelu'"),
    (
      'gpt2',
      dict(gpt2, scale_attn_by_inverse_layer_idx=True),
      r'config.json scale_attn_by_inverse_layer_idx=True: .* 1 / sqrt\(head_dim\) only',
    ),
    ('gpt2', dict(gpt2, scale_attn_weights=False), r'config.json scale_attn_weights=False'),
    ('gpt2', dict(gpt2, add_cross_attention=True), r'config.json add_cross_attention=True'),
  ]
  for family, c, message in cases:
    with pytest.raises(hf_import.HFImportError, match=message):
      models.HF_FAMILIES[family].config(c)
  # Older config.json files: top-level rope_theta and rope_scaling {type: llama3}.
  old = {k: v for k, v in llama.items() if k != 'rope_parameters'}
  fields = models.HF_FAMILIES['llama'].config(
    dict(
      old,
      rope_theta=5e5,
      max_position_embeddings=4096,
      rope_scaling=dict(type='llama3', factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0),
    )
  )
  assert fields['rope_theta'] == 5e5 and dict(fields['rope_scaling'])['original_max_position_embeddings'] == 4096
