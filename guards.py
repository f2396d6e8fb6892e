"""The checks every entry point makes of its files before any work: an input exists, is a file and parses (a broken
line named with its number); an output goes into a directory that exists and is writable, is not one of the
command's inputs or a file of a run (its config, tables, checkpoints), and replaces only a previous output of the
same kind unless --overwrite is given. A train.py --workdir is a directory, not a run's checkpoints/.

Beside errors.py, not in checkpointing/: these are about the command line's paths, not about checkpoints, and like
errors.py this module imports no JAX, so the checks run in a second, before anything starts or loads."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from errors import ConfigError

RUN_FILES = ('run_config.json', 'sharding_table.txt')  # what train.py writes beside checkpoints/


def input_file(path: str, flag: str) -> str:
  """`path` when it is a readable file; else a ConfigError saying what it is."""
  if not os.path.exists(path):
    raise ConfigError(f'{flag}={path}: no such file')
  if os.path.isdir(path):
    raise ConfigError(f'{flag}={path} is a directory, not a file')
  if not os.access(path, os.R_OK):
    raise ConfigError(f'{flag}={path} cannot be read (permission denied)')
  return path


def json_lines(path: str, flag: str) -> Iterator[tuple[int, Any]]:
  """(line number, value) of each non-blank line of a JSON Lines file; ConfigError naming file:line for a line that
  is not UTF-8 text or not JSON."""
  input_file(path, flag)
  with open(path, 'rb') as f:
    for n, raw in enumerate(f, 1):
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError:
        raise ConfigError(f'{path}:{n}: not UTF-8 text; {flag} reads JSON Lines') from None
      if not line.strip():
        continue
      try:
        yield n, json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(
          f'{path}:{n}: not JSON ({e.msg}, column {e.colno}); {flag} reads one JSON object per line'
        ) from None


def json_kind(value: Any) -> str:
  """What JSON calls a parsed value's type, for messages ('a number', 'an object')."""
  kinds = {bool: 'a boolean', int: 'a number', float: 'a number', str: 'a string', list: 'a list', dict: 'an object'}
  return kinds.get(type(value), 'null')


def run_of(path: str) -> str | None:
  """The run directory `path` belongs to (train.py's files beside checkpoints/, or anything under its
  checkpoints/), else None."""
  path = os.path.abspath(path)
  parent = os.path.dirname(path)
  if os.path.basename(path) in RUN_FILES and _is_run(parent):
    return parent
  d = parent
  while d != os.path.dirname(d):
    if os.path.basename(d) == 'checkpoints' and _is_run(os.path.dirname(d)):
      return os.path.dirname(d)
    d = os.path.dirname(d)
  return None


def _is_run(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, RUN_FILES[0])) or os.path.isdir(os.path.join(directory, 'checkpoints'))


def output_file(
  path: str,
  flag: str,
  *,
  what: str,
  previous: Callable[[str], bool],
  overwrite: bool = False,
  inputs: Iterable[tuple[str, str | None]] = (),
) -> str:
  """Checks, before any work, that `path` can take this command's output (`what`, e.g. 'generate.py results'):
  its directory exists and is writable; it is not a directory, not one of `inputs` ((flag, path) pairs), not a
  file of a run; an existing file is replaced only when `previous(path)` says it is an earlier output of this kind,
  or with --overwrite. `inputs` that are directories (a model's) hold no output. ConfigError naming the flag, the
  path and what to do. Returns the path."""
  full = os.path.abspath(path)
  if os.path.isdir(full):
    raise ConfigError(f'{flag}={path} is a directory: give a file path for the {what}')
  parent = os.path.dirname(full)
  if not os.path.isdir(parent):
    kind = 'is a file, not a directory' if os.path.exists(parent) else 'does not exist (create it first)'
    raise ConfigError(f'{flag}={path}: its directory {parent} {kind}')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f'{flag}={path}: its directory {parent} is not writable')
  for other, given in inputs:  # a file the command reads, or a directory it reads (a model's, a tokenizer's)
    if not given or not os.path.exists(given):
      continue
    if os.path.isdir(given) and os.path.commonpath([full, os.path.abspath(given)]) == os.path.abspath(given):
      raise ConfigError(f'{flag}={path} is inside {other}={given}, which this command reads: give another path')
    if os.path.exists(full) and os.path.samefile(full, given):
      raise ConfigError(f'{flag}={path} is also {other}, which this command reads: give another path for the {what}')
  if (run := run_of(full)) is not None:
    raise ConfigError(
      f"{flag}={path} is a file of the run in {run} (train.py's {', '.join(RUN_FILES)} and checkpoints/): "
      f'give another path for the {what}'
    )
  if os.path.exists(full) and not overwrite and not previous(full):
    raise ConfigError(
      f'{flag}={path} exists and is not an earlier {what}: give a new path, or --overwrite to replace it'
    )
  return path


def first_json_line(path: str) -> Any:
  """The first non-blank line of a file as JSON; None when it is empty, or not text or JSON."""
  try:
    with open(path, encoding='utf-8') as f:
      for line in f:
        if line.strip():
          return json.loads(line)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  return None


def write_text(path: str, text: str) -> None:
  """`text` written beside `path` and moved over it, so a failure part way leaves the old file whole."""
  directory = os.path.dirname(os.path.abspath(path))
  with tempfile.NamedTemporaryFile('w', dir=directory, prefix='.shardzoo-', delete=False, encoding='utf-8') as f:
    f.write(text)
  os.replace(f.name, path)


def workdir(path: str, flag: str = '--workdir') -> None:
  """train.py's --workdir: a directory (made if missing), not a file, and not inside another run's checkpoints/
  (a new run there would be nested in that run's checkpoints). ConfigError saying what to give."""
  full = os.path.abspath(path)
  if os.path.exists(full) and not os.path.isdir(full):
    raise ConfigError(f'{flag} {path} is a file, not a directory: give a directory (it is made if missing)')
  d = full
  while d != os.path.dirname(d):
    if os.path.basename(d) == 'checkpoints' and _is_run(os.path.dirname(d)):
      run = os.path.dirname(d)
      raise ConfigError(
        f"{flag} {path} is inside the checkpoints/ of the run in {run}: give the run's directory, {flag} {run}, "
        'to resume it, or a new directory'
      )
    d = os.path.dirname(d)
