"""The model zoo. Models name logical axes only; `partitioning` maps them to mesh axes via config rules.

Logical-axis vocabulary (one set of names across the zoo; every config's rules cover the names
its model uses, and a name without a rule is an error, never a silent replication):

| name       | meaning                                                        | typical rule            |
|------------|----------------------------------------------------------------|-------------------------|
| batch      | examples in a batch (activations, batch fields)                | ('data', 'fsdp')        |
| length     | sequence positions (activations; position-table rows)          | None (or 'context')     |
| embed      | model width d_model (params and activations)                   | 'fsdp', fallback None   |
| mlp        | feed-forward hidden width                                      | 'tensor'                |
| heads      | query attention heads                                          | 'tensor'                |
| kv_heads   | key/value heads (fewer than heads under grouped-query attn)    | 'tensor', fallback None |
| kv         | width of one attention head                                    | None                    |
| vocab      | vocabulary entries (embedding rows, logits)                    | 'tensor'                |
| norm       | LayerNorm/RMSNorm/BatchNorm scale, bias and statistics         | None                    |
| layers     | the stacked-layer axis of scanned blocks (`scan_layers=True`)  | None                    |
| lora_rank  | the rank of LoRA adapters (models/lora.py)                     | None                    |
| expert     | experts of a mixture-of-experts layer                          | 'expert'                |
| classes    | classifier outputs                                             | None                    |
| token_types| token-type (segment A/B) embedding rows (BERT)                 | None                    |
| height     | image rows (activations; rows of conv and image-input kernels) | None                    |
| width      | image columns (activations; kernel columns likewise)           | None                    |
| channels   | input image channels (and the kernel dim that reads them)      | None                    |
| conv_in    | input features of a conv kernel (or of a dense over conv maps) | None or 'fsdp'          |
| conv_out   | output features of a convolution kernel (and its activations)  | None or 'tensor'        |
| cache_batch| rows of a KV cache (generation; training/generate.py)          | like 'batch'            |
| cache_length| slots of a KV cache                                           | None                    |
| cache_heads| key/value heads of a KV cache                                  | like 'kv_heads'         |
| cache_kv   | head width of a KV cache                                       | None                    |

A model is chosen by `config.model.name`; `create(config.model, rngs, config.lora)` builds it. Compute dtype and
parameter dtype come from `config.model.dtype` / `config.model.param_dtype` (e.g. bfloat16 compute
with float32 parameters); logits are float32 unless `config.model.logits_dtype` says bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections
from flax import nnx

from errors import ConfigError
from models import bert, gpt2, llama, lora, moe, resnet, simple, vit

MODELS: dict[str, Callable[..., nnx.Module]] = {
  'gpt2': gpt2.GPT2,
  'llama': llama.Llama,
  'bert': bert.Bert,
  'moe': moe.MoE,
  'mlp': simple.MLP,
  'cnn': simple.CNN,
  'resnet': resnet.ResNet,
  'vit': vit.ViT,
}

# Hugging Face importers (see models/hf_import.py): zoo model name -> its family's mapping.
HF_FAMILIES = {
  'gpt2': gpt2.HF,
  'llama': llama.HF,
  'bert': bert.HF,
  'vit': vit.HF,
  'resnet': resnet.HF,
  'moe': moe.HF,
}


def create(
  cfg: ml_collections.ConfigDict, rngs: nnx.Rngs, lora_cfg: ml_collections.ConfigDict | None = None
) -> nnx.Module:
  """The model named by cfg.name; with lora_cfg.rank > 0, LoRA adapters on the Dense layers
  whose path matches lora_cfg.targets (see models/lora.py)."""
  if cfg.name not in MODELS:
    raise ConfigError(f'config.model.name={cfg.name!r} is not a known model; known: {sorted(MODELS)}')
  model = MODELS[cfg.name](cfg, rngs=rngs)
  if lora_cfg is not None and lora_cfg.get('rank', 0):
    model = lora.apply(model, lora_cfg.rank, lora_cfg.get('alpha', lora_cfg.rank), lora_cfg.targets, rngs)
  return model
