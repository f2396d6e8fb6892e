"""Faults: a non-finite loss or gradient never reaches the parameters; the run stops naming the step and the
parameter ('stop', the default) or skips and counts ('skip'); no checkpoint is written after a bad step. Disk
trouble (a workdir that is not writable, a disk that fills up mid-save) stops the run with one error naming
the directory and the OS error, and the checkpoints before it stay intact."""

import asyncio
import contextlib
import dataclasses
import errno
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from orbax.checkpoint._src.serialization import serialization

import data
import errors
import partitioning
import train
import training
from checkpointing import checkpointer, deadlines, storage, weights
from configs import default, schema
from tests.conftest import (
  BACKEND_COMPILE,
  ROOT,
  TINY_FLAGS,
  TINY_RUN,
  build_trainer,
  recorded_compile_events,
  tiny_config,
)


def _finite(tree) -> bool:
  return all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(jax.device_get(tree)))


def _assert_unchanged(before, after):
  for a, b in zip(
    jax.tree.leaves((before.params, before.opt_state, before.model_state)),
    jax.tree.leaves((after.params, after.opt_state, after.model_state)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)


def test_a_nan_batch_changes_nothing_and_names_the_first_bad_parameter():
  from configs import resnet

  cfg = resnet.get_config('dp,tiny')  # BatchNorm: its running averages must not take the NaNs either
  cfg.model.update(stage_sizes=(1,), width=4)
  cfg.update(batch_size=8)
  cfg.optim.warmup_steps = 0  # the first step already moves the weights
  trainer = build_trainer(cfg)
  step = training.compile_step(trainer, training.jit_train_step(trainer))
  batch = training.tasks.get('classification').synthetic_batch(cfg, seed=0)
  state = training.init_state(trainer)
  before = jax.device_get(state)
  state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
  assert float(metrics['nonfinite']) == 0 and int(metrics[training.FIRST_NONFINITE]) == -1
  good = jax.device_get(state)
  assert not np.array_equal(good.params['head']['layer']['kernel'], before.params['head']['layer']['kernel'])
  batch['image'][3, 5, 5, 0] = np.nan
  state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
  after = jax.device_get(state)
  _assert_unchanged(good, after)  # Adam's count included: the bad step is not counted as a step of Adam
  assert float(metrics['nonfinite']) == 1 and int(after.step) == 2

  def loss(params):  # the poisoned batch's gradients, computed apart: the first non-finite one in path order
    return trainer.task.loss(nnx.merge(trainer.graphdef, params, jax.tree.map(jnp.asarray, good.model_state)), batch)[0]

  grads = jax.grad(loss)(jax.tree.map(jnp.asarray, good.params))
  bad = [partitioning.path_str(p) for p, g in jax.tree_util.tree_leaves_with_path(grads) if not np.isfinite(g).all()]
  assert bad and trainer.trained_paths()[int(metrics[training.FIRST_NONFINITE])] == bad[0]
  # The schedule runs on applied updates: the skipped step and the next good one both take the rate of update 1.
  skipped_lr = float(metrics['lr'])
  batch['image'][3, 5, 5, 0] = 0.0
  state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
  assert skipped_lr == float(metrics['lr']) == float(trainer.schedule(1)) != float(trainer.schedule(2))
  # The check reads no gradient again: finiteness comes from the norm's sums of squares (one flag per leaf).
  text = training.trace(trainer, training.jit_train_step(trainer)).lower().as_text()
  checked = re.findall(r'stablehlo.is_finite %\S+ : \(tensor<([^>]*)>', text)
  leaves, rows = len(trainer.trained_paths()), cfg.batch_size  # rows: logsumexp's check of its row maxima
  assert f'{leaves}xf32' in checked and set(checked) <= {'f32', f'{leaves}xf32', f'{rows}xf32'}, checked


class _NanLoss:
  """A task whose loss is NaN while its gradients stay finite (the NaN reaches the loss through a
  stop_gradient term only), e.g. a diverging auxiliary term that is logged but not trained."""

  def __init__(self, task):
    self.task = task

  def __getattr__(self, name):
    return getattr(self.task, name)

  def metric_sums(self, model, batch):  # what the train step differentiates
    sums = self.task.metric_sums(model, batch)
    return {**sums, 'loss_sum': sums['loss_sum'] + jax.lax.stop_gradient(jnp.float32(jnp.nan))}


def test_a_nan_loss_with_finite_gradients_changes_nothing():
  # The loss counts as much as the gradients: optax.apply_if_finite (gradients only) applied this update
  # while the step reported it skipped.
  cfg = tiny_config('dp')
  cfg.model.num_layers = 1
  cfg.optim.warmup_steps = 0  # the first step already moves the weights
  trainer = build_trainer(cfg)
  trainer = dataclasses.replace(trainer, task=_NanLoss(trainer.task))
  step = training.compile_step(trainer, training.jit_train_step(trainer))
  state = training.init_state(trainer)
  before = jax.device_get(state)
  batch = trainer.task.synthetic_batch(cfg, seed=0)
  state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
  assert np.isnan(metrics['loss']) and np.isfinite(metrics['grad_norm']) and float(metrics['grad_norm']) > 0
  assert float(metrics['nonfinite']) == 1 and int(metrics[training.FIRST_NONFINITE]) == -1
  after = jax.device_get(state)
  _assert_unchanged(before, after)
  assert int(after.step) == 1


def test_absurd_learning_rate_stops_at_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  cfg = tiny_config('dp', total_steps=12, log_every=2, eval_every=100, checkpoint_every=2)
  cfg.optim.update(lr=1e30, warmup_steps=4, grad_clip=0.0)
  with pytest.raises(errors.NonFiniteError) as info:
    train.train_and_evaluate(cfg, str(tmp_path))
  msg = str(info.value)
  m = re.fullmatch(
    r"step (\d+): non-finite gradient of '([\w/]+)', loss (nan|inf); the update was skipped and the "
    r"run stopped \(config.on_nonfinite='stop'; 'skip' skips such steps\); last good checkpoint: "
    r'(.*)/(\d+)',
    msg,
  )
  assert m, msg
  bad, good = int(m.group(1)), int(m.group(5))
  assert good < bad and m.group(4) == str(tmp_path / 'checkpoints')
  steps = sorted(int(d) for d in os.listdir(m.group(4)) if d.isdigit())
  assert steps[-1] == good  # nothing written after the bad step
  assert _finite(weights.load_params(m.group(4), build_trainer(cfg).checkpoint_target()['params']))


def test_skip_goes_on_past_a_poisoned_batch_and_stops_after_k_in_a_row(monkeypatch):
  from configs import mnist

  cfg = mnist.get_config('dp,tiny')
  cfg.update(total_steps=6, log_every=3, eval_every=6, checkpoint_every=0, on_nonfinite='skip', max_nonfinite_skips=2)
  to_global, poisoned = data.to_global, {3}

  def poison(local, shardings, batch_size):
    poison.step += 1
    if poison.step in poisoned:
      local = dict(local, image=np.full_like(local['image'], np.nan))
    return to_global(local, shardings, batch_size)

  poison.step = 0
  monkeypatch.setattr(data, 'to_global', poison)
  result = train.train_and_evaluate(cfg, None)
  assert result['nonfinite_skipped'] == [3]
  assert _finite(result['state'].params) and np.isfinite(result['train']['loss'])

  poison.step, poisoned = 0, {2, 4, 5}  # two in a row at 4-5: stop, naming the second
  with pytest.raises(
    errors.NonFiniteError,
    match=r"^step 5: non-finite gradient of '[\w/]+', loss \S+; .*\(2 "
    r'non-finite steps in a row \(config.max_nonfinite_skips=2\)\); '
    r'last good checkpoint: none$',
  ):
    train.train_and_evaluate(cfg, None)


def test_bad_policy_is_a_config_error():
  trainer = build_trainer(tiny_config('dp'))
  with pytest.raises(errors.ConfigError, match=r"config.on_nonfinite='ignore': choose 'stop' or 'skip'"):
    training.NonFiniteGuard(trainer, 'ignore', 3)
  with pytest.raises(errors.ConfigError, match=r'config.max_nonfinite_skips=0: must be >= 1'):
    training.NonFiniteGuard(trainer, 'skip', 0)


def test_a_workdir_that_is_not_writable_stops_the_run_before_compiling(tmp_path):
  (tmp_path / 'file').write_text('')  # a workdir under a file (as root, permission bits would not stop us)
  workdir = tmp_path / 'file' / 'run'
  with recorded_compile_events() as compiles, pytest.raises(errors.StorageError) as info:
    train.train_and_evaluate(tiny_config('dp', checkpoint_every=2), str(workdir))
  assert str(info.value) == f'workdir {workdir} is not writable: Not a directory [ENOTDIR, errno 20] ({workdir})'
  assert BACKEND_COMPILE not in compiles


def _disk_full_at(step: int):
  """orbax's array write, failing for `step`'s checkpoint the way TensorStore fails on a full disk (its message
  as seen on a full 2 MiB tmpfs). It runs in orbax's background thread, after save() has returned."""
  write = serialization.async_serialize_from_host

  async def write_or_fail(rslices, spec, **kwargs):
    d, key = spec['kvstore']['base']['path'], spec['kvstore']['path']
    if f'/{step}.orbax-checkpoint-tmp/' in d:
      raise ValueError(
        f'RESOURCE_EXHAUSTED: Error writing "{key}/0" in OCDBT database at local file "{d}": Failed '
        f'writing: "{d}d/504f78fd3b40efc7": Failed to write 28775 bytes to file 4: No space left on '
        "device [os_error_code='28']"
      )
    return await write(rslices, spec, **kwargs)

  return write_or_fail


def test_a_disk_that_fills_up_mid_save_stops_the_run_and_the_rerun_resumes(tmp_path, monkeypatch, capfd):
  cfg = default.get_config()  # test_soak's run: the compilations are shared
  cfg.update_from_flattened_dict(TINY_RUN)  # checkpoints at steps 1, 4, 8 and 12
  workdir, ckpts = str(tmp_path), str(tmp_path / 'checkpoints')
  monkeypatch.setattr(serialization, 'async_serialize_from_host', _disk_full_at(8))
  capfd.readouterr()
  with pytest.raises(errors.StorageError) as info:  # found by the step after the failure, before step 12's save
    train.train_and_evaluate(cfg, workdir)
  assert re.fullmatch(
    rf'checkpoint {ckpts}/8 could not be written: No space left on device \[ENOSPC, errno 28\] \({ckpts}/8\.'
    rf'orbax-checkpoint-tmp/\S+\); the partial checkpoint was removed; the last good checkpoint is {ckpts}/4 and a '
    r'rerun resumes from it \(the disk is full, [\d.]+ MiB free of [\d.]+ MiB there: free space or choose another '
    rf"--workdir\); orbax's tracebacks are in {workdir}/orbax_errors.log",
    str(info.value),
  ), str(info.value)
  assert sorted(os.listdir(ckpts)) == ['1', '4']  # nothing deleted, nothing half-done left
  out, err = capfd.readouterr()
  assert 'Traceback' not in err and 'never retrieved' not in err  # orbax's went to the log file
  # The failure surfaces by the next save's wait at the latest (under load the loop may print step 12 first); the
  # listing above shows nothing was saved after it.
  assert 'step     8 |' in out
  assert not [f for f in os.listdir(workdir) if f.endswith('.writing')]
  with open(os.path.join(workdir, 'orbax_errors.log')) as f:  # whole: written aside, then renamed into place
    log = f.read()
  assert 'No space left on device' in log and log.endswith('\n')
  monkeypatch.undo()  # space freed: the same command resumes from step 4
  out = train.train_and_evaluate(cfg, workdir)
  assert int(out['state'].step) == 12 and 'preempted_at' not in out
  assert sorted(os.listdir(ckpts)) == ['12', '8']


def test_a_partial_checkpoint_its_writers_still_fill_is_removed(tmp_path, monkeypatch):
  """The failed save's other writer threads may still be writing while its partial checkpoint is removed: a file one
  of them adds to a directory rmtree has just emptied (ENOTEMPTY on its removal) is removed in the next round, not
  reported as a partial checkpoint that cannot be removed (a 2-core CI run met it); a directory that refuses
  removal for good is still reported."""
  ckpt = checkpointer.Checkpointer.__new__(checkpointer.Checkpointer)  # only its directory is needed
  ckpt.directory = str(tmp_path)
  (tmp_path / '8.orbax-checkpoint-tmp' / 'state' / 'd').mkdir(parents=True)
  (tmp_path / '8.orbax-checkpoint-tmp' / 'state' / 'd' / 'chunk').write_bytes(b'x')
  rmdir, late = os.rmdir, []

  def rmdir_while_written(path, *, dir_fd=None):
    if not late:  # a writer's file, just before the first directory goes
      late.append(os.path.join(path, 'late'))
      os.close(os.open(late[0], os.O_CREAT | os.O_WRONLY, dir_fd=dir_fd))
    return rmdir(path, dir_fd=dir_fd)

  monkeypatch.setattr(os, 'rmdir', rmdir_while_written)
  assert ckpt._remove_partial(8, settle_s=0.01) == 'the partial checkpoint was removed'
  assert late and os.listdir(tmp_path) == []

  def refused(path, *, dir_fd=None):
    raise PermissionError(errno.EACCES, 'Permission denied', path)

  (tmp_path / '4.orbax-checkpoint-tmp').mkdir()
  monkeypatch.setattr(os, 'rmdir', refused)
  assert ckpt._remove_partial(4, settle_s=0.01) == (
    f'the partial checkpoint {tmp_path}/4.orbax-checkpoint-tmp is left on disk (it cannot be removed: Permission '
    'denied [EACCES, errno 13]; no run takes it for a checkpoint, and the next that can write there removes it)'
  )


def test_too_little_space_for_the_checkpoints_is_refused_before_training_or_a_warning(tmp_path):
  """keep_checkpoints + 1 checkpoints (less those already written) must fit in the free space: one line naming
  both figures, before anything compiles ('refuse'), or the same as a warning ('warn')."""
  cfg = default.get_config()
  cfg.update_from_flattened_dict(TINY_RUN)
  nbytes = storage.state_bytes(build_trainer(cfg).abstract)
  assert nbytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(training.init_state(build_trainer(cfg))))
  free = shutil.disk_usage(tmp_path).free
  huge = free // 2  # 3 of them do not fit; 1 does
  msg = (
    rf'checkpoint directory {tmp_path} has [\d.]+ MiB free, but the run needs {3 * huge / 2**20:.1f} MiB there: 3 '
    rf'checkpoint\(s\) of {huge / 2**20:.1f} MiB \(config.keep_checkpoints=2, plus the one being written\)'
  )
  with pytest.raises(errors.StorageError, match=f'^{msg}: free space, choose another --workdir or lower'):
    storage.check_space(str(tmp_path), huge, 2)
  assert re.fullmatch(
    f"{msg}; training anyway \\(config.checkpoint_space='warn'\\)",
    storage.check_space(str(tmp_path), huge, 2, 'warn'),
  )
  for step in (4, 8):  # two kept already: one more is needed
    (tmp_path / str(step)).mkdir()
  assert storage.check_space(str(tmp_path), huge, 2) is None


