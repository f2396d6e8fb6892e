"""Checkpoints (checkpointing/): restore exactly, onto other meshes and rules, params only; clear errors for bad
input."""

import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import data
import models
import training
from checkpointing import checkpointer, integrity, storage, weights
from errors import CheckpointError, DamagedCheckpointError
from tests.conftest import ROOT, build_trainer, subprocess_env, tiny_config, train_on_random_batches
from training.trainer import state_tree


class _Iter:
  """A stand-in for a grain iterator (the real one is tested end to end in test_resume)."""

  def __init__(self, pos=0):
    self.pos = pos

  def get_state(self):  # grain's handler stores bytes for iterators other than its own
    return json.dumps({'pos': self.pos}).encode()

  def set_state(self, state):
    self.pos = json.loads(state)['pos']

  def start_prefetch(self):
    pass


def _halve_the_largest_data_file(d):
  # the metadata readable, some arrays not: orbax wraps TensorStore's OUT_OF_RANGE in a bare Exception
  f = max(d.rglob('d/*'), key=lambda f: f.stat().st_size)
  f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


CORRUPTIONS = [
  ('metadata', lambda d: (d / '_METADATA').write_text('{not json')),  # of a step's 'state'
  ('data', lambda d: [f.write_bytes(f.read_bytes()[:20]) for f in d.rglob('d/*')]),
  ('some array data', _halve_the_largest_data_file),
]


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A checkpoint of 2 AdamW steps of the tiny model under fsdp_tp on 8 devices."""
  directory = str(tmp_path_factory.mktemp('ckpt'))
  trainer = build_trainer(tiny_config('fsdp_tp'))
  _, state = train_on_random_batches(trainer, 2)
  ckpt = checkpointer.Checkpointer(directory, every_steps=1, keep=2)
  ckpt.save(2, state_tree(state), _Iter(7))
  ckpt.wait()
  ckpt.close()
  return directory, jax.device_get(state_tree(state))


def _assert_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), b)


def test_restore_is_exact_and_restores_the_data_position(saved):
  directory, expected = saved
  trainer = build_trainer(tiny_config('fsdp_tp'))
  it = _Iter()
  with checkpointer.Checkpointer(directory, every_steps=1, keep=2) as ckpt:
    state = ckpt.restore(trainer.checkpoint_target(), it)
  _assert_equal(state, expected)
  assert it.pos == 7 and int(state['step']) == 2
  jax.tree.map(
    lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(str(x.sharding)),
    state,
    state_tree(trainer.shardings),
  )


@pytest.mark.parametrize('preset,num_devices', [('dp', 8), ('tp', 8), ('fsdp', 4), ('dp', 1)])
def test_restore_onto_other_mesh_and_rules(saved, preset, num_devices):
  directory, expected = saved
  cfg = tiny_config(preset)
  cfg.mesh = (
    {
      'dp': dict(data=num_devices, fsdp=1, tensor=1),
      'tp': dict(data=2, fsdp=1, tensor=4),
      'fsdp': dict(data=1, fsdp=4, tensor=1),
    }[preset]
    if num_devices != 8 or preset != 'dp'
    else cfg.mesh
  )
  trainer = build_trainer(cfg, jax.devices()[:num_devices])
  with checkpointer.Checkpointer(directory, every_steps=1, keep=2) as ckpt:
    state = ckpt.restore(trainer.checkpoint_target(), _Iter())
  _assert_equal(state, expected)
  kernel = state['params']['blocks']['layers'][0]['mlp']['up']['layer']['kernel']
  assert kernel.sharding.mesh.size == num_devices
  assert kernel.sharding.spec == trainer.specs.params['blocks']['layers'][0]['mlp']['up']['layer']['kernel']


def test_params_only_for_fine_tuning(saved):
  directory, expected = saved
  trainer = build_trainer(tiny_config('tp'))
  params = weights.load_params(directory, trainer.checkpoint_target()['params'])
  _assert_equal(params, expected['params'])


def test_checkpoint_of_another_model_names_the_first_mismatch(saved):
  directory, _ = saved
  cfg = tiny_config('fsdp_tp')
  cfg.model.mlp_dim = 256
  trainer = build_trainer(cfg)
  msg = (
    r"parameter 'blocks/layers/0/mlp/down/layer/kernel': the model expects shape \(256, 64\), "
    r'the checkpoint has \(128, 64\)'
  )
  with (
    checkpointer.Checkpointer(directory, every_steps=1, keep=2) as ckpt,
    pytest.raises(CheckpointError, match=msg),
  ):
    ckpt.restore(trainer.checkpoint_target(), _Iter())
  with pytest.raises(CheckpointError, match=msg):
    weights.load_params(directory, trainer.checkpoint_target()['params'])


def test_missing_and_corrupt_checkpoints_are_clear_errors(saved, tmp_path):
  directory, _ = saved
  trainer = build_trainer(tiny_config('fsdp_tp'))
  with (
    checkpointer.Checkpointer(str(tmp_path / 'empty'), every_steps=1, keep=2) as ckpt,
    pytest.raises(CheckpointError, match='no checkpoint in'),
  ):
    ckpt.restore(trainer.checkpoint_target(), _Iter())
  with pytest.raises(CheckpointError, match='no checkpoint there'):
    weights.load_params(str(tmp_path / 'nothing'), trainer.checkpoint_target()['params'])
  # Garbage metadata, and truncated array data: both are errors, never a silent fresh start.
  for name, corrupt in CORRUPTIONS:
    broken = tmp_path / name
    shutil.copytree(directory, broken)
    corrupt(broken / '2' / 'state')
    with (
      checkpointer.Checkpointer(str(broken), every_steps=1, keep=2) as ckpt,
      pytest.raises(CheckpointError, match=r'checkpoint .*/2 (is missing or corrupt|could not be restored)'),
    ):
      ckpt.restore(trainer.checkpoint_target(), _Iter())


def test_unreadable_array_data_is_a_one_line_checkpoint_error_when_loading_weights(saved, monkeypatch):
  """load_params (config.init_from): orbax's bare Exception around TensorStore's read error (whose message is
  the whole TensorStore spec) is a CheckpointError with the read error's first line; other errors pass through."""
  directory, _ = saved
  trainer = build_trainer(tiny_config('fsdp_tp'))

  def unreadable(*args, **kwargs):
    try:
      raise ValueError('OUT_OF_RANGE: Error reading "params.embed" in OCDBT database\n[source locations=...]')
    except ValueError as e:
      raise Exception("Encountered error while reading array index: ... TensorStore({'base': ...})") from e

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', unreadable)
  with pytest.raises(
    CheckpointError,
    match=r'^checkpoint .*/2 could not be restored: OUT_OF_RANGE: '
    r'Error reading "params.embed" in OCDBT database; no older step to load instead in .*$',
  ):
    weights.load_params(directory, trainer.checkpoint_target()['params'])
  monkeypatch.setattr(
    ocp.PyTreeCheckpointHandler,
    'restore',
    lambda *a, **k: (_ for _ in ()).throw(KeyError('a bug, not damage')),
  )
  with pytest.raises(KeyError, match='a bug, not damage'):
    weights.load_params(directory, trainer.checkpoint_target()['params'])


