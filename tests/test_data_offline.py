"""Offline datasets through the real pipelines: batch contract per task, packing, per-process reading,
determinism across device counts, resumption (JSON and orbax), exact eval, and config errors."""

import dataclasses
import json

import jax
import ml_collections
import numpy as np
import pytest

import data
import partitioning
from configs import schema
from errors import ConfigError
from training import tasks

FAMILY = {'lm': 'gpt2', 'mlm': 'bert', 'text_classification': 'bert', 'classification': 'cnn'}  # task -> a model


def make(task: str, vocab_size: int = 260, **dataset) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = task
  c.dataset = ml_collections.ConfigDict(dataset)
  c.model = ml_collections.ConfigDict(dict(name=FAMILY.get(task, 'gpt2'), vocab_size=vocab_size))
  return schema.complete(c)  # the task's dataset fields and the family's model fields at their defaults


def check(cfg: ml_collections.ConfigDict, ds: data.Dataset) -> dict:
  """What train.py runs before compiling: the task checks the dataset; returns what the dataset makes."""
  spec = ds.example_spec()
  tasks.get(cfg.task).check_data(cfg, spec, ds.vocab, ds.num_classes)
  return spec


def take(ds: data.Dataset, n: int, global_batch: int = 8, rows: slice = slice(0, 8), seed: int = 0):
  it = iter(ds.train_dataset(global_batch, rows, seed))
  out = [next(it) for _ in range(n)]
  it.close()
  return out


def assert_same(a: list[dict], b: list[dict]) -> None:
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


class Recorder:
  """A random-access source that records which indices were read."""

  def __init__(self, source):
    self.source, self.read = source, set()

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    self.read.add(int(i))
    return self.source[i]


PACKED = dict(name='markov_text', seq_len=16, num_train=512, num_eval=37, pack=True)


def test_synthetic_images_contract_and_learnable_signal():
  cfg = make(
    'classification', name='synthetic_images', image_size=12, channels=3, num_classes=4, num_train=512, num_eval=101
  )
  ds = data.build(cfg)
  assert check(cfg, ds) == {'image': ((12, 12, 3), np.float32), 'label': ((), np.int32), 'mask': ((), np.float32)}
  assert ds.num_classes == 4 and ds.vocab is None
  b = take(ds, 1)[0]
  assert b['image'].shape == (8, 12, 12, 3) and b['image'].dtype == np.float32
  assert b['label'].dtype == np.int32 and b['mask'].dtype == np.float32 and b['mask'].all()
  # A nearest-class-mean classifier fit on the train split separates the eval split: real signal.
  train = [ds.eval_transform.map(ds.train[i]) for i in range(len(ds.train))]
  x = np.stack([t['image'].ravel() for t in train])
  y = np.array([t['label'] for t in train])
  means = np.stack([x[y == c].mean(0) for c in range(4)])
  evals = [b for b in ds.eval_batches(8, slice(0, 8))]
  xe = np.concatenate([b['image'].reshape(8, -1) for b in evals])
  ye, me = np.concatenate([b['label'] for b in evals]), np.concatenate([b['mask'] for b in evals])
  pred = np.argmin(((xe[:, None] - means[None]) ** 2).sum(-1), -1)
  assert me.sum() == 101 and ((pred == ye) * me).sum() / me.sum() > 0.9


def test_mlm_batches_follow_the_bert_contract():
  cfg = make('mlm', name='markov_text', seq_len=24, num_train=256, num_eval=50)
  ds = data.build(cfg)
  assert set(check(cfg, ds)) == {'inputs', 'targets', 'mask', 'input_mask', 'token_types'}
  tok = ds.tokenizer
  batches = take(ds, 30)
  for b in batches:
    assert {k: v.dtype for k, v in b.items()} == {
      'inputs': np.int32,
      'targets': np.int32,
      'mask': np.float32,
      'input_mask': np.int32,
      'token_types': np.int32,
    }
    real = b['input_mask'].astype(bool)
    n = real.sum(1)
    assert (b['targets'][:, 0] == tok.cls_id).all() and (b['targets'][np.arange(8), n - 1] == tok.sep_id).all()
    assert (b['targets'][~real] == tok.pad_id).all() and not b['token_types'].any()
    chosen = b['mask'] > 0
    assert chosen.sum(1).min() >= 1 and not chosen[:, 0].any() and not chosen[np.arange(8), n - 1].any()
    assert not (chosen & ~real).any()
    np.testing.assert_array_equal(b['inputs'][~chosen], b['targets'][~chosen])  # only chosen ones change
  assert len({int(b['input_mask'].sum()) for b in batches}) > 1  # lengths vary: padding matters
  chosen_inputs = np.concatenate([b['inputs'][b['mask'] > 0] for b in batches])
  assert 0.7 < (chosen_inputs == tok.mask_id).mean() < 0.9  # 80% [MASK]
  # Eval masks are fixed: two passes give the same batches.
  assert_same(list(ds.eval_batches(8, slice(0, 8))), list(ds.eval_batches(8, slice(0, 8))))


