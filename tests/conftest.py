"""Tests run on 8 simulated CPU devices (set before JAX starts its backends)."""

import atexit
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

# The suite's programs are tiny, so XLA:CPU's LLVM optimisation is most of what a test spends compiling them and
# saves little of their running: the tests and their children (subprocess_env) compile without it, with the same
# float operations (no fast math; planning.search.FAST_CPU_COMPILE's options). A flag set in XLA_FLAGS (user, CI) is
# kept and wins over ours.
FAST_COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0',
  '--xla_llvm_disable_expensive_passes=true',
  '--xla_cpu_use_fusion_emitters=false',
)
_flags = os.environ.get('XLA_FLAGS', '').split()
os.environ['XLA_FLAGS'] = ' '.join(
  _flags + [f for f in FAST_COMPILE_FLAGS if not any(g.startswith(f.split('=')[0] + '=') for g in _flags)]
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import partitioning  # noqa: E402

partitioning.simulate_cpu_devices(8)

# Many tests compile the same programs (the same tiny config under the same mesh, built by different
# trainers, in either xdist worker, or by the train.py children of several tests). A compilation cache private
# to this test session serves the repeats; it starts empty every session, so nothing carries over between runs,
# and is removed when the process that made it (pytest's main process) exits; the workers it starts find it in
# the environment. A size limit turns on the cache's file lock: processes write into it while others read it.
_CACHE = os.environ.get('SHARDZOO_TEST_JAX_CACHE')
if not _CACHE:
  _CACHE = os.environ['SHARDZOO_TEST_JAX_CACHE'] = tempfile.mkdtemp(prefix='shardzoo_jax_cache_')
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
CACHE_CONFIG = {
  'jax_compilation_cache_dir': _CACHE,
  'jax_persistent_cache_min_compile_time_secs': 0,
  'jax_persistent_cache_min_entry_size_bytes': 0,
  'jax_compilation_cache_max_size': 8 << 30,
}
for _k, _v in CACHE_CONFIG.items():
  jax.config.update(_k, _v)

import models  # noqa: E402
import training  # noqa: E402
from configs import default, schema  # noqa: E402
from tests.interrupt import pytest_configure  # noqa: E402, F401  (Ctrl-C stops the workers too)


def pytest_addoption(parser):
  parser.addoption('--all-presets', action='store_true', help='config matrix: every preset of every config file')


# pytest.ini runs the suite in xdist workers (-n auto --dist loadfile): one per core, at most 4 (each holds a
# JAX runtime of 8 simulated devices and starts train.py children), each file's tests in one worker, so its
# module fixtures and compiled programs are built once. `pytest -n 0` runs everything in this process.
def pytest_xdist_auto_num_workers(config):
  return min(4, os.cpu_count() or 1)


# The decode kernel's libraries, this CPU's and three other x86 targets' (test_decode_kernel.py), take about 45 s of
# compiling, which a cold cache (CI, a fresh machine) paid inside the tests. One background process at the lowest
# priority compiles them from the session's start, in the moments the workers leave a core idle; a test that needs
# one before it is done waits on kernels.build()'s lock instead of compiling it again.
KERNEL_TARGETS = ('native', 'skylake-avx512', 'x86-64-v3', 'x86-64-v2')
# A child's code that loads models/kernels/__init__.py (its sys.argv[1]) as `kernels`, without models/__init__'s
# imports of every model.
LOAD_KERNELS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location('shardzoo_kernels', sys.argv[1])
kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernels)
"""
_BUILD_CODE = (
  'import os, signal\nos.nice(19)\n'
  + LOAD_KERNELS
  + """
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # build() removes its partial file on the way out
for march in sys.argv[2:]:
  try:
    kernels.build(march)
  except RuntimeError:  # the test that needs it builds it again and reports why
    pass
