"""The synthetic language's entropy floor, and the grain pipeline's determinism and per-process slicing."""

import jax
import numpy as np
import pytest

import data
import partitioning
from data import MarkovLanguage
from errors import ShardingError


def test_markov_floor_matches_empirical_nll():
  lang = MarkovLanguage(16, 4, 0.03, seed=0)
  seqs = lang.sample(20000, 66, seed=5)
  e = lang.entropies()
  # NLL of real samples under the true chain estimates the entropy rate.
  assert lang.nll(seqs) == pytest.approx(e['order2'], abs=0.01)
  assert e['order2'] < e['bigram'] < e['unigram'] <= np.log(16) + 1e-9
  # Empirical unigram frequencies match the stationary distribution.
  freq = np.bincount(seqs.ravel(), minlength=16) / seqs.size
  np.testing.assert_allclose(freq, lang.stationary_pairs.sum(0), atol=0.005)
  assert lang.loss_floor(64) == pytest.approx((e['bigram'] + 63 * e['order2']) / 64)


def test_lm_example_shifts_by_one():
  ex = data.lm_example(np.arange(10).reshape(2, 5))
  np.testing.assert_array_equal(ex['inputs'], [[0, 1, 2, 3], [5, 6, 7, 8]])
  np.testing.assert_array_equal(ex['targets'], [[1, 2, 3, 4], [6, 7, 8, 9]])
  assert ex['mask'].dtype == np.float32 and ex['mask'].all()


def _batches(source, rows, n, seed=0, global_batch=8):
  it = iter(data.train_dataset(source, global_batch, rows, seed, data.lm_example))
  return [next(it)['inputs'] for _ in range(n)]


def test_processes_read_disjoint_rows_that_form_the_global_batch():
  source = np.arange(64 * 3).reshape(64, 3)
  whole = _batches(source, slice(0, 8), 10)
  halves = [_batches(source, slice(0, 4), 10), _batches(source, slice(4, 8), 10)]
  for g in range(10):
    np.testing.assert_array_equal(np.concatenate([halves[0][g], halves[1][g]]), whole[g])
  firsts = np.concatenate([b[:, 0] for b in whole[:8]])
  assert len(set(firsts.tolist())) == 64  # one epoch of 8 batches covers each example once


def test_same_seed_same_batches_and_resume_from_state():
  source = np.arange(64 * 3).reshape(64, 3)
  assert all((a == b).all() for a, b in zip(_batches(source, slice(0, 8), 12), _batches(source, slice(0, 8), 12)))
  assert not all(
    (a == b).all() for a, b in zip(_batches(source, slice(0, 8), 4, seed=0), _batches(source, slice(0, 8), 4, seed=1))
  )
  it = iter(data.train_dataset(source, 8, slice(0, 8), 0, data.lm_example))
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it)['inputs'] for _ in range(4)]
  it2 = iter(data.train_dataset(source, 8, slice(0, 8), 0, data.lm_example))
  it2.set_state(state)
  for e in expected:
    np.testing.assert_array_equal(next(it2)['inputs'], e)


def test_eval_pads_and_masks_the_last_batch():
  source = np.arange(13 * 5).reshape(13, 5)
  batches = list(data.eval_batches(source, 8, slice(0, 8), data.lm_example))
  assert len(batches) == 2
  assert batches[1]['mask'][:5].all() and not batches[1]['mask'][5:].any()
  assert sum(b['mask'].sum() for b in batches) == 13 * 4
  # Per-process: the second process's rows of the last batch are all padding.
  second = list(data.eval_batches(source, 8, slice(4, 8), data.lm_example))
  assert second[1]['mask'][:1].all() and not second[1]['mask'][1:].any()


class ProcessView:
  """A real sharding as one process of several sees it: only `devices` are addressable."""

  def __init__(self, sharding: jax.sharding.NamedSharding, devices):
    self.sharding, self.devices = sharding, set(devices)

  def addressable_devices_indices_map(self, global_shape):
    return {d: i for d, i in self.sharding.devices_indices_map(global_shape).items() if d in self.devices}


def test_local_rows_follow_the_batch_sharding():
  mesh = partitioning.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  s = jax.sharding.NamedSharding(mesh, jax.P(('data', 'fsdp')))
  assert data.local_rows(s, (16, 4)) == slice(0, 16)  # one process holds every row
  # Two processes, one per 'data' index: each reads its contiguous half, the second process rows 8-16.
  for d, want in ((0, slice(0, 8)), (1, slice(8, 16))):
    assert data.local_rows(ProcessView(s, mesh.devices[d].ravel()), (16, 4)) == want
  # Four processes, one per (data, fsdp): rows 4-8 for (0, 1); 'tensor' replicas read the same rows.
  assert data.local_rows(ProcessView(s, mesh.devices[0, 1].ravel()), (16, 4)) == slice(4, 8)
  # A replicated batch: every process reads every row.
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  assert data.local_rows(ProcessView(replicated, mesh.devices[1].ravel()), (16, 4)) == slice(0, 16)
  # A process holding fsdp=0 of both data rows holds rows 0-4 and 8-12: not one block, refused.
  with pytest.raises(
    ShardingError,
    match=r'this process holds non-contiguous batch rows \[\(0, 4\), \(8, 12\)\] '
    r'of a global batch of 16; order the mesh',
  ):
    data.local_rows(ProcessView(s, mesh.devices[:, 0].ravel()), (16, 4))