def test_damaged_latest_checkpoint_falls_back_and_is_kept(saved, tmp_path):
  """A newest checkpoint that cannot be read: an error naming it and the flag (resume_fallback=False), or
  (the default) moved aside to <step>.damaged, never deleted, and the previous one restored, with a warning."""
  directory, expected = saved
  trainer = build_trainer(tiny_config('fsdp_tp'))
  for name, corrupt in CORRUPTIONS:
    d = tmp_path / name
    shutil.copytree(directory, d)
    shutil.copytree(d / '2', d / '4')
    corrupt(d / '4' / 'state')
    ckpt = checkpointer.Checkpointer(str(d), every_steps=1, keep=2)
    with pytest.raises(
      CheckpointError,
      match=rf'checkpoint {d}/4 (is missing or corrupt|could not be '
      r'restored).*\(config.resume_fallback=True resumes from',
    ):
      ckpt.restore_latest(trainer.checkpoint_target(), _Iter(), fallback=False)
    assert (d / '4').is_dir()
    it = _Iter()
    state, warnings = ckpt.restore_latest(trainer.checkpoint_target(), it)
    _assert_equal(state, expected)
    assert it.pos == 7 and ckpt.latest_step() == 2, name
    assert len(warnings) == 1 and re.match(
      rf'checkpoint {d}/4 (is missing or corrupt|could not be restored).*; '
      rf'moved aside to {d}/4.damaged \(not deleted\); resumed from step 2$',
      warnings[0],
    ), warnings
    assert (d / '4.damaged' / 'state').is_dir() and not (d / '4').exists()
    # Step 4 is free again: the next save there (here the final one, forced) is written, not skipped.
    assert ckpt.due(4, force=True) and ckpt.save(4, state, it, force=True), name
    ckpt.wait()
    assert sorted(p.name for p in d.iterdir()) == ['2', '4', '4.damaged'], name
    ckpt.close()
    # The only checkpoint damaged: an error, and nothing moved (a rerun must not start afresh silently).
    only = tmp_path / f'{name}_only'
    shutil.copytree(directory, only)
    corrupt(only / '2' / 'state')
    ckpt = checkpointer.Checkpointer(str(only), every_steps=1, keep=2)
    with pytest.raises(CheckpointError, match=r'no older checkpoint can be read either'):
      ckpt.restore_latest(trainer.checkpoint_target(), _Iter())
    assert (only / '2' / 'state').is_dir() and ckpt.latest_step() == 2
    ckpt.close()


