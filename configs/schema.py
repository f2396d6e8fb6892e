"""What every config field may hold, checked before anything is built (train.py and export.py call `check`).

One table, FIELDS, gives each field of every config file its type and allowed values; the choices come
from their owners (models.MODELS, training.tasks.TASKS, ...). A bad value is one ConfigError naming the
field, the value and what is allowed. Fields no entry describes are an error too (a config file that adds a
field adds it here: tests/test_bad_input.py goes over every field of every config file). Deeper checks that
need the whole config (rules against the mesh, heads dividing the width, a dataset's fields) stay where they
are, still before compiling. `warnings` are the settings that are valid but would silently do something else
than written (train.py prints them). The command line is configs/cli.py's.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from errors import ConfigError

INF = float('inf')
RULE = '(logical name, mesh axis | tuple of mesh axes | None) pair'  # one of config.logical_axis_rules


@dataclasses.dataclass(frozen=True)
class Field:
  """A field's type (int, float, bool, str, 'regex', 'ints', 'mesh', 'dcn', 'rules', 'rope', 'remat', 'info',
  'mixture') and range."""

  kind: Any
  lo: float = -INF
  hi: float = INF
  lo_open: bool = False  # lo itself is not allowed
  hi_open: bool = False
  choices: Callable[[], Sequence[Any]] | None = None
  optional: bool = False  # None is allowed
  required: bool = False  # every config sets it (train.py reads it without a default)

  def allowed(self) -> str:
    if self.choices is not None:
      text = f'one of {list(self.choices())}'
      if self.kind == 'remat':  # layers.remat_policy still maps older configs' booleans
        text += ' (or, in a config file, True/False for full/none)'
    elif self.kind in (int, float):
      name = 'an integer' if self.kind is int else 'a finite number'
      bounds = [f'{">" if self.lo_open else ">="} {self.lo:g}'] if self.lo > -INF else []
      bounds += [f'{"<" if self.hi_open else "<="} {self.hi:g}'] if self.hi < INF else []
      text = f'{name} {" and ".join(bounds)}'.strip()
    else:
      text = {
        bool: 'True or False',
        str: 'a string',
        'regex': 'a regular expression (or empty)',
        'ints': 'a non-empty tuple of integers >= 1',
        'mesh': 'a dict of mesh axis name -> size >= 1 (one may be -1)',
        'dcn': 'a dict of mesh axis name -> number of slices >= 1',
        'rules': f'a list of {RULE}s',
        'rope': "None or Llama 3 scaling: (name, value) pairs of rope_type='llama3', factor, low_freq_factor, "
        'high_freq_factor, original_max_position_embeddings',
        'info': 'a string',
        'mixture': 'a non-empty list of (file glob, weight > 0) pairs',
      }[self.kind]
    return text + (' (or None)' if self.optional else '')

  def problem(self, value: Any) -> bool:
    """Whether `value` is not allowed."""
    if value is None:
      return not self.optional
    kind = self.kind
    if kind is bool:
      return not isinstance(value, bool)
    if kind in (int, float):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return True
      return (
        not math.isfinite(value)
        or value < self.lo
        or value > self.hi
        or (self.lo_open and value == self.lo)
        or (self.hi_open and value == self.hi)
      )
    if kind in (str, 'info', 'remat'):
      if kind == 'remat' and isinstance(value, bool):  # older configs: True/False mean full/none
        return False
      return not isinstance(value, str) or (self.choices is not None and value not in self.choices())
    if kind == 'regex':
      if not isinstance(value, str):
        return True
      try:
        re.compile(value)
      except re.error:
        return True
      return False
    if kind == 'ints':
      return (
        not isinstance(value, (tuple, list))
        or not value
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
      )
    if kind == 'mesh':
      return (
        not hasattr(value, 'items')
        or not value
        or any(
          not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or not (v >= 1 or v == -1)
          for k, v in value.items()
        )
        or list(value.values()).count(-1) > 1
      )
    if kind == 'dcn':
      return not hasattr(value, 'items') or any(
        not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 1 for k, v in value.items()
      )
    if kind == 'rules':
      return not isinstance(value, (tuple, list)) or any(_rule_problem(r) for r in value)
    if kind == 'mixture':
      return (
        not isinstance(value, (tuple, list))
        or not value
        or any(
          not isinstance(p, (tuple, list))
          or len(p) != 2
          or not isinstance(p[0], str)
          or isinstance(p[1], bool)
          or not isinstance(p[1], (int, float))
          or not (math.isfinite(p[1]) and p[1] > 0)
          for p in value
        )
      )
    if kind == 'rope':
      from models import layers

      try:
        layers.rope_scaling_params(value)
      except (ConfigError, TypeError, ValueError, AttributeError):
        return True
      return False
    raise AssertionError(kind)

  def bad_values(self) -> list[Any]:
    """Values this field refuses (for tests): one of the wrong type, and one out of range where a range exists."""
    wrong_type = {
      bool: 'yes',
      int: 'four',
      float: 'small',
      str: 3,
      'info': 3,
      'remat': 3,
      'regex': '(unclosed',
      'ints': 'abc',
      'mesh': {'data': 0},
      'dcn': {'data': -1},
      'rules': [('batch',)],
      'rope': dict(rope_type='yarn'),
      'mixture': [('a.jsonl', 0)],
    }[self.kind]
    out = [wrong_type]
    if self.choices is not None:
      out.append('no_such_choice')
    if self.kind in (int, float) and self.lo > -INF:
      out.append(self.kind(self.lo) if self.lo_open else self.kind(self.lo - 1))
    if self.kind in (int, float) and self.hi < INF:
      out.append(self.kind(self.hi) if self.hi_open else self.kind(self.hi + 1))
    if self.kind is float:
      out += [float('nan'), float('inf')]
    if self.kind == 'ints':
      out.append((0,))
    return out

  def message(self, path: str, value: Any) -> str:
    """The one-line error for a value `problem` refuses: a bad rule of a list of rules is named by its index."""
    if self.kind == 'rules' and isinstance(value, (tuple, list)):
      i, why = next((i, why) for i, r in enumerate(value) if (why := _rule_problem(r)))
      return f'config.{path}[{i}]={value[i]!r}: must be a {RULE} ({why})'
    shown = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    return f'config.{path}={shown!r}: must be {self.allowed()}'


def _rule_problem(rule: Any) -> str:
  """What is wrong with one logical-axis rule ('' if nothing): partitioning/rules.py's AxisRules then parses it."""
  if not isinstance(rule, (tuple, list)):
    return f'not a pair but a {type(rule).__name__}'
  if len(rule) != 2:
    return f'{len(rule)} items, not 2'
  name, target = rule
  if not isinstance(name, str):
    return f'the logical name {name!r} is not a string'
  if not (
    target is None
    or isinstance(target, str)
    or (isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target))
  ):
    return f'the target {target!r} is not a mesh axis name, a tuple of them or None'
  return ''


