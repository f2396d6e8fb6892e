"""Exporting trained weights: as a Hugging Face model directory (export_hf; the family's import table read
backwards, models/hf_export.py), or with LoRA adapters merged as a params-only checkpoint of this project.
`export.py --workdir DIR` rebuilds the run's model from the config kept beside its checkpoints
(checkpointing/run_config.py).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from checkpointing import weights
from data import tokens
from errors import ConfigError
from models import hf_export, hf_import, lora
from partitioning import path_str
from training.trainer import Trainer, TrainState

DTYPES = ('float32', 'bfloat16', 'float16', 'float64')  # the weights' dtypes on disk (export.py --dtype)
SHARD_SIZE = re.compile(r'(\d+(\.\d*)?|\.\d+)\s*[KMGT]B', re.IGNORECASE)  # huggingface_hub's sizes: 5GB, 500MB
# What write_hf writes or copies into its directory (glob patterns): the files `overwrite` removes first.
WRITTEN = (
  'model*.safetensors',
  'model.safetensors.index.json',
  'config.json',
  'generation_config.json',
  *hf_import.TOKENIZER_FILES,
)


def _merged_weights(trainer: Trainer, params: Any, model_state: Any) -> Any:
  """Params with LoRA adapters folded into the base kernels (the base model's parameter paths)."""

  def merge(params, rest):
    model = lora.merge(nnx.merge(trainer.graphdef, params, rest))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))

  return jax.jit(merge)(params, model_state)


def _host(x: jax.Array) -> np.ndarray:
  """One whole array on this host (gathered across processes when it spans several), in a fresh buffer:
  np.asarray(x) would also keep the copy cached on `x`, i.e. the whole model by the end of an export."""
  if not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  out = np.empty(x.shape, x.dtype)
  for shard in x.addressable_shards:
    if shard.replica_id == 0:
      out[shard.index] = np.asarray(shard.data)
  return out


def check_options(dtype: str | None, max_shard_size: str) -> None:
  """export.py's --dtype and --max_shard_size, before anything is built (numpy and huggingface_hub would raise
  a TypeError / ValueError mid-export)."""
  if dtype is not None and dtype not in DTYPES:
    raise ConfigError(f"--dtype={dtype!r}: one of {', '.join(DTYPES)} (default: the parameters' dtype)")
  size = SHARD_SIZE.fullmatch(str(max_shard_size).strip())
  if not size or float(size[1]) <= 0:
    raise ConfigError(
      f'--max_shard_size={max_shard_size!r}: a positive number with a unit KB, MB, GB or TB, e.g. 5GB or 500MB'
    )


def check_out_dir(
  config: ml_collections.ConfigDict, out_dir: str, *, overwrite: bool = False, checkpoints: str | None = None
) -> None:
  """Refuses (ConfigError), before anything is read or written, an export directory that is a file, one that
  the export reads from (config.init_from, a local tokenizer directory config.dataset.tokenizer, the checkpoint
  directory `checkpoints` or anything inside it), or a non-empty one unless `overwrite`."""
  out = os.path.realpath(out_dir)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f'export directory {out_dir!r} is an existing file, not a directory')
  tok = config.dataset.get('tokenizer')  # text tasks' datasets only
  for field, source in (('config.init_from', config.init_from), ('config.dataset.tokenizer', tok)):
    if isinstance(source, str) and source and os.path.isdir(source) and os.path.realpath(source) == out:
      raise ConfigError(
        f"export directory {out_dir!r} is the run's {field} ({source}), which the export reads: "
        'writing there would replace its files; give another directory'
      )
  root = os.path.realpath(checkpoints) if checkpoints else None
  if root and (out == root or out.startswith(root + os.sep)):
    raise ConfigError(
      f'export directory {out_dir!r} is {"" if out == root else "inside "}the checkpoint directory '
      f'{root}, which the export reads; give another directory'
    )
  present = sorted(os.listdir(out)) if os.path.isdir(out) else []
  if present and not overwrite:
    raise ConfigError(
      f'export directory {out_dir!r} is not empty ({", ".join(present[:4])}'
      f'{", ..." if len(present) > 4 else ""}): pass --overwrite (overwrite=True) to replace the '
      'files of an earlier export there, or give an empty directory'
    )


