"""config.model -> Hugging Face config.json (`to_hf_config` in each family's file, the PyTorch peer's
architecture): the import mapping reads the same architecture back (real and tiny sizes), and the
transformers model built from it has the zoo's parameter count (tiny sizes)."""

import json
import os

os.environ['HF_HUB_OFFLINE'] = '1'

import pytest  # noqa: E402
import transformers  # noqa: E402

from configs import bert as bert_config  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402
from configs import llama as llama_config  # noqa: E402
from configs import moe as moe_config  # noqa: E402
from configs import resnet as resnet_config  # noqa: E402
from configs import vit as vit_config  # noqa: E402
from models import bert, gpt2, hf_import, layers, llama, moe, resnet, vit  # noqa: E402

LLAMA3_ROPE = (
  ('rope_type', 'llama3'),
  ('factor', 32.0),
  ('low_freq_factor', 1.0),
  ('high_freq_factor', 4.0),
  ('original_max_position_embeddings', 8192),
)
# name -> (config file, argument, model overrides, family module, transformers Auto class)
CASES = {
  'gpt2': (gpt2_config, 'real', {}, gpt2, transformers.AutoModelForCausalLM),
  'gpt2_tiny': (gpt2_config, 'tiny', {}, gpt2, transformers.AutoModelForCausalLM),
  'llama': (llama_config, 'real', {}, llama, transformers.AutoModelForCausalLM),
  'llama_llama3_rope_untied': (
    llama_config,
    'real',
    dict(rope_scaling=LLAMA3_ROPE, tie_embeddings=False),
    llama,
    transformers.AutoModelForCausalLM,
  ),
  'llama_tiny': (llama_config, 'tiny', {}, llama, transformers.AutoModelForCausalLM),
  'llama_tiny_llama3_rope_untied': (
    llama_config,
    'tiny',
    dict(rope_scaling=LLAMA3_ROPE, tie_embeddings=False),
    llama,
    transformers.AutoModelForCausalLM,
  ),
  'vit': (vit_config, 'b16', {}, vit, transformers.AutoModelForImageClassification),
  'vit_tiny': (vit_config, 'tiny', {}, vit, transformers.AutoModelForImageClassification),
  'bert': (bert_config, 'base', {}, bert, transformers.AutoModelForMaskedLM),
  'bert_tiny': (bert_config, 'tiny', {}, bert, transformers.AutoModelForMaskedLM),
  'bert_classify': (bert_config, 'base,classify', {}, bert, transformers.AutoModelForSequenceClassification),
  'bert_tiny_classify': (bert_config, 'tiny,classify', {}, bert, transformers.AutoModelForSequenceClassification),
  'moe': (moe_config, 'small', {}, moe, transformers.AutoModelForCausalLM),
  'moe_tiny': (moe_config, 'tiny', {}, moe, transformers.AutoModelForCausalLM),
  'resnet50': (resnet_config, 'resnet50', {}, resnet, transformers.AutoModelForImageClassification),
  'resnet18': (resnet_config, 'resnet18', {}, resnet, transformers.AutoModelForImageClassification),
  'resnet_tiny': (resnet_config, 'tiny', {}, resnet, transformers.AutoModelForImageClassification),
  'resnet_tiny_bottleneck_v1': (
    resnet_config,
    'tiny',
    dict(block='bottleneck', stride_in_1x1=True),
    resnet,
    transformers.AutoModelForImageClassification,
  ),
}
TINY = sorted(k for k in CASES if 'tiny' in k)


def case(name):
  config_file, arg, overrides, family, auto = CASES[name]
  cfg = config_file.get_config(arg).model
  cfg.update(overrides)
  return cfg, family, auto