def test_text_classification_label_is_learnable_from_the_text():
  cfg = make('text_classification', name='markov_text', seq_len=40, num_classes=2, num_train=400, num_eval=200)
  ds = data.build(cfg)
  assert set(check(cfg, ds)) == {'inputs', 'input_mask', 'token_types', 'label', 'mask'} and ds.num_classes == 2
  b = take(ds, 1)[0]
  assert b['label'].shape == (8,) and b['mask'].shape == (8,) and b['inputs'].shape == (8, 40)

  def bigrams(source):  # bag of character bigrams, from the raw text
    out = np.zeros((len(source), 256 * 256))
    for i in range(len(source)):
      t = np.frombuffer(source[i]['text'].encode(), np.uint8).astype(int)
      np.add.at(out[i], t[:-1] * 256 + t[1:], 1)
    return out / out.sum(1, keepdims=True)

  xt, xe = bigrams(ds.train), bigrams(ds.eval)
  yt, ye = ds.train.labels, ds.eval.labels
  pred = np.argmin(((xe[:, None] - np.stack([xt[yt == c].mean(0) for c in (0, 1)])[None]) ** 2).sum(-1), -1)
  assert (pred == ye).mean() > 0.9


def test_packed_rows_keep_documents_apart_and_cover_the_split_exactly():
  cfg = make('lm', **PACKED)
  ds = data.build(cfg)
  tok, B, L = ds.tokenizer, 4, 16
  assert check(cfg, ds) == {
    k: ((L,), np.float32 if k == 'mask' else np.int32)
    for k in ('inputs', 'targets', 'mask', 'segment_ids', 'positions')
  }
  batches = list(ds.eval_batches(B, slice(0, B)))
  docs = [tok.encode(ds.eval[i]['text']) for i in range(len(ds.eval))]
  # Every target of every document is counted exactly once: the eval metric is exact.
  assert sum(b['mask'].sum() for b in batches) == sum(len(d) + 1 for d in docs)
  for r in range(B):
    stream = [(b, r) for b in batches]
    mine = docs[r::B]
    # Row r, read across batches, is documents r, r+B, ... one after another.
    ins = np.concatenate([b['inputs'][r][b['mask'][r] > 0] for b, r in stream])
    tgs = np.concatenate([b['targets'][r][b['mask'][r] > 0] for b, r in stream])
    np.testing.assert_array_equal(ins, np.concatenate([np.r_[tok.bos_id, d] for d in mine]))
    np.testing.assert_array_equal(tgs, np.concatenate([np.r_[d, tok.eos_id] for d in mine]))
    doc_of = np.concatenate([np.full(len(d) + 1, j) for j, d in enumerate(mine)])
    at = 0
    for b, r in stream:
      seg, pos, m = b['segment_ids'][r], b['positions'][r], b['mask'][r]
      np.testing.assert_array_equal(m, (seg > 0).astype(np.float32))
      n = int((seg > 0).sum())
      assert not seg[n:].any()  # padding only at the end of a row
      ids = doc_of[at : at + n]
      at += n
      # A segment is exactly one document's tokens (or the rest of one split at a row end) ...
      for s in np.unique(seg[:n]):
        assert len(np.unique(ids[seg[:n] == s])) == 1
        np.testing.assert_array_equal(pos[:n][seg[:n] == s], np.arange((seg[:n] == s).sum()))
      # ... and a new segment starts exactly where a new document does.
      np.testing.assert_array_equal(np.diff(seg[:n]) != 0, np.diff(ids) != 0)
    assert at == len(doc_of)