def test_to_global_builds_sharded_arrays():
  mesh = partitioning.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  s = jax.sharding.NamedSharding(mesh, jax.P(('data', 'fsdp')))
  local = data.lm_example(np.arange(8 * 5).reshape(8, 5))
  g = data.to_global(local, {k: s for k in local}, 8)
  assert g['inputs'].shape == (8, 4) and g['inputs'].sharding == s
  assert g['inputs'].addressable_shards[0].data.shape == (2, 4)
  np.testing.assert_array_equal(np.asarray(g['targets']), local['targets'])


def test_unknown_dataset():
  from tests.conftest import tiny_config

  cfg = tiny_config()
  cfg.dataset.name = 'nope'
  with pytest.raises(ValueError, match=r"config.dataset.name='nope' is not a known dataset"):
    data.build(cfg)


@pytest.mark.parametrize('packed', [False, True])
def test_a_data_position_resumes_with_another_number_of_processes(packed):
  """Positions saved by 2 processes (rows 0-3, 4-7) resume in 1 process (rows 0-7) and in 4 (2 rows each), and
  those of the 4 in 2, giving exactly the batches an uninterrupted run reads next (packed: each row's packer
  continues mid-document);
  another global batch is a CheckpointError naming both."""
  from data.pipeline import RowsIterator, packed_train_dataset  # pylint: disable=g-import-not-at-top
  from errors import CheckpointError  # pylint: disable=g-import-not-at-top

  docs = [np.arange(i % 7 + 3) + 100 * i for i in range(200)]
  tok = lambda d: {'inputs': d[:-1].astype(np.int32), 'targets': d[1:].astype(np.int32)}

  def it(rows, global_batch=8):
    ds = (
      packed_train_dataset(docs, global_batch, rows, 0, tok, 6, prefetch=0)
      if packed
      else data.train_dataset(
        np.stack([np.resize(d, 6) for d in docs]), global_batch, rows, 0, data.lm_example, num_threads=0, prefetch=0
      )
    )
    return RowsIterator(ds, rows, global_batch, packed)

  whole = it(slice(0, 8))
  expected = [next(whole)['inputs'] for _ in range(5)][3:]
  saved = []
  for rows in (slice(0, 4), slice(4, 8)):
    half = it(rows)
    for _ in range(3):
      next(half)
    saved.append(half.get_state())
  resumed = it(slice(0, 8))
  resumed.set_state(saved)
  for e in expected:
    np.testing.assert_array_equal(next(resumed)['inputs'], e)
  quarters = [it(slice(2 * q, 2 * q + 2)) for q in range(4)]
  for q in quarters:
    q.set_state(saved)
  for e in expected:
    np.testing.assert_array_equal(np.concatenate([next(q)['inputs'] for q in quarters]), e)
  for _ in range(2):  # and the reverse: 4 processes' positions resume in 2
    for q in quarters:
      next(q)
  halves = [it(slice(0, 4)), it(slice(4, 8))]
  for h in halves:
    h.set_state([q.get_state() for q in quarters])
  following = [next(whole)['inputs'] for _ in range(3)][2]
  np.testing.assert_array_equal(np.concatenate([next(h)['inputs'] for h in halves]), following)
  with pytest.raises(CheckpointError, match='global batch of 8 .*this run reads 16'):
    it(slice(0, 16), 16).set_state(saved)
  with pytest.raises(CheckpointError, match=r'covers rows \[\(0, 4\)\] of a global batch of 8, not rows \[\(4, 8\)\]'):
    it(slice(0, 8)).set_state(saved[:1])
  # Processes that hold the same rows (tensor parallelism across hosts) each save them: the copies resume as one,
  # and copies that disagree are an error naming the row.
  resumed = it(slice(0, 8))
  resumed.set_state([saved[0], saved[0], saved[1], saved[1]])
  np.testing.assert_array_equal(next(resumed)['inputs'], expected[0])
  if packed:
    other = {**saved[1], 'rows': [0, 4]}
    with pytest.raises(CheckpointError, match='read row 0 of the global batch saved different'):
      it(slice(0, 8)).set_state([saved[0], other, saved[1]])
