"""Tokenizers and per-example text transforms for the 'lm', 'mlm' and 'text_classification' tasks
(and `lm_example`, the 'lm' transform of rows of token ids, used by the offline 'markov' dataset).

Tokenizers: 'byte' (UTF-8 bytes 0..255 plus four special ids; no files) or a local directory holding
a Hugging Face tokenizer (loaded with `local_files_only=True`: never a hub download at run time).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from typing import Any

import grain
import numpy as np

from errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then <pad> 256, <bos>/[CLS] 257, <eos>/[SEP] 258, [MASK] 259."""

  vocab_size: int = 260
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  mask_id: int = 259
  num_regular: int = 256  # ids 0..num_regular-1 are ordinary tokens (MLM's random replacements)
  name: str = 'byte'

  @property
  def cls_id(self) -> int:
    return self.bos_id

  @property
  def sep_id(self) -> int:
    return self.eos_id

  def encode(self, text: str | bytes) -> np.ndarray:
    raw = text if isinstance(text, bytes) else str(text).encode('utf-8')
    return np.frombuffer(raw, np.uint8).astype(np.int32)

  def decode(self, ids: Any) -> str:
    return bytes(int(i) for i in np.asarray(ids).ravel() if i < 256).decode('utf-8', errors='replace')


class HFTokenizer:
  """A Hugging Face tokenizer from a local directory (tokenizer.json / vocab files + config)."""

  def __init__(self, path: str):
    try:
      import transformers  # noqa: PLC0415 (optional: only needed for this tokenizer)
    except ImportError:
      raise ConfigError(
        f'config.dataset.tokenizer={path!r} needs the transformers package '
        '(pip install transformers), or use the byte tokenizer'
      ) from None
    try:
      self.tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
      raise ConfigError(
        f'config.dataset.tokenizer={path!r}: no Hugging Face tokenizer could be loaded from '
        f'that directory ({str(e).splitlines()[0]})'
      ) from None
    t = self.tok
    self.name = path
    self.vocab_size = len(t)
    self.num_regular = self.vocab_size
    self.pad_id = t.pad_token_id if t.pad_token_id is not None else 0
    self.bos_id = t.bos_token_id if t.bos_token_id is not None else t.cls_token_id
    self.eos_id = t.eos_token_id if t.eos_token_id is not None else t.sep_token_id
    self.cls_id = t.cls_token_id if t.cls_token_id is not None else self.bos_id
    self.sep_id = t.sep_token_id if t.sep_token_id is not None else self.eos_id
    self.mask_id = t.mask_token_id

  def encode(self, text: str | bytes) -> np.ndarray:
    text = text.decode('utf-8') if isinstance(text, bytes) else str(text)
    return np.asarray(self.tok(text, add_special_tokens=False)['input_ids'], np.int32)

  def decode(self, ids: Any) -> str:
    return self.tok.decode([int(i) for i in np.asarray(ids).ravel()])


def tokenizer(spec: str | None) -> ByteTokenizer | HFTokenizer:
  if spec in (None, 'byte'):
    return ByteTokenizer()
  if not os.path.isdir(spec):
    raise ConfigError(
      f"config.dataset.tokenizer={spec!r} is neither 'byte' nor a local directory with a "
      'Hugging Face tokenizer (hub names are not downloaded at run time; save_pretrained() '
      'the tokenizer to a directory first)'
    )
  return HFTokenizer(spec)


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
    with self._lock:
      self.count += 1
      n = self.count
    if n == 10 ** int(math.log10(n)):
      where = example.get('_where', 'a row') if isinstance(example, dict) else 'a row'
      logging.warning(
        'data: %s has %d tokens, truncated to %d (config.dataset.seq_len + 1); %d document(s) truncated so far',
        where,
        len(ids),
        self.max_ids,
        n,
      )
    return ids[: self.max_ids]