def _clear_out_dir(out_dir: str) -> list[str]:
  """Removes the files an export writes or copies (WRITTEN) from out_dir, nothing else; returns their names."""
  paths = sorted(
    {
      p
      for pattern in WRITTEN
      for p in glob.glob(os.path.join(glob.escape(out_dir), pattern))
      if os.path.isfile(p) or os.path.islink(p)
    }
  )
  for path in paths:
    os.remove(path)
  return [os.path.basename(p) for p in paths]


def export_hf(
  trainer: Trainer,
  checkpoints: str,
  out_dir: str,
  families: dict[str, hf_import.Family],
  *,
  dtype: Any = None,
  max_shard_size: int | str = '5GB',
  overwrite: bool = False,
) -> dict[str, Any]:
  """Writes a checkpoint (`checkpoints`: a run's checkpoint directory, latest step, or one step's) as a
  Hugging Face directory (see write_hf); the optimizer state is not read. out_dir is checked (check_out_dir:
  not the run's checkpoints or source directories; empty unless `overwrite`) before anything is restored."""
  root = os.path.dirname(weights.step_directory(checkpoints))  # the run's checkpoint directory
  check_out_dir(trainer.config, out_dir, overwrite=overwrite, checkpoints=root)
  target = trainer.checkpoint_target()
  loaded, step_dir = weights.load_weights(checkpoints, target['params'], target['model_state'])
  stats = write_hf(
    trainer,
    loaded['params'],
    loaded['model_state'],
    out_dir,
    families,
    dtype=dtype,
    max_shard_size=max_shard_size,
    overwrite=overwrite,
  )
  return dict(stats, step_dir=step_dir)