def test_a_full_filesystem_stops_the_first_save_in_one_line_and_the_rerun_resumes_bitwise(tmp_path, capfd):
  """A real full disk: a 4 MiB tmpfs (mounted here when the tests run as root) whose space is taken but for less
  than one checkpoint. The run stops at the first save with one line, the partial checkpoint removed; with space
  freed, the same command ends bitwise where an uninterrupted run ends."""
  cfg = default.get_config()
  cfg.update_from_flattened_dict({**TINY_RUN, 'checkpoint_space': 'warn'})
  mount = tmp_path / 'small'
  mount.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=4m', 'tmpfs', str(mount)], capture_output=True).returncode:
    pytest.skip('cannot mount a tmpfs here (not root): the full disk is injected in the test above')
  try:
    ballast = mount / 'ballast'
    ballast.write_bytes(b'0' * (shutil.disk_usage(mount).free - 256 * 1024))
    workdir, ckpts = mount / 'run', mount / 'run' / 'checkpoints'
    capfd.readouterr()
    with pytest.raises(errors.StorageError) as info:
      train.train_and_evaluate(cfg, str(workdir))
    assert re.fullmatch(
      rf'checkpoint {ckpts}/1 could not be written: No space left on device \[ENOSPC, errno 28\] .*; the partial '
      r'checkpoint was removed; no checkpoint of this run is on disk \(the disk is full, [\d.]+ MiB free of 4.0 MiB '
      rf"there: free space or choose another --workdir\)(; orbax's tracebacks are in {workdir}/orbax_errors.log)?",
      str(info.value),
    ), str(info.value)
    assert os.listdir(ckpts) == [] and 'Traceback' not in capfd.readouterr().err
    ballast.unlink()
    resumed = train.train_and_evaluate(cfg, str(workdir))['state']
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)
  full = train.train_and_evaluate(cfg, str(tmp_path / 'full'))['state']
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(full))