def test_two_processes_read_disjoint_rows_that_form_the_global_batch():
  for cfg in (
    make('lm', **PACKED),
    make('classification', name='synthetic_images', image_size=8, num_train=512),
    make('mlm', name='markov_text', seq_len=16, num_train=512),
  ):
    ds = data.build(cfg)
    whole = take(ds, 3)
    parts = []
    for rows in (slice(0, 4), slice(4, 8)):
      rec = Recorder(ds.train)
      parts.append((take(dataclasses.replace(ds, train=rec, prefetch=1), 3, rows=rows), rec.read))
    for g in range(3):
      for k in whole[g]:
        np.testing.assert_array_equal(np.concatenate([parts[0][0][g][k], parts[1][0][g][k]]), whole[g][k])
    assert parts[0][1] and parts[1][1] and not parts[0][1] & parts[1][1], cfg.dataset.name  # disjoint reads
    # Eval: the processes read disjoint parts that together are the whole split.
    reads = []
    for rows in (slice(0, 4), slice(4, 8)):
      rec = Recorder(ds.eval)
      list(dataclasses.replace(ds, eval=rec).eval_batches(8, rows))
      reads.append(rec.read)
    if ds.pack_len:
      assert not reads[0] & reads[1] and reads[0] | reads[1] == set(range(len(ds.eval)))
    else:  # the padding rows of the last batch re-read the last example
      assert not (reads[0] & reads[1]) - {len(ds.eval) - 1} and reads[0] | reads[1] == set(range(len(ds.eval)))


def test_order_is_a_function_of_the_seed_and_equal_on_one_or_eight_devices():
  ds = data.build(make('lm', **PACKED))
  assert_same(take(ds, 5, seed=3), take(ds, 5, seed=3))
  assert not np.array_equal(take(ds, 1, seed=3)[0]['inputs'], take(ds, 1, seed=4)[0]['inputs'])
  eight = partitioning.make_mesh({'data': 8})
  one = partitioning.make_mesh({'data': 1}, jax.devices()[:1])
  got = {}
  for name, mesh in (('eight', eight), ('one', one)):
    s = jax.sharding.NamedSharding(mesh, jax.P('data'))
    rows = data.local_rows(s, (8, 16))
    got[name] = [jax.device_get(data.to_global(b, {k: s for k in b}, 8)) for b in take(ds, 3, rows=rows)]
  assert_same(got['eight'], got['one'])


@pytest.mark.parametrize(
  'cfg',
  [
    make('lm', **PACKED),
    make('classification', name='synthetic_images', image_size=8, num_train=64, augment='crop_flip'),
    make('mlm', name='markov_text', seq_len=16, num_train=64),
  ],
  ids=['packed_lm', 'augmented_images', 'mlm'],
)
def test_resume_from_json_state_equals_an_uninterrupted_run(cfg):
  ds = data.build(cfg)
  it = iter(ds.train_dataset(8, slice(0, 8), 0))
  states, run = [], []
  for _ in range(16):  # crosses epochs for the 64-example datasets
    states.append(json.loads(json.dumps(it.get_state())))  # what a checkpoint stores
    run.append(next(it))
  it.close()
  for k in (1, 4, 7, 10):
    fresh = iter(ds.train_dataset(8, slice(0, 8), 0))
    fresh.set_state(states[k])
    assert_same([next(fresh) for _ in range(6)], run[k : k + 6])
    fresh.close()


def test_resume_through_orbax_with_the_grain_checkpoint_handler(tmp_path):
  import grain
  import orbax.checkpoint as ocp

  ds = data.build(make('lm', **PACKED))
  it = iter(ds.train_dataset(8, slice(0, 8), 0))
  for _ in range(5):
    next(it)
  mngr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(create=True))
  mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mngr.wait_until_finished()
  expected = [next(it) for _ in range(6)]
  it.close()
  fresh = iter(ds.train_dataset(8, slice(0, 8), 0))
  mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
  assert_same([next(fresh) for _ in range(6)], expected)
  fresh.close()
  mngr.close()


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path):
  tokenizers = pytest.importorskip('tokenizers')
  transformers = pytest.importorskip('transformers')
  specials = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
  vocab = {t: i for i, t in enumerate(specials + list(data.markov.ALPHABET))}
  tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token='[UNK]'))
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tk, pad_token='[PAD]', unk_token='[UNK]', cls_token='[CLS]', sep_token='[SEP]', mask_token='[MASK]'
  ).save_pretrained(tmp_path)
  ds = data.build(make('mlm', vocab_size=64, name='markov_text', seq_len=16, num_train=64, tokenizer=str(tmp_path)))
  assert ds.tokenizer.vocab_size == len(vocab) and ds.tokenizer.mask_id == 4
  b = take(ds, 1)[0]
  text = ds.train[0]['text']
  assert list(ds.tokenizer.encode(text)) == [vocab[c] for c in text]
  assert (b['targets'][:, 0] == 2).all() and (b['inputs'][b['mask'] > 0] != 1).all()
  with pytest.raises(ConfigError, match=r'neither .byte. nor a local directory'):
    data.build(make('mlm', name='markov_text', seq_len=16, tokenizer='bert-base-uncased'))


