"""Your own data: JSON Lines (also gzipped), parquet, plain text and Hugging Face datasets, as random-access
sources of rows for the grain pipelines (pipeline.py), and the language-model documents made of them.

Why Hugging Face `datasets`: it converts JSON Lines, parquet and text once into Arrow files in a cache
(config.dataset.cache_dir, default Hugging Face's) and memory-maps them. A row is then read by its index without
loading the rest: each process reads only the rows of its part of every global batch, the data position is a
few integers that any number of processes resumes, and a file larger than memory stays on disk (the OS pages in
what is read). Its columns are Arrow arrays, so the checks below (a row without the key, a chat without an
assistant turn) run over whole columns before training, without decoding the rows one by one.

Files are opened one by one (one Arrow cache each, then concatenated), so a bad row is named by its file and
line. A cache is built aside and renamed into place when complete: a full or read-only cache directory is one
StorageError naming it, with nothing half-built left behind. The fields a row is read by: `text_key` (plain
language modelling), `prompt_key` + `completion_key` (the loss on the completion), `messages_key` (chats rendered
by the tokenizer's own chat template, the loss on the assistant turns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from configs import schema
from errors import ConfigError, StorageError, describe_os_error, os_error_of

FORMATS = ('json', 'parquet', 'text')  # config.dataset.name for files; 'hf' for a Hugging Face dataset
NAMES = (*FORMATS, 'hf')
NO_ASSISTANT = ('skip', 'error')  # config.dataset.no_assistant: what a chat without an assistant turn gets
SAMPLE_BY = ('line', 'paragraph', 'document')  # config.dataset.sample_by: the rows of a plain text file
schema.register('dataset.no_assistant', NO_ASSISTANT)
schema.register('dataset.sample_by', SAMPLE_BY)


def _datasets():
  import datasets  # noqa: PLC0415 (only for these sources)

  return datasets


def identity(paths: Sequence[str]) -> list[tuple[str, int, int]]:
  """(absolute path, size, mtime in ns) of each file: what keys a cache built from them (a rewritten file, a new
  cache)."""
  out = []
  for p in paths:
    st = os.stat(p)
    out.append((os.path.abspath(p), st.st_size, st.st_mtime_ns))
  return out


def expand(spec: str, what: str) -> list[str]:
  """The files of `spec`: one or more globs separated by commas (`**` reaches into folders), each sorted."""
  if not isinstance(spec, str) or not spec.strip():
    raise ConfigError(f'config.dataset.{what}={spec!r}: give the files as a glob, e.g. data/train-*.jsonl')
  files = []
  for pattern in (p.strip() for p in spec.split(',')):
    found = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
    if not found:
      raise ConfigError(f'config.dataset.{what}={spec!r}: {pattern!r} matches no file')
    files += found
  return files


class Rows:
  """Random-access rows (dicts) of one or more files, read through their memory-mapped Arrow caches.

  `keep` (optional) lists the rows served, in order (a chat without an assistant turn left out); `where(i)` names
  the file and line of row i for errors."""

  def __init__(self, tables: Sequence[Any], names: Sequence[str], columns: Sequence[str], unit: str = 'line'):
    self.files, self.unit = list(names), unit
    self.starts = np.cumsum([0] + [len(t) for t in tables])
    tables = [t.select_columns(list(columns)) for t in tables]  # other columns may differ between files
    for t, name in zip(tables[1:], names[1:]):
      if t.features != tables[0].features:
        raise ConfigError(
          f'{name} holds {dict(t.features)}, but {names[0]} holds {dict(tables[0].features)}: the files of one '
          'source must have the same types in the columns read'
        )
    self.data = tables[0] if len(tables) == 1 else _datasets().concatenate_datasets(tables)
    self.keep: np.ndarray | None = None

  def __len__(self) -> int:
    return len(self.data) if self.keep is None else len(self.keep)

  def __getitem__(self, i: int) -> dict[str, Any]:
    i = int(i)
    row = self.data[int(self.keep[i]) if self.keep is not None else i]
    row['_where'] = self.where(i)  # for the transforms' messages (a truncated or unrenderable row)
    return row

  def where(self, i: int) -> str:
    """'file line n' of row i (of the rows served)."""
    return self.names()(i)

  def names(self) -> RowNames:
    """`where` without the rows (what a token cache's documents are named by in worker processes)."""
    return RowNames(self.files, self.starts, self.keep, self.unit)


@dataclasses.dataclass(frozen=True)
class RowNames:
  """'file line n' of row i of a Rows (of the rows served)."""

  files: list[str]
  starts: np.ndarray
  keep: np.ndarray | None
  unit: str

  def __call__(self, i: int) -> str:
    j = int(self.keep[i]) if self.keep is not None else int(i)
    f = int(np.searchsorted(self.starts, j, side='right')) - 1
    return f'{self.files[f]} {self.unit} {j - self.starts[f] + 1}'


def _load(fmt: str, file: str, cfg: Any) -> Any:
  """One file as a memory-mapped datasets.Dataset (built into the Arrow cache the first time: build_aside)."""
  if os.path.getsize(file) == 0:
    raise ConfigError(f'{file} is empty (config.dataset.name={fmt!r})')
  ds, kwargs = _datasets(), {'sample_by': cfg.sample_by} if fmt == 'text' else {}
  builder = lambda cache_dir: ds.load_dataset_builder(fmt, data_files=[file], cache_dir=cache_dir, **kwargs)
  root = os.path.abspath(os.path.expanduser(cfg.cache_dir or ds.config.HF_DATASETS_CACHE))
  try:
    with tempfile.TemporaryDirectory() as elsewhere:  # where under a cache this file's goes (builders lock there)
      where = os.path.relpath(builder(elsewhere).cache_dir, elsewhere)

    def build(aside: str) -> str:
      built = builder(aside)
      built.download_and_prepare()
      return built.cache_dir

    complete = lambda path: os.path.isfile(os.path.join(path, 'dataset_info.json'))
    build_aside(root, os.path.join(root, where), build, f'the Arrow cache of {file}', complete)
    return builder(root).as_dataset(split='train')
  except StorageError:
    raise
  except StopIteration:
    raise ConfigError(f'{file} has no rows (config.dataset.name={fmt!r})') from None
  except Exception as e:  # datasets wraps the reader's error (e.g. pyarrow's JSON parse error and its row)
    cause = e.__cause__ or e
    raise ConfigError(f'{file} cannot be read as {fmt}: {type(cause).__name__}: {str(cause).splitlines()[0]}') from None


_WRITING = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # errors only writing meets (reading the file meets others)


def build_aside(
  root: str,
  final: str,
  build: Callable[[str], str],
  what: str,
  complete: Callable[[str], bool],
  *,
  lock: bool = False,
  also: str = '',
) -> bool:
  """Builds the cache directory `final` under the cache's `root` unless `complete(final)`: `build(aside)` writes it
  in a new directory of its own under `root` and returns the directory it made there (aside, or one inside it),
  which is renamed to `final` once whole, so that a build cut short (a full disk, a read-only directory, a kill)
  leaves nothing a later run could take for a cache, nor empty directories. A build another process finished first
  is taken as it is; with `lock`, builds of one `final` wait for each other (a file lock beside it, which stays),
  and the first to get it removes what killed builds left (an incomplete `final`, directories aside). Whether this
  call built it. A full or read-only root is one StorageError naming `what`, `root`, the OS error, what is left
  and what to do (`also`: one more way out)."""
  if complete(final):
    return False
  made, aside = [], None
  prefix = f'.{os.path.basename(final)}.building-'
  try:
    d = os.path.dirname(final)
    while not os.path.isdir(d):  # the directories this build adds, removed again if it fails
      made.append(d)
      d = os.path.dirname(d)
    os.makedirs(root, exist_ok=True)
    if lock:
      os.makedirs(os.path.dirname(final), exist_ok=True)
    from filelock import FileLock  # noqa: PLC0415 (datasets' own dependency)

    with FileLock(final + '.lock') if lock else contextlib.nullcontext():
      if lock:
        if complete(final):  # another process built it while this one waited
          return False
        for stale in [final, *glob.glob(os.path.join(root, glob.escape(prefix) + '*'))]:  # builds cut short
          shutil.rmtree(stale, ignore_errors=True)
      aside = tempfile.mkdtemp(prefix=prefix, dir=root)
      built = build(aside)
      os.makedirs(os.path.dirname(final), exist_ok=True)
      try:
        os.rename(built, final)
      except OSError:
        if not complete(final):
          raise
        return False
    return True
  except Exception as e:
    found = os_error_of(e)
    if found is None or found.code not in _WRITING and not str(found.filename or '').startswith(root):
      raise  # not the cache's fault (the source's own errors)
    left = _remove(aside, made)
    advice = (
      'free space there or set config.dataset.cache_dir to a directory with space'
      if found.code in (errno.ENOSPC, errno.EDQUOT)
      else 'set config.dataset.cache_dir to a writable directory'
    )
    raise StorageError(
      f'{what} could not be built in {root}: {describe_os_error(found.code, found.strerror, None)}; {left} '
      f'({advice}{", or " + also if also else ""})'
    ) from None
  finally:
    _remove(aside, [])


def _remove(aside: str | None, made: list[str]) -> str:
  """Removes an unfinished build and the directories made for it; what is left of them (checked)."""
  if aside is not None:
    shutil.rmtree(aside, ignore_errors=True)
  for d in made:
    with contextlib.suppress(OSError):
      os.rmdir(d)
  left = [p for p in [aside, *made] if p is not None and os.path.exists(p)]
  return f'{left[0]} is left there (no run takes it for a cache)' if left else 'nothing of it is left there'


def _hf(cfg: Any, split: str, what: str) -> Any:
  """A split of a Hugging Face dataset: a directory written by save_to_disk, or a hub id through the cache."""
  path = cfg.path
  if not path:
    raise ConfigError("config.dataset.name='hf' needs config.dataset.path: a hub id or a save_to_disk directory")
  ds = _datasets()
  try:
    saved = ('dataset_dict.json', 'state.json')  # what save_to_disk writes (a DatasetDict, a Dataset)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in saved):
      loaded = ds.load_from_disk(path)
      if isinstance(loaded, ds.DatasetDict):
        if split not in loaded:
          raise ConfigError(f'config.dataset.{what}={split!r}: {path} has splits {sorted(loaded)}')
        loaded = loaded[split]
      return loaded
    return ds.load_dataset(path, split=split, cache_dir=cfg.cache_dir)
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError(
      f'config.dataset.path={path!r} ({what}={split!r}): no such save_to_disk directory, and not loadable as a '
      f'Hugging Face dataset ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); a hub dataset '
      'is read from the Hugging Face cache: load it once where the hub can be reached'
    ) from None


def _column(table: Any, key: str, source: str) -> pa.ChunkedArray:
  if key not in table.column_names:
    raise ConfigError(f'{source} has no column {key!r} (its columns: {table.column_names}): set config.dataset.*_key')
  return table.data.column(key)


def _first_null(col: pa.ChunkedArray) -> int:
  return int(pc.index(pc.is_null(col), True).as_py())


def open_rows(cfg: Any, spec: str, what: str, keys: Sequence[str], every_column: bool = False) -> Rows:
  """The rows of `spec` (a glob of files, or a split of config.dataset.path for 'hf'); ConfigError, naming the
  file and line, for a glob matching nothing, an empty or unreadable file, a row without one of `keys`. A row holds
  `keys`, or with `every_column` the first file's columns (GRPO's rows go whole to the reward functions)."""
  fmt = cfg.name
  if fmt == 'hf':
    tables, names, unit = [_hf(cfg, spec, what)], [f'{cfg.path} split {spec}'], 'row'
  else:
    names = expand(spec, what)
    tables, unit = [_load(fmt, f, cfg) for f in names], 'row' if fmt == 'parquet' else 'line'
  for t, name in zip(tables, names):
    if not len(t):
      raise ConfigError(f'{name} has no rows')
    for key in keys:
      col = _column(t, key, name)
      if col.null_count:
        raise ConfigError(f'{name} {unit} {_first_null(col) + 1} has no {key!r} (config.dataset.*_key)')
  return Rows(tables, names, tables[0].column_names if every_column else keys, unit)


def with_assistant(rows: Rows, key: str, policy: str) -> tuple[Rows, int]:
  """Rows whose chat (`key`: a list of {'role', 'content'}) has an assistant turn; the others are left out and
  counted ('skip') or the first is a ConfigError naming its file and line ('error')."""
  if policy not in NO_ASSISTANT:
    raise ConfigError(f'config.dataset.no_assistant={policy!r}; choose one of {list(NO_ASSISTANT)}')
  col = rows.data.data.column(key)
  kind = col.type.value_type if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) else None
  if kind is None or not pa.types.is_struct(kind) or {'role', 'content'} - {f.name for f in kind}:
    raise ConfigError(
      f'column {key!r} of {rows.files[0]} is {col.type}, not a chat (a list of {{"role", "content"}} messages)'
    )
  has = np.zeros(len(rows.data), bool)
  start = 0
  for chunk in col.chunks:  # chunk by chunk: bounded memory for any file size
    parents = np.asarray(pc.list_parent_indices(chunk))
    roles = pc.struct_field(pc.list_flatten(chunk), 'role')
    has[start + parents[np.asarray(pc.fill_null(pc.equal(roles, 'assistant'), False))]] = True
    start += len(chunk)
  if has.all():
    return rows, 0
  missing = np.flatnonzero(~has)
  if policy == 'error':
    raise ConfigError(
      f'{rows.where(int(missing[0]))} is a chat without an assistant turn ({len(missing)} such rows; '
      "config.dataset.no_assistant='skip' leaves them out)"
    )
  if len(missing) == len(has):
    raise ConfigError(f'no chat of {", ".join(rows.files)} has an assistant turn: nothing to train on')
  rows.keep = np.flatnonzero(has)
  return rows, len(missing)
