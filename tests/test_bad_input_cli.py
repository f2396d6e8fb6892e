"""Bad input as users give it, by kind: a config switched to another model family or task by an override, config
files that break while they run, rules given as a dict or on the command line, run directories export.py cannot
read, init_from paths that are not there, a TFDS data_dir typo, stray arguments and missing flags, and settings
that would silently do something else (a warning line). Each kind has one mechanism; each case is one line naming
the culprit, before anything is built."""

import re
import subprocess
import sys
import threading

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

import errors
import models
import partitioning
import train
from configs import cli, schema
from tests.conftest import ROOT, build_trainer, subprocess_env
from tests.test_configs import MODULES

FAMILIES = dict(MODULES)


def parse(argv):
  """A command line parsed as app.run parses train.py's (a fresh flag set reading these arguments)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, lock_config=True, sys_argv=argv)
  return cli.parse_flags(argv, fv), fv


def overridden(argv):
  """The config of `train.py --config ... --config.x=y`, as train.py's main receives it."""
  return parse(['train.py', *argv])[1].config


# --- A config switched to another model family or task ----------------------------------------------------


@pytest.mark.parametrize(
  'argv, message',
  [
    (
      ['--config=configs/gpt2.py:tiny', '--config.model.name=resnet'],
      r"^config.model.name='resnet' with config.task='lm': resnet trains on config.task='classification' only; it "
      r'also needs config.model.channels, config.model.width, config.model.block, config.model.stage_sizes, '
      r'config.model.bn_eps, config.model.bn_momentum, config.model.num_classes, which this config does not set',
    ),
    (
      ['--config=configs/llama.py:tiny', '--config.model.name=moe'],
      r"^config.model.name='moe' with config.task='lm': moe needs config.model.num_experts, config.model.top_k, "
      r'config.model.capacity_factor, config.model.group_size, config.model.aux_loss_weight, which this config',
    ),
    (
      ['--config=configs/gpt2.py:tiny', '--config.model.name=vit'],
      r"^config.model.name='vit' with config.task='lm': vit trains on config.task='classification' only; it also "
      r'needs config.model.image_size, config.model.patch_size, config.model.channels, config.model.num_classes,',
    ),
    (
      ['--config=configs/gpt2.py:tiny', '--config.task=classification'],
      r"^config.model.name='gpt2' with config.task='classification': gpt2 trains on config.task='lm' or 'dpo' or "
      r"'grpo' only \(",
    ),
    (
      ['--config=configs/gpt2.py:tiny', '--config.task=mlm'],
      r"^config.model.name='gpt2' with config.task='mlm': gpt2 trains on config.task='lm' or 'dpo' or 'grpo' "
      r'only \(',
    ),
    (
      ['--config=configs/bert.py:tiny', '--config.task=lm'],
      r"^config.model.name='bert' with config.task='lm': bert trains on config.task='mlm' or "
      r"'text_classification' only",
    ),
  ],
)
def test_a_config_switched_to_another_family_or_task_names_what_it_needs(argv, message, monkeypatch):
  config = overridden([argv[0].replace('=', f'={ROOT}/', 1), *argv[1:]])
  monkeypatch.setattr(partitioning, 'fit_mesh', lambda *a: pytest.fail('built before the check'))
  with pytest.raises(errors.ConfigError, match=message) as e:
    train.train_and_evaluate(config, None, dry_run=True)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize(
  'name, arg',
  [(n, a) for n, m in MODULES for a in getattr(m, 'SIZES', {}) if 'tiny' in a and n in models.MODELS | {'mnist': 0}],
)
def test_each_family_declares_every_field_it_reads(name, arg):
  """A model built from a config.model that holds only the fields its family needs (and the name), completed with
  the schema's defaults, builds: configs/schema.py FAMILIES declares every field the family reads (a missing one
  would fail here, reading the field)."""
  config = FAMILIES[name].get_config(arg)
  family = schema.FAMILIES[config.model.name]
  config.model = ml_collections.ConfigDict({k: config.model[k] for k in ('name', *family.needs)})
  assert config.task in family.tasks
  build_trainer(schema.complete(config))


# --- Config files that break ----------------------------------------------------------------------------------