ZSTD_MAGIC = bytes.fromhex('28b52ffd')


def stored_blocks(data: bytes, least: int = 256) -> list[tuple[int, int]]:
  """(start, size) of each block of at least `least` bytes that a zstd frame in `data` stores as it is (a raw block,
  where compressing did not pay), in a frame without a content checksum: bytes flipped there decompress without an
  error. Elsewhere (a frame's header, a compressed block) zstd may fail the read itself."""
  found, at = [], data.find(ZSTD_MAGIC)
  while at >= 0:
    descriptor = data[at + 4]
    single, dict_id, fcs = descriptor >> 5 & 1, descriptor & 3, descriptor >> 6
    pos = at + 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_id] + ((1 if single else 0), 2, 4, 8)[fcs]
    while pos + 3 <= len(data) and not descriptor & 4:  # bit 2: a content checksum would catch the flip
      header = int.from_bytes(data[pos : pos + 3], 'little')
      kind, size = header >> 1 & 3, header >> 3
      if kind == 0 and size >= least:
        found.append((pos + 3, size))
      pos += 3 + (1 if kind == 1 else size)
      if header & 1:  # the frame's last block
        break
    at = data.find(ZSTD_MAGIC, at + 4)
  return found


def test_a_flipped_byte_fails_the_checksum_and_the_rerun_resumes_bitwise(tmp_path, capsys):
  """64 bytes flipped inside an array's stored bytes in the newest checkpoint read back without a read error; the
  checksums saved with it differ, so it is damage: moved aside, the one before resumed, and the run ends bitwise
  where the uninterrupted run ended (before, the corrupted step was resumed and trained on).

  Where to flip: most frames of the arrays' files are compressed, and bytes flipped in the middle of the largest
  file (as this test first did) sometimes made zstd fail the read, the read-error path tested elsewhere. A stored
  block decompresses as flipped; but a stored block may also hold bytes the restore never reads (one near the end
  of the largest file did: the step restored whole). Each stored block is tried in turn until the checksums catch
  one; a flip that no read sees leaves the restore's state as it was, which is checked too."""
  cfg = default.get_config()
  cfg.update_from_flattened_dict(TINY_RUN)
  workdir, ckpts = str(tmp_path), tmp_path / 'checkpoints'
  full = jax.device_get(train.train_and_evaluate(cfg, workdir)['state'])
  files = sorted((ckpts / '12' / 'state').rglob('ocdbt.process_0/d/*'), key=lambda f: -f.stat().st_size)
  out = ''
  for f, (start, size) in ((file, block) for file in files for block in stored_blocks(file.read_bytes())):
    kept = f.read_bytes()
    raw = bytearray(kept)
    middle = start + size // 2 - 32
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    f.write_bytes(bytes(raw))
    capsys.readouterr()
    resumed = train.train_and_evaluate(cfg, workdir)['state']
    out = capsys.readouterr().out
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), full)
    if 'WARNING checkpoint' in out:
      break
    f.write_bytes(kept)  # bytes no read sees: the step restored whole; the next block
  assert re.search(
    rf'^WARNING checkpoint: checkpoint {ckpts}/12 is corrupt: the checksums of 1 of \d+ arrays differ from those '
    rf'saved with it \(e.g. [\w/]+\); moved aside to {ckpts}/12.damaged \(not deleted\); resumed from step 8$',
    out,
    re.M,
  ), out
  assert sorted(os.listdir(ckpts)) == ['12', '12.damaged', '8']