@pytest.mark.parametrize(
  'override,first',
  [
    ({'optim.name': 'sgd'}, '1/0/trace/blocks/layers/0/attn/key/layer/bias'),
    ({'freeze': 'embed'}, 'inner_states/train/inner_state/1/0/count'),
  ],
)
def test_checkpoint_of_another_optimizer_is_a_config_error_not_damage(saved, override, first):
  """Another optimizer or freeze (same parameters): one CheckpointError naming the first optimizer state and the
  config fields to compare, before orbax reads anything; not damage, so nothing is moved aside."""
  directory, _ = saved
  cfg = tiny_config('fsdp_tp')
  cfg.update_from_flattened_dict(override)
  ckpt = checkpointer.Checkpointer(directory, every_steps=1, keep=2)
  with pytest.raises(CheckpointError) as info:
    ckpt.restore_latest(build_trainer(cfg).checkpoint_target(), _Iter())
  ckpt.close()
  assert not isinstance(info.value, DamagedCheckpointError)
  assert re.fullmatch(
    rf"checkpoint {directory}/2: optimizer state 'opt_state/{first}' \(shape \([\d, ]*\)\) is "
    r"missing from the checkpoint; the checkpoint has instead e.g. \['opt_state/1/0/count', .*\]\. Was it "
    r'written with another optimizer\? Compare config.optim.name, config.freeze, config.train_only '
    r'and the optimizer settings .*',
    str(info.value),
  ), str(info.value)
  assert sorted(os.listdir(directory)) == ['2']