def _owned(module: str, name: str, *, sort: bool = False) -> Callable[[], list[Any]]:
  """The allowed values as their owner declares them (`module.name`), imported when first asked for."""

  def values() -> list[Any]:
    found = getattr(importlib.import_module(module), name)
    return sorted(found) if sort else list(found)

  return values


DTYPES = lambda: ['float32', 'bfloat16', 'float16']
POSITIVE = Field(int, lo=1)
COUNT = Field(int, lo=0)
RATE = Field(float, lo=0, lo_open=True)  # > 0
NONNEG = Field(float, lo=0)
FRACTION = Field(float, lo=0, hi=1, hi_open=True)  # [0, 1)

FIELDS: dict[str, Field] = {
  # the run
  'task': Field(str, choices=_owned('training.tasks', 'TASKS', sort=True), required=True),
  'seed': Field(int, lo=0, required=True),
  'batch_size': Field(int, lo=1, required=True),
  'grad_accum_steps': POSITIVE,
  'accum_gather_once': Field(bool),
  'total_steps': Field(int, lo=1, required=True),
  'log_every': Field(int, lo=1, required=True),
  'eval_every': Field(int, lo=1, required=True),
  'checkpoint_every': COUNT,
  'keep_checkpoints': POSITIVE,
  'sample_len': COUNT,
  'profile_first_step': COUNT,
  'profile_steps': POSITIVE,
  'on_nonfinite': Field(str, choices=lambda: ['stop', 'skip']),
  'max_nonfinite_skips': COUNT,
  'resume_fallback': Field(bool),
  'checkpoint_space': Field(str, choices=lambda: ['refuse', 'warn']),
  'preset': Field('info'),
  'size': Field('info'),  # set by get_config(arg): what the file built
  'mesh': Field('mesh', required=True),
  'dcn_mesh': Field('dcn'),
  'logical_axis_rules': Field('rules', required=True),
  'decode_rules': Field('rules'),  # generation's rules in place of logical_axis_rules; []: the same
  'context_load_balance': Field(bool),
  'pipeline.microbatches': POSITIVE,  # under ('layers', 'stage'): micro-batches per step (docs/pipelines.md)
  'pipeline.repeats': POSITIVE,  # 1: GPipe; > 1: circular, each device holding that many non-adjacent stages
  # starting from pretrained weights, what trains
  'init_from': Field(str),
  'dont_load': Field('regex'),
  'freeze': Field('regex'),
  'train_only': Field('regex'),
  'lora.rank': COUNT,
  'lora.alpha': RATE,
  'lora.targets': Field('regex'),
  'lora.export_merged': Field(bool),
  # optimizer
  'optim.name': Field(str, choices=_owned('training.optim', 'OPTIMIZERS'), required=True),
  'optim.lr': Field(float, lo=0, required=True),
  'optim.warmup_steps': COUNT,
  'optim.min_lr_ratio': Field(float, lo=0, hi=1),
  'optim.weight_decay': NONNEG,
  'optim.b1': FRACTION,
  'optim.b2': FRACTION,
  'optim.eps': RATE,
  'optim.grad_clip': NONNEG,
  'optim.momentum': FRACTION,
  # model (every family's fields; a family reads the ones it has)
  'model.name': Field(str, choices=_owned('models', 'MODELS', sort=True), required=True),
  'model.dtype': Field(str, choices=DTYPES),
  'model.param_dtype': Field(str, choices=DTYPES),
  'model.logits_dtype': Field(str, choices=DTYPES),
  'model.loss_chunks': COUNT,  # the LM loss in that many chunks along the length; 0 or 1: off
  'model.attention': Field(str, choices=_owned('models.attention', 'IMPLEMENTATIONS')),
  'model.remat': Field('remat', choices=_owned('models.layers', 'REMAT_POLICIES')),  # True/False: full/none
  'model.scan_layers': Field(bool),
  'model.vocab_size': POSITIVE,
  'model.pad_vocab_to': POSITIVE,
  'model.max_len': Field(int, lo=1, optional=True),  # None: the imported model's (fine-tune configs)
  'model.num_layers': POSITIVE,
  'model.num_heads': POSITIVE,
  'model.num_kv_heads': POSITIVE,
  'model.head_dim': POSITIVE,
  'model.embed_dim': POSITIVE,
  'model.mlp_dim': POSITIVE,
  'model.norm_eps': RATE,
  'model.tie_embeddings': Field(bool),
  'model.rope_theta': RATE,
  'model.rope_scaling': Field('rope', optional=True),
  'model.num_experts': POSITIVE,
  'model.top_k': POSITIVE,
  'model.capacity_factor': RATE,
  'model.group_size': POSITIVE,
  'model.aux_loss_weight': NONNEG,
  'model.router_z_loss_weight': NONNEG,
  'model.type_vocab_size': POSITIVE,
  'model.head': Field(str, choices=_owned('models.bert', 'HEADS')),
  'model.num_classes': POSITIVE,
  'model.image_size': POSITIVE,
  'model.patch_size': POSITIVE,
  'model.channels': POSITIVE,
  'model.features': Field('ints'),
  'model.width': POSITIVE,
  'model.block': Field(str, choices=_owned('models.resnet', 'BLOCKS', sort=True)),
  'model.stage_sizes': Field('ints'),
  'model.bn_eps': RATE,
  'model.bn_momentum': FRACTION,
  'model.bn_fast_variance': Field(bool),
  'model.bn_fused': Field(bool),
  'model.stride_in_1x1': Field(bool),
  # data
  'dataset.name': Field(str, required=True),
  'dataset.seq_len': Field(int, lo=1, optional=True),  # None: the model's max_len (fine-tune configs)
  'dataset.vocab_size': POSITIVE,
  'dataset.branching': POSITIVE,
  'dataset.smoothing': Field(float, lo=0, hi=1),
  'dataset.seed': COUNT,
  'dataset.num_train': POSITIVE,
  'dataset.num_eval': POSITIVE,
  'dataset.num_classes': POSITIVE,
  'dataset.image_size': POSITIVE,
  'dataset.channels': POSITIVE,
  'dataset.pack': Field(bool),
  'dataset.tokenizer': Field(str),
  'dataset.data_dir': Field(str, optional=True),
  'dataset.train_split': Field(str),
  'dataset.eval_split': Field(str),
  'dataset.mlm_probability': Field(float, lo=0, hi=1, lo_open=True, hi_open=True),
  'dataset.noise': NONNEG,
  'dataset.max_shift': COUNT,
  'dataset.text_key': Field(str),
  'dataset.min_text_len': POSITIVE,
  'dataset.max_text_len': POSITIVE,
  'dataset.num_threads': POSITIVE,
  'dataset.prefetch': COUNT,
  'dataset.augment': Field(str, choices=_owned('data.vision', 'AUGMENTATIONS')),
  # your own files (data/files.py): 'json', 'parquet', 'text', 'hf'
  'dataset.train_files': Field(str),  # globs, comma-separated ('hf': a split name)
  'dataset.eval_files': Field(str),
  'dataset.mixture': Field('mixture', optional=True),  # (glob, weight) pairs instead of train_files
  'dataset.path': Field(str),  # 'hf': a hub id or a save_to_disk directory
  'dataset.cache_dir': Field(str, optional=True),  # the Arrow cache (None: Hugging Face's)
  'dataset.sample_by': Field(str, choices=_owned('data.files', 'SAMPLE_BY')),  # 'text' files' rows
  'dataset.prompt_key': Field(str, optional=True),
  'dataset.completion_key': Field(str, optional=True),
  'dataset.messages_key': Field(str, optional=True),
  'dataset.no_assistant': Field(str, choices=_owned('data.files', 'NO_ASSISTANT')),
}
OPAQUE = (
  'mesh',
  'dcn_mesh',
  'model.rope_scaling',
)  # dict-valued fields checked as a whole (keys: axis names, rope settings)


