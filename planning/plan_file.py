"""The winning plan as a config file that `train.py --config` reads as it is.

The file imports the searched config file, calls its get_config with the same argument, and sets every
field that differs from it (the plan's mesh, rules and remat, and any --config.* override the search ran
with), so the plan stays readable as a diff against the preset it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from configs import schema
from errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _value(v: Any) -> str:
  if isinstance(v, ml_collections.ConfigDict):
    v = v.to_dict()
  if isinstance(v, (list, tuple)):
    inner = ', '.join(repr(tuple(x)) if isinstance(x, (list, tuple)) else repr(x) for x in v)
    return f'[{inner}]' if isinstance(v, list) else f'({inner}{"," if len(v) == 1 else ""})'
  return repr(v)


def check_out_path(path: str, *, overwrite: bool = False, config_file: str | None = None) -> None:
  """A bad --out (a directory, a missing parent, not .py, an existing file without `overwrite`, the config file
  the plan is read from) is one ConfigError, before anything compiles."""
  parent = os.path.dirname(os.path.abspath(path)) or '.'
  if not path.endswith('.py'):
    raise ConfigError(f'--out {path!r}: the plan is a config file, give a path ending in .py')
  if os.path.isdir(path):
    raise ConfigError(f'--out {path!r} is a directory; give a file path ending in .py')
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
    raise ConfigError(f'--out {path!r}: directory {parent!r} does not exist or is not writable')
  if config_file and os.path.exists(path) and os.path.samefile(path, config_file):
    raise ConfigError(
      f'--out {path!r} is the config file the plan is made from (the plan imports it); give another path'
    )
  if os.path.exists(path) and not overwrite:
    raise ConfigError(f'--out {path!r} exists; give another path, or --overwrite to replace it')


def render(
  config_file: str, arg: str | None, base: ml_collections.ConfigDict, plan: ml_collections.ConfigDict, header: str
) -> str:
  """The text of the plan file: header (a docstring), then get_config = the base's plus the differences."""
  config_file = os.path.abspath(config_file)
  rel = os.path.relpath(config_file, ROOT)
  module = rel[:-3].replace(os.sep, '.') if rel.startswith('configs' + os.sep) and rel.endswith('.py') else None
  theirs, ours = schema.leaves(base), schema.leaves(plan)
  lines = []
  for path, value in ours.items():
    if path in ('mesh', 'logical_axis_rules') or path not in theirs or theirs[path] != value:
      if path in ('mesh', 'dcn_mesh'):
        lines.append(f'  c.{path} = common.mesh({dict(value.items())!r})')
      else:
        lines.append(f'  c.{path} = {_value(value)}')
  if module:
    load = [
      f'from configs import common, {module.split(".")[-1]} as base',
      '',
      '',
      'def get_config(arg=None):',
      f'  c = base.get_config({arg!r})',
    ]
  else:
    load = [
      'import importlib.util',
      '',
      'from configs import common',
      '',
      '',
      'def get_config(arg=None):',
      f'  spec = importlib.util.spec_from_file_location("plan_base", {config_file!r})',
      '  base = importlib.util.module_from_spec(spec)',
      '  spec.loader.exec_module(base)',
      f'  c = base.get_config({arg!r})',
    ]
  return '\n'.join(
    [f'r"""{header.strip()}\n"""']
    + load
    + ['  with c.unlocked():']
    + ['  ' + line for line in lines]
    + ['  return c', '']
  )


def write(path: str, text: str, *, overwrite: bool = False, config_file: str | None = None) -> None:
  check_out_path(path, overwrite=overwrite, config_file=config_file)
  with open(path, 'w') as f:
    f.write(text)


def fields_changed(base: ml_collections.ConfigDict, plan: ml_collections.ConfigDict) -> Mapping[str, Any]:
  theirs = schema.leaves(base)
  return {k: v for k, v in schema.leaves(plan).items() if theirs.get(k) != v}
