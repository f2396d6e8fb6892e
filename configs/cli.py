"""The command line of train.py, export.py, search.py and the benchmarks: absl's flag parsing with a bad --config
reported as one line instead of a traceback (`parse_flags`).

A missing or broken config file, an unknown field (named with the nearest field of its section), a misspelled
preset or size, a value of the wrong type: each is one `shardzoo: config error: ...` line. A config file that
raises while it runs is named with its line and the error (the traceback's innermost frame in that file); one
whose get_config() returns something else than a ConfigDict, or leaves out a field every config sets, is named
too. The fields themselves, their defaults and what they allow are configs/schema.py's.

Every entry point is quiet by default: progress lines and warnings, not the INFO lines of JAX's backend search,
TensorFlow's start-up or our own modules (`--verbose` brings them back).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import importlib.util
import os
import re
import traceback
from collections.abc import Mapping
from typing import Any

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

import errors
from configs import schema
from configs.schema import FIELDS
from errors import ConfigError


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

# TensorFlow (imported by clu's metric writers and the TFDS datasets) announces itself from C++ when it is imported,
# twice with its oneDNN kernels on; it computes no model math here (only input pipelines), so they stay off and its
# INFO lines quiet unless the environment says otherwise. Set before anything imports it.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
flags.DEFINE_bool('verbose', False, 'Also print the INFO lines of JAX, TensorFlow, orbax and our modules.')


class _Completed(flags.ArgumentParser):
  """ml_collections' parser of a --config file, with the config it loads completed by the schema's defaults
  (schema.complete) before the --config.<field> overrides are applied to it: an override reaches every field,
  not only those the file writes (--config.dataset.train_files on configs/gpt2.py)."""

  def __init__(self, parser: flags.ArgumentParser):
    self.parser = parser

  def parse(self, argument: Any) -> Any:
    return schema.complete(self.parser.parse(argument))

  def flag_type(self) -> str:
    return self.parser.flag_type()


def parse_flags(argv: list[str], flag_values: flags.FlagValues | None = None) -> list[str]:
  """absl's flag parsing (app.run's flags_parser) with one line for a bad --config instead of a traceback:
  a config file that is missing or does not compile, an unknown field (named with the nearest field of its
  section), a misspelled preset or size, a value that does not parse. The --config.<field> overrides are
  checked against the loaded config before ml_collections applies them (`_check_overrides`)."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  for name in _config_flags(flag_values):
    if not isinstance(flag_values[name].parser, _Completed):
      flag_values[name].parser = _Completed(flag_values[name].parser)
  _check_file(argv, flag_values)
  try:
    with _file_errors(argv, flag_values):
      overrides = _overrides(argv, flag_values)
      if overrides and not _config_flag(argv, flag_values)[1]:
        raise _BadOverride(
          f'{overrides[0]}: --{overrides[0].flag}.* flags override a --{overrides[0].flag} file, and none is given: '
          f"add --{overrides[0].flag} FILE (the run's config file; a run's run_config.json is read as it is)"
        )
      if overrides:
        _check_overrides(overrides, _loaded(argv, flag_values))
      rest = flag_values(argv)
      for name in _config_flags(flag_values):  # ml_collections defers a config file that failed to load until read
        if flag_values[name].value is not None or flag_values[name].present:
          hasattr(flag_values[name].value, 'keys')
          _check_loaded(flag_values[name].value, argv, flag_values)
    if len(rest) > 1:
      raise errors.usage(_stray(rest[1:], argv, flag_values))
    if flag_values is flags.FLAGS:  # an entry point's own flags (tests parse theirs into fresh FlagValues)
      logging.set_verbosity(logging.INFO if flag_values.verbose else logging.WARNING)
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
  """What get_config() returned is a ConfigDict with the fields every config sets (the others completed with their
  defaults); its meshes keep their order."""
  schema.complete(config)
  flag, _ = _config_flag(argv, flag_values)
  if not isinstance(config, ml_collections.ConfigDict):
    raise SystemExit(
      f'shardzoo: config error: {flag}: get_config() returned '
      f'{"None (no return statement?)" if config is None else "a " + type(config).__name__}, not an '
      'ml_collections.ConfigDict (configs/<model>.py show how one is built)'
    )
  if missing := schema.missing_field(config):
    raise SystemExit(f'shardzoo: config error: {flag}: {missing}')
  schema.keep_written_order(config)


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


def overridden(argv: list[str], flag_values: flags.FlagValues | None = None) -> set[str]:
  """The config fields the command line sets (--config.model.dtype=... -> {'model.dtype'}): where an entry point
  takes a value from elsewhere (a checkpoint's config.json) unless it is given."""
  return {o.path for o in _overrides(argv, flags.FLAGS if flag_values is None else flag_values)}


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
