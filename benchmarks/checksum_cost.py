"""The cost of checkpoint checksums (checkpointing/integrity.py): a train state of --mib MiB (float32 arrays, FSDP
over 8 simulated CPU devices) saved and restored by a Checkpointer; the checksums' own time on the devices, and the time
save() blocks for and a full restore takes, with and without them.

  PYTHONPATH=. python benchmarks/checksum_cost.py --mib 256
"""

import argparse
import os
import shutil
import tempfile
import time

import jax

jax.config.update('jax_num_cpu_devices', 8)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from checkpointing import checkpointer, integrity  # noqa: E402, F401  (checkpointer: its array handler)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--mib', type=int, default=256)
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  mesh = jax.make_mesh((8,), ('fsdp',), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.NamedSharding(mesh, jax.P('fsdp'))
  rows = args.mib * 2**20 // 4 // 1024 // 16  # 16 arrays of [rows, 1024] float32
  tree = {
    f'w{i}': jax.device_put(np.random.default_rng(i).standard_normal((rows, 1024), np.float32), sharding)
    for i in range(16)
  }
  gib = sum(x.size * 4 for x in tree.values()) / 2**30
  integrity.checksums(tree).block_until_ready()  # compiled once
  t = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    integrity.checksums(tree).block_until_ready()
    t.append(time.perf_counter() - t0)
  print(
    f'state {gib * 1024:.0f} MiB; checksums on the devices: {min(t):.3f} s (median {np.median(t):.3f} s) = '
    f'{min(t) / gib:.3f} s/GiB'
  )
  d = tempfile.mkdtemp()
  for label, save in (('with checksums', ocp.args.StandardSave), ('orbax alone', None)):
    blocked, total, restored = [], [], []
    for r in range(3):
      path = os.path.join(d, f'{label}{r}'.replace(' ', '_'))
      with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=True)) as mngr:
        t0 = time.perf_counter()
        items = {'state': ocp.args.StandardSave(tree)}
        if save:
          items['checksums'] = save({'sums': integrity.checksums(tree)})
        mngr.save(1, args=ocp.args.Composite(**items))
        blocked.append(time.perf_counter() - t0)
        mngr.wait_until_finished()
        total.append(time.perf_counter() - t0)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        t0 = time.perf_counter()
        out = mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))['state']
        if save:
          np.asarray(integrity.checksums(out))
        else:
          jax.block_until_ready(out)
        restored.append(time.perf_counter() - t0)
      shutil.rmtree(path)
    print(
      f'{label}: save blocks {min(blocked):.3f} s, save complete {min(total):.3f} s, restore (+ verify) '
      f'{min(restored):.3f} s'
    )
  shutil.rmtree(d)


if __name__ == '__main__':
  main()
