"""The model zoo. Models name logical axes only; `partitioning` maps them to mesh axes via config rules.

The logical-axis names the models use (batch, length, embed, mlp, heads, kv_heads, kv, vocab, norm, layers,
expert, ...) are one vocabulary across the zoo, listed with their meanings and typical rules in docs/rules.md.
Every config's rules cover the names its model uses; a name without a rule is an error, never a silent replication.

A model is chosen by `config.model.name`; `create(config.model, rngs, config.lora)` builds it. Compute dtype and
parameter dtype come from `config.model.dtype` / `config.model.param_dtype` (e.g. bfloat16 compute
with float32 parameters); logits are float32 unless `config.model.logits_dtype` says bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections
from flax import nnx

from configs import schema
from errors import ConfigError
from models import bert, decoder, gpt2, lora, moe, resnet, simple, vit

# The dense decoder families (llama, qwen2, qwen3, mistral, gemma, gemma2, gemma3, phi3, olmo2) are one Decoder with
# each family's options (models/decoder.py FAMILIES); their Hugging Face mappings come from the same table.
MODELS: dict[str, Callable[..., nnx.Module]] = {
  **decoder.ENTRY,
  'gpt2': gpt2.GPT2,
  'bert': bert.Bert,
  'moe': moe.MoE,
  **{name: moe.MoE for name in moe.SPARSE_HF},  # qwen3_moe, deepseek_v3, gpt_oss
  'mlp': simple.MLP,
  'cnn': simple.CNN,
  'resnet': resnet.ResNet,
  'vit': vit.ViT,
}
# The choices of config.model.name; what each family reads and trains on is configs/schema.py FAMILIES.
schema.register('model.name', sorted(MODELS))

# Hugging Face importers (see models/hf_import.py): zoo model name -> its family's mapping.
HF_FAMILIES = {
  **decoder.HF_FAMILIES,
  'gpt2': gpt2.HF,
  'bert': bert.HF,
  'vit': vit.HF,
  'resnet': resnet.HF,
  'moe': moe.HF,
  **moe.SPARSE_HF,
}


def create(
  cfg: ml_collections.ConfigDict, rngs: nnx.Rngs, lora_cfg: ml_collections.ConfigDict | None = None
) -> nnx.Module:
  """The model named by cfg.name; with lora_cfg.rank > 0, LoRA adapters on the Dense layers
  whose path matches lora_cfg.targets (see models/lora.py)."""
  if cfg.name not in MODELS:
    raise ConfigError(f'config.model.name={cfg.name!r} is not a known model; known: {sorted(MODELS)}')
  model = MODELS[cfg.name](cfg, rngs=rngs)
  if lora_cfg is not None and lora_cfg.rank:
    model = lora.apply(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, rngs)
  return model
