"""Opening prepared TFDS datasets as random-access sources, offline, with one clear error per problem.

Nothing here downloads: `as_data_source` only reads what `download_and_prepare` wrote to data_dir.
An unprepared dataset fails at once (tfds would otherwise retry the network for minutes) with the
command that prepares it on a machine with network access.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from typing import Any

from errors import ConfigError

RANDOM_ACCESS_FORMATS = ('array_record', 'parquet')


def _tfds():
  import tensorflow_datasets as tfds  # noqa: PLC0415 (0.5 s; only when a TFDS dataset is used)

  return tfds


def builder(name: str, data_dir: str | None, offline_names: Sequence[str] = ()) -> Any:
  """The TFDS builder for `name` reading from data_dir (the TFDS default when None)."""
  tfds = _tfds()
  try:
    return tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    known = list(offline_names) + tfds.list_builders(with_community_datasets=False)
    close = difflib.get_close_matches(name.split('/')[0], known, n=3)
    hint = f'; did you mean {close}?' if close else ''
    # tfds also reads a dataset prepared in data_dir without its code: a data_dir typo looks like an unknown name
    looked = data_dir or tfds.core.constants.DATA_DIR
    where = 'config.dataset.data_dir' if data_dir else 'the TFDS default; config.dataset.data_dir is unset'
    missing = '' if os.path.isdir(looked) else ', which does not exist'
    raise ConfigError(
      f'config.dataset.name={name!r} is not a known dataset: not offline ({sorted(offline_names)}), not a '
      f'TFDS dataset (tfds.list_builders()) and not prepared in {looked} ({where}){missing}{hint}'
    ) from None


def prepare_command(name: str, data_dir: str) -> str:
  return (
    f'tfds build {name} --data_dir={data_dir} --file_format=array_record   (or in Python: '
    f"tfds.builder({name!r}, data_dir={data_dir!r}, file_format='array_record').download_and_prepare())"
  )


def split_names(spec: str) -> list[str]:
  """'train[:90%]+validation' -> ['train', 'validation']."""
  return [re.sub(r'\[.*\]$', '', part.strip()) for part in spec.split('+')]


def open_split(b: Any, name: str, split: str, what: str) -> Sequence[Any]:
  """A random-access source of decoded examples (dicts of numpy arrays / bytes) of one split."""
  root = str(b.data_dir).rsplit('/' + b.name, 1)[0]
  known = list(b.info.splits)  # empty when not prepared (or under tfds.testing.mock_data)
  unknown = [s for s in split_names(split) if known and s not in known]
  if unknown:
    raise ConfigError(
      f'config.dataset.{what}={split!r}: {name} has no split {unknown[0]!r}; its splits: {sorted(known)}'
    )
  try:
    return b.as_data_source(split=split)
  except Exception as e:
    if not b.is_prepared():
      manual = (
        (
          f' {name} also needs files downloaded by hand into --manual_dir: see tfds.builder({name!r})'
          '.MANUAL_DOWNLOAD_INSTRUCTIONS.'
        )
        if getattr(b, 'MANUAL_DOWNLOAD_INSTRUCTIONS', None)
        else ''
      )
      raise ConfigError(
        f'TFDS dataset {name!r} is not prepared in data_dir {root} (config.dataset.data_dir; nothing is '
        f'downloaded at run time). Prepare it on a machine with network access: {prepare_command(name, root)}, '
        f'then copy {root}/{b.name} here or point config.dataset.data_dir at it.{manual}'
      ) from None
    fmt = getattr(b.info.file_format, 'value', b.info.file_format)
    if fmt not in RANDOM_ACCESS_FORMATS:
      raise ConfigError(
        f'TFDS dataset {name!r} in {b.data_dir} is stored as {fmt}, which has no random access; convert it: '
        f'tfds convert_format --dataset_version_dir={b.data_dir} --out_file_format=array_record '
        f'(or prepare it again with --file_format=array_record)'
      ) from e
    raise
