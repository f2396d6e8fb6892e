"""TFDS pipelines under tfds.testing.mock_data (no network), a tiny dataset prepared offline for the
split and file-format errors, the fast failure of an unprepared dataset, and train.py on mock lm1b."""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds

import data
import partitioning
import train
from data import vision
from errors import ConfigError
from tests.conftest import tiny_config
from tests.test_data_offline import Recorder, assert_same, check, make, take

N = 21  # examples per mocked split: not a multiple of the batch


@pytest.fixture
def mock():
  with tfds.testing.mock_data(num_examples=N):
    yield


VISION = {'mnist': (28, 1), 'cifar10': (32, 3), 'imagenet2012': (40, 3)}  # imagenet: any size; mocks vary


@pytest.mark.parametrize('name', VISION)
def test_vision_pipelines(name, mock):
  size, channels = VISION[name]
  cfg = make('classification', name=name, image_size=size, channels=channels)
  ds = data.build(cfg)
  assert check(cfg, ds)['image'] == ((size, size, channels), np.float32)
  assert ds.num_classes == tfds.builder(name).info.features['label'].num_classes
  b = take(ds, 2)[1]
  assert b['image'].shape == (8, size, size, channels) and b['image'].dtype == np.float32
  assert b['label'].dtype == np.int32 and b['mask'].dtype == np.float32 and b['mask'].all()
  assert abs(b['image'].mean()) < 1.5 and 0.3 < b['image'].std() < 2  # normalised
  evals = list(ds.eval_batches(8, slice(0, 8)))
  assert [int(e['mask'].sum()) for e in evals] == [8, 8, 5]
  # Eval is deterministic and un-augmented: exactly the eval transform of each example, in order.
  expected = [ds.eval_transform.map(ds.eval[i]) for i in range(N)]
  np.testing.assert_array_equal(
    np.concatenate([e['image'] for e in evals])[:N], np.stack([x['image'] for x in expected])
  )
  np.testing.assert_array_equal(np.concatenate([e['label'] for e in evals])[:N], [x['label'] for x in expected])
  # Augmentation on train only: mnist has none; cifar10 and imagenet2012 draw a different view per rng.
  ex = ds.train[3]
  views = [ds.transform.random_map(ex, np.random.default_rng(s))['image'] for s in range(4)]
  if name == 'mnist':
    ref = ds.eval_transform.map(ex)['image']
    assert all(np.array_equal(v, ref) for v in views)
  else:
    assert len({v.tobytes() for v in views}) > 1


def test_imagenet_crops():
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)
  c = vision.center_crop(image, 32)
  assert c.shape == (32, 32, 3)
  # The center crop sees the middle 87.5% of the shorter side.
  np.testing.assert_allclose(c.mean(), vision.resize(image[4:56, 19:71], 32, 32).mean(), atol=2)
  crops = [vision.inception_crop(image, np.random.default_rng(s), 24) for s in range(5)]
  assert all(x.shape == (24, 24, 3) and x.dtype == np.uint8 for x in crops)
  assert len({x.tobytes() for x in crops}) == 5


@pytest.mark.parametrize('name', ['lm1b', 'c4'])
def test_packed_text_pipelines(name, mock):
  L = 32
  ds = data.build(make('lm', name=name, seq_len=L, pack=True))
  tok = ds.tokenizer
  for b in take(ds, 3):
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
      'inputs': ((8, L), np.int32),
      'targets': ((8, L), np.int32),
      'mask': ((8, L), np.float32),
      'segment_ids': ((8, L), np.int32),
      'positions': ((8, L), np.int32),
    }
    seg = b['segment_ids']
    np.testing.assert_array_equal(b['mask'], seg > 0)
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    # Within a document the next input is this position's target; positions count up from 0.
    np.testing.assert_array_equal(b['inputs'][:, 1:][same], b['targets'][:, :-1][same])
    np.testing.assert_array_equal(b['positions'][:, 1:][same], b['positions'][:, :-1][same] + 1)
    assert (b['positions'][:, 1:][~same & (seg[:, 1:] > 0)] == 0).all()  # a new segment starts at 0
  docs = [tok.encode(ds.eval[i]['text']) for i in range(N)]
  evals = list(ds.eval_batches(8, slice(0, 8)))
  assert sum(e['mask'].sum() for e in evals) == sum(len(d) + 1 for d in docs)  # every target, once