@pytest.mark.parametrize(
  'cfg, message',
  [
    (make('lm', name='nope'), r"config.dataset.name='nope' is not a known dataset"),
    (make('lm', name='synthetic_imags'), r"did you mean \['synthetic_images'"),
    (
      make('classification', name='markov_text', seq_len=16),
      r"config.task='classification' does not fit dataset "
      r"'markov_text', which serves \['lm', 'mlm'",
    ),
    (make('lm', name='markov_text', seq_len=1), r'config.dataset.seq_len=1: must be an integer >= 2'),
    (make('mlm', name='markov_text'), r'config.dataset.seq_len=None: must be an integer >= 3'),
    (make('classification', name='synthetic_images', image_size=0), r'config.dataset.image_size=0: must be a positive'),
    (make('mlm', name='markov_text', seq_len=16, pack=True), r'pack=True packs documents for task lm'),
    (make('classification', name='synthetic_images', augment='mixup'), r"config.dataset.augment='mixup'"),
  ],
)
def test_config_errors(cfg, message):
  with pytest.raises(ConfigError, match=message):
    data.build(cfg)


def test_the_task_checks_the_dataset_against_itself_and_the_model():
  packed = data.build(make('lm', **PACKED))
  check(make('lm', **PACKED), packed)
  unpacked = make('lm', **{**PACKED, 'pack': False})
  with pytest.raises(
    ConfigError,
    match=r"dataset 'markov_text' makes batch fields .* but task 'lm' takes "
    r"\['inputs', 'mask', 'targets'\] \(missing \[\], unused \['positions', 'segment_ids'\]\)",
  ):
    check(unpacked, packed)
  with pytest.raises(
    ConfigError, match=r"makes 'inputs' as int32 \(16,\) per example, but task 'lm' takes int32 \(12,\)"
  ):
    check(make('lm', **{**PACKED, 'seq_len': 12}), packed)
  markov = make('lm', vocab_size=16, name='markov', branching=4, smoothing=0.03, seq_len=16, num_train=64, num_eval=8)
  markov.dataset.vocab_size = 16
  ds = data.build(markov)
  check(markov, ds)
  int_mask = lambda x: {**data.lm_example(x), 'mask': np.ones(16, np.int32)}
  with pytest.raises(
    ConfigError, match=r"makes 'mask' as int32 \(16,\) per example, but task 'lm' takes float32 \(16,\)"
  ):
    check(markov, dataclasses.replace(ds, transform=int_mask))
  with pytest.raises(ConfigError, match=r"dataset 'markov' makes train examples .* but eval examples"):
    check(markov, dataclasses.replace(ds, eval_transform=int_mask))
  # Token ids and labels the model has: one check, whatever emits them.
  markov.dataset.vocab_size = 20
  with pytest.raises(
    ConfigError,
    match=r'the markov language \(config.dataset.vocab_size\) has 20 ids but '
    r'config.model.vocab_size=16: set config.model.vocab_size >= 20',
  ):
    check(markov, data.build(markov))
  text = make('lm', vocab_size=16, name='markov_text', seq_len=16)
  with pytest.raises(
    ConfigError,
    match=r'the byte tokenizer has 260 ids but config.model.vocab_size=16: set '
    r'config.model.vocab_size >= 260',
  ):
    check(text, data.build(text))
  for cfg in (
    make('classification', name='synthetic_images', image_size=8, channels=3, num_classes=4),
    make('text_classification', name='markov_text', seq_len=16, num_classes=4),
  ):
    cfg.model.num_classes = 3
    with pytest.raises(
      ConfigError, match=rf"dataset '{cfg.dataset.name}' has 4 classes but config.model.num_classes=3"
    ):
      check(cfg, data.build(cfg))
    cfg.model.num_classes = 4
    check(cfg, data.build(cfg))