def _checkpoint_params(directory: str, cfg) -> dict:
  return jax.device_get(weights.load_params(directory, build_trainer(cfg).checkpoint_target()['params']))


@pytest.mark.slow
def test_damage_one_process_sees_is_agreed_both_ways_and_the_rerun_resumes_bitwise(tmp_path):
  """Two processes, FSDP over both (each writes its own shards under state/ocdbt.process_<i>), checkpoints 2, 4, 6
  and 8: step 8's shards that only process 1 reads truncated, step 6's largest array file (shards only process 0
  reads) truncated, step 4's process_1-of-2.json deleted. Each process alone would have restored another step
  (before the processes agreed, they then waited on each other until a crash, every rerun alike); now both print
  the same three warnings, process 0 moves the three steps aside, and both resume step 2 and end bitwise where the
  uninterrupted run ended."""
  from tests.test_multiprocess import _losses, _start

  mesh = ['--config.mesh.data=1', '--config.mesh.fsdp=8', '--config.mesh.tensor=1']
  run = [
    '--config.total_steps=8',
    '--config.eval_every=8',
    '--config.checkpoint_every=2',
    '--config.keep_checkpoints=4',
  ]
  full, d = tmp_path / 'full', tmp_path / 'damaged'
  procs = _start([*run, *mesh, '--config.log_every=2', '--workdir', str(full)], 2)
  outs = [p.communicate(timeout=400) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
  expected = _losses(outs[0][0])  # steps 2, 4, 6, 8 and the eval at 8
  shutil.copytree(full, d)
  ckpts = d / 'checkpoints'
  for f in (ckpts / '8/state/ocdbt.process_1/d').iterdir():
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  f = max((ckpts / '6/state/ocdbt.process_0/d').iterdir(), key=lambda f: f.stat().st_size)
  f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  (ckpts / '4/data/process_1-of-2.json').unlink()
  t0 = time.monotonic()
  procs = _start([*run, *mesh, '--config.log_every=2', '--workdir', str(d)], 2)
  outs = [p.communicate(timeout=400) for p in procs]
  took = time.monotonic() - t0
  assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
  # the same warnings on every process: printed by process 0, logged by the others
  printed = [re.findall(r'WARNING checkpoint: (.*)', outs[0][0]), re.findall(r'\] checkpoint: (.*)', outs[1][1])]
  assert printed[0] == printed[1], printed
  assert len(printed[0]) == 3, printed[0]
  for step, line in zip((8, 6), printed[0]):
    assert re.fullmatch(
      rf'checkpoint {ckpts}/{step} could not be restored: OUT_OF_RANGE: Error reading .* \(seen by process '
      rf'{1 if step == 8 else 0} of 2\); moved aside to {ckpts}/{step}.damaged \(not deleted\); resumed from step 2',
      line,
    ), line
  assert printed[0][2] == (
    f'checkpoint {ckpts}/4 is missing or corrupt: the data position in {ckpts}/4/data is incomplete: '
    f'process_1-of-2.json missing; moved aside to {ckpts}/4.damaged (not deleted); resumed from step 2'
  )
  assert f'resumed from {ckpts}/2' in outs[0][0] and _losses(outs[0][0]) == expected[1:]
  assert sorted(os.listdir(ckpts)) == ['2', '4', '4.damaged', '6', '6.damaged', '8', '8.damaged']
  cfg = default.get_config()
  cfg.update_from_flattened_dict(TINY_FLAGS)
  cfg.mesh.update(data=1, fsdp=8, tensor=1)
  jax.tree.map(
    np.testing.assert_array_equal,
    _checkpoint_params(str(ckpts), cfg),
    _checkpoint_params(str(full / 'checkpoints'), cfg),
  )
  print(f'the damaged run resumed and finished in {took:.0f} s')


def test_event_files_on_a_full_filesystem_stop_the_run_in_one_line(tmp_path, capfd):
  """TensorBoard's event files (clu's writer) on a full disk: one StorageError naming the workdir, the cause and the
  last good checkpoint (none here: checkpoints off), and no traceback on the terminal."""
  cfg = tiny_config('dp', total_steps=40, log_every=1, eval_every=40, checkpoint_every=0)
  mount = tmp_path / 'small'
  mount.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mount)], capture_output=True).returncode:
    pytest.skip('cannot mount a tmpfs here (not root)')
  try:
    (mount / 'ballast').write_bytes(b'0' * (shutil.disk_usage(mount).free - 12 * 1024))
    capfd.readouterr()
    with pytest.raises(errors.StorageError) as info:
      train.train_and_evaluate(cfg, str(mount / 'run'))
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)
  assert re.fullmatch(
    rf'the event files in {mount}/run could not be written: No space left on device \[ENOSPC, errno 28\]; the last '
    r'good checkpoint is none \(the disk is full, [\d.]+ MiB free of 1.0 MiB there: free space or choose another '
    r'--workdir\)',
    str(info.value),
  ), str(info.value)


