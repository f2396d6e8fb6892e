"""Per-example text transforms for the 'lm', 'mlm' and 'text_classification' tasks (and `lm_example`, the 'lm'
transform of rows of token ids, used by the offline 'markov' dataset). The tokenizers, and how a document, a
prompt/completion pair and a chat become ids, are data/tokens.py's (decoding calls the same rules).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import grain
import numpy as np

from data import row_checks, tokens


def _framed(tok, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
  """[CLS] ids [SEP], truncated to seq_len and padded with <pad>; returns (row, number of real tokens)."""
  ids = ids[: seq_len - 2]
  n = len(ids) + 2
  row = np.full(seq_len, tok.pad_id, np.int32)
  row[0], row[1 : n - 1], row[n - 1] = tok.cls_id, ids, tok.sep_id
  return row, n


def lm_example(seqs: np.ndarray) -> dict[str, np.ndarray]:
  """Next-token prediction: inputs are tokens[:-1], targets tokens[1:], every target counted."""
  seqs = np.asarray(seqs)
  return {
    'inputs': seqs[..., :-1].astype(np.int32),
    'targets': seqs[..., 1:].astype(np.int32),
    'mask': np.ones(seqs[..., 1:].shape, np.float32),
  }


class Truncations:
  """Counts the documents cut to the row length, and says so in the log at the 1st, 10th, 100th ... of them
  (per process; transforms run in grain's threads)."""

  def __init__(self, max_ids: int):
    self.max_ids, self.count, self._lock = max_ids, 0, threading.Lock()

  def cut(self, ids: np.ndarray, example: Any) -> np.ndarray:
    if len(ids) <= self.max_ids:
      return ids
    self.note(len(ids), example.get('_where', 'a row') if isinstance(example, dict) else 'a row')
    return ids[: self.max_ids]

  def note(self, length: int, where: Any) -> None:
    """Counts one document of `length` ids cut to max_ids; `where` (or a callable giving it) names its row."""
    with self._lock:
      self.count += 1
      n = self.count
    if n == 10 ** int(math.log10(n)):
      where = where() if callable(where) else where  # a cached document names its row only here
      logging.warning(
        'data: %s has %d tokens, truncated to %d (config.dataset.seq_len + 1); %d document(s) truncated so far',
        where,
        length,
        self.max_ids,
        n,
      )

  def __getstate__(self) -> dict[str, Any]:  # to worker processes (a lock does not pickle); each counts its own
    return {'max_ids': self.max_ids, 'count': self.count}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state['max_ids'])
    self.count = state['count']


def _document(ids: np.ndarray, loss: np.ndarray | None, truncations: Truncations | None, example: Any) -> dict:
  """inputs ids[:-1], targets ids[1:]; with `loss` (per id, 1 = trained on), mask = loss[1:] (per target)."""
  if truncations is not None:
    ids = truncations.cut(ids, example)
  doc = {'inputs': ids[:-1].astype(np.int32), 'targets': ids[1:].astype(np.int32)}
  if loss is not None:
    doc['mask'] = loss[1 : len(ids)].astype(np.float32)
  return doc


class LMDocument(grain.transforms.Map):
  """One document (tokens.document: begin(text) <eos>); inputs ids[:-1], targets ids[1:], every target trained on."""

  def __init__(self, tok, key: str = 'text', truncations: Truncations | None = None):
    self.tok, self.key, self.truncations = tok, key, truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    return _document(tokens.document(self.tok, example[self.key]), None, self.truncations, example)


class CachedDocument(grain.transforms.Map):
  """A document from a token cache (data/token_cache.py: {'ids', 'loss'} as tokens.document, prompt_completion or
  chat made them), truncated and split into inputs and targets as the transforms above do."""

  def __init__(self, truncations: Truncations | None = None):
    self.truncations = truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    return _document(example['ids'], example['loss'], self.truncations, example)


