"""Post-training rows of your own files: preference pairs (task 'dpo') and prompts to sample from (task 'grpo').

A pair is a row with a prompt and two answers (config.dataset.prompt_key, chosen_key, rejected_key): texts, encoded
as prompt/completion rows are (tokens.prompt_completion: the loss on the answer and its end-of-text), or chats in
TRL's conversational form (the prompt a list of messages, each answer a list of assistant messages), rendered by the
tokenizer's chat template with the loss on the answer's turns. A GRPO row has a prompt (a text, or a chat rendered
with the generation prompt); the whole row goes to the reward functions with each completion.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any

import grain
import numpy as np
import pyarrow.compute as pc

from data import files, row_checks, text, tokens
from data.dataset import Dataset
from errors import ConfigError


def _answer(tok, prompt: Any, answer: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
  """(ids, loss) of prompt + answer: the loss on the answer only."""
  if isinstance(prompt, str) and isinstance(answer, str):
    return tokens.prompt_completion(tok, prompt, answer)
  if isinstance(prompt, list) and isinstance(answer, list):
    tokens.check_chat_template(tok, 'a preference pair of chats')
    ids, loss = tokens.chat(tok, [*prompt, *answer], where)
    loss[: len(tokens.chat_prompt(tok, prompt))] = 0  # the prompt's own assistant turns are context, not answers
    return ids, loss
  raise ConfigError(
    f'{where}: the prompt is {type(prompt).__name__} and the answer {type(answer).__name__}: a pair is texts '
    '(strings) or chats (lists of {"role", "content"} messages)'
  )


class _Side(grain.transforms.Map):
  """One answer of a pair as an LM document (inputs, targets, mask), for text.LMRow to pad."""

  def __init__(self, tok, prompt_key: str, answer_key: str, truncations: text.Truncations):
    self.tok, self.keys, self.truncations = tok, (prompt_key, answer_key), truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    ids, loss = _answer(self.tok, example[self.keys[0]], example[self.keys[1]], example.get('_where', 'a pair'))
    ids = self.truncations.cut(ids, example)
    return {'inputs': ids[:-1], 'targets': ids[1:], 'mask': loss[1 : len(ids)].astype(np.float32)}


class PreferencePair(grain.transforms.Map):
  """A row -> chosen_{inputs,targets,mask} and rejected_* (seq_len each, padding masked) and the pair's mask 1;
  with the reference's log-probs of the split attached (`with_reference`), ref_chosen_logps and ref_rejected_logps
  of the row (its '_index')."""

  def __init__(self, tok, prompt_key: str, chosen_key: str, rejected_key: str, seq_len: int):
    cut = text.Truncations(seq_len + 1)
    self.sides = {
      s: text.LMRow(_Side(tok, prompt_key, key, cut), seq_len)
      for s, key in (('chosen', chosen_key), ('rejected', rejected_key))
    }
    self.reference: np.ndarray | None = None  # (rows, 2): the reference's summed answer log-probs per pair

  def with_reference(self, logps: np.ndarray) -> PreferencePair:
    out = copy.copy(self)
    out.reference = np.asarray(logps, np.float32)
    return out

  def map(self, example: Any) -> dict[str, np.ndarray]:
    out = {f'{s}_{k}': v for s, row in self.sides.items() for k, v in row.map(example).items()}
    if self.reference is not None:
      chosen, rejected = self.reference[example['_index']]
      out |= {'ref_chosen_logps': np.float32(chosen), 'ref_rejected_logps': np.float32(rejected)}
    return out | {'mask': np.float32(1.0)}


def check_distinct(rows: files.Rows, chosen_key: str, rejected_key: str) -> None:
  """ConfigError naming the first row whose chosen and rejected answers are the same (nothing to prefer)."""
  table = rows.data.data
  a, b = table.column(chosen_key), table.column(rejected_key)
  try:
    same = np.asarray(pc.fill_null(pc.equal(a, b), False))
  except Exception:  # chats (lists of structs): compared as Python values
    same = np.asarray([x == y for x, y in zip(a.to_pylist(), b.to_pylist())])
  if rows.keep is not None:
    same = same[rows.keep]
  if same.any():
    i = int(np.argmax(same))
    raise ConfigError(
      f'{rows.where(i)}: the chosen and the rejected answer are the same ({chosen_key!r} == {rejected_key!r}): '
      f'a pair must prefer one answer to another ({int(same.sum())} such rows)'
    )


def _tokenizer(cfg) -> Any:
  from configs import schema  # noqa: PLC0415

  tok = tokens.tokenizer(cfg.tokenizer, schema.derived_from(cfg, 'tokenizer'))
  if tok.eos_id is None:
    raise ConfigError(f'tokenizer {tok.name!r} has no end-of-text token: answers end with one')
  return tok


def _open(cfg, keys: list[str], every_column: bool = False) -> tuple[files.Rows, files.Rows, str]:
  name = cfg.name
  if name not in files.NAMES:
    raise ConfigError(
      f'config.dataset.name={name!r}: preference pairs and GRPO prompts come from your own files: one of '
      f'{list(files.NAMES)} (docs/post_training.md)'
    )
  if not cfg.train_files or not cfg.eval_files:
    raise ConfigError(f'config.dataset.name={name!r} needs config.dataset.train_files and eval_files (globs)')
  train = files.open_rows(cfg, cfg.train_files, 'train_files', keys, every_column)
  eval_ = files.open_rows(cfg, cfg.eval_files, 'eval_files', keys, every_column)
  return train, eval_, f'{cfg.train_files}; eval {cfg.eval_files}'


def pairs(cfg) -> Dataset:
  """The preference pairs of config.dataset (task 'dpo')."""
  keys = [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key]
  if not cfg.prompt_key:
    raise ConfigError('config.task=dpo needs config.dataset.prompt_key (the column of the prompts)')
  train, eval_, where = _open(cfg, keys)
  for r in (train, eval_):
    row_checks.check_post(r, keys)
    check_distinct(r, cfg.chosen_key, cfg.rejected_key)
  tok, L = _tokenizer(cfg), cfg.seq_len
  return Dataset(
    cfg.name,
    Indexed(train),  # a row's index finds its precomputed reference log-probs (with_reference)
    Indexed(eval_),
    PreferencePair(tok, cfg.prompt_key, cfg.chosen_key, cfg.rejected_key, L),
    num_threads=cfg.num_threads,
    prefetch=cfg.prefetch,
    tokenizer=tok,
    vocab=(tok.vocab_size, f'the {tok.name} tokenizer'),
    description=f'{cfg.name} ({where}): train {len(train):,} / eval {len(eval_):,} preference pairs '
    f'({cfg.prompt_key!r}, {cfg.chosen_key!r} over {cfg.rejected_key!r}); {tok.name} tokenizer '
    f'({tok.vocab_size} ids); two rows of {L} tokens per pair, the loss on the answers',
  )


class Indexed:
  """Rows that carry their index (`_index`): a rollout reads the whole row again for the reward functions."""

  def __init__(self, rows: files.Rows):
    self.rows = rows

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, i: int) -> dict[str, Any]:
    return self.rows[i] | {'_index': int(i)}


def prompt_ids(tok, prompt: Any, where: str) -> list[int]:
  """A GRPO prompt's ids: a text as a decode's prompt (tokens.prompt), a chat with the generation prompt."""
  if isinstance(prompt, str):
    return tokens.prompt(tok, prompt)
  if isinstance(prompt, list):
    return tokens.chat_prompt(tok, prompt)
  raise ConfigError(f'{where}: the prompt is {type(prompt).__name__}: give a text or a chat (a list of messages)')


class Prompt(grain.transforms.Map):
  """A row -> 'prompt' (its ids, left-aligned and padded to `length`), 'prompt_len', 'index' (the row's), 'mask' 1."""

  def __init__(self, tok, key: str, length: int):
    self.tok, self.key, self.length = tok, key, length

  def map(self, example: Any) -> dict[str, np.ndarray]:
    where = example.get('_where', 'a prompt')
    ids = prompt_ids(self.tok, example[self.key], where)
    if len(ids) > self.length:
      raise ConfigError(
        f'{where}: the prompt has {len(ids)} tokens, over the {self.length} a prompt may have (config.dataset.seq_len '
        '- config.grpo.max_new_tokens)'
      )
    row = np.full(self.length, self.tok.pad_id, np.int32)
    row[: len(ids)] = ids
    return {
      'prompt': row,
      'prompt_len': np.int32(len(ids)),
      'index': np.int32(example['_index']),
      'mask': np.float32(1),
    }


def prompts(cfg, max_new_tokens: int) -> Dataset:
  """The prompts of config.dataset (task 'grpo'): rows with config.dataset.prompt_key, the rest of each row for the
  reward functions."""
  if not cfg.prompt_key:
    raise ConfigError('config.task=grpo needs config.dataset.prompt_key (the column of the prompts)')
  train, eval_, where = _open(cfg, [cfg.prompt_key], every_column=True)
  for r in (train, eval_):
    row_checks.check_post(r, [cfg.prompt_key])
  tok, P = _tokenizer(cfg), cfg.seq_len - max_new_tokens
  if P < 1:
    raise ConfigError(
      f'config.dataset.seq_len={cfg.seq_len} leaves no room for a prompt before config.grpo.max_new_tokens='
      f'{max_new_tokens} new tokens'
    )
  return Dataset(
    cfg.name,
    Indexed(train),
    Indexed(eval_),
    Prompt(tok, cfg.prompt_key, P),
    num_threads=cfg.num_threads,
    prefetch=cfg.prefetch,
    tokenizer=tok,
    vocab=(tok.vocab_size, f'the {tok.name} tokenizer'),
    description=f'{cfg.name} ({where}): train {len(train):,} / eval {len(eval_):,} prompts ({cfg.prompt_key!r}, at '
    f'most {P} tokens); {tok.name} tokenizer ({tok.vocab_size} ids)',
  )


# --- The reference's log-probs, precomputed (config.dpo.precompute_reference) -----------------------------------

REFERENCE_DIR = 'shardzoo_reference_logps'


def _file_ids(spec: str | None, what: str) -> list[Any]:
  return files.identity(files.expand(spec, what)) if spec else []


def reference_path(cfg: Any, reference: dict[str, Any]) -> str:
  """Where the reference's log-probs of config.dataset's pairs are kept: beside the data's Arrow cache
  (config.dataset.cache_dir, else Hugging Face's), in a file named by a hash of `reference` (what makes the
  reference's weights) and of the data (each file's path, size and modification time; the keys, tokenizer and
  seq_len that make its rows): another model or other data is another file, never a stale one."""
  data_id = {
    'name': cfg.name,
    'path': cfg.get('path'),
    'train': _file_ids(cfg.train_files, 'train_files') if cfg.name != 'hf' else cfg.train_files,
    'eval': _file_ids(cfg.eval_files, 'eval_files') if cfg.name != 'hf' else cfg.eval_files,
    'keys': [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key],
    'tokenizer': str(cfg.tokenizer),
    'seq_len': cfg.seq_len,
  }
  blob = json.dumps({'reference': reference, 'data': data_id}, sort_keys=True, default=str)
  import datasets  # noqa: PLC0415  (only to find its cache)

  root = os.path.abspath(os.path.expanduser(cfg.cache_dir or datasets.config.HF_DATASETS_CACHE))
  return os.path.join(root, REFERENCE_DIR, hashlib.sha256(blob.encode()).hexdigest()[:32] + '.npz')


def load_reference(path: str, ds: Dataset) -> tuple[np.ndarray, np.ndarray] | None:
  """(train, eval) log-probs stored at `path` for `ds`'s pairs, or None where there are none (or not for as
  many pairs)."""
  if not os.path.isfile(path):
    return None
  with np.load(path) as f:
    train, eval_ = f['train'], f['eval']
  if train.shape != (len(ds.train), 2) or eval_.shape != (len(ds.eval), 2):
    return None
  return train, eval_


def save_reference(path: str, train: np.ndarray, eval_: np.ndarray) -> None:
  """Written whole or not at all: into a temporary file beside `path`, then renamed over it."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix='.writing-', suffix='.npz', dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, 'wb') as f:
      np.savez(f, train=train, eval=eval_)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def with_reference(ds: Dataset, train: np.ndarray, eval_: np.ndarray) -> Dataset:
  """`ds` whose pairs carry the reference's log-probs (ref_chosen_logps, ref_rejected_logps) of each split."""
  return dataclasses.replace(
    ds, transform=ds.transform.with_reference(train), eval_transform=ds.transform.with_reference(eval_)
  )
