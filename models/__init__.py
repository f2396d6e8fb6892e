"""The model zoo. Models name logical axes only; `partitioning` maps them to mesh axes via config rules.

Logical-axis vocabulary (one set of names across the zoo):

| name     | meaning                                               | typical rule           |
|----------|-------------------------------------------------------|------------------------|
| batch    | examples in a batch (activations)                     | ('data', 'fsdp')       |
| length   | sequence positions (activations; position table rows) | None (or 'sequence')   |
| embed    | model width d_model (params and activations)          | 'fsdp', fallback None  |
| mlp      | feed-forward hidden width                             | 'tensor'               |
| heads    | attention heads                                       | 'tensor'               |
| kv       | width of one attention head                           | None                   |
| vocab    | vocabulary entries (embedding rows, logits)           | 'tensor'               |
| norm     | LayerNorm/RMSNorm scale and bias                      | None                   |

A model is chosen by `config.model.name`; `create(config.model, rngs)` builds it.
"""
from __future__ import annotations

from collections.abc import Callable

import ml_collections
from flax import nnx

from models import gpt
from partitioning import ConfigError

MODELS: dict[str, Callable[..., nnx.Module]] = {
    'gpt': gpt.GPT,
}


def create(cfg: ml_collections.ConfigDict, rngs: nnx.Rngs) -> nnx.Module:
  if cfg.name not in MODELS:
    raise ConfigError(f'config.model.name={cfg.name!r} is not a known model; known: {sorted(MODELS)}')
  return MODELS[cfg.name](cfg, rngs=rngs)