@pytest.mark.parametrize('name', sorted(CASES))
def test_import_mapping_reads_the_same_architecture_back(name):
  cfg, family, _ = case(name)
  d = json.loads(json.dumps(family.to_hf_config(cfg)))  # what a config.json file holds
  fields = family.HF.config(d)
  expected = {k: cfg.get(k) for k in fields}
  if 'head_dim' in fields:  # MoE configs leave these to the defaults the model derives
    expected.update(
      head_dim=cfg.get('head_dim') or cfg.embed_dim // cfg.num_heads,
      num_kv_heads=cfg.get('num_kv_heads') or cfg.num_heads,
    )
  if 'rope_scaling' in fields:  # configs hold it as pairs or None; the importer gives the checked form
    expected['rope_scaling'] = layers.rope_scaling_params(cfg.get('rope_scaling'))
  if family is moe:  # no config.json field: the importer makes it dropless, like Mixtral
    expected['capacity_factor'] = cfg.num_experts / cfg.top_k
  assert fields == expected
  hf_cfg = transformers.AutoConfig.for_model(**d)
  assert hf_cfg.model_type == d['model_type'] and type(hf_cfg).__name__ != 'PretrainedConfig'
  if 'num_classes' in cfg:  # not an architecture field on import (the dataset decides), but exported
    assert hf_cfg.num_labels == cfg.num_classes
  if family is moe:
    assert hf_cfg.router_z_loss_coef == cfg.router_z_loss_weight
    assert hf_cfg.router_aux_loss_coef == pytest.approx(cfg.aux_loss_weight * cfg.num_layers / cfg.top_k)


def test_moe_exported_aux_loss_coefficient_gives_mixtral_the_same_penalty():
  """Where every layer routes alike, transformers' Mixtral load-balancing loss with the exported coefficient
  equals the zoo's weighted aux loss (Mixtral: over all layers' tokens, counting top_k assignments each)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from transformers.models.mixtral import modeling_mixtral  # pylint: disable=g-import-not-at-top

  cfg = moe_config.get_config('tiny').model
  cfg.update(num_layers=4, num_experts=6, top_k=2, aux_loss_weight=0.01)
  logits = np.random.default_rng(0).standard_normal((1, 32, cfg.num_experts)).astype(np.float32) * 2
  _, _, stats = moe.route(jnp.asarray(logits), cfg.top_k, 32)
  ours = cfg.aux_loss_weight * cfg.num_layers * float(stats['load_balance_loss'])
  coef = moe.to_hf_config(cfg)['router_aux_loss_coef']
  theirs = coef * float(
    modeling_mixtral.load_balancing_loss_func((torch.tensor(logits[0]),) * cfg.num_layers, cfg.num_experts, cfg.top_k)
  )
  np.testing.assert_allclose(theirs, ours, rtol=1e-5)


def test_families_register_the_export():
  for family in (gpt2, llama, vit, bert, moe, resnet):
    assert family.HF.to_config is family.to_hf_config


def num_hf_params(d: dict, auto) -> int:
  """Parameters of the transformers model built from config.json `d` (tied tensors counted once)."""
  model = auto.from_config(transformers.AutoConfig.for_model(**d))
  return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('name', TINY)
def test_transformers_model_has_the_zoo_parameter_count(name):
  # Like for like: the tiny configs have no vocabulary padding (pad_vocab_to=1); both sides count tied
  # embeddings once; BERT's MLM model has no pooler (BertForMaskedLM, zoo head 'mlm') and its classifier has
  # the pooler and no MLM head (BertForSequenceClassification, zoo head 'classify'), as in the zoo.
  cfg, family, auto = case(name)
  assert num_hf_params(family.to_hf_config(cfg), auto) == family.num_params(cfg)


@pytest.mark.parametrize('name', ['gpt2_tiny', 'bert_tiny', 'bert_tiny_classify', 'moe_tiny'])
def test_vocab_padding_is_the_only_parameter_difference(name):
  # The zoo pads the vocabulary rows (embedding, untied head, MLM decoder bias) to a multiple of
  # pad_vocab_to; transformers has the real vocabulary. At the real sizes this is GPT-2's 36,096
  # (47 rows x 768) and BERT's 53,830 (70 x 768 + 70 bias) / 53,760 (classify: no decoder bias).
  cfg, family, auto = case(name)
  cfg.pad_vocab_to = 128
  rows = -(-cfg.vocab_size // 128) * 128 - cfg.vocab_size
  per_row = {
    'gpt2_tiny': cfg.embed_dim,
    'bert_tiny': cfg.embed_dim + 1,
    'bert_tiny_classify': cfg.embed_dim,
    'moe_tiny': 2 * cfg.embed_dim,
  }[name]  # MoE: embedding and untied head
  assert family.num_params(cfg) - num_hf_params(family.to_hf_config(cfg), auto) == rows * per_row


def test_moe_config_json_the_zoo_cannot_build_names_the_field():
  d = moe.to_hf_config(case('moe_tiny')[0])
  for field, value in (('sliding_window', 4096), ('hidden_act', 'gelu')):
    with pytest.raises(hf_import.HFImportError, match=f'config.json {field}={value!r}'):
      moe.HF.config(dict(d, **{field: value}))
