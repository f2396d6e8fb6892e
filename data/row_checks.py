"""Checks of the rows a fine-tune trains on, made once per source before training starts (data/registry.py calls
`check_sft` for prompt/completion pairs and chats): the prompt, completion and message content fields hold text
(a number would be trained on as its digits, or break the chat template in a loader thread, far from its row),
and how many answers config.dataset.seq_len cuts away entirely (a row whose prompt fills the row trains on
nothing; an eval split of only such rows has no target to average over). One function, so a pipeline that reads
rows another way calls the same checks."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

from data import tokens
from errors import ConfigError

SAMPLE = 256  # rows per source tokenized to count answers cut away: a second or so, for any file size


def _is_text(feature: Any) -> bool:
  return getattr(feature, 'dtype', None) in ('string', 'large_string')


def _message_fields(feature: Any) -> dict | None:
  """The {'role', 'content', ...} features of a chat column (a list of structs), else None."""
  inner = getattr(feature, 'feature', None)
  if inner is None and isinstance(feature, list) and feature:
    inner = feature[0]
  return inner if isinstance(inner, dict) else None


def _first_not_text(rows: Any, get: Any) -> tuple[int, Any]:
  """(row index, value) of the first row whose value (`get(row)`) is not a string; scanned on the error path only."""
  for j in range(len(rows.data)):
    for value in get(rows.data[j]):
      if not isinstance(value, str):
        return j, value
  return 0, None


def check_types(rows: Any, keys: list[str], messages: str | None) -> None:
  """The columns read hold text: `keys` (prompt, completion) strings, and each message's 'content' of `messages`
  a string. ConfigError naming the column, its type, and the first row (file and line) holding something else."""
  features = rows.data.features
  for key in keys:
    if not _is_text(features[key]):
      j, value = _first_not_text(rows, lambda r, key=key: [r[key]])
      raise ConfigError(
        f'{rows.where(j)}: {key!r} is {value!r} ({type(value).__name__}), not text (column {key!r} of '
        f'{features[key]}): write it as a JSON string'
      )
  fields = _message_fields(features[messages]) if messages else None
  if fields is not None and 'content' in fields and not _is_text(fields['content']):
    j, value = _first_not_text(rows, lambda r: [m['content'] for m in r[messages]])
    raise ConfigError(
      f"{rows.where(j)}: a message's 'content' is {value!r} ({type(value).__name__}), not text: chat templates "
      'render strings; write it as a JSON string'
    )


@contextlib.contextmanager
def row_named(example: Any):
  """An error raised while a row is transformed (in a loader thread, far from its row) as one ConfigError naming
  the row's file and line (its '_where', data/files.py)."""
  try:
    yield
  except ConfigError:
    raise
  except Exception as e:
    where = example.get('_where', 'a row') if isinstance(example, dict) else 'a row'
    first = str(e).strip().splitlines()[0] if str(e).strip() else ''
    raise ConfigError(f'{where} cannot be made into ids: {type(e).__name__}: {first}') from e


def first_trained(tok: Any, row: dict, prompt: str | None, completion: str | None, messages: str | None) -> int:
  """The index of a row's first id trained on (its answer's start), by the training rules of data/tokens.py."""
  if messages:
    _, loss = tokens.chat(tok, row[messages], row.get('_where', 'a chat'))
  else:
    _, loss = tokens.prompt_completion(tok, row[prompt], row[completion])
  return int(np.argmax(loss > 0)) if loss.any() else len(loss)


def check_sft(
  rows: Any, what: str, tok: Any, seq_len: int, prompt: str | None, completion: str | None, messages: str | None
) -> None:
  """`check_types` (call it on the rows as read, before any are left out), then up to SAMPLE rows spread over the
  source tokenized: every one with its answer beyond the row's seq_len + 1 ids is a ConfigError (nothing would be
  trained on, or evaluated), some a warning with the count and the seq_len that fits them."""
  n = len(rows)
  checked = sorted({int(i) for i in np.linspace(0, n - 1, min(n, SAMPLE))})
  starts = {}
  for i in checked:
    with row_named({'_where': rows.where(i)}):  # a template or tokenizer error here names its row too
      starts[i] = first_trained(tok, rows[i], prompt, completion, messages)
  cut = [i for i, s in starts.items() if s > seq_len]
  if not cut:
    return
  needed = max(starts[i] for i in cut)
  fix = f'raise config.dataset.seq_len to at least {needed} or shorten the prompts'
  if len(cut) == len(checked):
    raise ConfigError(
      f'{what}: every row checked ({len(checked)} of {n}) has its answer beyond config.dataset.seq_len={seq_len} '
      f'(e.g. {rows.where(cut[0])}: the answer starts at token {starts[cut[0]]}), so nothing would be '
      f'{"evaluated" if what == "eval_files" else "trained on"}: {fix}'
    )
  logging.warning(
    'data: %d of %d %s rows checked have their answer beyond config.dataset.seq_len=%d (e.g. %s) and train on '
    'nothing: %s',
    len(cut),
    len(checked),
    what,
    seq_len,
    rows.where(cut[0]),
    fix,
  )


def check_post(rows: Any, keys: list[str]) -> None:
  """`check_types` for post-training rows (data/preference.py): each of `keys` (a pair's prompt and answers, a
  GRPO row's prompt) holds texts, or chats whose messages' content is text; anything else is a ConfigError naming
  the column and the first row (file and line) holding it."""
  features = rows.data.features
  for key in keys:
    if _message_fields(features[key]) is not None:
      check_types(rows, [], key)
    else:
      check_types(rows, [key], None)
