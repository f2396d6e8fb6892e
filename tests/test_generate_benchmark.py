"""benchmarks/generate.py, smoke-tested so it cannot rot: a 1-layer GPT-2, both sides in one process (--inline,
to spare two interpreter starts), on whatever machine the suite runs (--busy); the table comes out with the bound
beside every figure and the two sides' greedy tokens equal. A child process: the script defines its own flags."""

import sys

import pytest

from tests import children
from tests.conftest import ROOT, subprocess_env


def test_generate_benchmark_smoke():
  cmd = [sys.executable, 'benchmarks/generate.py', '--busy', '--inline', '--probe_mib=16', '--probe_matmul=256']
  cmd += ['--batches=2', '--prompt_len=5', '--new_tokens=3', '--reps=1', '--layers=1', '--hidden=32', '--heads=2']
  r = children.run(cmd + ['--vocab=128'], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'machine: read bandwidth' in r.stdout and 'INLINE (the sides in one process): not figures' in r.stdout
  assert 'decode matmuls: ' in r.stdout
  import torch
  import transformers

  assert f'transformers {transformers.__version__} on torch {torch.__version__}' in r.stdout  # the peer's versions
  rows = [line.split('|')[1:-1] for line in r.stdout.splitlines() if line.startswith('| 2 |')]
  assert len(rows) == 1, r.stdout
  cells = [c.strip() for c in rows[0]]
  assert float(cells[6]) >= 0 and cells[7].endswith('%') and cells[11] == 'True', r.stdout  # bound, of bound, same
  assert all(float(gb) > 0 for gb in cells[13].split('/')), r.stdout  # the read rate before and after ours' reps


def test_the_same_tokens_column_counts_the_rows_that_agree():
  """'True' when every row's tokens are the peer's; else the rows that are and where the earliest other parts. A
  child process: importing the script defines its flags."""
  code = (
    'import sys; sys.path.insert(0, "benchmarks"); import generate as g; '
    'print(g.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]])); '
    'print(g.agreement([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [7, 8, 0]]))'
  )
  r = children.run([sys.executable, '-c', code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.splitlines() == ['True', '1/3 rows (the first other parts at token 2)'], r.stdout


def test_decode_kernel_benchmark_smoke():
  """benchmarks/decode_kernel.py on tiny shapes: a row per case, both sides timed (where the kernel runs here)."""
  cmd = [sys.executable, 'benchmarks/decode_kernel.py', '--busy', '--hidden=32', '--layers=1', '--vocab=64']
  cmd += ['--steps=2', '--reps=1', '--rounds=1', '--rows=3', '--gemm_rows=16', '--packed_rows=12']
  cmd += ['--attention_rows=2', '--slots=12']
  r = children.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  if 'nothing to compare' in r.stderr:
    pytest.skip(r.stderr.strip().splitlines()[-1])
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [line for line in r.stdout.splitlines() if line.startswith('| ') and ' ms (' in line]
  assert len(rows) >= 4 and all(line.count(' ms (') == 2 for line in rows), r.stdout
  assert sum(' attention |' in line for line in rows) == 2, r.stdout  # float32 and bfloat16 caches
  # a packed row per GEMM: float32 (AVX2 or AVX-512: 'with its GEMM') and bfloat16 pairs (AVX-512 BF16)
  gemms = ('with its GEMM' in r.stdout) + ('AVX-512 BF16' in r.stdout)
  assert sum('packed before the loop' in line for line in rows) == gemms, r.stdout
