"""The config matrix: every config file in configs/ is built and trained for 2 steps on 8 simulated
CPU devices under its last preset (all with `pytest --all-presets`; the first is dry-run), at its tiny size
(configs/default.py, which has none, shrunk as tests/conftest.py shrinks it), so a new config file is covered
automatically. The checkpoint families' config files (FAMILY_TESTED) are dry-run under that preset instead (built
and both steps traced, nothing compiled): their family tests compile and train them against references; so are
the config files that other tests train through train.py (CONFIG_TESTED).

A config file is any configs/*.py with a get_config(arg); it must define RULES (its presets) and,
when it has real sizes, SIZES with a 'tiny' entry that the matrix uses.
"""

import glob
import importlib
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

import models
import partitioning
import train
import training
from checkpointing import run_config
from configs import default, schema
from tests import conftest
from tests.conftest import ROOT, assert_every_leaf_named

MAX_TINY_PARAMS = 2_000_000  # keeps the matrix inside the CI budget; shrink a config's 'tiny' size instead
# Model families whose own test file runs them against transformers (logits, export, greedy tokens) and trains
# the presets that shard what is new in them equal to one device (test_presets_train_equal_to_one_device,
# test_ep_and_fsdp_presets_train_equal_to_one_device); the train.py path around the model (data, eval, the run's
# config, frozen weights) is the same for every LM and trained here by the other configs. Their config files are
# dry-run here (every compile of these families costs tens of seconds on 2 cores); `--all-presets` trains them too.
FAMILY_TESTS = {
  'tests/test_decoder_families.py': ('qwen2', 'qwen3', 'mistral', 'gemma', 'gemma2', 'gemma3', 'phi3', 'olmo2'),
  'tests/test_sparse_families.py': ('qwen3_moe', 'deepseek_v3', 'gpt_oss'),
}
FAMILY_TESTED = {family for families in FAMILY_TESTS.values() for family in families}
# Config files trained through train.py elsewhere, their task's sharded steps equal to one device under fsdp and tp
# (tests/test_post_training.py's test_post_training_steps_sharded_equal_one_device): docs/post_training.md's
# commands (tests/test_docs.py) run both at their tiny size, test_post_training_runs.py runs GRPO's. Dry-run here
# too; `--all-presets` trains them.
CONFIG_TESTS = {
  'docs/post_training.md': ('llama_dpo', 'llama_grpo'),
  'tests/test_post_training_runs.py': ('llama_grpo',),
}
CONFIG_TESTED = {name for names in CONFIG_TESTS.values() for name in names}


def config_modules():
  out = []
  for path in sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))):
    name = os.path.splitext(os.path.basename(path))[0]
    module = importlib.import_module(f'configs.{name}')
    if hasattr(module, 'get_config'):
      out.append((name, module))
  return out


MODULES = config_modules()


def tiny_config(module, preset):
  if module is default:  # no sizes: shrunk as the other tests shrink it (its own size learns in test_train.py)
    return conftest.tiny_config(preset)
  arg = f'{preset},tiny' if hasattr(module, 'SIZES') else preset
  return module.get_config(arg)


def matrix_presets(module, all_presets: bool) -> list[str]:
  """The last preset of each file trains by default (the richest: e.g. fsdp_tp, ep_tp); every preset with
  `pytest --all-presets`. The first preset (e.g. dp) is validated by a dry run (rules, shapes, traced steps)
  in test_real_size_dry_run_validates_without_allocating / test_first_preset_validates_in_a_dry_run."""
  presets = list(module.RULES)
  return presets if all_presets else [presets[-1]]


def trained_here(name, module, all_presets: bool) -> bool:
  """Whether the matrix trains the config file (else it dry-runs it): all but the FAMILY_TESTED families' and the
  CONFIG_TESTED files."""
  if all_presets:
    return True
  return name not in CONFIG_TESTED and tiny_config(module, list(module.RULES)[-1]).model.name not in FAMILY_TESTED