def write_hf(
  trainer: Trainer,
  params: Any,
  model_state: Any,
  out_dir: str,
  families: dict[str, hf_import.Family],
  *,
  dtype: Any = None,
  max_shard_size: int | str = '5GB',
  overwrite: bool = False,
) -> dict[str, Any]:
  """Writes the model's weights (sharded arrays, as the trainer holds them) as a Hugging Face directory:
  config.json (with the tokenizer's bos/eos/pad ids where the model's config.json had none), safetensors
  (sharded with an index above max_shard_size), the tokenizer (a local Hugging Face tokenizer's files copied; the
  byte tokenizer written as a Hugging Face one, its chat template included; else the tokenizer files of the
  Hugging Face model it started from), and generation_config.json (the Hugging Face model's it started from, else
  the token ids), so transformers' AutoTokenizer and pipelines load it. LoRA adapters are merged. dtype: the
  weights' dtype on disk (default: the parameters'). Each zoo tensor is gathered to the host once, alone, and
  written in place. out_dir must be empty (or new), and not the run's source directories (check_out_dir);
  `overwrite` first removes the files an export writes (WRITTEN) from it, listed in the result's 'removed'."""
  config = trainer.config
  name = config.model.name
  if name not in families:
    raise ConfigError(
      f'config.model.name={name!r} has no Hugging Face layout to export to; families with one: {sorted(families)}'
    )
  family = families[name]
  check_out_dir(config, out_dir, overwrite=overwrite)
  multihost_utils.sync_global_devices('shardzoo:export_out_checked')  # every process checked before one writes
  writer = jax.process_index() == 0
  removed = _clear_out_dir(out_dir) if writer and overwrite and os.path.isdir(out_dir) else []
  if config.lora.rank:
    params = _merged_weights(trainer, params, model_state)
  leaves = jax.tree_util.tree_leaves_with_path(params) + jax.tree_util.tree_leaves_with_path(model_state)
  flat = {path_str(p): x for p, x in leaves}
  dtype = np.dtype(dtype or jax.tree.leaves(params)[0].dtype)
  stats = hf_export.write(
    family,
    config.model,
    {k: tuple(x.shape) for k, x in flat.items()},
    lambda path: _host(flat[path]),
    out_dir,
    dtype=dtype,
    max_shard_size=max_shard_size,
    is_writer=writer,
  )
  source = config.init_from if hf_import.is_hf_dir(config.init_from) else None
  if writer:
    base = None
    if source:  # its config.json only (HFDir would also list every tensor of its files)
      with open(os.path.join(source, 'config.json')) as f:
        base = json.load(f)
    tok = _tokenizer(config)
    hf_config = hf_export.config_json(family, config.model, dtype, base)
    ids = _token_ids(tok)
    hf_config.update({k: v for k, v in ids.items() if hf_config.get(k) is None})  # the run's tokenizer's, if unset
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    copied = []
    tok_dir = config.dataset.get('tokenizer')  # text tasks' datasets only
    tok_dir = tok_dir if isinstance(tok_dir, str) and os.path.isdir(tok_dir) else None
    byte = isinstance(tok, tokens.ByteTokenizer)  # written below, as the ids the run trained on
    for src, patterns in (
      (tok_dir, hf_import.TOKENIZER_FILES),
      # the Hugging Face directory the run started from: its generation config, and its tokenizer (with its chat
      # template) where the run read no other tokenizer
      (source, ('generation_config.json', *(() if tok_dir or byte else hf_import.TOKENIZER_FILES))),
    ):
      for path in sorted({p for pattern in patterns for p in glob.glob(os.path.join(src, pattern))} if src else ()):
        target = os.path.join(out_dir, os.path.basename(path))
        if not (os.path.exists(target) and os.path.samefile(path, target)):  # never a file onto itself
          shutil.copy(path, target)
        copied.append(os.path.basename(path))
    if byte:  # no files to copy: written as a Hugging Face tokenizer
      stats['written'] = tok.save_pretrained(out_dir)
    if not os.path.exists(os.path.join(out_dir, 'generation_config.json')) and ids:
      with open(os.path.join(out_dir, 'generation_config.json'), 'w') as f:
        json.dump(ids, f, indent=2, sort_keys=True)  # what transformers' generate stops at and pads with
      stats['written'] = [*stats.get('written', []), 'generation_config.json']
    stats['copied'] = sorted(copied)
  stats['removed'] = removed
  multihost_utils.sync_global_devices('shardzoo:export_hf')
  return dict(stats, dtype=dtype.name)


def _tokenizer(config: ml_collections.ConfigDict) -> Any:
  """The run's tokenizer where it has one that transformers can load (byte, or a Hugging Face directory), else
  None (a Markov language's ids; a tokenizer directory no longer there: the export still writes the weights)."""
  if 'tokenizer' not in config.dataset:  # an image dataset
    return None
  try:
    tok = tokens.for_dataset(config.dataset)
  except ConfigError:
    return None
  return tok if isinstance(tok, (tokens.ByteTokenizer, tokens.HFTokenizer)) else None


def _token_ids(tok: Any) -> dict[str, int]:
  """bos/eos/pad token ids for config.json and generation_config.json (transformers' pipelines need them)."""
  if tok is None:
    return {}
  ids = {'bos_token_id': tok.bos_id, 'eos_token_id': tok.eos_id, 'pad_token_id': tok.pad_id}
  return {k: int(v) for k, v in ids.items() if v is not None}


def export_merged_lora(trainer: Trainer, state: TrainState, workdir: str) -> str:
  """Saves the params with LoRA adapters folded into the base kernels, as a params-only checkpoint
  (<workdir>/export/0/state) that `init_from` reads with the base model's config (no LoRA)."""
  merged = _merged_weights(trainer, state.params, state.model_state)
  directory = os.path.join(os.path.abspath(workdir), 'export')
  with ocp.StandardCheckpointer() as saver:
    saver.save(os.path.join(directory, '0', 'state'), {'params': merged}, force=True)
    saver.wait_until_finished()
  return directory