class PromptCompletion(grain.transforms.Map):
  """tokens.prompt_completion: begin(prompt) completion <eos>, the loss on the completion and <eos> only."""

  def __init__(self, tok, prompt_key: str, completion_key: str, truncations: Truncations | None = None):
    self.tok, self.keys, self.truncations = tok, (prompt_key, completion_key), truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    with row_checks.row_named(example):  # a loader thread's error names its row
      ids, loss = tokens.prompt_completion(self.tok, example[self.keys[0]], example[self.keys[1]])
    return _document(ids, loss, self.truncations, example)


class ChatDocument(grain.transforms.Map):
  """A chat (a list of {'role', 'content'}) as the tokenizer's chat template renders it (tokens.chat: transformers'
  apply_chat_template, token for token), the loss on the assistant turns only."""

  def __init__(self, tok, key: str, truncations: Truncations | None = None):
    tokens.check_chat_template(tok, f'config.dataset.messages_key={key!r}')
    self.tok, self.key, self.truncations = tok, key, truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    with row_checks.row_named(example):
      ids, loss = tokens.chat(self.tok, example[self.key], example.get('_where', 'a chat'))
    return _document(ids, loss, self.truncations, example)


class LMRow(grain.transforms.Map):
  """One document per row (no packing): `doc` (LMDocument, PromptCompletion, ChatDocument) truncated to seq_len
  targets, padding masked (mask = the document's loss mask, 0 on padding)."""

  def __init__(self, doc: grain.transforms.Map, seq_len: int):
    self.doc, self.seq_len = doc, seq_len

  def map(self, example: Any) -> dict[str, np.ndarray]:
    d, L = self.doc.map(example), self.seq_len
    n = min(len(d['inputs']), L)
    out = {k: np.zeros(L, np.int32) for k in ('inputs', 'targets')}
    out['mask'] = np.zeros(L, np.float32)
    for k in out:
      out[k][:n] = d[k][:n] if k in d else 1.0
    return out


class MaskTokens(grain.transforms.RandomMap):
  """BERT masked-LM: [CLS] text [SEP] padded; `prob` of the text tokens (at least one) are chosen,
  80% of them replaced by [MASK], 10% by a random token, 10% kept. mask = 1 on the chosen ones."""

  def __init__(self, tok, seq_len: int, prob: float = 0.15, key: str = 'text'):
    self.tok, self.seq_len, self.prob, self.key = tok, seq_len, prob, key

  def random_map(self, example: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    t, L = self.tok, self.seq_len
    targets, n = _framed(t, t.encode(example[self.key]), L)
    inputs, mask = targets.copy(), np.zeros(L, np.float32)
    if n > 2:
      k = max(1, int(round(self.prob * (n - 2))))
      chosen = 1 + rng.choice(n - 2, size=k, replace=False)
      u = rng.random(k)
      inputs[chosen[u < 0.8]] = t.mask_id
      rand = chosen[(u >= 0.8) & (u < 0.9)]
      inputs[rand] = rng.integers(0, t.num_regular, size=len(rand))
      mask[chosen] = 1.0
    return {
      'inputs': inputs,
      'targets': targets,
      'mask': mask,
      'input_mask': (np.arange(L) < n).astype(np.int32),
      'token_types': np.zeros(L, np.int32),
    }


class ClassifyText(grain.transforms.Map):
  """[CLS] text [SEP] padded, with the example's label."""

  def __init__(self, tok, seq_len: int, key: str = 'text', label_key: str = 'label'):
    self.tok, self.seq_len, self.key, self.label_key = tok, seq_len, key, label_key

  def map(self, example: Any) -> dict[str, np.ndarray]:
    inputs, n = _framed(self.tok, self.tok.encode(example[self.key]), self.seq_len)
    return {
      'inputs': inputs,
      'input_mask': (np.arange(self.seq_len) < n).astype(np.int32),
      'token_types': np.zeros(self.seq_len, np.int32),
      'label': np.int32(example[self.label_key]),
      'mask': np.float32(1.0),
    }