def pytest_generate_tests(metafunc):
  if {'name', 'preset'} <= set(metafunc.fixturenames):
    all_presets = metafunc.config.getoption('--all-presets')
    train_them = metafunc.function.__name__ == 'test_config_trains_two_steps'
    metafunc.parametrize(
      'name,preset',
      [
        pytest.param(name, preset, id=f'{name}:{preset}')
        for name, module in MODULES
        if trained_here(name, module, all_presets) == train_them
        for preset in matrix_presets(module, all_presets)
      ],
    )


def test_every_config_file_is_in_the_matrix_with_two_presets():
  assert {'default', 'gpt2'} <= {name for name, _ in MODULES}
  for name, module in MODULES:
    assert len(module.RULES) >= 2, f'configs/{name}.py needs at least two presets (RULES)'
    assert not hasattr(module, 'SIZES') or 'tiny' in module.SIZES, f"configs/{name}.py: SIZES needs 'tiny'"
    doc = (module.__doc__ or '').strip()
    assert f'python train.py --config configs/{name}.py' in doc.split('\n\n')[1] if doc.count('\n\n') else False, (
      f'configs/{name}.py must start with the command that runs it'
    )


def test_family_tests_hold_the_families_dry_run_here():
  """FAMILY_TESTED names only families that their test file runs (a CASES entry there)."""
  for path, families in FAMILY_TESTS.items():
    text = open(os.path.join(ROOT, path)).read()
    assert all(f"\n  '{family}': (" in text for family in families), path
  for path, names in CONFIG_TESTS.items():  # the page's commands, or the test's train.py run, of each file
    text = open(os.path.join(ROOT, path)).read()
    run = 'python train.py --config configs/{}.py:tiny' if path.endswith('.md') else '{}.get_config('
    assert all(run.format(name) in text for name in names), path
    assert path.endswith('.md') or 'train.train_and_evaluate(' in text, path


def check_tiny_model(name, preset, cfg):
  """The tiny size's every parameter names its logical axes (one per dimension) before anything is allocated, and
  the size stays small."""
  assert math.prod(v for v in cfg.mesh.values() if v > 0) in (8, jax.device_count()) or -1 in cfg.mesh.values()
  abstract = nnx.eval_shape(lambda: models.create(cfg.model, nnx.Rngs(0)))
  assert_every_leaf_named(nnx.state(abstract), f'configs/{name}.py:{preset}')
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert n <= MAX_TINY_PARAMS, f'configs/{name}.py tiny size has {n:,} parameters'


def test_family_config_builds_and_traces(name, preset, tmp_path):
  """A FAMILY_TESTED or CONFIG_TESTED config file under the preset the matrix would train: built and both steps
  traced on 8 devices (every rule and activation constraint checked), and its config kept in a workdir rebuilds the
  same model, shapes and shardings."""
  module = dict(MODULES)[name]
  cfg = tiny_config(module, preset)
  check_tiny_model(name, preset, cfg)
  assert train.train_and_evaluate(cfg, None, dry_run=True)['num_params'] > 0
  run_config.save(cfg, str(tmp_path))
  make = lambda c: training.build(
    c, partitioning.make_mesh(c.mesh), lambda rngs: models.create(c.model, rngs, c.get('lora'))
  )
  trainer, rebuilt = make(cfg), make(run_config.load(str(tmp_path)))
  assert rebuilt.abstract == trainer.abstract and rebuilt.specs == trainer.specs, f'{name}:{preset}'