def test_mlm_and_unpacked_lm_on_lm1b(mock):
  ds = data.build(make('mlm', name='lm1b', seq_len=24))
  b = take(ds, 1)[0]
  assert b['inputs'].shape == (8, 24) and (b['mask'] > 0).sum(1).min() >= 1
  cfg = make('lm', name='lm1b', seq_len=12)
  ds = data.build(cfg)
  assert set(check(cfg, ds)) == {'inputs', 'targets', 'mask'} and ds.pack_len is None
  docs = [ds.tokenizer.encode(ds.eval[i]['text']) for i in range(N)]
  evals = list(ds.eval_batches(8, slice(0, 8)))
  assert sum(e['mask'].sum() for e in evals) == sum(min(len(d) + 1, 12) for d in docs)  # truncated rows


def test_eval_metric_is_exact_when_the_split_is_not_a_multiple_of_the_batch(mock):
  ds = data.build(make('classification', name='mnist'))
  W = np.random.default_rng(0).normal(size=(784, 10)).astype(np.float32) * 0.05
  mesh = partitioning.make_mesh({'data': 8})
  s = jax.sharding.NamedSharding(mesh, jax.P('data'))

  @jax.jit
  def sums(b):
    logits = b['image'].reshape(8, -1) @ W
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, b['label'])
    return jnp.stack([(loss * b['mask']).sum(), ((logits.argmax(-1) == b['label']) * b['mask']).sum(), b['mask'].sum()])

  total = sum(
    np.asarray(sums(data.to_global(b, {k: s for k in b}, 8)), np.float64)
    for b in ds.eval_batches(8, data.local_rows(s, (8,)))
  )
  # Plain numpy, one example at a time, straight from the source.
  x = np.stack([(ds.eval[i]['image'] / 255 - 0.1307) / 0.3081 for i in range(N)]).reshape(N, -1) @ W.astype(np.float64)
  y = np.array([ds.eval[i]['label'] for i in range(N)])
  loss = np.log(np.exp(x).sum(1)) - x[np.arange(N), y]
  assert total[2] == N
  np.testing.assert_allclose(total[0] / total[2], loss.mean(), rtol=1e-5)
  assert total[1] / total[2] == (x.argmax(1) == y).mean()


def test_processes_read_disjoint_parts_of_a_tfds_split(mock):
  for cfg in (
    make('lm', name='lm1b', seq_len=16, pack=True),
    make('classification', name='imagenet2012', image_size=16),
  ):
    ds = data.build(cfg)
    reads = []
    for rows in (slice(0, 2), slice(2, 4)):
      rec = Recorder(ds.reads('eval')[0])  # lm1b: its token cache
      read = (
        dataclasses.replace(ds, cached=dataclasses.replace(ds.cached, eval=rec))
        if ds.cached
        else dataclasses.replace(ds, eval=rec)
      )
      list(read.eval_batches(4, rows))
      reads.append(rec.read)
    assert not (reads[0] & reads[1]) - {N - 1} and reads[0] | reads[1] == set(range(N))


@pytest.mark.parametrize(
  'cfg',
  [make('lm', name='lm1b', seq_len=16, pack=True), make('classification', name='imagenet2012', image_size=16)],
  ids=['lm1b', 'imagenet2012'],
)
def test_tfds_resume_equals_an_uninterrupted_run(cfg, mock):
  ds = data.build(cfg)
  it = iter(ds.train_dataset(4, slice(0, 4), 0))
  for _ in range(4):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(8)]
  it.close()
  fresh = iter(ds.train_dataset(4, slice(0, 4), 0))
  fresh.set_state(state)
  assert_same([next(fresh) for _ in range(8)], expected)
  fresh.close()


def test_unprepared_dataset_fails_within_seconds_saying_how_to_prepare(tmp_path):
  t0 = time.perf_counter()
  with pytest.raises(ConfigError) as e:
    data.build(make('classification', name='mnist', data_dir=str(tmp_path)))
  assert time.perf_counter() - t0 < 10
  msg = str(e.value)
  assert f"'mnist' is not prepared in data_dir {tmp_path}" in msg
  assert f'tfds build mnist --data_dir={tmp_path} --file_format=array_record' in msg
  with pytest.raises(ConfigError, match=r'imagenet2012 also needs files downloaded by hand into --manual_dir'):
    data.build(make('classification', name='imagenet2012', data_dir=str(tmp_path)))


