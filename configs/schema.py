"""What every config field may hold, checked before anything is built (train.py and export.py call `check`).

One table, FIELDS, gives each field of every config file its type and allowed values; the choices come
from their owners (models.MODELS, training.tasks.TASKS, ...). A bad value is one ConfigError naming the
field, the value and what is allowed. Fields no entry describes are an error too (a config file that adds a
field adds it here: tests/test_validation.py goes over every field of every config file). Deeper checks that
need the whole config (rules against the mesh, heads dividing the width, a dataset's fields) stay where they
are, still before compiling.

`parse_flags` is absl's command-line parsing for train.py, export.py and search.py, with a bad --config (a missing
or broken file, an unknown field, a misspelled preset, a value of the wrong type) reported as one line instead
of a traceback. A config file that raises while it runs is named with its line and the error (the traceback's
innermost frame in that file); one whose get_config() returns something else than a ConfigDict, or leaves out a
field every config sets (`Field.required`), is named too. `warnings` are the settings that are valid but would
silently do something else than written (train.py prints them).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import math
import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

import errors
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


class _ListParser(flags.ArgumentParser):
  """--config.<list field>="[...]": a Python list literal, e.g. --config.logical_axis_rules="[('batch', 'data'),
  ...]" (ml_collections parses no list-valued field from the command line; `check` then reads it like any value)."""

  def parse(self, argument: Any) -> list[Any]:
    if not isinstance(argument, str):  # the config file's own value, as the flag's default
      return list(argument)
    try:
      value = ast.literal_eval(argument)
    except (SyntaxError, ValueError):
      value = None
    if not isinstance(value, (list, tuple)):
      raise ValueError("must be a Python list literal, e.g. \"[('batch', 'data'), ('embed', None)]\"")
    return list(value)

  def flag_type(self) -> str:
    return 'list literal'


config_flags.register_flag_parser_for_type(list, _ListParser())


def parse_flags(argv: list[str], flag_values: flags.FlagValues | None = None) -> list[str]:
  """absl's flag parsing (app.run's flags_parser) with one line for a bad --config instead of a traceback:
  a config file that is missing or does not compile, an unknown field (named with the nearest field of its
  section), a misspelled preset or size, a value that does not parse. The --config.<field> overrides are
  checked against the loaded config before ml_collections applies them (`_check_overrides`)."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  _check_file(argv, flag_values)
  try:
    with _file_errors(argv, flag_values):
      overrides = _overrides(argv, flag_values)
      if overrides:
        _check_overrides(overrides, _loaded(argv, flag_values))
      rest = flag_values(argv)
      for name in _config_flags(flag_values):  # ml_collections defers a config file that failed to load until read
        if flag_values[name].value is not None or flag_values[name].present:
          hasattr(flag_values[name].value, 'keys')
          _check_loaded(flag_values[name].value, argv, flag_values)
    if len(rest) > 1:
      raise errors.usage(_stray(rest[1:], argv, flag_values))
    return rest
  except flags.Error as e:  # the config file's get_config(arg) refused its argument, or a value ml_collections refused
    text = str(e)
    cause = [line.strip() for line in text.splitlines() if re.match(r'\s*\w+(Error|Exception): ', line)]
    message = text.splitlines()[0].rstrip(':').strip()
    if cause:
      message += f': {cause[-1].split(": ", 1)[1]}'
  except _BadOverride as e:
    message = str(e)
  raise SystemExit(f'shardzoo: config error: {message}')


@contextlib.contextmanager
def _file_errors(argv: list[str], flag_values: flags.FlagValues):
  """An exception raised while the --config file ran (found by the innermost frame of the traceback in that file:
  absl and ml_collections rewrap it, or defer it) ends the program naming the file, the line and the error. A
  ConfigError (a config file refusing its argument: a misspelled preset) keeps its own words."""
  try:
    yield
  except Exception as e:
    flag, file = _config_flag(argv, flag_values)
    found = _raised_in(e, file) if file else None
    if found is None:
      raise
    error, frame = found
    if isinstance(error, ConfigError):
      message = f'{flag}: {error}'
    else:
      code = f' ({frame.line})' if frame.line else ''
      message = f'{flag}: error at {frame.filename}:{frame.lineno}{code}: {_describe(error, frame.line)}'
    raise SystemExit(f'shardzoo: config error: {message}') from None


def _raised_in(error: BaseException, file: str) -> tuple[BaseException, traceback.FrameSummary] | None:
  """The first exception of `error`'s chain (causes and contexts) whose traceback passes through `file`, and its
  innermost frame there."""
  target, seen = os.path.realpath(file), set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.realpath(f.filename) == target]
    if frames:
      return error, frames[-1]
    error = error.__cause__ or error.__context__
  return None


# The Python type a field of each kind holds, for the line naming an assignment of another type.
_HOLDS = {'rules': 'list', 'mesh': 'dict', 'dcn': 'dict', 'ints': 'tuple', 'regex': 'str', 'mixture': 'tuple'}
_LITERAL = {ast.Dict: 'dict', ast.List: 'list', ast.Tuple: 'tuple', ast.Set: 'set'}


def _config_paths(line: str) -> tuple[str | None, list[str]]:
  """From one line of a config file: the field path it assigns (``c.model.dim = ...`` -> 'model.dim', with the
  assigned value's type name where it is a literal) and every dotted path it reads from a name."""
  try:
    tree = ast.parse(line.strip())
  except SyntaxError:
    return None, []

  def dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
      names.append(node.attr)
      node = node.value
    return '.'.join(reversed(names)) if isinstance(node, ast.Name) and names else None

  assigned = None
  stmt = tree.body[0] if tree.body else None
  if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
    assigned = dotted(stmt.targets[0])
  reads = [
    p for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) if (p := dotted(n))
  ]
  return assigned, reads