def test_config_trains_two_steps(name, preset, tmp_path):
  module = dict(MODULES)[name]
  cfg = tiny_config(module, preset)
  check_tiny_model(name, preset, cfg)

  cfg.update(total_steps=2, log_every=1, eval_every=2, sample_len=0)
  result = train.train_and_evaluate(cfg, str(tmp_path))
  assert np.isfinite(result['train']['loss']) and np.isfinite(result['eval']['loss'])
  assert result['eval']['weight'] > 0 and 0 <= result['eval']['accuracy'] <= 1
  params = result['state'].params
  assert jax.tree.leaves(params)[0].sharding.mesh.size == 8
  # Two steps trained what trains and nothing else: each trainable parameter moved from its (seeded)
  # initial value, each frozen one (LoRA's base weights) did not.
  trainer = training.build(
    cfg, partitioning.make_mesh(cfg.mesh), lambda rngs: models.create(cfg.model, rngs, cfg.get('lora'))
  )
  start = jax.device_get(training.init_state(trainer).params)
  # The run's config kept in the workdir (for export.py) rebuilds the same model, shapes and shardings.
  again = run_config.load(str(tmp_path))
  rebuilt = training.build(
    again, partitioning.make_mesh(again.mesh), lambda rngs: models.create(again.model, rngs, again.get('lora'))
  )
  assert rebuilt.abstract == trainer.abstract and rebuilt.specs == trainer.specs, f'{name}:{preset}'
  labels = trainer.labels or jax.tree.map(lambda _: 'train', start)
  for (path, before), after, label in zip(
    jax.tree_util.tree_leaves_with_path(start), jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(labels)
  ):
    assert np.array_equal(before, after) == (label == 'frozen'), f'{name}:{preset} {partitioning.path_str(path)}'


@pytest.mark.parametrize('name', [name for name, module in MODULES if hasattr(module, 'SIZES')])
def test_real_size_dry_run_validates_without_allocating(name, capsys):
  """Each config's default (real) size builds abstractly on 8 devices: rules, shapes and traced steps
  are validated and the per-device table is printed; nothing is allocated or compiled."""
  module = dict(MODULES)[name]
  out = train.train_and_evaluate(module.get_config(None), None, dry_run=True)
  printed = capsys.readouterr().out
  assert 'WARNING sharding' not in printed, printed  # e.g. unrolled layers' ('layers', None) rule is not 'unused'
  tiny = train.train_and_evaluate(tiny_config(module, list(module.RULES)[0]), None, dry_run=True)
  assert out['num_params'] > tiny['num_params']
  assert 'params + optimizer per device' in printed


@pytest.mark.parametrize('name', [name for name, module in MODULES if not hasattr(module, 'SIZES')])
def test_first_preset_validates_in_a_dry_run(name):
  """Files without sizes: their first preset builds and traces abstractly (the matrix trains the last)."""
  module = dict(MODULES)[name]
  assert train.train_and_evaluate(tiny_config(module, list(module.RULES)[0]), None, dry_run=True)['num_params'] > 0


@pytest.mark.parametrize('name', ['gpt2_finetune', 'llama_lora'])
def test_tokenizer_follows_init_from_overrides(name):
  """Derived fields follow their inputs until set: --config.init_from=DIR also moves the tokenizer once the config is
  completed (as cli.parse_flags does after the overrides)."""
  cfg = importlib.import_module(f'configs.{name}').get_config()
  cfg.lock()
  cfg.init_from = '/elsewhere/model'  # what config_flags does for --config.init_from=/elsewhere/model
  schema.complete(cfg)
  assert cfg.dataset.tokenizer == '/elsewhere/model' == cfg.to_dict()['dataset']['tokenizer']


def test_the_sharding_summary_of_real_llama_fits_a_screen():
  """By default a run prints one row per module, not one per parameter, with the full table's totals."""
  from configs import llama

  cfg = llama.get_config(None)
  trainer = training.build(
    cfg, partitioning.make_mesh(cfg.mesh), lambda rngs: models.create(cfg.model, rngs, cfg.get('lora'))
  )
  t = trainer
  summary = partitioning.sharding_summary(
    t.abstract.params, t.specs.params, t.mesh.shape, t.abstract.opt_state, t.specs.opt_state
  ).splitlines()
  full = partitioning.sharding_table(
    t.abstract.params, t.axes.params, t.specs.params, t.mesh.shape, t.abstract.opt_state, t.specs.opt_state
  ).splitlines()
  assert len(full) > 100 and len(summary) <= 30, (len(full), summary)
  assert summary[-2:] == full[-2:]  # parameters, per-device bytes, optimizer state
  rows = summary[2:-3]
  params = sum(int(row.split()[2].replace(',', '')) for row in rows if row.split()[2] != '-')
  assert f'parameters: {params:,} ' in summary[-2]