"""
)


def _selects_kernel_tests(config) -> bool:
  here = os.path.join(ROOT, 'tests')
  paths = [os.path.abspath(str(a).split('::')[0]) for a in config.args] or [here]
  return any(p in (here, ROOT, os.path.join(here, 'test_decode_kernel.py')) for p in paths)


def pytest_sessionstart(session):
  config = session.config
  if hasattr(config, 'workerinput') or platform.machine() not in ('x86_64', 'AMD64'):
    return  # the main process only; the other targets are x86's
  if os.environ.get('SHARDZOO_DECODE_KERNEL', '1') == '0' or not _selects_kernel_tests(config):
    return
  source = os.path.join(ROOT, 'models', 'kernels', '__init__.py')
  config._kernel_builds = subprocess.Popen(
    [sys.executable, '-c', _BUILD_CODE, source, *KERNEL_TARGETS],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
  )


def pytest_sessionfinish(session):
  builds = getattr(session.config, '_kernel_builds', None)
  if builds is not None and builds.poll() is None:  # a short run: stop the compiles it did not need
    with contextlib.suppress(ProcessLookupError):
      os.killpg(builds.pid, signal.SIGTERM)
    builds.wait()


# The files that take longest, or hold a test of 15 s or more, longest first (a quiet 2-core run's durations). The
# workers take files in collection order (pytest.ini: --no-loadscope-reorder) as each runs out of work: these
# first, then the rest by number of tests (what xdist's own order would be), so the end of the run is short
# files that let both workers finish together, not a minute-long file that one worker starts last.
HEAVY_FIRST = (
  'test_docs.py',
  'test_configs.py',
  'test_faults.py',
  'test_sparse_families.py',
  'test_speed_paths.py',
  'test_multiprocess.py',
  'test_train.py',
  'test_resume.py',
  'test_generation.py',
  'test_decoder_families.py',
  'test_pipeline.py',
  'test_hf_families.py',
  'test_lm_eval_model.py',
  'test_context.py',
  'test_your_data.py',
  'test_soak.py',
  'test_post_training_runs.py',
  'test_moe.py',
  'test_accumulate.py',
  'test_bad_input.py',
  'test_hf_export.py',
  'test_journeys.py',
  'test_guards.py',
  'test_data_multiprocess.py',
)


def pytest_collection_modifyitems(config, items):
  files = [os.path.basename(str(item.path)) for item in items]
  count = {f: files.count(f) for f in set(files)}
  rank = lambda f: (HEAVY_FIRST.index(f), 0) if f in HEAVY_FIRST else (len(HEAVY_FIRST), -count[f])
  order = sorted(range(len(items)), key=lambda i: (rank(files[i]), files[i], i))
  items[:] = [items[i] for i in order]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_COMPILE = '/jax/core/compile/backend_compile_duration'  # also timed around a persistent-cache hit


# The default config shrunk as tiny_config shrinks it, as flat overrides (train.py: --config.<key>=<value>;
# in process: ConfigDict.update_from_flattened_dict). Tests that run train.py share these sizes (and compilations).
TINY_FLAGS = {
  'model.num_layers': 2,
  'model.embed_dim': 64,
  'model.mlp_dim': 128,
  'model.max_len': 16,
  'dataset.seq_len': 16,
  'dataset.num_train': 512,
  'dataset.num_eval': 100,
  'batch_size': 16,
  'optim.warmup_steps': 1,
  'sample_len': 0,
}
# A 12-step run of it with checkpoints at steps 1, 4, 8 and 12 (test_faults' full disk, test_soak).
TINY_RUN = {**TINY_FLAGS, 'total_steps': 12, 'checkpoint_every': 4, 'log_every': 4, 'eval_every': 12}


def tiny_config(preset: str = 'fsdp_tp', **overrides) -> ml_collections.ConfigDict:
  """The default config shrunk so a step takes milliseconds; same rules and mesh."""
  c = default.get_config(preset)
  c.model.update(num_layers=2, embed_dim=64, mlp_dim=128, num_heads=4, max_len=16)
  c.dataset.update(seq_len=16, num_train=512, num_eval=100)
  c.update(batch_size=16, total_steps=3, log_every=1, eval_every=3, sample_len=0)
  c.optim.warmup_steps = 1
  for k, v in overrides.items():
    c[k] = v
  return c


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, f'tests need 8 simulated CPU devices, got {jax.devices()}'


@pytest.fixture(scope='session', autouse=True)
def _library_temp_files(tmp_path_factory):
  """Libraries' temporary files go under pytest's base temp directory, which pytest prunes (keeps 3 runs).

  tfds makes a temporary directory it never removes for every builder made over a data_dir with no prepared
  dataset (DatasetInfo.initialize_from_bucket); the TFDS tests make dozens per run. TMPDIR carries the
  directory to the train.py children that tests start."""
  tempfile.tempdir = str(tmp_path_factory.mktemp('tempfile'))
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv('TMPDIR', tempfile.tempdir)
    yield
  tempfile.tempdir = None


def build_trainer(cfg: ml_collections.ConfigDict, devices=None) -> training.Trainer:
  """A Trainer for the config's model on its mesh (all 8 devices unless `devices` is given). The config is completed
  first (schema.complete, as a loaded one is): a test may switch its optimizer or family in code."""
  schema.complete(cfg)
  return training.build(cfg, partitioning.make_mesh(cfg.mesh, devices), lambda rngs: models.create(cfg.model, rngs))


@contextlib.contextmanager
def recorded_compile_events():
  """Collects the names of JAX's compile events (e.g. BACKEND_COMPILE) seen inside the block."""
  events: list[str] = []
  listener = lambda event, duration, **kw: events.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def assert_every_leaf_named(state, where: str = '') -> dict:
  """Every leaf of an NNX state names one logical axis (a string) per dimension; returns the axes tree."""
  axes = partitioning.nnx_logical_axes(state)
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state)):
    names = axes
    for k in path:
      names = names[k.key]
    culprit = f'{where} {partitioning.path_str(path)}'.strip()
    assert names is not None and len(names) == leaf.ndim and all(isinstance(n, str) for n in names), culprit
  return axes


