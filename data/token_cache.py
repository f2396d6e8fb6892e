"""Token caches: every document of a source tokenized once, in batches on every core, into memory-mapped files of
token ids (and loss masks), which later runs, other processes and resumed runs read instead of tokenizing again.

Why: the packed pipelines tokenize a document when they read it, in the one packing thread, so a real (BPE)
tokenizer bounds the input at about a quarter of what one GPU consumes (docs/performance.md). Levanter caches ids
in a store built in parallel and MaxText reads pre-tokenized files; here the cache is one flat array of ids per
source (uint16 where the vocabulary fits, else int32), the documents' offsets into it and, for prompt/completion
pairs and chats, a loss mask per id, read by numpy's memmap: a document is two slices, no Python per token.

The ids are data/tokens.py's, through its functions (document, prompt_completion, chat and their batch forms,
which call the tokenizer once per batch), so a cached document is the in-line pipeline's token for token (tested);
config.dataset.token_cache=False reads through the in-line path. Truncation to the row, and its counting in the
log, happen when a document is read, as before.

A cache is keyed by the source's identity (its Arrow files', or a TFDS split's files: path, size, mtime), the
tokenizer's (its files' contents, transformers' and tokenizers' versions) and the fields read. It is built under a
file lock (one build per host: other processes wait for it, then read it), aside in a directory of its own, and
renamed into place once complete; a cache whose files do not match its meta.json (cut short, damaged) is removed
and built again, never read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import glob
import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from data import files, row_checks, tokens

VERSION = 1  # of the files' layout: a change makes new keys
KINDS = ('text', 'pair', 'chat')  # tokens.document of keys[0]; prompt_completion of keys[0], keys[1]; chat of keys[0]
BATCH = 1024  # rows per tokenizer call (and per progress update)
POOL_MIN_ROWS = 4096  # chats render in Python (jinja): in worker processes, above this many rows
_TOKENIZER_FILES = (
  'tokenizer*',
  'vocab*',
  'merges*',
  'special_tokens_map.json',
  'added_tokens.json',
  'chat_template*',
  '*.model',
  '*.tiktoken',
)


def cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def tokenizer_identity(tok: Any) -> dict[str, Any]:
  """What decides the ids a tokenizer gives: its class and settings, a local directory's tokenizer files (not a
  model's weights beside them), and the versions of the libraries that run it."""
  ident: dict[str, Any] = {'class': type(tok).__name__, 'name': tok.name}
  if isinstance(tok, tokens.HFTokenizer):
    import tokenizers  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    h = hashlib.sha256()
    found = sorted({f for p in _TOKENIZER_FILES for f in glob.glob(os.path.join(tok.name, p)) if os.path.isfile(f)})
    for f in found:
      h.update(os.path.basename(f).encode() + b'\0')
      with open(f, 'rb') as fh:
        h.update(hashlib.sha256(fh.read()).digest())
    ident.update(files=h.hexdigest(), transformers=transformers.__version__, tokenizers=tokenizers.__version__)
  else:
    ident['settings'] = repr(tok)
  return ident


def _mapped(path: str, dtype: Any, count: int) -> np.ndarray:
  return np.asarray(np.memmap(path, dtype, 'r', shape=(count,))) if count else np.zeros(0, dtype)


def _nth(i: int) -> str:
  return f'document {i + 1}'


class TokenDocs:
  """A source's documents from its cache: random access, item i = {'ids', 'loss' (None for plain text), '_where'}
  (the row's file and line, for the truncation log and errors)."""

  def __init__(self, path: str, meta: dict[str, Any], where: Callable[[int], str] | None = None):
    self.path, self.meta, self._where = path, meta, where
    n, count = meta['documents'], meta['ids']
    # Plain ndarray views of the mapped files: slicing one costs less than slicing a np.memmap.
    self.offsets = np.asarray(np.memmap(os.path.join(path, 'offsets.bin'), np.int64, 'r', shape=(n + 1,)))
    self.ids = _mapped(os.path.join(path, 'ids.bin'), meta['dtype'], count)
    self.loss = _mapped(os.path.join(path, 'loss.bin'), np.uint8, count) if meta['loss'] else None

  def __len__(self) -> int:
    return int(self.meta['documents'])

  def where(self, i: int) -> str:
    return (self._where or _nth)(int(i))

  def __getstate__(self) -> dict[str, Any]:  # worker processes map the files again; the arrays do not travel
    return {'path': self.path, 'meta': self.meta, 'where': self._where}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state['path'], state['meta'], state['where'])

  def __getitem__(self, i: int) -> dict[str, Any]:
    i = int(i)
    lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
    return {
      'ids': self.ids[lo:hi].astype(np.int32),
      'loss': None if self.loss is None else self.loss[lo:hi].astype(np.float64),
      '_where': functools.partial(self._where or _nth, i),  # named only when logged (text.Truncations)
    }

  @property
  def num_tokens(self) -> int:
    return int(self.meta['ids'])


# --- Building ------------------------------------------------------------------------------------------------------