BODY = 'from configs import gpt2\n\n\ndef get_config(arg=None):\n  c = gpt2.get_config("tiny")\n{}\n  return c\n'
BROKEN_FILES = {  # the file's text -> the line after '--config=<file>: '
  'returns a dict': ('def get_config(arg=None):\n  return dict(seed=0)\n', r'get_config\(\) returned a dict, not an '),
  'returns None': (
    'def get_config(arg=None):\n  pass\n',
    r'get_config\(\) returned None \(no return statement\?\), not an ',
  ),
  'imports a module that is not there': (
    'import no_such_module\n\ndef get_config(arg=None):\n  return None\n',
    r"error at {file}:1 \(import no_such_module\): ModuleNotFoundError: No module named 'no_such_module'$",
  ),
  'lacks mesh': (BODY.format("  del c['mesh']"), r'config.mesh is missing: every config sets it \(a dict of'),
  'raises inside': (
    BODY.format('  c.batch_size = c.batch_size // 0'),
    r'error at {file}:6 \(c.batch_size = c.batch_size // 0\): ZeroDivisionError: integer division or modulo by '
    r'zero$',
  ),
  'reads a misspelled field': (
    BODY.format('  c.model.mlp_dim = 4 * c.model.emebd_dim'),
    r"error at {file}:6 \(c.model.mlp_dim = 4 \* c.model.emebd_dim\): AttributeError: no field 'emebd_dim'; did "
    r"you mean 'embed_dim'\?$",
  ),
  'a KeyError inside get_config': (
    BODY.format('  c.batch_size = {"tiny": 8}[arg]'),
    r'error at {file}:6 \(c.batch_size = {{"tiny": 8}}\[arg\]\): KeyError: None$',
  ),
  'rules given as a dict': (
    BODY.format("  c.logical_axis_rules = {'batch': 'data', 'embed': 'fsdp'}"),
    r'error at {file}:6 \(.*\): config.logical_axis_rules holds a list, so a dict cannot replace it: it must be '
    r'a list of \(logical name, mesh axis \| tuple of mesh axes \| None\) pairs$',
  ),
}


@pytest.mark.parametrize('case', sorted(BROKEN_FILES))
def test_a_config_file_that_breaks_is_named_with_its_line_and_error(case, tmp_path, monkeypatch):
  text, message = BROKEN_FILES[case]
  file = tmp_path / 'my_config.py'
  file.write_text(text)
  # With overrides the file is loaded to check them against it, before ml_collections applies them.
  for extra in ([], ['--config.seed=3']):
    # ml_collections runs every config file as the module 'config_config': one loaded before lends its fields
    monkeypatch.delitem(sys.modules, 'config_config', raising=False)
    with pytest.raises(SystemExit) as e:
      parse(['train.py', f'--config={file}', *extra])
    line = str(e.value)
    assert line.startswith(f'shardzoo: config error: --config={file}: ') and '\n' not in line, line
    assert re.search(message.format(file=file), line), line


def test_a_config_file_refusing_its_argument_keeps_its_words():
  with pytest.raises(SystemExit) as e:
    parse(['train.py', f'--config={ROOT}/configs/gpt2.py:tp,dp'])
  assert str(e.value) == (
    f"shardzoo: config error: --config={ROOT}/configs/gpt2.py:tp,dp: gpt2.py: two presets 'tp' and 'dp' in "
    "'tp,dp'; give one preset and/or one size"
  )


# --- Rules on the command line ---------------------------------------------------------------------------------


def test_rules_can_be_given_on_the_command_line_and_are_checked():
  rules = "[('batch', 'data'), ('embed', None), ('mlp', 'tensor')]"
  config = overridden([f'--config={ROOT}/configs/gpt2.py:tp,tiny', f'--config.logical_axis_rules={rules}'])
  assert config.logical_axis_rules == [('batch', 'data'), ('embed', None), ('mlp', 'tensor')]
  with pytest.raises(errors.ConfigError, match=r"^config.logical_axis_rules\[1\]=\('embed',\): must be a"):
    schema.check(
      overridden([f'--config={ROOT}/configs/gpt2.py', "--config.logical_axis_rules=[('batch', 'data'), ('embed',)]"])
    )
  with pytest.raises(SystemExit) as e:
    parse(['train.py', f'--config={ROOT}/configs/gpt2.py', '--config.logical_axis_rules=batch'])
  assert str(e.value) == (
    'shardzoo: config error: flag --config.logical_axis_rules=batch: must be a Python list literal, e.g. '
    "\"[('batch', 'data'), ('embed', None)]\""
  )


# --- A mesh keeps the order written ----------------------------------------------------------------------------