class ShardzooTinyText(tfds.core.GeneratorBasedBuilder):
  """A real (not mocked) TFDS dataset, prepared offline in a test."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {'text': tfds.features.Text(), 'label': tfds.features.ClassLabel(num_classes=3)}
      ),
    )

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(40), 'test': self._generate_examples(11)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {'text': f'document {i} ' + 'xy' * (i % 7), 'label': i % 3}


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  root = tmp_path_factory.mktemp('tfds')
  tfds.builder('shardzoo_tiny_text', data_dir=str(root / 'ar'), file_format='array_record').download_and_prepare()
  tfds.builder('shardzoo_tiny_text', data_dir=str(root / 'tfr')).download_and_prepare()  # tfrecord: no random access
  return root


def test_prepared_dataset_reads_and_rejects_unknown_splits(prepared):
  ds = data.build(make('text_classification', name='shardzoo_tiny_text', data_dir=str(prepared / 'ar'), seq_len=32))
  assert len(ds.train) == 40 and len(ds.eval) == 11 and isinstance(ds.eval[0]['text'], bytes)
  assert ds.num_classes == 3 and ds.vocab == (260, 'the byte tokenizer')
  b = list(ds.eval_batches(8, slice(0, 8)))
  assert sum(e['mask'].sum() for e in b) == 11
  np.testing.assert_array_equal(np.concatenate([e['label'] for e in b])[:11], [ds.eval[i]['label'] for i in range(11)])
  with pytest.raises(
    ConfigError,
    match=r"config.dataset.eval_split='validation': shardzoo_tiny_text has no split "
    r"'validation'; its splits: \['test', 'train'\]",
  ):
    data.build(
      make('lm', name='shardzoo_tiny_text', data_dir=str(prepared / 'ar'), seq_len=32, eval_split='validation')
    )
  with pytest.raises(
    ConfigError, match=r'is stored as tfrecord, which has no random access; convert it: tfds convert_format'
  ):
    data.build(make('lm', name='shardzoo_tiny_text', data_dir=str(prepared / 'tfr'), seq_len=32))
  with pytest.raises(ConfigError, match=r'config.dataset.num_classes=5 but shardzoo_tiny_text has 3'):
    data.build(
      make('text_classification', name='shardzoo_tiny_text', data_dir=str(prepared / 'ar'), seq_len=32, num_classes=5)
    )


def test_tfds_dataset_errors(mock):
  with pytest.raises(ConfigError, match=r"did you mean \['mnist'"):
    data.build(make('classification', name='mnits'))
  with pytest.raises(ConfigError, match=r'config.dataset.channels=3 but mnist has 1'):
    data.build(make('classification', name='mnist', channels=3))
  with pytest.raises(
    ConfigError, match=r"config.task='classification' does not fit dataset 'lm1b', which serves \['lm', 'mlm'\]"
  ):
    data.build(make('classification', name='lm1b'))
  with pytest.raises(ConfigError, match=r"config.task='lm' does not fit dataset 'cifar10'"):
    data.build(make('lm', name='cifar10', seq_len=16))


@pytest.mark.parametrize('pack', [False, True])
def test_train_py_switches_to_lm1b_with_the_byte_tokenizer(tmp_path, mock, pack):
  cfg = tiny_config()  # the default GPT on markov; switch the dataset as --config.dataset.name=lm1b would
  cfg.dataset.name = 'lm1b'
  cfg.dataset.pack = pack
  result = train.train_and_evaluate(cfg, str(tmp_path))
  assert cfg.model.vocab_size == 260  # the default config leaves it to the data: the Markov language's, now the bytes'
  docs = [data.tokens.ByteTokenizer().encode(tfds.data_source('lm1b', split='test')[i]['text']) for i in range(N)]
  L = cfg.dataset.seq_len
  expected = sum(len(d) + 1 if pack else min(len(d) + 1, L) for d in docs)
  assert result['eval']['weight'] == expected  # every target of the split counted once, padding masked
  assert np.isfinite(result['eval']['loss']) and int(result['state'].step) == cfg.total_steps