def encode(tok: Any, kind: str, keys: Sequence[str], batch: dict[str, list], where: Callable[[int], str]) -> list:
  """(ids, loss or None) of each row of `batch` (columns), by data/tokens.py's rules; an error names its row
  (`where(j)`: row j's file and line)."""
  try:
    if kind == 'text':
      return [(ids, None) for ids in tokens.documents(tok, batch[keys[0]])]
    if kind == 'pair':
      return tokens.prompt_completions(tok, batch[keys[0]], batch[keys[1]])
  except Exception:  # noqa: BLE001 (row by row below, to name the row)
    pass
  out = []
  for j in range(len(batch[keys[0]])):
    w = where(j)
    with row_checks.row_named({'_where': w}):
      if kind == 'text':
        out.append((tokens.document(tok, batch[keys[0]][j]), None))
      elif kind == 'pair':
        out.append(tokens.prompt_completion(tok, batch[keys[0]][j], batch[keys[1]][j]))
      else:
        out.append(tokens.chat(tok, batch[keys[0]][j], w))
  return out


_WORKER: dict[str, Any] = {}


def _init_worker(read: Any, tok: Any, kind: str, keys: Sequence[str]) -> None:
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'  # one process per core already
  _WORKER.update(read=read, tok=tok, kind=kind, keys=keys)


def _encode_span(span: tuple[int, int]) -> list[tuple]:
  w = _WORKER
  return encode(w['tok'], w['kind'], w['keys'], w['read'](*span), lambda j: w['read'].where(span[0] + j))


def _batches(read: Any, n: int, tok: Any, kind: str, keys: Sequence[str], num_proc: int):
  """Encoded rows, batch by batch in order. Text and pairs: one tokenizer call per batch (a fast tokenizer's own
  threads use every core; the byte tokenizer is numpy). Chats render one by one in Python, so many of them go to
  `num_proc` worker processes (spawned: a fork would copy JAX's and the tokenizer's threads)."""
  spans, done = [(lo, min(lo + BATCH, n)) for lo in range(0, n, BATCH)], 0
  if kind == 'chat' and num_proc > 1 and n >= POOL_MIN_ROWS:
    ctx = multiprocessing.get_context('spawn')
    try:
      with concurrent.futures.ProcessPoolExecutor(num_proc, ctx, _init_worker, (read, tok, kind, keys)) as pool:
        for span, out in zip(spans, pool.map(_encode_span, spans)):
          yield span, out
          done += 1
      return
    except concurrent.futures.process.BrokenProcessPool:
      logging.warning(
        'data: the token cache could not start worker processes (a script that calls data.build needs '
        "`if __name__ == '__main__':` for them); tokenizing in this process"
      )
  for lo, hi in spans[done:]:
    yield (lo, hi), encode(tok, kind, keys, read(lo, hi), lambda j, lo=lo: read.where(lo + j))


def _complete(path: str) -> dict[str, Any] | None:
  """The cache's meta.json where its files are whole (sizes as it records), else None."""
  try:
    with open(os.path.join(path, 'meta.json')) as f:
      meta = json.load(f)
    item = np.dtype(meta['dtype']).itemsize
    want = {'offsets.bin': 8 * (meta['documents'] + 1), 'ids.bin': item * meta['ids']}
    if meta['loss']:
      want['loss.bin'] = meta['ids']
    if all(os.path.getsize(os.path.join(path, f)) == size for f, size in want.items()):
      return meta
  except (OSError, ValueError, KeyError, TypeError):
    pass
  return None


def _write(aside: str, batches: Any, n: int, loss: bool, dtype: np.dtype, label: str) -> int:
  """Writes the encoded batches' files into `aside`, with a progress bar (documents, tokens/s, ETA); the ids."""
  from tqdm import tqdm  # noqa: PLC0415

  count, t0 = 0, time.perf_counter()
  offsets = [np.zeros(1, np.int64)]
  with contextlib.ExitStack() as stack:
    ids_f = stack.enter_context(open(os.path.join(aside, 'ids.bin'), 'wb'))
    loss_f = stack.enter_context(open(os.path.join(aside, 'loss.bin'), 'wb')) if loss else None
    bar = stack.enter_context(
      tqdm(total=n, unit='doc', desc=f'token cache {label}', mininterval=2, leave=False, disable=n < 10 * BATCH)
    )  # tokens/s beside it; tqdm's ETA
    for (lo, hi), docs in batches:
      lengths = np.fromiter((len(ids) for ids, _ in docs), np.int64, len(docs))
      if docs:
        ids_f.write(np.concatenate([ids for ids, _ in docs]).astype(dtype).tobytes())
        if loss_f is not None:
          loss_f.write(np.concatenate([lo_ for _, lo_ in docs]).astype(np.uint8).tobytes())
      offsets.append(count + np.cumsum(lengths))
      count += int(lengths.sum())
      bar.update(hi - lo)
      bar.set_postfix_str(f'{count / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s', refresh=False)
  np.concatenate(offsets).tofile(os.path.join(aside, 'offsets.bin'))
  return count