def test_a_mesh_keeps_the_order_written(tmp_path):
  """A plain ConfigDict sorts its keys when iterated: tensor=4, data=2 would be laid out as data, tensor. Config
  files and --config.mesh keep the written order; a config built in code with a reordering mesh is refused."""
  file = tmp_path / 'sorted_mesh.py'
  file.write_text(
    'import ml_collections\nfrom configs import gpt2\n\n\ndef get_config(arg=None):\n  c = gpt2.get_config("tp,tiny")\n'
    '  c.mesh = ml_collections.ConfigDict(dict(tensor=4, data=2, fsdp=1))\n  return c\n'
  )
  assert list(overridden([f'--config={file}']).mesh) == ['tensor', 'data', 'fsdp']
  mesh = "{'tensor': 4, 'data': 2}"
  assert list(overridden([f'--config={ROOT}/configs/gpt2.py:tiny', f'--config.mesh={mesh}']).mesh) == [
    'tensor',
    'data',
  ]
  config = FAMILIES['gpt2'].get_config('tp,tiny')
  config.mesh = ml_collections.ConfigDict(dict(tensor=4, data=2, fsdp=1))
  with pytest.raises(
    errors.ConfigError,
    match=r"^config.mesh={'tensor': 4, 'data': 2, 'fsdp': 1} is a ConfigDict that sorts its keys: its axes would be "
    r"laid out as \['data', 'fsdp', 'tensor'\], not in the order written; build it with common.mesh",
  ):
    schema.check(config)
  config.mesh = ml_collections.ConfigDict(dict(data=2, fsdp=1, tensor=4))  # sorted as written: the same layout
  schema.check(config)


# --- Settings that would silently do something else ------------------------------------------------------------


def test_settings_that_would_silently_differ_are_warned_about(monkeypatch, capsys):
  config = FAMILIES['gpt2'].get_config('tiny')
  assert schema.warnings(config) == []
  config.optim.warmup_steps, config.total_steps, config.dont_load = 500, 5, '^head/'

  class Built(Exception):
    pass

  def stop(*args):  # the warnings come before anything is built
    raise Built

  monkeypatch.setattr(partitioning, 'fit_mesh', stop)
  with pytest.raises(Built):
    train.train_and_evaluate(config, None, dry_run=True)
  assert capsys.readouterr().out.splitlines() == [
    'WARNING config: config.optim.warmup_steps=500 with config.total_steps=5: the warmup is cut to 4 steps (the '
    'learning rate peaks at the last step)',
    "WARNING config: config.dont_load='^head/' has no effect without config.init_from: nothing is loaded, every "
    'parameter starts fresh',
  ]
  from training import optim

  assert optim.make_schedule(config.optim, 5)(4) == pytest.approx(config.optim.lr)  # what the warning says
  config.init_from = '/some/checkpoint'
  assert len(schema.warnings(config)) == 1


def test_a_config_missing_a_field_every_config_sets_is_named():
  config = FAMILIES['gpt2'].get_config('tiny')
  del config['total_steps']
  with pytest.raises(errors.ConfigError, match=r'^config.total_steps is missing: every config sets it \(an integer'):
    schema.check(config)


# --- export.py's run directory ---------------------------------------------------------------------------------


def test_a_directory_that_is_not_a_run_is_said_what_it_is(tmp_path):
  from checkpointing import run_config

  run = tmp_path / 'run'
  (run / 'checkpoints' / '4' / 'state').mkdir(parents=True)
  (run / 'run_config.json').write_text('{"seed": 0, ')  # damaged: cut off mid-write
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'file').write_text('')
  expected = re.escape(
    'give the directory a run was trained in (train.py --workdir), which holds run_config.json and checkpoints/'
  )
  cases = {
    tmp_path / 'nowhere': f'^--workdir {tmp_path}/nowhere does not exist: {expected}$',
    tmp_path / 'file': f'^--workdir {tmp_path}/file is a file, not a directory',
    tmp_path / 'empty': f'^--workdir {tmp_path}/empty is empty: {expected}$',
    run / 'checkpoints': rf"^--workdir {run}/checkpoints is a run's checkpoints/ directory \(steps \[4\]\): give the "
    rf"run's directory, --workdir {run} \(and --step N",
    run / 'checkpoints' / '4': rf"^--workdir {run}/checkpoints/4 is one checkpoint step's directory: give the run's "
    rf'directory and the step, --workdir {run} --step 4$',
  }
  for workdir, message in cases.items():
    with pytest.raises(errors.ConfigError, match=message):
      run_config.check_workdir(str(workdir))
  run_config.check_workdir(str(run))
  with pytest.raises(
    errors.ConfigError,
    match=rf'^{run}/run_config.json is damaged \(Expecting property name enclosed in double quotes: line 1 column 13 '
    r"\(char 12\)\): give the run's config with --config",
  ):
    run_config.load(str(run))


# --- init_from --------------------------------------------------------------------------------------------------


