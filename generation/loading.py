"""Loading a language model for decoding: a decode-only build (the model built abstractly and placed by the
config's rules, or config.decode_rules; no optimizer, no train step, no batch checks) whose weights are read
straight into their shardings from a run's checkpoint, a params-only checkpoint, or a Hugging Face directory (its
own compute dtype and lengths); the tokenizer prompts are encoded with, by training's rules (data/tokens.py); and
the command line of generate.py and evaluate_lm.py (`from_flags`)."""

from __future__ import annotations

import functools
import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import errors
import guards
import models
import partitioning
from checkpointing import hf_config, run_config, weights
from configs import schema
from data import tokens
from errors import ConfigError
from generation.engine import Generator, cache_layout
from models import hf_import


def check_language_model(config: ml_collections.ConfigDict) -> None:
  """ConfigError for a run that is not a language model (said before anything about its tokenizer)."""
  if config.task != 'lm':
    raise ConfigError(
      f'config.task={config.task!r} (model {config.model.name!r}): generation needs a language model '
      f"(task 'lm': {', '.join(n for n, f in schema.FAMILIES.items() if 'lm' in f.tasks)})"
    )


def decode_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config a decode is built from: config.decode_rules (when set) in place of the training rules, so the
  parameters are loaded in the layout decoding runs in, and stored in the compute dtype where it is narrower than
  param_dtype (float32 parameters kept for a bfloat16 decode would be read at twice the bytes and cast at every
  step; the layers cast them to the compute dtype anyway, so the tokens are the same). ConfigError for a run that
  is not a language model."""
  check_language_model(config)
  config = ml_collections.ConfigDict(config.to_dict())
  if config.decode_rules:
    config.logical_axis_rules = [tuple(r) for r in config.decode_rules]
  compute, stored = (jnp.dtype(config.model.get(k, 'float32')) for k in ('dtype', 'param_dtype'))
  if jnp.issubdtype(compute, jnp.floating) and compute.itemsize < stored.itemsize:
    config.model.param_dtype = compute.name
  return config


def build(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> tuple[partitioning.PlacedModel, partitioning.AxisRules]:
  """The decode-only build of a decode_config: the model's parameters and state placed abstractly by its rules
  (partitioning.place_model, as training builds it), checked to decode; nothing allocated. (placed, rules)."""
  rules = partitioning.AxisRules(config.logical_axis_rules)
  rules.check_mesh(mesh.shape)
  if (stages := partitioning.pipeline.stages_of(rules, dict(mesh.shape))) > 1:
    field = 'config.decode_rules' if config.decode_rules else 'config.logical_axis_rules'
    raise ConfigError(
      f"{field} pipeline the layers over stage={stages} (('layers', 'stage')), and decoding runs no pipeline: "
      "give config.decode_rules without it, e.g. the fsdp preset's list with --config FILE:fsdp[,size] "
      '--config.decode_rules="[...]" (docs/generation.md)'
    )
  make_model = lambda rngs: models.create(config.model, rngs, config.lora)
  placed = partitioning.place_model(make_model, rules, mesh, seed=config.seed)
  cache_layout(nnx.merge(placed.graphdef, placed.abstract['params'], placed.abstract['model_state']))
  return placed, rules


def load(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, *, checkpoints: str | None = None, unroll: bool = True
) -> Generator:
  """A Generator for a run's checkpoint (`checkpoints`: its checkpoint directory, latest step, or one step's), else
  for config.init_from (a Hugging Face directory whose config.json was adopted, or a params-only checkpoint of
  this project); weights are read straight into the decoding layout (decode_config), and a scanned stack's are
  then unrolled (`unstack_layers`; unroll=False decodes the stack scanned, as GRPO's rollouts do from the
  training state: engine.policy_sampler)."""
  config = decode_config(config)
  placed, rules = build(config, mesh)
  if checkpoints is not None:
    loaded, _ = weights.load_weights(checkpoints, placed.targets('params'), placed.targets('model_state'))
    params, model_state = loaded['params'], loaded['model_state']
  elif hf_import.is_hf_dir(config.init_from):
    got = hf_import.import_weights(
      hf_import.HFDir(config.init_from),
      hf_config.family(config, models.HF_FAMILIES),
      config.model,
      placed.abstract['params'],
      placed.shardings['params'],
      placed.abstract['model_state'],
      placed.shardings['model_state'],
    )
    params, model_state = got.params, got.model_state
  elif config.init_from:
    params, model_state = weights.load_params(config.init_from, placed.targets('params')), {}
  else:
    raise ConfigError('nothing to generate from: give a run (its checkpoints) or config.init_from')
  if unroll and config.model.get('scan_layers'):
    config.model.scan_layers = False
    placed, _ = build(config, mesh)
    params = unstack_layers(params, placed.shardings['params'])
    model_state = unstack_layers(model_state, placed.shardings['model_state'])
  generator = Generator(
    placed.graphdef,
    params,
    model_state,
    rules=rules,
    mesh=mesh,
    max_len=config.model.get('max_len'),  # None: positions without a table (rotary)
    vocab=config.model.vocab_size,
    matmul=config.decode_matmul,
  )
  generator.huge_pages()
  return generator


def unstack_layers(stored: Any, shardings: Any) -> Any:
  """A scanned model's weights (pure dicts; each stack's leaves stacked on a leading layers axis) as the unrolled
  model's (`shardings`: its NamedShardings, whose {0: .., 1: ..} dicts name the layers), placed so. A decode runs
  its layers unrolled: a scanned decode step slices every layer's weights out of the stack and rewrites the whole
  cache, several times slower on CPU (docs/generation.md). Each stacked leaf is freed once split, so the weights
  are held twice only one leaf at a time."""
  if not isinstance(shardings, dict):
    return stored
  if shardings and all(isinstance(k, int) for k in shardings) and not any(isinstance(k, int) for k in stored):
    n = len(shardings)
    leaves, treedef = jax.tree.flatten(stored)
    per_layer = [jax.tree.leaves(shardings[i]) for i in range(n)]
    layers: list[list[jax.Array]] = [[] for _ in range(n)]
    for j, leaf in enumerate(leaves):
      for i, part in enumerate(_splitter(n, tuple(s[j] for s in per_layer))(leaf)):
        layers[i].append(part)
      leaf.delete()
    return {i: unstack_layers(treedef.unflatten(layers[i]), shardings[i]) for i in range(n)}
  return {k: unstack_layers(stored[k], shardings[k]) for k in shardings}


@functools.cache
def _splitter(n: int, shardings: tuple[jax.sharding.Sharding, ...]) -> Any:
  """A stacked leaf -> its n layers, placed by `shardings`: one jitted function per placement, so leaves of one
  shape and placement (a layer's query, key and value kernels) share its compiled program."""
  return jax.jit(lambda x: tuple(x[i] for i in range(n)), out_shardings=shardings)


def family_configs() -> dict[str, str]:
  """The config file a Hugging Face directory's model_type is generated with when none is given (generate.py):
  configs/<name>.py of each language-model family (configs/schema.py FAMILIES with task 'lm') that imports it
  (models.HF_FAMILIES), e.g. 'qwen3' -> configs/qwen3.py, 'mixtral' -> configs/moe.py."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return {
    model_type: f'configs/{name}.py'
    for name, family in models.HF_FAMILIES.items()
    if 'lm' in schema.FAMILIES[name].tasks and os.path.isfile(os.path.join(root, 'configs', f'{name}.py'))
    for model_type in family.model_types
  }


def family_config(hf_dir: str) -> str:
  """configs/<family>.py for a Hugging Face directory (its config.json's model_type)."""
  with open(os.path.join(hf_dir, 'config.json')) as f:
    model_type = json.load(f).get('model_type')
  known = family_configs()
  if model_type not in known:
    raise ConfigError(
      f'{hf_dir}: model_type={model_type!r} is not a language model the zoo generates with; known: {sorted(known)}'
    )
  return known[model_type]


def tokenizer(config: ml_collections.ConfigDict, *, given: str | None = None, hf_dir: str | None = None) -> Any:
  """What prompts are encoded and ids decoded with: `given` ('byte' or a local Hugging Face tokenizer directory),
  else the Hugging Face directory's own tokenizer, else the run's (data.tokens.for_dataset: config.dataset.tokenizer,
  or a Markov language's letters). ConfigError naming what is missing."""
  if given:
    return tokens.tokenizer(given)
  if hf_dir:
    if not any(glob.glob(os.path.join(glob.escape(hf_dir), p)) for p in hf_import.TOKENIZER_FILES):
      raise ConfigError(
        f'{hf_dir} has no tokenizer files ({", ".join(hf_import.TOKENIZER_FILES)}): save the tokenizer there '
        '(tokenizer.save_pretrained) or give --tokenizer DIR'
      )
    return tokens.HFTokenizer(hf_dir)
  return tokens.for_dataset(config.dataset)


def encode(tok: Any, prompt: str | list[dict]) -> list[int]:
  """A prompt's ids as training gave the same text (data/tokens.py): a string begins as the tokenizer begins a text
  (a prompt/completion row's first part), a chat (a list of {'role', 'content'}) is rendered by the chat template
  with its generation prompt."""
  return tokens.chat_prompt(tok, prompt) if isinstance(prompt, list) else tokens.prompt(tok, prompt)


def read_prompts(prompt: list[str], chat: list[str], path: str | None) -> list[str | list[dict]]:
  """generate.py's prompts: `prompt` strings (--prompt), one-turn chats of `chat` (--chat), and a JSONL file's rows
  (--prompts: {"prompt": ...} gives a string, {"messages": [...]} a chat). ConfigError naming the file:line."""
  prompts = [*prompt, *([{'role': 'user', 'content': c}] for c in chat)]
  if path:
    for n, row in guards.json_lines(path, '--prompts'):
      messages = row.get('messages') if isinstance(row, dict) else None
      if isinstance(messages, list) and messages and all(_is_message(m) for m in messages):
        prompts.append(messages)
      elif isinstance(row, dict) and isinstance(row.get('prompt'), str):
        prompts.append(row['prompt'])
      else:
        got = _describe_row(row)
        raise ConfigError(
          f'{path}:{n}: {got}; each line must be a JSON object with a "prompt" string or "messages" (a list of '
          '{"role": string, "content": string})'
        )
  if not prompts:
    raise ConfigError('no prompts: give --prompt TEXT or --chat TEXT (repeatable) or --prompts FILE.jsonl')
  return prompts


def _is_message(m: Any) -> bool:
  return isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)


def _describe_row(row: Any) -> str:
  """What a --prompts line holds instead of a prompt, for its error."""
  if not isinstance(row, dict):
    return f'{guards.json_kind(row)}, not a JSON object'
  if 'prompt' in row:
    return f'"prompt" is {guards.json_kind(row["prompt"])}, not a string'
  messages = row.get('messages')
  if messages is None:
    return f'neither "prompt" nor "messages" (keys: {sorted(row)})'
  if not isinstance(messages, list) or not messages:
    return '"messages" is not a non-empty list'
  i = next(i for i, m in enumerate(messages) if not _is_message(m))
  m = messages[i]
  if not isinstance(m, dict):
    return f'messages[{i}] is {guards.json_kind(m)}, not an object'
  bad = [k for k in ('role', 'content') if not isinstance(m.get(k), str)]
  return f'messages[{i}] has ' + ', '.join(f'"{k}": {json.dumps(m.get(k))}' for k in bad) + ' (strings needed)'


def checkpoint_facts(config: ml_collections.ConfigDict, overridden: set[str] = frozenset()) -> dict[str, Any]:
  """A Hugging Face directory's own compute dtype and lengths, taken where the command line does not set them
  (`overridden`: 'model.dtype', ...) over the family config's (a training config: bf16 compute, 2048 positions):
  config.json's dtype, and its lengths through hf_config.adopt. Returns what was taken."""
  with open(os.path.join(config.init_from, 'config.json')) as f:
    hf = json.load(f)
  taken = {}
  dtype = hf.get('dtype') or hf.get('torch_dtype') or 'float32'  # transformers loads float32 where none is said
  if 'model.dtype' not in overridden and dtype in schema.DTYPES:
    config.model.dtype = taken['dtype'] = dtype
  if 'model.max_len' not in overridden and 'max_len' in config.model:
    config.model.max_len = None  # config.json's (hf_config.adopt keeps a length the config sets)
  return taken


def with_family_config(argv: list[str]) -> list[str]:
  """An entry point's argv (generate.py, evaluate_lm.py) with --init_from and no --config: the family's config file
  (by config.json's model_type) added as --config, so --config.* overrides apply to it."""
  given = lambda name: any(a == f'--{name}' or a.startswith(f'--{name}=') for a in argv)
  if given('config') or not given('init_from'):
    return argv
  i = next(i for i, a in enumerate(argv) if a == '--init_from' or a.startswith('--init_from='))
  source = argv[i].split('=', 1)[1] if '=' in argv[i] else (argv[i + 1] if i + 1 < len(argv) else '')
  with errors.one_line():  # HFImportError is a ConfigError
    path = hf_import.resolve(source)
    if not hf_import.is_hf_dir(path):
      raise ConfigError(f'--init_from={source!r} is not a Hugging Face model directory (config.json + safetensors)')
    file = family_config(path)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return argv[:1] + [f'--config={os.path.join(root, file)}'] + argv[1:]


def from_flags(
  config: ml_collections.ConfigDict | None,
  workdir: str | None,
  step: int | None,
  init_from: str | None,
  tokenizer_dir: str | None = None,
  overridden: set[str] = frozenset(),
) -> tuple[Generator, Any]:
  """What generate.py and evaluate_lm.py decode with: (Generator, tokenizer) for a run (`workdir`: its config from
  run_config.json unless `config` is given; the latest checkpoint, or `step`'s) or a Hugging Face directory / hub
  id (`init_from`: architecture, compute dtype and lengths from its config.json, except the config fields the
  command line sets, `overridden`), on the config's mesh fitted to the devices here."""
  hf_dir, checkpoints = None, None
  if workdir:
    run_config.check_workdir(workdir)
    config = config or run_config.load(workdir)
    checkpoints = os.path.join(workdir, 'checkpoints', *([str(step)] if step is not None else []))
  else:
    config.init_from = hf_dir = hf_import.resolve(init_from)
    config.dont_load = ''
    taken = checkpoint_facts(config, overridden)
    hf_config.adopt(config, models.HF_FAMILIES)
    print(f'{hf_dir}: ' + ', '.join(f'{k}={v!r}' for k, v in {**taken, 'max_len': config.model.get('max_len')}.items()))
  schema.check(config)
  check_language_model(config)
  tok = tokenizer(config, given=tokenizer_dir, hf_dir=hf_dir)
  if config.model.vocab_size is None:  # a config whose vocabulary follows the data (the tiny sizes): its tokenizer's
    config.model.vocab_size = tok.vocab_size
  mesh, note = partitioning.start_mesh(config.mesh)
  if note:
    print(f'WARNING {note}')
  platform = jax.devices()[0].platform
  cpu = f' ({partitioning.cpu_devices_note()})' if platform == 'cpu' else ''
  print(f'mesh: {dict(mesh.shape)} on {jax.device_count()} {platform} devices{cpu}')
  return load(config, mesh, checkpoints=checkpoints), tok