def _document(ids: np.ndarray, loss: np.ndarray | None, truncations: Truncations | None, example: Any) -> dict:
  """inputs ids[:-1], targets ids[1:]; with `loss` (per id, 1 = trained on), mask = loss[1:] (per target)."""
  if truncations is not None:
    ids = truncations.cut(ids, example)
  doc = {'inputs': ids[:-1].astype(np.int32), 'targets': ids[1:].astype(np.int32)}
  if loss is not None:
    doc['mask'] = loss[1 : len(ids)].astype(np.float32)
  return doc


class LMDocument(grain.transforms.Map):
  """One document: ids = <bos> text <eos>; inputs ids[:-1], targets ids[1:] (every target trained on)."""

  def __init__(self, tok, key: str = 'text', truncations: Truncations | None = None):
    self.tok, self.key, self.truncations = tok, key, truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    t = self.tok
    bos = [t.bos_id] if t.bos_id is not None else []
    ids = np.concatenate([bos, t.encode(example[self.key]), [t.eos_id]]).astype(np.int32)
    return _document(ids, None, self.truncations, example)


class PromptCompletion(grain.transforms.Map):
  """<bos> prompt completion <eos>, the loss on the completion and <eos> only (mask 0 on the prompt's targets)."""

  def __init__(self, tok, prompt_key: str, completion_key: str, truncations: Truncations | None = None):
    self.tok, self.keys, self.truncations = tok, (prompt_key, completion_key), truncations

  def map(self, example: Any) -> dict[str, np.ndarray]:
    t = self.tok
    bos = [t.bos_id] if t.bos_id is not None else []
    prompt = np.concatenate([bos, t.encode(example[self.keys[0]])])
    answer = np.concatenate([t.encode(example[self.keys[1]]), [t.eos_id]])
    ids = np.concatenate([prompt, answer]).astype(np.int32)
    loss = np.concatenate([np.zeros(len(prompt)), np.ones(len(answer))])
    return _document(ids, loss, self.truncations, example)


class ChatDocument(grain.transforms.Map):
  """A chat (a list of {'role', 'content'}) as the tokenizer's chat template renders it (transformers'
  apply_chat_template, token for token), the loss on the assistant turns only.

  An assistant turn's tokens are those that rendering the chat up to and including it adds to the chat before
  it rendered with the generation prompt (so the header the template writes before an answer is not trained on;
  the end-of-turn token after it is). Templates that do not render a chat's beginning as a prefix of the whole
  (some drop earlier turns' reasoning) are refused, naming the row."""

  def __init__(self, tok, key: str, truncations: Truncations | None = None):
    if getattr(getattr(tok, 'tok', None), 'chat_template', None) is None:
      raise ConfigError(
        f"config.dataset.messages_key={key!r} renders chats with the tokenizer's chat template, and tokenizer "
        f'{tok.name!r} has none (config.dataset.tokenizer: a Hugging Face tokenizer directory whose '
        'tokenizer_config.json or chat_template.jinja holds one)'
      )
    self.tok, self.key, self.truncations = tok, key, truncations

  def _render(self, messages: list, prompt: bool = False) -> list[int]:
    return list(self.tok.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)['input_ids'])

  def map(self, example: Any) -> dict[str, np.ndarray]:
    messages = [{'role': m['role'], 'content': m['content']} for m in example[self.key]]
    ids = self._render(messages)
    loss = np.zeros(len(ids))
    for i, m in enumerate(messages):
      if m['role'] != 'assistant':
        continue
      before = self._render(messages[:i], prompt=True) if i else []
      upto = self._render(messages[: i + 1])
      if upto != ids[: len(upto)] or before != upto[: len(before)]:
        raise ConfigError(
          f'{example.get("_where", "a chat")}: the chat template of {self.tok.name} does not render the chat up '
          f'to turn {i} as the beginning of the whole chat, so its assistant tokens cannot be told apart'
        )
      loss[len(before) : len(upto)] = 1
    return _document(np.asarray(ids, np.int32), loss, self.truncations, example)


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