def test_init_from_that_is_not_there_or_only_pytorch_weights(tmp_path):
  from training import pretrained

  with pytest.raises(errors.ConfigError) as e:
    pretrained._is_hf_dir('gpt2')
  assert str(e.value).startswith("config.init_from='gpt2' is neither a checkpoint directory of this project nor a ")
  assert 'owner/name, e.g. openai-community/gpt2' in str(e.value) and 'HF_HUB_OFFLINE=1' in str(e.value)
  assert 'hf download owner/name' in str(e.value)
  with pytest.raises(errors.ConfigError, match=r'no such directory$'):
    pretrained._is_hf_dir(str(tmp_path / 'nowhere'))
  (tmp_path / 'config.json').write_text('{"model_type": "gpt2"}')
  (tmp_path / 'pytorch_model.bin').write_bytes(b'torch')
  with pytest.raises(
    errors.HFImportError,
    match=r'has no \*.safetensors files \(PyTorch .bin checkpoints are not read: convert them with transformers '
    r'save_pretrained\(safe_serialization=True\)\)$',
  ):
    pretrained._is_hf_dir(str(tmp_path))


def test_closing_a_checkpointer_joins_orbax_cleanup_thread(tmp_path, monkeypatch):
  """orbax starts a thread to clean temporary directories when a CheckpointManager is made and joins it only
  before a save: a run stopped by bad input before its first save must not leave it to outlive the interpreter
  (it printed a 40-line traceback after our line in a third of such runs)."""
  import asyncio

  from orbax.checkpoint._src.path import temporary_paths

  from checkpointing import checkpointer

  cleanup = temporary_paths.cleanup_temporary_paths

  async def slow_cleanup(*args, **kwargs):  # as on a slow file system: the thread is still running at close
    await asyncio.sleep(1.0)
    return await cleanup(*args, **kwargs)

  monkeypatch.setattr(temporary_paths, 'cleanup_temporary_paths', slow_cleanup)
  before = set(threading.enumerate())
  ckpt = checkpointer.Checkpointer(str(tmp_path / 'checkpoints'), every_steps=1, keep=1)
  assert set(threading.enumerate()) - before, 'orbax started no cleanup thread: the premise changed'
  ckpt.close()
  # orbax's thread (run_sync's idle executor workers are joined by concurrent.futures at exit, without error)
  alive = [t.name for t in set(threading.enumerate()) - before if '_target_setting_result' in t.name]
  assert alive == [], alive


# --- A TFDS data_dir typo --------------------------------------------------------------------------------------


def test_a_tfds_data_dir_typo_names_the_directory_looked_in(tmp_path):
  from data import tfds_source

  with pytest.raises(
    errors.ConfigError,
    match=rf"^config.dataset.name='my_dataset' is not a known dataset: not offline \(\['markov'\]\), not a TFDS "
    rf'dataset \(tfds.list_builders\(\)\) and not prepared in {tmp_path}/typo \(config.dataset.data_dir\), which '
    r'does not exist(;|$)',
  ):
    tfds_source.builder('my_dataset', str(tmp_path / 'typo'), ['markov'])


# --- The command line: one line, not every flag ----------------------------------------------------------------


def test_stray_arguments_are_one_line():
  with pytest.raises(SystemExit) as e:
    parse(['train.py', f'--config={ROOT}/configs/gpt2.py', 'tiny'])
  assert str(e.value) == (
    "shardzoo: usage error: unexpected argument(s) ['tiny']: everything else is a flag (--name=value); a preset or "
    f'size goes after the config file: --config={ROOT}/configs/gpt2.py:tiny (--help for all flags)'
  )


def test_entry_points_print_one_line_for_usage_errors_and_bad_run_directories(tmp_path):
  """What the user sees: the one line, not absl's list of every flag before it (subprocesses, run in parallel)."""
  env = {**subprocess_env(), 'HF_HUB_OFFLINE': '1'}
  runs = {
    'train.py stray argument': (
      ['train.py', '--config', 'configs/gpt2.py', 'tiny', '--dry_run'],
      "shardzoo: usage error: unexpected argument(s) ['tiny']: everything else is a flag (--name=value); a preset or "
      'size goes after the config file: --config=configs/gpt2.py:tiny (--help for all flags)',
    ),
    'search.py without --config': (
      ['search.py', '--devices', '8', '--device_kind', 'cpu'],
      'shardzoo: usage error: --config, --devices and --device_kind are required, e.g. --config configs/llama.py '
      '--devices 8 --device_kind h100 (--help for all flags)',
    ),
    'export.py of an empty directory': (
      ['export.py', '--workdir', str(tmp_path), '--out', str(tmp_path / 'out')],
      f'shardzoo: export error: --workdir {tmp_path} is empty: give the directory a run was trained in (train.py '
      '--workdir), which holds run_config.json and checkpoints/',
    ),
  }
  procs = {
    name: subprocess.Popen(
      [sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for name, (argv, _) in runs.items()
  }
  for name, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if 'oneDNN' not in line and 'absl::InitializeLog' not in line]
    assert proc.returncode == 1 and lines == [runs[name][1]] and out == '', (name, out, err[-2000:])