def test_a_missing_data_position_is_damage_and_another_batch_size_names_the_checkpoint(saved, tmp_path):
  """A data.RowsIterator's position (one JSON file per process): none there is damage naming <step>/data, so
  the previous checkpoint is resumed (at its position). A position this run cannot take (another batch size)
  is a CheckpointError naming the checkpoint, and nothing is moved aside."""
  directory, _ = saved
  cfg = tiny_config('fsdp_tp')
  ds = data.build(cfg)
  rows_iter = lambda batch: ds.train_iterator(batch, slice(0, batch), cfg.seed)
  source = rows_iter(16)
  batches = [next(source) for _ in range(4)]
  d = tmp_path / 'run'
  for step in (2, 4):  # a RowsIterator's position after 3 batches; step 4's then lost
    shutil.copytree(f'{directory}/2', d / str(step))
  source = rows_iter(16)
  [next(source) for _ in range(3)]
  (d / '2' / 'data' / 'process_0-of-1.json').write_text(json.dumps(source.get_state()))
  (d / '4' / 'data' / 'process_0-of-1.json').unlink()
  source.close()
  trainer = build_trainer(cfg)
  ckpt = checkpointer.Checkpointer(str(d), every_steps=1, keep=2)
  wide = rows_iter(32)
  other_batch = (
    f'checkpoint {d}/2: the saved data position is for a global batch of 16 (unpacked); this run '
    'reads 32 (unpacked): resume with the batch size it was saved with'
  )
  with pytest.raises(CheckpointError, match=f'^{re.escape(other_batch)}$'):  # from metadata: train.py
    ckpt.check(trainer.checkpoint_target(), 2, data_iter=wide)  # says so before compiling
  ckpt.check(trainer.checkpoint_target(), 4, data_iter=wide)  # no position there: damage, for the restore to meet
  with pytest.raises(CheckpointError) as info:
    ckpt.restore_latest(trainer.checkpoint_target(), wide)
  wide.close()
  assert not isinstance(info.value, DamagedCheckpointError)
  assert str(info.value) == other_batch
  missing = f'checkpoint {d}/4 is missing or corrupt: the data position in {d}/4/data is missing'
  it = rows_iter(16)
  with pytest.raises(DamagedCheckpointError, match=rf'^{missing} .*\(config.resume_fallback=True'):
    ckpt.restore_latest(trainer.checkpoint_target(), it, fallback=False)
  assert sorted(p.name for p in d.iterdir()) == ['2', '4']
  state, warnings = ckpt.restore_latest(trainer.checkpoint_target(), it)
  assert int(state['step']) == 2 and len(warnings) == 1 and warnings[0].startswith(missing), warnings
  assert warnings[0].endswith(f'moved aside to {d}/4.damaged (not deleted); resumed from step 2'), warnings
  jax.tree.map(np.testing.assert_array_equal, next(it), batches[3])
  it.close()
  ckpt.close()


def test_a_save_cut_short_is_never_picked_up_and_is_cleaned_up(saved, tmp_path):
  """Orbax writes a step into <step>.orbax-checkpoint-tmp and renames it to <step> when every item is written:
  a save killed midway (here step 6, half-written) is no step. restore_latest resumes the newest complete one
  with no warning, and the leftover is removed once the directory is opened again (by the next save)."""
  directory, expected = saved
  d = tmp_path / 'run'
  shutil.copytree(directory, d)
  shutil.copytree(d / '2', d / '6.orbax-checkpoint-tmp')
  CORRUPTIONS[1][1](d / '6.orbax-checkpoint-tmp' / 'state')  # its data half-written
  (d / '6.orbax-checkpoint-tmp' / 'commit_success.txt').unlink()
  ckpt = checkpointer.Checkpointer(str(d), every_steps=1, keep=2)
  it = _Iter()
  state, warnings = ckpt.restore_latest(build_trainer(tiny_config('fsdp_tp')).checkpoint_target(), it)
  _assert_equal(state, expected)
  assert warnings == [] and it.pos == 7 and ckpt.manager.all_steps() == [2]
  assert ckpt.save(4, state, it)
  ckpt.close()
  assert sorted(p.name for p in d.iterdir()) == ['2', '4']


