"""Two real processes (4 simulated CPU devices each) assemble the same global batches as one process,
including packed eval, where the processes' rows run out at different batches."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests import children
from tests.conftest import ROOT, subprocess_env
from tests.test_multiprocess import _free_port

# Shared by the workers and this process (the workers must not import the tests package: its conftest
# asks for 8 devices).
BATCHES = r'''
import jax, ml_collections
import data, partitioning
from configs import schema

def global_batches():
  """Three train batches and the whole packed eval split, as global arrays on a data=8 mesh."""
  # Packed eval: rows 0-3 (process 0) fill 3 batches, rows 4-7 (process 1) only 2.
  cfg = schema.complete(ml_collections.ConfigDict(dict(task='lm', dataset=dict(name='markov_text', seq_len=16,
                                                                               num_train=512, num_eval=20, pack=True))))
  ds = data.build(cfg)
  s = jax.sharding.NamedSharding(partitioning.make_mesh({'data': 8}), jax.P('data'))
  rows = data.local_rows(s, (8, 16))
  shardings = {k: s for k in ds.example_spec()}
  it = iter(ds.train_dataset(8, rows, 0))
  train = [data.to_global(next(it), shardings, 8) for _ in range(3)]
  it.close()
  return train, [data.to_global(b, shardings, 8) for b in ds.eval_batches(8, rows)]
'''
WORKER = r"""
import json, sys
import jax
from jax.experimental import multihost_utils
import partitioning
partitioning.simulate_cpu_devices(4)
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
exec(sys.argv[3])
train, evals = global_batches()
gather = lambda x: multihost_utils.process_allgather(x, tiled=True)
out = {'train': [{k: gather(v).tolist() for k, v in b.items()} for b in train],
       'eval_sums': [float(gather(b['mask']).sum()) for b in evals]}
print('RESULT ' + json.dumps(out), flush=True)
multihost_utils.sync_global_devices('end')
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_two_processes_assemble_the_batches_of_one():
  port = _free_port()
  procs = [
    children.Popen(
      [sys.executable, '-c', WORKER, f'127.0.0.1:{port}', str(i), BATCHES],
      cwd=ROOT,
      env={**subprocess_env(2), 'PYTHONPATH': ROOT},
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(next(line for line in o.splitlines() if line.startswith('RESULT '))[7:]) for o, _ in outs]
  assert results[0] == results[1]
  namespace = {}
  exec(BATCHES, namespace)
  train, evals = namespace['global_batches']()  # this process: 8 devices
  for got, want in zip(results[0]['train'], train):
    for k in want:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
  assert len(results[0]['eval_sums']) == 3
  assert results[0]['eval_sums'] == [float(np.asarray(b['mask']).sum()) for b in evals]
