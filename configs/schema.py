"""What every config field may hold, checked before anything is built (train.py and export.py call `check`).

One table, FIELDS, gives each field of every config file its type and allowed values; the choices come
from their owners (models.MODELS, training.tasks.TASKS, ...). A bad value is one ConfigError naming the
field, the value and what is allowed. Fields no entry describes are an error too (a config file that adds a
field adds it here: tests/test_validation.py goes over every field of every config file). Deeper checks that
need the whole config (rules against the mesh, heads dividing the width, a dataset's fields) stay where they
are, still before compiling.

`parse_flags` is absl's command-line parsing for train.py, export.py and search.py, with a bad --config (a missing
or broken file, an unknown field, a misspelled preset, a value of the wrong type) reported as one line instead
of a traceback.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from errors import ConfigError

INF = float('inf')
RULE = '(logical name, mesh axis | tuple of mesh axes | None) pair'  # one of config.logical_axis_rules


@dataclasses.dataclass(frozen=True)
class Field:
  """A field's type (int, float, bool, str, 'regex', 'ints', 'mesh', 'dcn', 'rules', 'rope', 'remat', 'info') and
  range."""

  kind: Any
  lo: float = -INF
  hi: float = INF
  lo_open: bool = False  # lo itself is not allowed
  hi_open: bool = False
  choices: Callable[[], Sequence[Any]] | None = None
  optional: bool = False  # None is allowed

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
  'task': Field(str, choices=_owned('training.tasks', 'TASKS', sort=True)),
  'seed': COUNT,
  'batch_size': POSITIVE,
  'total_steps': POSITIVE,
  'log_every': POSITIVE,
  'eval_every': POSITIVE,
  'checkpoint_every': COUNT,
  'keep_checkpoints': POSITIVE,
  'sample_len': COUNT,
  'profile_first_step': COUNT,
  'profile_steps': POSITIVE,
  'on_nonfinite': Field(str, choices=lambda: ['stop', 'skip']),
  'max_nonfinite_skips': COUNT,
  'resume_fallback': Field(bool),
  'preset': Field('info'),
  'size': Field('info'),  # set by get_config(arg): what the file built
  'mesh': Field('mesh'),
  'dcn_mesh': Field('dcn'),
  'logical_axis_rules': Field('rules'),
  'decode_rules': Field('rules'),  # generation's rules in place of logical_axis_rules; []: the same
  'context_load_balance': Field(bool),
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
  'optim.name': Field(str, choices=_owned('training.optim', 'OPTIMIZERS')),
  'optim.lr': NONNEG,
  'optim.warmup_steps': COUNT,
  'optim.min_lr_ratio': Field(float, lo=0, hi=1),
  'optim.weight_decay': NONNEG,
  'optim.b1': FRACTION,
  'optim.b2': FRACTION,
  'optim.eps': RATE,
  'optim.grad_clip': NONNEG,
  'optim.momentum': FRACTION,
  # model (every family's fields; a family reads the ones it has)
  'model.name': Field(str, choices=_owned('models', 'MODELS', sort=True)),
  'model.dtype': Field(str, choices=DTYPES),
  'model.param_dtype': Field(str, choices=DTYPES),
  'model.logits_dtype': Field(str, choices=DTYPES),
  'model.loss_chunks': COUNT,  # the LM loss in that many chunks along the length; 0 or 1: off
  'model.attention': Field(str, choices=_owned('models.attention', 'IMPLEMENTATIONS')),
  'model.remat': Field('remat', choices=_owned('models.layers', 'REMAT_POLICIES')),  # True/False: full/none
  'model.scan_layers': Field(bool),
  'model.vocab_size': POSITIVE,
  'model.pad_vocab_to': POSITIVE,
  'model.max_len': POSITIVE,
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
  'dataset.name': Field(str),
  'dataset.seq_len': POSITIVE,
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
  """Raises one ConfigError for the first field that is unknown or holds a value it does not allow."""
  for path, value in leaves(config).items():
    field = FIELDS.get(path)
    if field is None:
      raise ConfigError(
        f'config.{path} is not a field shardzoo knows; a new field is described in '
        'configs/schema.py FIELDS (its type and allowed values)'
      )
    if field.problem(value):
      raise ConfigError(field.message(path, value))


def parse_flags(argv: list[str], flag_values: flags.FlagValues | None = None) -> list[str]:
  """absl's flag parsing (app.run's flags_parser) with one line for a bad --config instead of a traceback:
  a config file that is missing or does not compile, an unknown field (with ml_collections' suggestion, or
  naming a field this config file does not declare), a misspelled preset or size, a value that does not parse."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  try:
    rest = flag_values(argv)
    for name in _config_flags(flag_values):  # ml_collections defers a config file that failed to load until read
      if flag_values[name].value is not None:
        hasattr(flag_values[name].value, 'keys')
    return rest
  except flags.Error as e:  # a value of the wrong type, or the config file's get_config(arg) refused its argument
    text = str(e)
    cause = [line.strip() for line in text.splitlines() if re.match(r'\s*\w+(Error|Exception): ', line)]
    message = text.splitlines()[0].rstrip(':').strip()
    if cause:
      message += f': {cause[-1].split(": ", 1)[1]}'
    for pattern, kind in ((r'for int\(\)', 'an integer'), (r'to float', 'a number'), (r'[Bb]oolean', 'True or False')):
      if re.search(pattern, text):
        message += f' (must be {kind})'
        break
  except (OSError, SyntaxError) as e:  # the config file is missing, unreadable or not Python
    message = _load_error(argv, flag_values, e)
  except (AttributeError, KeyError) as e:  # --config.<field> naming no field
    text = str(e.args[0] if e.args else e)
    if "has no attribute 'get_config'" in text:  # ml_collections: the file defines no get_config()
      raise SystemExit(
        f'shardzoo: config error: {_config_flag(argv, flag_values)[0]}: the file defines no '
        'get_config(), so it is not a config file (configs/<model>.py are)'
      ) from None
    bad = re.search(r'instead of "([^"]+)"', text) or re.search(r'(\w+)', text)
    name = bad.group(1) if bad else text
    flag = next((a for a in argv if re.match(rf'--config\.([\w.]*\.)?{re.escape(name)}(=|$)', a)), f'--config.{name}')
    path = flag.split('=', 1)[0][len('--config.') :]
    hint = re.search(r'Did you mean "([^"]+)"', text)
    if path in FIELDS:  # a field of other config files: a did-you-mean would point at the wrong field
      message = f'{flag}: this config file does not declare config.{path}'
    else:
      message = f'{flag}: the config has no field {name!r}' + (f'; did you mean {hint.group(1)!r}?' if hint else '')
  raise SystemExit(f'shardzoo: config error: {message}')


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


def _load_error(argv: list[str], flag_values: flags.FlagValues, error: OSError | SyntaxError) -> str:
  """'--config=<file>[:arg]: no such file' (or the OS error, or the syntax error's file:line and message)."""
  flag, file = _config_flag(argv, flag_values)
  if isinstance(error, SyntaxError):
    return f'{flag}: syntax error at {error.filename}:{error.lineno}: {error.msg}'
  # ml_collections keeps only the text: '[Errno 2] No such file or directory: <the file>'
  os_error = re.search(r"\[Errno (\d+)\] ([^:\n]+)(?:: '([^'\n]*)')?", str(error))
  if os_error and int(os_error.group(1)) == errno.ENOENT:
    missing = os_error.group(3) or file  # the config file, or a file its get_config reads
    return f'{flag}: no such file' + (f' {missing!r}' if not flag.endswith(f'={missing}') else '')
  return f'{flag}: cannot be read ({os_error.group(2) if os_error else str(error).splitlines()[0]})'