def test_small_replicated_arrays_are_written_by_one_replica_and_big_ones_by_all(tmp_path, caplog):
  """Orbax cuts a replicated array into one slice per replica, each by an eager slice compiled per (shape,
  device). Under checkpointer.MIN_REPLICA_SLICE_BYTES per slice an array is written whole (nothing compiled);
  above it every replica writes its slice (8 slice programs here). Both restore exactly."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  replicated = NamedSharding(jax.make_mesh((8,), ('data',)), P())
  n_big = 8 * (checkpointer.MIN_REPLICA_SLICE_BYTES // 4 + 3)  # shapes no other test slices
  tree = {
    'small': jax.device_put(np.arange(8 * 37, dtype=np.float32), replicated),
    'big': jax.device_put(np.arange(n_big, dtype=np.float32), replicated),
  }
  with jax.log_compiles(True), caplog.at_level('WARNING'), ocp.StandardCheckpointer() as saver:
    saver.save(tmp_path / 'c', tree)
    saver.wait_until_finished()
    restored = saver.restore(
      tmp_path / 'c', jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    )
  sliced = re.findall(
    r'Compiling jit\(slice\) with global shapes and types \(ShapedArray\(float32\[(\d+)\]\)', caplog.text
  )
  assert sliced == [str(n_big)] * 8, sliced
  _assert_equal(restored, jax.device_get(tree))


def test_the_private_orbax_paths_the_checkpointer_uses_are_there():
  """checkpointer.write_small_replicated_arrays_whole is the one private use of orbax (written against 0.12.8):
  an orbax that moves these paths fails here, by name, and the handler registered for jax.Arrays is the one it
  made (orbax's public get_type_handler)."""
  from orbax.checkpoint._src.metadata import array_metadata_store
  from orbax.checkpoint._src.serialization import type_handler_registry

  assert isinstance(array_metadata_store.Store(), array_metadata_store.Store)
  add = type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add
  assert {'override', 'ignore_warnings'} <= set(inspect.signature(add).parameters)
  registered = ocp.type_handlers.get_type_handler(jax.Array)
  checkpointer.write_small_replicated_arrays_whole()
  again = ocp.type_handlers.get_type_handler(jax.Array)
  assert isinstance(again, ocp.type_handlers.ArrayHandler) and again is not registered


_FALL_BACK = """
import gc, sys
from tests.conftest import build_trainer, tiny_config
from checkpointing import checkpointer
from tests.test_checkpointing import _Iter
with checkpointer.Checkpointer(sys.argv[1], every_steps=1, keep=2) as ckpt:
  state, warnings = ckpt.restore_latest(build_trainer(tiny_config('fsdp_tp')).checkpoint_target(), _Iter())
gc.collect()  # the asyncio tasks of the reads orbax abandoned are collected; the rest finish as the process exits
print(int(state["step"]), len(warnings))
"""


def test_only_tensorstore_completions_into_a_closed_loop_are_dropped():
  """checkpointing.storage.AbandonedReads.install: a TensorStore future's completion scheduled into a closed event loop
  returns None (orbax abandoned the read); any other call into a closed loop raises as asyncio does, and an open
  loop schedules both."""
  import asyncio

  import tensorstore as ts

  assert getattr(asyncio.BaseEventLoop.call_soon_threadsafe, 'shardzoo_abandoned_reads', False)
  loop = asyncio.new_event_loop()
  ran = []
  loop.call_soon_threadsafe(ran.append, ts.Future(1))
  loop.call_soon_threadsafe(ran.append, 2)
  loop.run_until_complete(asyncio.sleep(0))
  assert len(ran) == 2
  loop.close()
  assert loop.call_soon_threadsafe(ran.append, ts.Future(3)) is None
  with pytest.raises(RuntimeError, match='Event loop is closed'):
    loop.call_soon_threadsafe(ran.append, 4)


def test_an_abandoned_read_s_log_is_held_while_reading_then_dropped_or_passed_on(caplog, monkeypatch):
  """asyncio can log an abandoned read (any Future subclass's 'never retrieved') before the checkpointer knows the
  damage: held while the checkpoint is read, dropped once it is found damaged, passed on as it came if not."""
  monkeypatch.setattr(sys, 'unraisablehook', sys.unraisablehook)  # `met` installs its own
  reads, log = storage.AbandonedReads(), logging.getLogger('asyncio')

  def abandoned(kind: str, where: str) -> None:
    e = ValueError(f'OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database at local file "{where}/4/state/"')
    log.error(f'{kind} exception was never retrieved\nfuture: <{kind} finished>', exc_info=(ValueError, e, None))

  try:
    with caplog.at_level(logging.ERROR, logger='asyncio'):
      with reads.reading('/ck/a'):
        abandoned('Task', '/ck/a')
        abandoned('_GatheringFuture', '/ck/a')
        assert not caplog.records
        reads.met('/ck/a')
      assert not caplog.records  # the damage known: dropped
      with reads.reading('/ck/b'):
        abandoned('Task', '/ck/b')
        assert not caplog.records
      assert [r.getMessage().split('\n')[0] for r in caplog.records] == ['Task exception was never retrieved']
      abandoned('Future', '/ck/c')  # no read under way: as it comes
      assert len(caplog.records) == 2
  finally:
    log.removeFilter(reads)


@pytest.mark.parametrize('corrupt', [1, 2], ids=['every data file truncated', 'one array file halved'])
def test_falling_back_from_damaged_data_prints_the_warning_and_no_abandoned_reads(saved, tmp_path, corrupt):
  """Orbax reads a checkpoint's arrays concurrently and, at the first that fails, closes its event loop with the
  rest in flight: in a fresh process (as train.py resumes) each of those printed a traceback, 'Event loop is
  closed' or asyncio's 'Task/Future exception was never retrieved', after the warning that names the damage;
  some land before the damage is known, others as the process exits. The script exits at once, so that the ones
  at exit are printed too (checkpointing/storage.AbandonedReads holds and then drops them all)."""
  directory, _ = saved
  d = tmp_path / 'run'
  shutil.copytree(directory, d)
  shutil.copytree(d / '2', d / '4')
  CORRUPTIONS[corrupt][1](d / '4' / 'state')
  r = subprocess.run(
    [sys.executable, '-c', _FALL_BACK, str(d)],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0 and r.stdout == '2 1\n', r.stdout + r.stderr[-3000:]
  assert 'Traceback' not in r.stderr and 'never retrieved' not in r.stderr, r.stderr[-3000:]
  assert sorted(p.name for p in d.iterdir()) == ['2', '4.damaged']


def test_any_error_reading_a_data_position_is_damage_and_falls_back(saved, tmp_path):
  """A data position whose file parses but cannot be taken (here a TypeError from the iterator's set_state) is damage
  like any other failure to read a checkpoint's own files: the previous step is restored, the damaged one moved aside
  (before, the TypeError went through the restore and stopped the run)."""
  directory, expected = saved
  d = tmp_path / 'run'
  shutil.copytree(directory, d)
  shutil.copytree(d / '2', d / '4')
  (d / '4' / 'data' / 'process_0-of-1.json').write_text('[1, 2]')
  it = _Iter()
  with checkpointer.Checkpointer(str(d), every_steps=1, keep=2) as ckpt:
    state, warnings = ckpt.restore_latest(build_trainer(tiny_config('fsdp_tp')).checkpoint_target(), it)
  _assert_equal(state, expected)
  assert it.pos == 7 and len(warnings) == 1, warnings
  assert re.fullmatch(
    rf'checkpoint {d}/4 could not be restored: TypeError: .*; moved aside to {d}/4.damaged \(not deleted\); '
    r'resumed from step 2',
    warnings[0],
  ), warnings[0]


def _noise(x, rng):
  """Random finite float32 bit patterns: incompressible, so zstd stores them verbatim and a bit flipped in the
  file is the same bit flipped in the array orbax reads back."""
  if x.dtype != np.float32:
    return x
  bits = rng.integers(0, 2**32, x.shape, dtype=np.uint32)
  bits = np.where((bits >> 23) & 0xFF == 0xFF, bits & ~np.uint32(1 << 30), bits)  # no inf or NaN
  return jax.device_put(bits.view(np.float32), x.sharding)


def _flip_a_bit(step_dir, array) -> None:
  """One bit of `array`'s first shard, flipped where the step's array files hold it."""
  shard = np.asarray(array.addressable_shards[0].data).tobytes()
  window = shard[len(shard) // 2 : len(shard) // 2 + 16]
  f = next(f for f in step_dir.rglob('d/*') if window in f.read_bytes())
  raw = bytearray(f.read_bytes())
  raw[raw.index(window) + 5] ^= 0x10
  f.write_bytes(bytes(raw))


@pytest.fixture(scope='module')
def noisy(tmp_path_factory):
  """A run's checkpoints 1 and 2 (tiny fsdp_tp model, params of random bits) and a params-only one
  (weights.save_weights, what a merged LoRA export writes), and the parameters they hold."""
  d = tmp_path_factory.mktemp('noisy')
  trainer = build_trainer(tiny_config('fsdp_tp'))
  state = state_tree(training.init_state(trainer))
  rng = np.random.default_rng(0)
  state['params'] = jax.tree.map(lambda x: _noise(x, rng), state['params'])
  with checkpointer.Checkpointer(str(d / 'run'), every_steps=1, keep=3) as ckpt:
    for step in (1, 2):
      ckpt.save(step, state, _Iter())
      ckpt.wait()
  weights.save_weights(str(d / 'export'), {'params': state['params']})
  return d, state['params']


def _load_for_decoding(directory, params_only):
  import generation
  import partitioning

  cfg = tiny_config('fsdp_tp')
  if params_only:
    cfg.init_from = str(directory)
    return generation.load(cfg, partitioning.make_mesh(cfg.mesh))
  return generation.load(cfg, partitioning.make_mesh(cfg.mesh), checkpoints=str(directory))


def _init_from(directory, params_only):
  from training import pretrained

  cfg = tiny_config('fsdp_tp')
  cfg.init_from = str(directory)
  return pretrained.init_state(build_trainer(cfg), models.HF_FAMILIES)


def _export(directory, params_only):
  from training import export

  return export.export_hf(
    build_trainer(tiny_config('fsdp_tp')), str(directory), str(directory) + '-hf', models.HF_FAMILIES
  )


@pytest.mark.parametrize(
  'load,params_only',
  [(_init_from, False), (_init_from, True), (_load_for_decoding, False), (_load_for_decoding, True), (_export, False)],
  ids=['init_from a run', 'init_from params only', 'decode a run', 'decode params only', 'export a run'],
)
def test_every_weight_load_refuses_a_flipped_bit_naming_the_step_the_array_and_an_older_step(
  noisy, tmp_path, load, params_only
):
  """One bit flipped in the file of one array of the newest step: every load of a run's weights (a fine-tune's
  init_from, decoding, export) and of a params-only checkpoint checks the checksums saved with it, as a resume
  does, and refuses in one line (before, init_from and the others loaded the changed array silently)."""
  d, params = noisy
  src = d / ('export' if params_only else 'run')
  shutil.copytree(src, tmp_path / 'c')
  step = 0 if params_only else 2
  _flip_a_bit(tmp_path / 'c' / str(step), params['tok']['embed']['embedding'])
  fix = (
    f'load an older step instead: step 1 ({tmp_path}/c/1)' if step else f'no older step to load instead in {tmp_path}/c'
  )
  with pytest.raises(DamagedCheckpointError) as info:
    load(tmp_path / 'c', params_only)
  assert str(info.value) == (
    f'checkpoint {tmp_path}/c/{step} is corrupt: the checksums of 1 of the {len(jax.tree.leaves(params))} arrays '
    f'read differ from those saved with it (params/tok/embed/embedding); {fix}'
  )


def test_weights_of_checkpoints_saved_without_their_checksums_paths_are_checked_in_jax_order(noisy, tmp_path):
  """Checksums saved before their paths were (the last round's checkpoints) are matched to the arrays by the order
  JAX saved them in, rebuilt from orbax's metadata, where a layer index 10 sorts after 9."""
  d, params = noisy
  shutil.copytree(d / 'run', tmp_path / 'c')
  sums = tmp_path / 'c' / '2' / 'checksums' / '_METADATA'
  md = json.loads(sums.read_text())
  md['custom_metadata'] = None
  sums.write_text(json.dumps(md))
  target = build_trainer(tiny_config('fsdp_tp')).checkpoint_target()['params']
  _assert_equal(weights.load_params(str(tmp_path / 'c'), target), jax.device_get(params))
  _flip_a_bit(tmp_path / 'c' / '2', params['blocks']['layers'][1]['mlp']['up']['layer']['kernel'])
  with pytest.raises(DamagedCheckpointError, match=r'\(params/blocks/layers/1/mlp/up/layer/kernel\); load an older'):
    weights.load_params(str(tmp_path / 'c'), target)
  layers = {str(i): {'w': jax.ShapeDtypeStruct((1,), np.float32)} for i in range(12)}
  assert integrity.saved_order({'params': {'layers': layers, 'embed': layers['0']}, 'opt': [layers['1']]}) == [
    'opt/0/w',
    'params/embed/w',
    *[f'params/layers/{i}/w' for i in range(12)],
  ]
