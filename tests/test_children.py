"""tests/children.py: a command forked from the zygote behaves as the same command started by subprocess does."""

import signal
import subprocess
import sys

import pytest

from tests import children
from tests.conftest import ROOT, subprocess_env

SCRIPT = r"""
import os, signal, sys
import jax
print([signal.getsignal(s) for s in (signal.SIGPIPE, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGINT)])
print(sys.argv, os.getcwd(), os.environ.get('SHARDZOO_CHILD_NOTE'), jax.config.jax_default_matmul_precision)
print(sys.path[0], [(s.line_buffering, s.write_through, type(s.buffer).__name__) for s in (sys.stdout, sys.stderr)])
print('to stderr', file=sys.stderr)
if sys.argv[1] == 'raise':
  raise ValueError('from the child')
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


@pytest.mark.parametrize('how', ['3', 'raise', 'a message'])
def test_a_forked_command_exits_prints_and_reads_its_environment_as_a_started_one(tmp_path, how):
  env = {**subprocess_env(), 'SHARDZOO_CHILD_NOTE': 'seen', 'JAX_DEFAULT_MATMUL_PRECISION': 'highest'}
  argv = [sys.executable, '-c', SCRIPT, how, 'x y']
  ran = [
    run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    for run in (children.run, subprocess.run)
  ]
  forked, started = ran
  assert children.forkable(argv) and forked.returncode == started.returncode == {'3': 3}.get(how, 1)
  assert forked.stdout == started.stdout and ' seen highest' in forked.stdout
  if how == 'raise':  # the same traceback, less the zygote's frames above the script's
    assert forked.stderr.startswith('to stderr\nTraceback') and forked.stderr.endswith('ValueError: from the child\n')
    assert started.stderr.endswith('ValueError: from the child\n')
  else:
    assert forked.stderr == started.stderr


def test_a_forked_script_takes_signals_and_timeouts_as_a_started_one(tmp_path):
  """train.py from the zygote: a real pid that SIGTERM ends (-15); wait's timeout; kill."""
  (tmp_path / 'sleeps.py').write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
  argv = [sys.executable, str(tmp_path / 'sleeps.py')]
  for sig, status in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
    p = children.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == 'ready\n'
    with pytest.raises(subprocess.TimeoutExpired):
      p.wait(timeout=0.2)
    assert p.poll() is None
    p.send_signal(sig)
    assert p.wait(timeout=30) == status
    p.stdout.close()