def build(
  root: str,
  identity: dict[str, Any],
  read: Any,
  n: int,
  tok: Any,
  kind: str,
  keys: Sequence[str],
  *,
  label: str,
  num_proc: int | None = None,
) -> tuple[str, dict[str, Any]]:
  """The path and meta of the cache of `identity` under `root`, built first where there is none (once per host:
  a file lock); `read(lo, hi)` gives rows [lo, hi) as columns, `read.where(i)` names row i ('file line n')."""
  if kind not in KINDS:
    raise ValueError(f'token cache kind {kind!r}; one of {KINDS}')
  full = {'version': VERSION, 'kind': kind, 'keys': list(keys), 'tokenizer': tokenizer_identity(tok), **identity}
  key = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:24]
  path = os.path.join(root, key)
  took = {}

  def write(aside: str) -> str:
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.int32)
    t0 = time.perf_counter()
    count = _write(aside, _batches(read, n, tok, kind, keys, num_proc or cores()), n, kind != 'text', dtype, label)
    took.update(seconds=time.perf_counter() - t0, ids=count)
    meta = {
      **full,
      'documents': n,
      'ids': count,
      'dtype': dtype.name,
      'loss': kind != 'text',
      'seconds': took['seconds'],
    }
    with open(os.path.join(aside, 'meta.json'), 'w') as f:
      json.dump(meta, f, indent=1, default=str)
    return aside

  complete = lambda p: _complete(p) is not None
  if files.build_aside(root, path, write, f'the token cache of {label}', complete, lock=True,
                       also='config.dataset.token_cache=False'):  # fmt: skip
    logging.info(
      'data: token cache of %s built in %.1fs: %d documents, %d tokens (%s tokens/s) in %s',
      label,
      took['seconds'],
      n,
      took['ids'],
      f'{took["ids"] / max(took["seconds"], 1e-9):,.0f}',
      path,
    )
  return path, _complete(path)


# --- Sources -------------------------------------------------------------------------------------------------------


def default_root(cache_dir: str | None) -> str:
  """config.dataset.cache_dir, else Hugging Face datasets' cache; the token caches go in shardzoo-tokens/ there."""
  if not cache_dir:
    import datasets  # noqa: PLC0415

    cache_dir = datasets.config.HF_DATASETS_CACHE
  return os.path.join(os.path.abspath(os.path.expanduser(str(cache_dir))), 'shardzoo-tokens')


class _RowsReader:
  """Rows [lo, hi) of a files.Rows as columns (one Arrow read per batch), picklable for worker processes."""

  def __init__(self, rows: Any, keys: Sequence[str]):
    self.data, self.keep, self.keys, self.rows = rows.data.select_columns(list(keys)), rows.keep, list(keys), rows

  def __call__(self, lo: int, hi: int) -> dict[str, list]:
    return self.data[self.keep[lo:hi].tolist()] if self.keep is not None else self.data[lo:hi]

  def where(self, i: int) -> str:
    return self.rows.where(i)


def of_rows(rows: Any, tok: Any, kind: str, keys: Sequence[str], cache_dir: str | None, label: str) -> TokenDocs | None:
  """The cached documents of your own files' rows (data/files.py Rows): the one function from rows to cached ids
  (kind 'text': tokens.document of keys[0]; 'pair': tokens.prompt_completion of keys[0], keys[1]; 'chat':
  tokens.chat of keys[0]). None for rows held in memory (no Arrow files identify them): they are tokenized as
  they are read."""
  arrow = [f['filename'] for f in rows.data.cache_files]
  if not arrow:
    return None
  ident = {
    'source': files.identity(arrow),
    'rows': len(rows),
    'keep': None if rows.keep is None else hashlib.sha256(np.asarray(rows.keep).tobytes()).hexdigest(),
  }
  path, meta = build(default_root(cache_dir), ident, _RowsReader(rows, keys), len(rows), tok, kind, keys, label=label)
  return TokenDocs(path, meta, rows.names())  # names, not rows: worker processes need no Arrow tables


class _SourceReader:
  """Examples [lo, hi) of a random-access source (a TFDS data source) as columns."""

  def __init__(self, source: Any, keys: Sequence[str]):
    self.source, self.keys = source, list(keys)

  def __call__(self, lo: int, hi: int) -> dict[str, list]:
    examples = [self.source[i] for i in range(lo, hi)]
    return {k: [ex[k] for ex in examples] for k in self.keys}

  def where(self, i: int) -> str:
    return f'example {i + 1}'


def of_source(
  source: Any, identity: dict[str, Any], tok: Any, key: str, cache_dir: str | None, label: str
) -> TokenDocs:
  """The cached documents (tokens.document of `key`) of a random-access source, e.g. a TFDS split, whose
  `identity` names its files."""
  ident = {**identity, 'rows': len(source)}
  path, meta = build(default_root(cache_dir), ident, _SourceReader(source, [key]), len(source), tok, 'text', [key],
                     label=label)  # fmt: skip
  return TokenDocs(path, meta)
