"""Token caches (data/token_cache.py): batches read through a cache are the in-line pipeline's token for token
(config.dataset.token_cache=False, the reference), for plain text, prompt/completion pairs, chats and TFDS text; a
cache is reused, built once when several builders race, and a half-built or damaged one is rebuilt, never read."""

import errno
import json
import os
import threading
import time

import numpy as np
import pytest

import data
from data import packing, pipeline, text, token_cache
from errors import StorageError
from tests.test_data_offline import assert_same
from tests.test_your_data import chats, make, pairs, save_tokenizer, write_jsonl

KINDS = {
  'text': lambda p: dict(train_files=p, eval_files=p),
  'pair': lambda p: dict(train_files=p, eval_files=p, prompt_key='prompt', completion_key='completion'),
  'chat': lambda p: dict(train_files=p, eval_files=p, messages_key='messages'),
}


def rows_of(kind: str) -> list[dict]:
  if kind == 'pair':
    return pairs(120)
  if kind == 'chat':
    return chats(60)
  return [{'text': 'the cat sat ' * (i % 6 + 1) + str(i)} for i in range(120)]


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
  return save_tokenizer(tmp_path_factory.mktemp('tokenizer'))


def batches(cfg, n: int = 6) -> list[dict]:
  ds = data.build(cfg)
  it = iter(ds.train_dataset(8, slice(0, 8), 0))
  out = [next(it) for _ in range(n)]
  it.close()
  return out + list(ds.eval_batches(8, slice(0, 8)))


@pytest.mark.parametrize('kind', list(KINDS))
@pytest.mark.parametrize('tokenizer', ['byte', 'hf'])
def test_batches_from_the_cache_are_the_inline_pipelines(tmp_path, tok_dir, kind, tokenizer):
  path = write_jsonl(tmp_path / 'rows.jsonl', rows_of(kind))
  tok = tok_dir if tokenizer == 'hf' else 'byte'
  for pack in (True, False) if kind == 'pair' else (True,):
    fields = dict(name='json', seq_len=48, tokenizer=tok, pack=pack, cache_dir=str(tmp_path / 'c'), **KINDS[kind](path))
    cfg = lambda cache, fields=fields: make(token_cache=cache, **fields)
    assert isinstance(data.build(cfg(True)).cached.train, token_cache.TokenDocs)
    assert_same(batches(cfg(False)), batches(cfg(True)))


def test_tfds_text_through_the_cache_is_the_inline_pipelines(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=48):
    cfg = lambda cache: make(name='lm1b', seq_len=24, pack=True, token_cache=cache, cache_dir=str(tmp_path))
    assert isinstance(data.build(cfg(True)).cached.train, token_cache.TokenDocs)
    assert_same(batches(cfg(False), 3), batches(cfg(True), 3))


def _build(root, n=300, **kw):
  texts = [f'document {i} ' * (i % 5 + 1) for i in range(n)]
  read = token_cache._SourceReader([{'text': t} for t in texts], ['text'])
  tok = data.tokens.ByteTokenizer()
  return token_cache.build(str(root), {'source': 'test'}, read, n, tok, 'text', ['text'], label='test', **kw), texts