def _describe(error: BaseException, line: str | None) -> str:
  """'<ErrorType>: <first line>' of an error raised at `line` of a config file; a value of another type assigned
  to a field, or a read of a field that does not exist, said from the line itself and the fields FIELDS knows."""
  assigned, reads = _config_paths(line or '')
  if isinstance(error, TypeError) and assigned in FIELDS:
    field = FIELDS[assigned]
    holds = _HOLDS.get(field.kind) or getattr(field.kind, '__name__', None)
    value = ast.parse(line.strip()).body[0].value
    given = _LITERAL.get(type(value)) or (type(value.value).__name__ if isinstance(value, ast.Constant) else 'value')
    if holds and given != holds:
      return f'config.{assigned} holds a {holds}, so a {given} cannot replace it: it must be {field.allowed()}'
  if isinstance(error, (AttributeError, KeyError)):  # a ConfigDict read of a field it does not have
    for path in reads:
      if path in FIELDS or any(f.startswith(path + '.') for f in FIELDS):
        continue
      parent, _, key = path.rpartition('.')
      known = [f.rpartition('.')[2] for f in FIELDS if f.rpartition('.')[0] == parent]
      if not known:
        continue
      near = difflib.get_close_matches(key, known, n=1)
      return f'{type(error).__name__}: no field {key!r}' + (f'; did you mean {near[0]!r}?' if near else '')
  return f'{type(error).__name__}: {(str(error).strip().splitlines() or [""])[0]}'


def _check_loaded(config: Any, argv: list[str], flag_values: flags.FlagValues) -> None:
  """What get_config() returned is a ConfigDict with the fields every config sets; its meshes keep their order."""
  flag, _ = _config_flag(argv, flag_values)
  if not isinstance(config, ml_collections.ConfigDict):
    raise SystemExit(
      f'shardzoo: config error: {flag}: get_config() returned '
      f'{"None (no return statement?)" if config is None else "a " + type(config).__name__}, not an '
      'ml_collections.ConfigDict (configs/<model>.py show how one is built)'
    )
  if missing := missing_field(config):
    raise SystemExit(f'shardzoo: config error: {flag}: {missing}')
  keep_written_order(config)


def _stray(extra: list[str], argv: list[str], flag_values: flags.FlagValues) -> str:
  """The one line for arguments that are not flags: a word after the config file was likely meant for its ':'."""
  flag, file = _config_flag(argv, flag_values)
  hint = ''
  if file and all(not a.startswith('-') and '/' not in a for a in extra):
    hint = f'; a preset or size goes after the config file: {flag.split(":", 1)[0]}:{",".join(extra)}'
  return f'unexpected argument(s) {extra}: everything else is a flag (--name=value){hint}'