# --- Storage faults during a save: one true line, within seconds, no hang ---------------------------------------
# Real faults where the tests may mount (root): a bind mount remounted read-only, a tmpfs filled. benchmarks/
# storage_faults.py tries each 20 times in train.py processes (docs/checkpoint_faults.md); here a few in process.


def _tiny_run(**overrides):
  cfg = default.get_config()  # test_soak's run: the compilations are shared
  cfg.update_from_flattened_dict({**TINY_RUN, **overrides})  # checkpoints at steps 1, 4, 8 and 12
  return cfg


def _mount(*args) -> bool:
  return subprocess.run(['mount', *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def _bind(path):
  """`path` bind-mounted onto itself (a mount of its own, which can be remounted read-only), or a skip."""
  path.mkdir(parents=True, exist_ok=True)
  if not _mount('--bind', str(path), str(path)):
    pytest.skip('cannot mount here (not root): the injected faults below cover the lines')
  try:
    yield path
  finally:
    subprocess.run(['umount', '-l', str(path)], check=False)


def _read_only(path) -> None:
  """Remounts a bind mount read-only, retried while orbax has files open for writing on it (EBUSY)."""
  deadline = time.monotonic() + 2
  while not _mount('-o', 'remount,bind,ro', str(path)) and time.monotonic() < deadline:
    time.sleep(0.002)


def _at_save(monkeypatch, step, fire):
  """Calls fire() as orbax's save of `step` starts (in the Checkpointer's save thread); returns when it did."""
  save, fired = ocp.CheckpointManager.save, []

  def hooked(self, s, *args, **kwargs):
    if s == step:
      fired.append(time.monotonic())
      fire()
    return save(self, s, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'save', hooked)
  return fired


def _on_disk_as_said(line: str, ckpts) -> None:
  """What the storage line says about the checkpoint directory holds there."""
  steps = sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())
  partials = [str(ckpts / d) for d in os.listdir(ckpts) if '.orbax-checkpoint-tmp' in d]
  good = re.search(rf'the last good checkpoint is {ckpts}/(\d+) and a rerun resumes from it', line)
  assert good and int(good.group(1)) == steps[-1], (line, steps)
  if m := re.search(r'the partial checkpoint (\S+) is left on disk', line):
    assert partials == [m.group(1)], (line, partials)
  else:
    assert re.search('the partial checkpoint was removed|nothing of it was written|could not be deleted', line)
    assert partials == [], (line, partials)


def test_a_checkpoint_directory_made_read_only_mid_save_ends_in_one_true_line(tmp_path, monkeypatch, capfd):
  """The checkpoint directory remounted read-only during step 8's save (before, 1 try in 4 waited 20 minutes for
  orbax's timeout): one line, within seconds, naming the operation, what is left on disk (checked), the last good
  checkpoint and the remount, with nothing on the terminal; the rerun, writable again, resumes from it. One moment
  here; benchmarks/storage_faults.py tries 20 at random moments."""
  cfg = _tiny_run()
  for i, delay in enumerate((0.02,)):
    workdir = tmp_path / str(i)
    with _bind(workdir / 'checkpoints') as ckpts:
      fired = _at_save(monkeypatch, 8, lambda d=delay, c=ckpts: threading.Timer(d, _read_only, (c,)).start())
      capfd.readouterr()
      with pytest.raises(errors.StorageError) as info:
        train.train_and_evaluate(cfg, str(workdir))
      took = time.monotonic() - fired[0]
      line, err = str(info.value), capfd.readouterr().err
      assert took < 8 and not info.value.blocked, (took, line)
      assert re.fullmatch(
        rf'(checkpoint {ckpts}/8 could not be written|old checkpoint {ckpts}/1 could not be deleted after checkpoint '
        rf'8 was written): Read-only file system \[EROFS, errno 30\].*; the last good checkpoint is {ckpts}/\d+ and a '
        rf'rerun resumes from it \(\S+ is on a filesystem mounted read-only: remount it read-write or choose another '
        rf"--workdir\)(; orbax's tracebacks are in {workdir}/orbax_errors.log)?",
        line,
      ), line
      assert 'MiB' not in line and 'Traceback' not in err and 'never retrieved' not in err, err[-2000:]
      _on_disk_as_said(line, ckpts)
    monkeypatch.undo()
  resumed = train.train_and_evaluate(cfg, str(workdir))  # the last one, writable again
  assert int(resumed['state'].step) == 12


def test_an_old_checkpoint_that_cannot_be_deleted_is_named_and_the_new_one_is_the_last_good(tmp_path, monkeypatch):
  """Step 1's directory read-only when step 8's save (keep_checkpoints=2) deletes it: the line names the delete
  and step 1 (still on disk), and step 8 as the last good checkpoint (before: 'checkpoint 8 could not be written',
  naming 8 as the last good one in the same line)."""
  cfg, ckpts = _tiny_run(), tmp_path / 'checkpoints'
  _at_save(monkeypatch, 8, lambda: (_mount('--bind', str(ckpts / '1'), str(ckpts / '1')), _read_only(ckpts / '1')))
  try:
    with pytest.raises(errors.StorageError) as info:
      train.train_and_evaluate(cfg, str(tmp_path))
  finally:
    subprocess.run(['umount', '-l', str(ckpts / '1')], capture_output=True)
  if 'could not be deleted' not in str(info.value) and not os.path.ismount(ckpts / '1'):
    pytest.skip('cannot mount here (not root)')
  line = str(info.value)  # orbax's threads may log the failure after the line is made (then only at exit)
  assert line.removesuffix(f"; orbax's tracebacks are in {tmp_path}/orbax_errors.log") == (
    f'old checkpoint {ckpts}/1 could not be deleted after checkpoint 8 was written: Read-only file system [EROFS, '
    f'errno 30]; it is still on disk; the last good checkpoint is {ckpts}/8 and a rerun resumes from it ({ckpts}/1 '
    f'is on a filesystem mounted read-only: remount it read-write or choose another --workdir)'
  ), line
  assert sorted(os.listdir(ckpts)) == ['1', '4', '8']


@pytest.mark.parametrize('how', ['deadline', 'sigterm'])
def test_a_save_that_never_finishes_stops_at_its_deadline_or_soon_after_sigterm(tmp_path, monkeypatch, how):
  """Step 8's array writes never return (a filesystem that stops answering): the run stops at the save's deadline
  (config.checkpoint_timeout=2), or under a long one STALL_S (2 s here) after SIGTERM finds the save writing nothing,
  in one line naming what blocks; the StorageError is `blocked`, so the entry point exits without waiting for the
  threads."""
  release, write = threading.Event(), serialization.async_serialize_from_host

  async def stuck(rslices, spec, **kwargs):
    while '/8.orbax-checkpoint-tmp/' in spec['kvstore']['base']['path'] and not release.is_set():
      await asyncio.sleep(0.05)
    return await write(rslices, spec, **kwargs)

  monkeypatch.setattr(serialization, 'async_serialize_from_host', stuck)
  monkeypatch.setattr(deadlines, 'STALL_S', 2.0)
  start = deadlines.Deadlines.start

  def only_step_8(self, step, nbytes):  # the earlier saves (the first compiles its checksums) under no deadline
    save = start(self, step, nbytes)
    save.limit_s = save.limit_s if step == 8 else 600.0
    return save

  monkeypatch.setattr(deadlines.Deadlines, 'start', only_step_8)
  term = lambda: os.kill(os.getpid(), signal.SIGTERM)  # as the save starts: the loop takes it at step 9
  fired = _at_save(monkeypatch, 8, term if how == 'sigterm' else lambda: None)
  ckpts = tmp_path / 'checkpoints'
  try:
    with pytest.raises(errors.StorageError) as info:
      train.train_and_evaluate(_tiny_run(checkpoint_timeout=2 if how == 'deadline' else 60), str(tmp_path))
    took = time.monotonic() - fired[0]
    # Listed before the writes are released: released, orbax's thread would write on, where the real process has
    # already exited after its line (errors.one_line, the next test).
    left = sorted(os.listdir(ckpts))
  finally:
    release.set()
  why = (
    r'did not finish within 2 s \(config.checkpoint_timeout=2\)'
    if how == 'deadline'
    else r'wrote nothing for 2 s once the run was stopping \(SIGTERM\), \d+ s in'
  )
  assert re.fullmatch(
    rf'checkpoint {ckpts}/8 could not be written: the save {why}: {ckpts} is writable; orbax waits in .*; the '
    rf'partial checkpoint was removed; the last good checkpoint is {ckpts}/4 and a rerun resumes from it \(set '
    r"config.checkpoint_timeout above the time a save takes here, or choose another --workdir\)(; orbax's tracebacks "
    rf'are in {tmp_path}/orbax_errors.log)?',
    str(info.value),
  ), str(info.value)
  assert info.value.blocked and took < 8, took
  assert left == ['1', '4']


def test_a_blocked_save_ends_the_process_after_its_line_without_waiting_for_its_threads():
  """errors.one_line prints a blocked StorageError's line and exits at once: the interpreter would otherwise wait
  for the save's threads (here one that never ends) before exiting."""
  script = (
    'import threading, errors\n'
    'threading.Thread(target=threading.Event().wait).start()\n'
    'e = errors.StorageError("checkpoint /w/8 could not be written: the save did not finish")\n'
    'e.blocked = True\n'
    'with errors.one_line():\n'
    '  raise e\n'
  )
  r = subprocess.run([sys.executable, '-c', script], cwd=ROOT, capture_output=True, text=True, timeout=30)
  assert (r.returncode, r.stdout, r.stderr) == (
    1,
    '',
    'shardzoo: storage error: checkpoint /w/8 could not be written: the save did not finish\n',
  )


def test_a_run_config_that_cannot_be_written_is_one_line_with_advice_fitting_the_cause(tmp_path):
  """run_config.json on a read-only filesystem: the line names the file, the OS error and a remount (before: free
  space, whatever the cause)."""
  from checkpointing import run_config

  mount = tmp_path / 'ro'
  mount.mkdir()
  if not _mount('-t', 'tmpfs', '-o', 'size=1m,ro', 'tmpfs', str(mount)):
    pytest.skip('cannot mount a tmpfs here (not root)')
  try:
    with pytest.raises(errors.StorageError) as info:
      run_config.save(default.get_config(), str(mount / 'run'))
  finally:
    subprocess.run(['umount', '-l', str(mount)], capture_output=True)
  assert str(info.value) == (
    f'{mount}/run/run_config.json could not be written: Read-only file system [EROFS, errno 30]; the last good '
    f'checkpoint is none ({mount}/run is on a filesystem mounted read-only: remount it read-write or choose another '
    '--workdir)'
  )


def test_failures_nobody_retrieved_go_to_the_error_log_whole_or_the_line_says_it_could_not(tmp_path, caplog):
  """An event loop's future that failed for an OS error and was never awaited is kept for the error log (the
  loop's exception handler), not logged by asyncio; the log is written whole, or flush says why not."""
  log = storage.OrbaxTracebacks(str(tmp_path / 'orbax_errors.log'))
  try:
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(OSError(errno.ENOSPC, 'No space left on device', str(tmp_path / 'x')))
    del future
    gc.collect()
    loop.close()
    assert 'never retrieved' not in caplog.text
    assert log.flush() == (str(tmp_path / 'orbax_errors.log'), None)
    assert (tmp_path / 'orbax_errors.log').read_text().startswith('Future exception was never retrieved\n')
    log.keep('another')
    log.path = str(tmp_path / 'gone' / 'orbax_errors.log')
    assert log.flush() == (None, 'No such file or directory [ENOENT, errno 2]')
  finally:
    log.close()


# --- The Arrow cache of your own files under storage faults -------------------------------------------------------


def _jsonl(path, rows: int) -> str:
  with open(path, 'w') as f:
    for i in range(rows):
      f.write(json.dumps({'text': f'row {i}: ' + 'the quick brown fox jumps over the lazy dog ' * 2}) + '\n')
  return str(path)


@pytest.mark.parametrize('fault', ['full', 'read-only', 'injected'])
def test_an_arrow_cache_that_cannot_be_built_is_one_storage_error_that_leaves_nothing(tmp_path, monkeypatch, fault):
  """JSON Lines whose Arrow cache goes to a full or read-only filesystem (a 256 KiB tmpfs; injected: the build
  failing halfway): one StorageError naming the cache directory, and nothing left there that a later run could take
  for a cache (before: a config error 'cannot be read as json: OSError: ... No space left on device', empty cache
  directories and a 0-byte lock). With space, the same config builds the cache and trains."""
  cache = tmp_path / 'small' / 'cache'
  cfg = tiny_config('dp', total_steps=2, log_every=1, eval_every=2)
  cfg.model.vocab_size = 260  # the byte tokenizer's
  cfg.dataset = ml_collections.ConfigDict(
    dict(
      name='json',
      train_files=_jsonl(tmp_path / 'train.jsonl', 4000),  # ~0.5 MiB of JSON, more as Arrow
      eval_files=_jsonl(tmp_path / 'eval.jsonl', 64),
      tokenizer='byte',
      seq_len=16,
      cache_dir=str(cache),
    )
  )
  cfg = schema.complete(cfg)
  mount = tmp_path / 'small'
  mount.mkdir()
  if fault == 'injected':
    import datasets

    def half_then_full(self, *args, **kwargs):  # a first Arrow file written, then the disk full
      os.makedirs(self.cache_dir + '.incomplete', exist_ok=True)
      with open(os.path.join(self.cache_dir + '.incomplete', 'json-train-00000.arrow'), 'wb') as f:
        f.write(b'\0' * 1000)
      raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(datasets.DatasetBuilder, 'download_and_prepare', half_then_full)
  elif not _mount('-t', 'tmpfs', '-o', 'size=256k' + (',ro' if fault == 'read-only' else ''), 'tmpfs', str(mount)):
    pytest.skip('cannot mount a tmpfs here (not root): the injected fault covers the line')
  try:
    with pytest.raises(errors.StorageError) as info:
      train.train_and_evaluate(cfg, None)
    why, advice = {
      'read-only': ('Read-only file system [EROFS, errno 30]', 'set config.dataset.cache_dir to a writable directory'),
    }.get(
      fault,
      (
        'No space left on device [ENOSPC, errno 28]',
        'free space there or set config.dataset.cache_dir to a directory with space',
      ),
    )
    assert str(info.value) == (
      f'the Arrow cache of {tmp_path}/train.jsonl could not be built in {cache}: {why}; nothing of it is left there '
      f'({advice})'
    )
    assert list(mount.rglob('*')) == []
    monkeypatch.undo()
    if fault != 'injected':
      _mount('-o', 'remount,rw,size=64m', str(mount))
    out = train.train_and_evaluate(cfg, None)  # the rerun, with space
    assert int(out['state'].step) == 2 and len(list(cache.rglob('*.arrow'))) == 2
  finally:
    subprocess.run(['umount', '-l', str(mount)], capture_output=True)