def test_a_cache_is_reused_and_built_once_by_racing_builders(tmp_path, monkeypatch):
  writes, real = [], token_cache._write

  def slow_write(*args, **kwargs):
    writes.append(1)
    time.sleep(0.3)  # the other builder arrives while this one builds
    return real(*args, **kwargs)

  monkeypatch.setattr(token_cache, '_write', slow_write)
  got = []
  threads = [threading.Thread(target=lambda: got.append(_build(tmp_path)[0])) for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(writes) == 1 and len({p for p, _ in got}) == 1
  (path, meta), texts = _build(tmp_path)  # a later run: read, not built
  assert len(writes) == 1
  docs = token_cache.TokenDocs(path, meta)
  for i in (0, 7, 299):
    np.testing.assert_array_equal(docs[i]['ids'], data.tokens.document(data.tokens.ByteTokenizer(), texts[i]))


@pytest.mark.parametrize('damage', ['truncated ids', 'no meta', 'left aside'])
def test_a_half_built_cache_is_rebuilt_never_read(tmp_path, damage):
  (path, meta), texts = _build(tmp_path)
  if damage == 'truncated ids':
    with open(os.path.join(path, 'ids.bin'), 'r+b') as f:
      f.truncate(meta['ids'] // 2)
  elif damage == 'no meta':
    os.remove(os.path.join(path, 'meta.json'))
  else:  # a build killed before its rename: only its directory aside
    os.rename(path, os.path.join(tmp_path, f'.{os.path.basename(path)}.building-x'))
  assert token_cache._complete(path) is None
  (again, meta2), _ = _build(tmp_path)
  assert again == path and meta2['ids'] == meta['ids']
  assert [f for f in os.listdir(tmp_path) if 'building' in f] == []
  docs = token_cache.TokenDocs(again, meta2)
  np.testing.assert_array_equal(docs[299]['ids'], data.tokens.document(data.tokens.ByteTokenizer(), texts[299]))


def test_a_cache_that_cannot_be_written_is_one_storage_error_that_leaves_nothing(tmp_path, monkeypatch):
  def full(aside, *args, **kwargs):
    with open(os.path.join(aside, 'ids.bin'), 'wb') as f:
      f.write(b'\0' * 100)
    raise OSError(errno.ENOSPC, 'No space left on device', os.path.join(aside, 'ids.bin'))

  monkeypatch.setattr(token_cache, '_write', full)
  with pytest.raises(StorageError, match=r'the token cache of test could not be built in .*No space left on device'):
    _build(tmp_path)
  assert [f for f in os.listdir(tmp_path) if not f.endswith('.lock')] == []


def test_image_batches_from_worker_processes_are_the_threads(tmp_path):
  """config.dataset.num_workers: the same batches, in order, as the threads make, and a position saved by the
  threads resumes in the workers (one pool of two spawned workers: seconds)."""
  cfg = lambda workers: make('classification', name='synthetic_images', num_train=64, num_eval=8, num_workers=workers)
  its = [data.build(cfg(w)).train_iterator(8, slice(0, 8), 0) for w in (0, 2)]
  threads, states = [], []
  for _ in range(9):  # crosses an epoch
    states.append(json.loads(json.dumps(its[0].get_state())))
    threads.append(next(its[0]))
  its[1].set_state([states[3]])
  workers = [next(its[1]) for _ in range(6)]
  assert its[1].get_state() == json.loads(json.dumps(its[0].get_state()))
  for it in its:
    it.close()
  assert_same(threads[3:], workers)


def cached_docs(tmp_path, docs: list, loss: list | None = None) -> token_cache.TokenDocs:
  """A token cache of these ids (and loss masks), written as token_cache.build lays one out."""
  offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
  offsets.tofile(tmp_path / 'offsets.bin')
  np.concatenate(docs).astype(np.uint16).tofile(tmp_path / 'ids.bin')
  if loss is not None:
    np.concatenate(loss).astype(np.uint8).tofile(tmp_path / 'loss.bin')
  meta = {'documents': len(docs), 'ids': int(offsets[-1]), 'dtype': 'uint16', 'loss': loss is not None}
  return token_cache.TokenDocs(str(tmp_path), meta)


class NotCached:
  """The same documents, not a TokenDocs: read through grain's packer."""

  def __init__(self, docs):
    self.docs = docs

  def __len__(self):
    return len(self.docs)

  def __getitem__(self, i):
    return self.docs[i]


def packed(source, whole: bool, n: int, state=None, workers: int = 0, L: int = 16) -> tuple[list, list]:
  """n batches of rows 0-3 of a global batch of 4 and the data position before each (through JSON)."""
  cut = text.Truncations(L + 1) if whole else None
  ds = pipeline.packed_train_dataset(source, 4, slice(0, 4), 1, text.CachedDocument(cut), L, whole=whole,
                                     num_workers=workers)  # fmt: skip
  it = iter(ds)
  if state is not None:
    it.set_state(state)
  states, out = [], []
  for _ in range(n):
    states.append(json.loads(json.dumps(it.get_state())))
    out.append(next(it))
  it.close()
  return out, states


@pytest.mark.parametrize('whole', [False, True], ids=['concat_then_split', 'whole'])
def test_the_numpy_packer_makes_grains_rows_and_positions(tmp_path, whole):
  """Documents of every awkward length (no targets, exactly a row, several rows; loss masks): the numpy packer's
  batches and data positions are grain's, and each resumes the other's."""
  rng = np.random.default_rng(0)
  lengths = rng.choice([0, 1, 1, 2, 3, 5, 8, 15, 16, 17, 40], 400)
  docs = cached_docs(tmp_path, [rng.integers(1, 250, n) for n in lengths], [rng.integers(0, 2, n) for n in lengths])
  if not whole:
    docs.loss = None  # plain text: every target counted
  fast, fast_states = packed(docs, whole, 40)
  assert packing.numpy_packs(docs, text.CachedDocument())
  slow, slow_states = packed(NotCached(docs), whole, 40)
  assert_same(fast, slow)
  assert fast_states == slow_states
  for k in (1, 13, 30):
    assert_same(packed(docs, whole, 5, slow_states[k])[0], slow[k : k + 5])
    assert_same(packed(NotCached(docs), whole, 5, fast_states[k])[0], fast[k : k + 5])


def test_packed_rows_from_worker_processes_are_this_processs(tmp_path):
  """config.dataset.num_workers on packed text: the same batches and data positions as packing here, and a position
  saved without workers resumes in them. Prompt/completion pairs through their token cache (whole documents, loss
  masks); which packer runs in the workers is pinned above, the caches against the in-line rows by the first test
  (one pool of two spawned workers: seconds)."""
  path = write_jsonl(tmp_path / 'rows.jsonl', rows_of('pair'))
  fields = dict(name='json', seq_len=48, pack=True, cache_dir=str(tmp_path / 'c'), **KINDS['pair'](path))
  its = [data.build(make(num_workers=w, **fields)).train_iterator(8, slice(0, 8), 0) for w in (0, 2)]
  here, states = [], []
  for _ in range(6):
    states.append(json.loads(json.dumps(its[0].get_state())))
    here.append(next(its[0]))
  its[1].set_state([states[2]])
  workers = [next(its[1]) for _ in range(4)]
  assert json.loads(json.dumps(its[1].get_state())) == json.loads(json.dumps(its[0].get_state()))
  for it in its:
    it.close()
  assert_same(workers, here[2:])