class _BadOverride(Exception):
  """A --config.<field> override naming no field of the config, or holding a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class _Override:
  flag: str  # the config flag's name ('config')
  path: str  # the field's dotted path ('model.embed_dim')
  value: str | None  # as given (None: a bare boolean --config.<field> / --noconfig.<field>)
  positions: tuple[int, ...]  # where in argv (the flag, and its value when given apart)

  def __str__(self) -> str:
    return f'--{self.flag}.{self.path}' + ('' if self.value is None else f'={self.value}')


def _overrides(argv: list[str], flag_values: flags.FlagValues) -> list[_Override]:
  """The --<config flag>.<field>[=value] arguments (also '--<config flag>.<field> value' and the '--no' form)."""
  names = _config_flags(flag_values)
  out = []
  for i, arg in enumerate(argv[1:], 1):
    if arg == '--':
      break
    body = arg.lstrip('-')
    if not arg.startswith('-') or any(o.positions[-1] == i for o in out):
      continue
    for name in names:
      for prefix, negated in ((f'{name}.', False), (f'no{name}.', True)):
        if not body.startswith(prefix):
          continue
        path, eq, value = body[len(prefix) :].partition('=')
        if eq or negated or i + 1 >= len(argv) or argv[i + 1].startswith('-'):
          out.append(_Override(name, path, value if eq else None, (i,)))
        else:
          out.append(_Override(name, path, argv[i + 1], (i, i + 1)))
        break
      else:
        continue
      break
  return out


# How ml_collections parses an override of a field of this type, as a check that needs no error text.
_PARSES = {
  int: lambda v: int(v),
  float: lambda v: float(v),
  bool: lambda v: {'true': True, 't': True, '1': True, 'false': False, 'f': False, '0': False}[v.lower()],
}
_KIND = {int: 'an integer', float: 'a number', bool: 'True or False'}


def _loaded(argv: list[str], flag_values: flags.FlagValues) -> ml_collections.ConfigDict | None:
  """The config the command line's --config=<file>[:arg] builds, before any override; None when there is none or
  it does not load (ml_collections then reports why, as it loads it itself)."""
  flag, file = _config_flag(argv, flag_values)
  if not file or not os.path.isfile(file):
    return None
  arg = flag.split('=', 1)[1].partition(':')[2] or None
  try:
    spec = importlib.util.spec_from_file_location('_shardzoo_overrides_checked_against', file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg is not None else module.get_config()
  except Exception:  # noqa: BLE001  (a file that does not load is reported by ml_collections' own loading)
    return None
  _check_loaded(config, argv, flag_values)  # not a ConfigDict, or without a required field: named before overrides
  return config


def _check_overrides(overrides: list[_Override], config: ml_collections.ConfigDict | None) -> None:
  """Each override names a field of the config, and a value its type parses; else _BadOverride naming it (with
  the nearest field of the section for a misspelling)."""
  if config is None:
    return
  for o in overrides:
    node, names = config, o.path.split('.')
    for depth, key in enumerate(names):
      if not isinstance(node, (ml_collections.ConfigDict, Mapping)) or key not in node:
        if o.path in FIELDS:  # a field of other config files: a did-you-mean would point at the wrong field
          raise _BadOverride(f'{o}: this config file does not declare config.{o.path}')
        known = list(node.keys()) if isinstance(node, (ml_collections.ConfigDict, Mapping)) else []
        near = difflib.get_close_matches(key, known, n=1)
        raise _BadOverride(
          f'{o}: the config has no field {key!r}' + (f'; did you mean {near[0]!r}?' if near else '')
          if depth == len(names) - 1 or not known
          else f'{o}: the config has no section {key!r}' + (f'; did you mean {near[0]!r}?' if near else '')
        )
      parent, node = node, node[key]
    kind = parent.get_type(names[-1]) if isinstance(parent, ml_collections.ConfigDict) else type(node)
    if o.value is not None and kind in _PARSES:
      try:
        _PARSES[kind](o.value)
      except (ValueError, KeyError):
        raise _BadOverride(f'flag {o}: cannot parse {o.value!r} (must be {_KIND[kind]})') from None


def _config_flags(flag_values: flags.FlagValues) -> list[str]:
  return [name for name in flag_values if config_flags.config_flags.is_config_flag(flag_values[name])]


def _config_flag(argv: list[str], flag_values: flags.FlagValues) -> tuple[str, str]:
  """('--config=<file>[:arg]', '<file>') as given on the command line."""
  names = _config_flags(flag_values) or ['config']
  for i, arg in enumerate(argv):
    given = re.match(rf'--?({"|".join(map(re.escape, names))})(=|$)', arg)
    if given:
      value = arg[given.end() :] if given.group(2) else (argv[i + 1] if i + 1 < len(argv) else '')
      return f'--{given.group(1)}={value}', value.split(':', 1)[0]
  return f'--{names[0]}', ''


def _check_file(argv: list[str], flag_values: flags.FlagValues) -> None:
  """The --config file exists, reads, compiles and binds get_config, checked before ml_collections loads it (its
  own errors for these are text to parse): one line naming the file, and the line of a syntax error."""
  flag, file = _config_flag(argv, flag_values)
  if not file:
    return
  if not os.path.isfile(file):
    raise SystemExit(f'shardzoo: config error: {flag}: no such file')
  try:
    with open(file, encoding='utf-8') as f:
      source = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise SystemExit(f'shardzoo: config error: {flag}: cannot be read ({getattr(e, "strerror", None) or e})') from None
  try:
    tree = ast.parse(source, filename=file)
  except SyntaxError as e:
    raise SystemExit(f'shardzoo: config error: {flag}: syntax error at {e.filename}:{e.lineno}: {e.msg}') from None
  bound = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      bound.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      bound.update(a.asname or a.name.split('.')[0] for a in node.names)
    elif isinstance(node, ast.Assign):
      bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
  if 'get_config' not in bound and not any(isinstance(n, ast.ImportFrom) and n.names[0].name == '*' for n in tree.body):
    raise SystemExit(
      f'shardzoo: config error: {flag}: the file defines no get_config(), so it is not a config file '
      '(configs/<model>.py are)'
    )
