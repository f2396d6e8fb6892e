"""Starting from pretrained weights: `config.init_from` names a checkpoint of this project (params
only; the optimizer starts fresh) or a Hugging Face model directory (config.json + safetensors; params
and model state such as BatchNorm running statistics).

`config.dont_load` (regex over zoo parameter paths, e.g. '^classifier/') leaves matching parameters
freshly initialised (a new head with another number of classes). Everything else must be explained:
missing or unexpected parameters are an error that lists them.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from checkpointing import hf_config, weights
from errors import ConfigError
from models import hf_import, lora
from partitioning import path_str
from training import optim
from training.trainer import Trainer, TrainState, split_model

# A length derived from the model is at most this many tokens: a whole context per example (131,072 positions
# for Llama 3.2) would not fit a fine-tune's memory.
LONGEST_DERIVED_SEQ_LEN = 1024


def derive_lengths(config: ml_collections.ConfigDict, fallback: int | None = None) -> None:
  """Lengths a config file leaves unset (None: the fine-tune configs) follow the model: config.model.max_len is
  config.json's (checkpointing.hf_config), config.dataset.seq_len the model's max_len, at most LONGEST_DERIVED_SEQ_LEN.
  `fallback` stands in for a max_len no config.json gave (a dry run whose init_from is not there)."""
  has_max_len = 'max_len' in config.model
  if has_max_len and config.model.max_len is None:
    if fallback is None:
      raise ConfigError(
        'config.model.max_len is unset: it follows the config.json of a Hugging Face config.init_from; '
        'set config.init_from to one, or set config.model.max_len'
      )
    config.model.max_len = fallback
  if 'dataset' in config and 'seq_len' in config.dataset and config.dataset.seq_len is None:
    if not has_max_len:
      raise ConfigError(f'config.dataset.seq_len is unset, and config.model.name={config.model.name!r} has no max_len')
    config.dataset.seq_len = min(config.model.max_len, LONGEST_DERIVED_SEQ_LEN)


def check_path(path: str) -> None:
  """config.init_from exists: a Hugging Face model directory or a directory (a checkpoint of this project, whose
  shapes `check_source` reads). ConfigError naming the path, before anything is built from it."""
  _is_hf_dir(path)


def check_dont_load(trainer: Trainer) -> None:
  """config.dont_load must be a regex that matches some parameter (or model state) path: one that matches none
  would load everything, silently. Cheap (abstract shapes): train.py can call it before compiling."""
  dont_load = trainer.config.dont_load
  if not dont_load:
    return
  try:
    pattern = re.compile(dont_load)
  except re.error as e:
    raise ConfigError(f'config.dont_load={dont_load!r} is not a valid regex: {e}') from None
  paths = list(_flat(trainer.abstract.params)) + list(_flat(trainer.abstract.model_state))
  if not any(pattern.search(p) for p in paths):
    raise ConfigError(
      f'config.dont_load={dont_load!r} matches no parameter path (everything would be loaded); paths '
      f'are e.g. {optim.example_paths(paths)}'
    )


def _not_loaded(config: ml_collections.ConfigDict) -> str | None:
  """The regex of the parameters left to fresh initialisation: config.dont_load, and LoRA's adapters (B = 0)."""
  dont_load = config.dont_load or None
  if config.lora.rank:
    dont_load = '|'.join(f'(?:{r})' for r in (dont_load, lora.LORA_PARAM.pattern) if r)
  return dont_load


def check_source(trainer: Trainer) -> None:
  """config.init_from's checks that read no weights (train.py runs them before compiling): dont_load matches a
  parameter; the path is a Hugging Face directory (its config.json was adopted by checkpointing.hf_config; tensor
  shapes are checked as they stream) or a checkpoint of this project whose parameter shapes, read from its
  metadata, are the model's. ConfigError / CheckpointError naming the culprit."""
  check_dont_load(trainer)
  path = trainer.config.init_from
  if not _is_hf_dir(path):
    weights.check_weights(path, trainer.checkpoint_target()['params'], dont_load=_not_loaded(trainer.config))


