"""A Hugging Face model directory's config.json adopted into config.model (its architecture), before a model is
built from it: fine-tuning (training/pretrained.py) and decoding (generation/) start from one alike. Its weights are
streamed by models/hf_import.py."""

from __future__ import annotations

from typing import Any

import ml_collections

from configs import schema
from errors import ConfigError
from models import hf_import


def family(config: ml_collections.ConfigDict, families: dict[str, hf_import.Family]) -> hf_import.Family:
  name = config.model.name
  if name not in families:
    raise ConfigError(
      f'init_from={config.init_from!r} is a Hugging Face directory, but config.model.name={name!r} '
      f'has no Hugging Face importer; families with one: {sorted(families)}'
    )
  return families[name]


def adopt(
  config: ml_collections.ConfigDict,
  families: dict[str, hf_import.Family],
) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
  """Reads the architecture (sizes, heads, eps, ...) from the HF config.json into config.model.

  A field the family lets differ (`Family.keep`, e.g. Llama's max_len: rotary positions have no table)
  keeps config.model's value when it works with the checkpoint, and is an error naming both values when
  it does not. A checkpoint of another family with the same fields (a Qwen3 directory for a Llama config)
  switches config.model.name to it. Returns (every field taken from config.json, {kept field: (ours,
  config.json's)}) for the log.
  """
  hf = hf_import.HFDir(config.init_from)
  fam = family(config, families)
  model_type = hf.config.get('model_type')
  name = config.model.name
  if model_type not in fam.model_types:
    # A family with the same config fields (the decoder families: models/decoder.py) is taken in its place, so a
    # config of one (configs/llama_sft.py) fine-tunes a checkpoint of any (a Qwen3 or Gemma 3 directory).
    name = next(
      (n for n, f in families.items() if model_type in f.model_types and schema.FAMILIES[n] == schema.FAMILIES[name]),
      None,
    )
    if name is None:
      raise ConfigError(
        f'{config.init_from}/config.json has model_type={model_type!r}, but config.model.name='
        f'{config.model.name!r} imports {list(fam.model_types)}'
      )
    fam = families[name]
  fields = fam.config(hf.config)
  if name != config.model.name:
    fields = {'name': name, **fields}
  unknown = sorted(k for k in fields if k not in config.model)
  if unknown:
    raise ConfigError(f'config.model has no field(s) {unknown} that {config.model.name} reads from config.json')
  kept = {}
  for name, check in fam.keep.items():
    ours, theirs = config.model.get(name), fields.get(name)
    if name in fields and ours is not None and ours != theirs:
      why = check(ours, theirs)
      if why:
        raise ConfigError(
          f'config.model.{name}={ours!r} does not fit {config.init_from} (config.json gives {theirs!r}): {why}'
        )
      kept[name] = (ours, fields.pop(name))
  config.model.update(fields)
  return fields, kept