def leaves(config: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """Dotted field path -> value, for every field (dict-valued fields in OPAQUE count as one)."""
  out = {}
  for key, value in config.items():
    path = f'{prefix}{key}'
    if isinstance(value, (Mapping, ml_collections.ConfigDict)) and path not in OPAQUE:
      out.update(leaves(value, path + '.'))
    else:
      out[path] = value
  return out


def check(config: ml_collections.ConfigDict) -> None:
  """Raises one ConfigError for the first field that is missing, unknown or holds a value it does not allow, a
  mesh whose axes would not keep the order written, or a model family that does not train on config.task or
  lacks a field it reads (models.check_config)."""
  if missing := missing_field(config):
    raise ConfigError(missing)
  for path, value in leaves(config).items():
    field = FIELDS.get(path)
    if field is None:
      raise ConfigError(
        f'config.{path} is not a field shardzoo knows; a new field is described in '
        'configs/schema.py FIELDS (its type and allowed values)'
      )
    if field.problem(value):
      raise ConfigError(field.message(path, value))
  for name in MESHES:
    if _reordered(config.get(name)):
      value = config[name]
      raise ConfigError(
        f'config.{name}={dict(_written(value))!r} is a ConfigDict that sorts its keys: its axes would be laid out '
        f'as {list(value)}, not in the order written; build it with common.mesh(...) '
        '(ml_collections.ConfigDict(..., sort_keys=False))'
      )
  importlib.import_module('models').check_config(config.model, config.task)


def missing_field(config: Any) -> str:
  """'config.<path> is missing: ...' for the first field every config sets (Field.required) that `config` lacks."""
  have = leaves(config)
  for path, field in FIELDS.items():
    if field.required and path not in have:
      return f'config.{path} is missing: every config sets it ({field.allowed()})'
  return ''


MESHES = ('mesh', 'dcn_mesh')  # device-layout order: outermost axis first


def _written(value: ml_collections.ConfigDict) -> dict[str, Any]:
  # A ConfigDict keeps its fields in the order they were set and sorts them only when iterated (sort_keys=True,
  # the default); ml_collections has no public reader of that order.
  return dict(value._fields)


def _reordered(value: Any) -> bool:
  """Whether `value` is a key-sorting ConfigDict whose axes were written in another order."""
  return isinstance(value, ml_collections.ConfigDict) and value._sort_keys and list(_written(value)) != list(value)


def keep_written_order(config: ml_collections.ConfigDict) -> None:
  """config.mesh and config.dcn_mesh in the order written, where a plain ConfigDict (in a config file, or from
  --config.mesh="{...}") would sort the axes and so change the device layout."""
  for name in MESHES:
    if _reordered(config.get(name)):
      config[name] = ml_collections.ConfigDict(_written(config[name]), sort_keys=False)


def warnings(config: ml_collections.ConfigDict) -> list[str]:
  """Settings that are valid but would not do what they say (train.py prints each as a warning line)."""
  out = []
  optim, total = config.get('optim') or {}, config.get('total_steps')
  if total is not None and optim.get('warmup_steps', 0) > max(total - 1, 0):
    out.append(
      f'config.optim.warmup_steps={optim.warmup_steps} with config.total_steps={total}: the warmup is cut to '
      f'{max(total - 1, 0)} steps (the learning rate peaks at the last step)'
    )
  if config.get('dont_load') and not config.get('init_from'):
    out.append(
      f'config.dont_load={config.dont_load!r} has no effect without config.init_from: nothing is loaded, '
      'every parameter starts fresh'
    )
  return out


def __getattr__(name: str) -> Any:
  # schema.parse_flags: search.py, generate.py and evaluate.py still name it here (configs/cli.py is its home).
  if name == 'parse_flags':
    from configs import cli

    return cli.parse_flags
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