def _is_hf_dir(path: str) -> bool:
  """Whether init_from is a Hugging Face directory (else a checkpoint directory of this project); ConfigError
  for a path that is neither, and for a Hugging Face directory without safetensors weights."""
  if hf_import.is_hf_dir(path):
    return True
  if os.path.isfile(os.path.join(path, 'config.json')):  # PyTorch weights only (pytorch_model.bin)
    hf_import.HFDir(path)  # its HFImportError says how to convert them
  if not os.path.isdir(path):
    hub = (
      ''
      if '/' in path
      else (
        '; as a Hugging Face hub id it needs its owner (owner/name, e.g. openai-community/gpt2: legacy short '
        'names are not looked up) and is read from the Hugging Face cache (HF_HOME; offline, with '
        'HF_HUB_OFFLINE=1, fetch it first where the hub can be reached: hf download owner/name)'
      )
    )
    raise ConfigError(
      f'config.init_from={path!r} is neither a checkpoint directory of this project nor a '
      f'Hugging Face model directory (config.json + *.safetensors): no such directory{hub}'
    )
  return False


def init_state(trainer: Trainer, families: dict[str, hf_import.Family]) -> TrainState:
  """The train state with pretrained params (born in their shardings), fresh optimizer state,
  and fresh initialisation for parameters matching config.dont_load."""
  config = trainer.config
  path, dont_load = config.init_from, _not_loaded(config)
  check_dont_load(trainer)
  loaded_state = None
  if _is_hf_dir(path):
    got = hf_import.import_weights(
      hf_import.HFDir(path),
      hf_config.family(config, families),
      config.model,
      trainer.abstract.params,
      trainer.shardings.params,
      trainer.abstract.model_state,
      trainer.shardings.model_state,
      dont_load,
    )
    loaded, loaded_state = got.params, got.model_state
  else:
    loaded = weights.load_params(path, trainer.checkpoint_target()['params'], dont_load=dont_load)
  return with_params(trainer, loaded, loaded_state)


def _flat(tree: Any) -> dict[str, Any]:
  return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def with_params(trainer: Trainer, loaded: Any, loaded_state: Any = None) -> TrainState:
  """A fresh TrainState whose params are `loaded` where given (a partial tree) and freshly
  initialised elsewhere, likewise its model state (e.g. BatchNorm running statistics) from
  `loaded_state`; the optimizer state is initialised for the final params. One jit: the random
  initialisation of loaded leaves is dead code that XLA removes."""
  loaded_flat, state_flat = _flat(loaded), _flat(loaded_state or {})
  param_paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(trainer.abstract.params)]
  state_paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(trainer.abstract.model_state)]
  treedef, state_treedef = jax.tree.structure(trainer.abstract.params), jax.tree.structure(trainer.abstract.model_state)

  def init(loaded_flat, state_flat):
    _, params, rest = split_model(trainer.make_model(nnx.Rngs(trainer.config.seed)))
    fresh = dict(zip(param_paths, jax.tree.leaves(params), strict=True))
    merged = jax.tree.unflatten(treedef, [loaded_flat.get(p, fresh[p]) for p in param_paths])
    fresh_state = dict(zip(state_paths, jax.tree.leaves(rest), strict=True))
    rest = jax.tree.unflatten(state_treedef, [state_flat.get(p, fresh_state[p]) for p in state_paths])
    return TrainState(jnp.zeros((), jnp.int32), merged, trainer.tx.init(merged), rest)

  in_shardings = (
    {p: s for p, s in _flat(trainer.shardings.params).items() if p in loaded_flat},
    {p: s for p, s in _flat(trainer.shardings.model_state).items() if p in state_flat},
  )
  return jax.jit(init, in_shardings=in_shardings, out_shardings=trainer.shardings, donate_argnums=(0, 1))(
    loaded_flat, state_flat
  )