def train_on_random_batches(trainer: training.Trainer, steps: int) -> tuple[training.TrainState, training.TrainState]:
  """(initial state on host, state after `steps` jitted train steps on the task's synthetic batches)."""
  state = training.init_state(trainer)
  start = jax.device_get(state)
  step = training.jit_train_step(trainer)
  for i in range(steps):
    batch = trainer.task.synthetic_batch(trainer.config, seed=i)
    state, _ = step(state, jax.device_put(batch, trainer.batch_shardings))
  return start, state


def all_eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in it (custom_vjp, remat, scan, shard_map bodies)."""
  yield from jaxpr.eqns
  for sub in jax.extend.core.subjaxprs(jaxpr):
    yield from all_eqns(sub)


def child_xla_flags() -> str:
  """This session's XLA_FLAGS less a device count (--xla_force_host_platform_device_count): what a child
  process compiles with (XLA keys its compilation cache on them, so a child shares the session's programs)."""
  return ' '.join(partitioning.mesh.CPU_COUNT_FLAG.sub('', os.environ.get('XLA_FLAGS', '')).split())


def subprocess_env(processes: int = 1) -> dict[str, str]:
  """Environment for running train.py in a child process: CPU only, no inherited device count (the session's
  other XLA flags, FAST_COMPILE_FLAGS among them, carry over). A child that runs alone shares this session's
  compilation cache (a test's reruns of one config compile once); the processes of one multi-process job
  (`processes` > 1) compile for themselves, as a job's processes on several hosts do."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'TF_CPP_MIN_LOG_LEVEL': '2', 'XLA_FLAGS': child_xla_flags()}
  if processes == 1:
    env.update({k.upper(): str(v) for k, v in CACHE_CONFIG.items()})
  return env


def stack_layers(tree: Any) -> Any:
  """Unrolled -> scanned parameters: every {'layers': {0: t0, 1: t1, ...}} becomes {'layers': stack(t_i)}.

  Works on pure dicts (nnx.to_pure_dict) of arrays; the inverse is `unstack_layers`.
  """
  if not isinstance(tree, Mapping):
    return tree
  out = {}
  for k, v in tree.items():
    if k == 'layers' and isinstance(v, Mapping) and v and all(isinstance(i, int) for i in v):
      out[k] = jax.tree.map(lambda *xs: jnp.stack(xs), *(v[i] for i in range(len(v))))
    else:
      out[k] = stack_layers(v)
  return out


def unstack_layers(tree: Any, num: int) -> Any:
  """Scanned -> unrolled parameters (inverse of `stack_layers`), `num` layers per stack."""
  if not isinstance(tree, Mapping):
    return tree
  return {
    k: ({i: jax.tree.map(lambda x, i=i: x[i], v) for i in range(num)} if k == 'layers' else unstack_layers(v, num))
    for k, v in tree.items()
  }


# --- Hugging Face export (training/export.py) --------------------------------------------------------


def train_steps(trainer: training.Trainer, state: training.TrainState, steps: int = 2) -> training.TrainState:
  """`steps` jitted train steps from `state` on the task's synthetic batches (the weights move)."""
  step = training.jit_train_step(trainer)
  for i in range(steps):
    state, _ = step(
      state, jax.device_put(trainer.task.synthetic_batch(trainer.config, seed=i), trainer.batch_shardings)
    )
  return state


def export_hf(trainer: training.Trainer, state: training.TrainState, out_dir: str, **kwargs) -> dict:
  from training import export

  return export.write_hf(trainer, state.params, state.model_state, str(out_dir), models.HF_FAMILIES, **kwargs)


def assert_hf_round_trip(
  trainer: training.Trainer, state: training.TrainState, hf_dir: str, out_dir: str, **kwargs
) -> None:
  """HF -> zoo (`state`, as imported) -> HF: every exported tensor is bitwise the original's, and the
  original's tensors not written are ones the family's importer ignores (tied copies, buffers, other heads)."""
  import re

  import numpy as np

  from models import hf_import

  export_hf(trainer, state, out_dir, **kwargs)
  family = models.HF_FAMILIES[trainer.config.model.name]
  theirs, ours = hf_import.HFDir(hf_dir), hf_import.HFDir(str(out_dir))
  assert ours.keys() <= theirs.keys(), sorted(ours.keys() - theirs.keys())
  for key in sorted(ours.keys()):
    a, b = theirs.read(key, [(0, n) for n in theirs.shape(key)]), ours.read(key, [(0, n) for n in ours.shape(key)])
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), key
  left = sorted(k for k in theirs.keys() - ours.keys() if not any(re.search(r, k) for r in family.ignore))
  assert not left, left


def load_exported(trainer: training.Trainer, state: training.TrainState, out_dir: str, auto_class: Any, **kwargs):
  """The state exported to `out_dir` and loaded by transformers (eval mode, fp32), with nothing missing or left."""
  export_hf(trainer, state, out_dir, **kwargs)
  model, info = auto_class.from_pretrained(str(out_dir), output_loading_info=True)
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys']), info
  return model.eval()
