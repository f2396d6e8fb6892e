"""Bad input, tried systematically (issue 12): every field of every config file with a value of the wrong type
and values out of range, an unknown field and a misspelled preset on the command line, bad data and bad
Hugging Face directories. Each gives one ConfigError line naming the culprit and what is allowed, before
anything compiles."""

import os
import re
import subprocess
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

import errors
import partitioning
import train
import training
from configs import cli, schema
from tests.conftest import ROOT, subprocess_env
from tests.test_configs import MODULES, tiny_config

FAMILIES = dict(MODULES)


def configs():
  """Every config file at its default and (where it has one) tiny size."""
  for name, module in MODULES:
    yield f'{name}', module.get_config()
    if hasattr(module, 'SIZES') and 'tiny' in module.SIZES:
      yield f'{name}:tiny', tiny_config(module, list(module.RULES)[-1])


def with_value(cfg, path, value):
  out = ml_collections.ConfigDict(cfg.to_dict())  # field references resolved: only `path` changes
  node, _, key = path.rpartition('.')
  target = out
  for part in node.split('.') if node else ():
    target = target[part]
  with target.ignore_type():
    target[key] = value
  return out


def test_every_field_of_every_config_refuses_bad_values_in_one_line():
  cases = clear = 0
  for name, cfg in configs():
    schema.check(cfg)  # the config files themselves are valid
    for path, _value in schema.leaves(cfg).items():
      assert path in schema.FIELDS, f'{name}: config.{path} is described nowhere (configs/schema.py FIELDS)'
      for bad in schema.FIELDS[path].bad_values():
        cases += 1
        with pytest.raises(errors.ConfigError) as e:
          schema.check(with_value(cfg, path, bad))
        message = str(e.value)
        start = (
          f'config.{path}='
          if path in schema.OPAQUE
          # a list of rules names its first bad rule
          else f'config.{path}[0]={bad[0]!r}: must be '
          if schema.FIELDS[path].kind == 'rules'
          else f'config.{path}={bad!r}: must be '
        )
        assert message.startswith(start), (name, message)
        assert '\n' not in message, message
        clear += 1
  print(f'config fields: {cases} bad values over {len(list(configs()))} configs, {clear} one-line errors')
  assert cases > 500


def test_train_py_checks_the_schema_before_building_anything(monkeypatch):
  cfg = with_value(FAMILIES['gpt2'].get_config('tiny'), 'optim.lr', -1.0)
  monkeypatch.setattr(partitioning, 'fit_mesh', lambda *a: pytest.fail('built before the schema check'))
  with pytest.raises(errors.ConfigError, match=r'^config.optim.lr=-1.0: must be a finite number >= 0$'):
    train.train_and_evaluate(cfg, None, dry_run=True)
  with pytest.raises(errors.ConfigError, match=r'^config.model.num_haeds is not a field shardzoo knows'):
    train.train_and_evaluate(with_value(FAMILIES['gpt2'].get_config('tiny'), 'model.num_haeds', 4), None)


def test_a_step_that_does_not_fit_the_device_is_one_error_before_anything_is_allocated(monkeypatch):
  """train.py compares each compiled step's memory with the device's (profiling.memory_limit: the allocator's
  bytes_limit on GPUs and TPUs, unknown on CPUs) before creating the state: one DeviceMemoryError with both
  figures and what to change. Here the CPU device is given a 256 KiB limit."""
  from tests import conftest
  from training import profiling

  monkeypatch.setattr(profiling, 'memory_limit', lambda device: 2**18)
  monkeypatch.setattr(training, 'init_state', lambda *a: pytest.fail('state allocated before the check'))
  with pytest.raises(errors.DeviceMemoryError) as e:
    train.train_and_evaluate(conftest.tiny_config(), None)
  size = r'[0-9.]+ (B|KiB|MiB)'
  assert re.fullmatch(
    rf'the train step needs {size} per device \(arguments {size}, temporaries {size}, outputs '
    rf'{size} beyond the donated state\), more than the 256.00 KiB a cpu holds '
    r'for it: lower config.batch_size=16, or recompute more in the backward pass '
    r"\(config.model.remat='none'; 'full' keeps least\), or compute the loss in chunks "
    r'\(config.model.loss_chunks\), or shard the state and activations over more devices '
    r'\(config.mesh, config.logical_axis_rules\)',
    str(e.value),
  ), str(e.value)
  # within FIT_MARGIN of the limit passes: the compiled figure may overstate a peak by a few percent
  import jax
  import jax.numpy as jnp

  compiled = jax.jit(lambda x: jnp.sin(x) @ x).lower(jnp.ones((256, 256))).compile()
  need = profiling.compiled_memory(compiled)
  monkeypatch.undo()
  profiling.check_fits({'step': compiled}, jax.devices()[0], conftest.tiny_config(), limit=int(need / 1.04))
  with pytest.raises(errors.DeviceMemoryError, match=r'^the step needs '):
    profiling.check_fits({'step': compiled}, jax.devices()[0], conftest.tiny_config(), limit=int(need / 1.06))


def test_out_of_device_memory_from_xla_is_one_line():
  """XLA's RESOURCE_EXHAUSTED (the TPU compiler's when a step does not fit; a GPU's when an allocation fails) ends
  an entry point with XLA's first line and what to change; other runtime errors keep their traceback."""
  import jax

  tpu = (
    'RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (25.33G) '
    'exceeds available HBM (15.75G).\nmore detail'
  )
  with pytest.raises(SystemExit) as e, errors.one_line():
    raise jax.errors.JaxRuntimeError(tpu)
  assert str(e.value) == (
    'shardzoo: memory error: out of device memory (' + tpu.splitlines()[0][:-1] + '): lower the '
    'batch size (config.batch_size), recompute more in the backward pass (config.model.remat), '
    'or shard the state and activations over more devices (config.mesh, '
    'config.logical_axis_rules)'
  )
  with pytest.raises(jax.errors.JaxRuntimeError, match='INTERNAL: something else'), errors.one_line():
    raise jax.errors.JaxRuntimeError('INTERNAL: something else')


def parse(argv):
  """train.py's command line parsed as app.run does (a fresh flag set reading these arguments)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, lock_config=True, sys_argv=argv)
  return cli.parse_flags(argv, fv), fv


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_command_line_unknown_field_misspelled_preset_and_wrong_type(name):
  module = FAMILIES[name]
  path = os.path.join(ROOT, 'configs', f'{name}.py')
  field = next(
    p for p, f in schema.FIELDS.items() if f.kind is int and p in schema.leaves(module.get_config()) and '.' in p
  )
  section, key = field.rsplit('.', 1)
  typo = key[1] + key[0] + key[2:]
  cases = [
    (
      [f'--config.{section}.{typo}=3'],
      rf'^shardzoo: config error: --config.{section}.{typo}=3: the config has no '
      rf"field '{typo}'; did you mean '{key}'\?$",
    ),
    (
      [f'--config.{field}=abc'],
      rf"^shardzoo: config error: flag --config.{field}=abc: .*'abc' \(must be an "
      r'integer\)$',
    ),
  ]
  presets = list(module.RULES)
  argv0 = ['train.py', f'--config={path}:{presets[0]}x']
  with pytest.raises(
    SystemExit,
    match=rf'^shardzoo: config error: --config={path}:{presets[0]}x: \w+.py: unknown config argument '
    rf"'{presets[0]}x'; presets: .*'{presets[0]}'",
  ):
    parse(argv0)
  for extra, message in cases:
    with pytest.raises(SystemExit, match=message):
      parse(['train.py', f'--config={path}', *extra])
  _, fv = parse(['train.py', f'--config={path}', f'--config.{field}=7'])
  assert schema.leaves(fv.config)[field] == 7


def test_missing_or_broken_config_file_is_one_line(tmp_path, monkeypatch):
  missing, broken = str(tmp_path / 'gpt3.py'), tmp_path / 'broken.py'
  broken.write_text('from configs import common\n\ndef get_config(:\n')
  common = os.path.join(ROOT, 'configs', 'common.py')  # a module of the configs, not a config file
  # ml_collections executes every config file into one module, 'config_config': one loaded before in this
  # process would lend common.py its get_config (train.py loads one file per process)
  monkeypatch.delitem(sys.modules, 'config_config', raising=False)
  with pytest.raises(
    SystemExit,
    match=rf'^shardzoo: config error: --config={common}: the file defines no '
    r'get_config\(\), so it is not a config file',
  ):
    parse(['train.py', '--config', common])
  for extra in ([], ['--config.seed=3']):  # with overrides ml_collections fails while parsing, else when first read
    with pytest.raises(SystemExit, match=rf'^shardzoo: config error: --config={missing}: no such file$'):
      parse(['train.py', f'--config={missing}', *extra])
    with pytest.raises(
      SystemExit,
      match=rf'^shardzoo: config error: --config={broken}:tiny: syntax error at '
      rf'{broken}:3: invalid syntax$',
    ):
      parse(['train.py', '--config', f'{broken}:tiny', *extra])


def test_bad_logical_axis_rule_is_named_by_its_index():
  cfg = FAMILIES['gpt2'].get_config('fsdp_tp,tiny')
  rules = [tuple(r) for r in cfg.logical_axis_rules]
  pair = r'must be a \(logical name, mesh axis \| tuple of mesh axes \| None\) pair'
  cases = {
    ('append', ('embed', 'fsdp', 'x')): rf"^config.logical_axis_rules\[{len(rules)}\]=\('embed', 'fsdp', 'x'\): "
    rf'{pair} \(3 items, not 2\)$',
    ('insert', (None, 'fsdp')): rf"^config.logical_axis_rules\[0\]=\(None, 'fsdp'\): {pair} \(the logical name "
    r'None is not a string\)$',
    ('insert', ('embed', 3)): rf"^config.logical_axis_rules\[0\]=\('embed', 3\): {pair} \(the target 3 is not",
  }
  for (where, rule), message in cases.items():
    bad = rules + [rule] if where == 'append' else [rule] + rules
    with pytest.raises(errors.ConfigError, match=message):
      schema.check(with_value(cfg, 'logical_axis_rules', bad))


def test_launch_flags_that_would_be_ignored_or_crash_are_one_error_each():
  from training import cluster

  cases = {
    (None, 2, 0): r'^--num_processes=2 needs --coordinator_address=host:port',
    (None, 1, 3): r'^--process_id=3 is not in 0..0 \(--num_processes=1\); to start processes by hand',
    (None, 1, -1): r'^--process_id=-1 is not in 0..0',
    (None, 0, 0): r'^--num_processes=0 must be >= 1$',
  }
  for args, message in cases.items():
    with pytest.raises(errors.ConfigError, match=message):
      cluster.Launch(*args, cluster='none')
  for name in ('slurm', 'slurmm'):  # a scheduler and the manual flags: which one is meant?
    with pytest.raises(errors.ConfigError, match=rf'^--cluster={name} and --coordinator_address/--num_processes both'):
      cluster.Launch('127.0.0.1:1234', 2, 0, cluster=name)
  assert cluster.Launch(None, 1, 0, 'none').num_processes == 1
  r = subprocess.run(
    [sys.executable, 'train.py', '--config', 'configs/default.py', '--workdir', '/nonexistent/w', '--peer_timeout=0'],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
    'shardzoo: config error: --peer_timeout=0.0: must be at least 5 seconds'
  ), r.stderr[-2000:]


def test_default_config_declares_the_documented_model_options():
  """The README's model options are settable on the Quickstart config, at their defaults (the schema's: the values
  the model computes without them)."""
  from configs import default
  from models import layers

  model = default.get_config().model
  options = ('attention', 'remat', 'logits_dtype', 'loss_chunks', 'scan_layers')
  assert {k: model[k] for k in options} == {k: schema.FIELDS[f'model.{k}'].default for k in options}
  assert layers.stack_options(model) == dict(scan=False, remat='none') and layers.loss_chunks(model) == 0
  _, fv = parse(['train.py', f'--config={ROOT}/configs/default.py', '--config.model.scan_layers=True'])
  assert fv.config.model.scan_layers is True


def test_field_of_other_config_files_is_not_declared_here_not_misspelled():
  with pytest.raises(
    SystemExit,
    match=r'^shardzoo: config error: --config.model.remat=full: this config file does '
    r'not declare config.model.remat$',
  ):
    parse(['train.py', f'--config={ROOT}/configs/mnist.py', '--config.model.remat=full'])


def test_remat_booleans_mean_full_and_none_as_documented():
  from models import layers

  cfg = FAMILIES['gpt2'].get_config('tiny')
  for value, policy in ((True, 'full'), (False, 'none')):
    schema.check(with_value(cfg, 'model.remat', value))
    assert layers.remat_policy(value) == policy
  with pytest.raises(
    errors.ConfigError,
    match=r"^config.model.remat='True': must be one of \['none', 'full', 'dots', "
    r"'attention'\] \(or, in a config file, True/False for full/none\)$",
  ):
    schema.check(with_value(cfg, 'model.remat', 'True'))  # what --config.model.remat=True gives a str field


def test_two_presets_or_two_sizes_are_refused():
  gpt2 = FAMILIES['gpt2']
  with pytest.raises(ValueError, match=r"^gpt2.py: two presets 'tp' and 'dp' in 'tp,dp,tiny'; give one preset"):
    gpt2.get_config('tp,dp,tiny')
  with pytest.raises(ValueError, match=r"^gpt2.py: two sizes 'tiny' and 'real' in 'tiny,fsdp,real'"):
    gpt2.get_config('tiny,fsdp,real')
  assert (gpt2.get_config('tp,tiny,tp').preset, gpt2.get_config('tp,tiny,tp').size) == ('tp', 'tiny')
  with pytest.raises(ValueError, match=r"^bert.py: two tasks 'classify' and 'mlm' in 'mlm,tiny,classify'; give one"):
    FAMILIES['bert'].get_config('mlm,tiny,classify')  # the last task word won
  assert FAMILIES['bert'].get_config('classify,tiny,classify').task == 'text_classification'
  with pytest.raises(
    SystemExit,
    match=r"^shardzoo: config error: --config=.*gpt2.py:tp,dp: gpt2.py: two presets 'tp' and 'dp'",
  ):
    parse(['train.py', f'--config={ROOT}/configs/gpt2.py:tp,dp'])


def test_freeze_or_dont_load_matching_no_parameter_is_an_error():
  import types

  import jax
  import jax.numpy as jnp

  from training import optim, pretrained

  leaf = jax.ShapeDtypeStruct((4,), jnp.float32)
  params = {'tok': {'embedding': leaf}, 'blocks': {str(i): {'w': leaf} for i in range(6)}, 'ln_f': {'scale': leaf}}
  with pytest.raises(
    errors.ConfigError,
    match=r"^config.freeze='\^nothing_here/' matches no parameter path \(it would "
    r"freeze nothing\); paths are e.g. 'blocks/0/w', .*'tok/embedding' "
    r'\(4 of 8\)$',
  ):
    optim.trainable_labels(params, '^nothing_here/', None)
  assert optim.trainable_labels(params, '^tok/', None)['tok']['embedding'] == 'frozen'
  config = schema.complete(ml_collections.ConfigDict(dict(init_from='/no/such/dir', dont_load='^nothing_here/')))
  trainer = types.SimpleNamespace(config=config, abstract=types.SimpleNamespace(params=params, model_state={}))
  with pytest.raises(
    errors.ConfigError,
    match=r"^config.dont_load='\^nothing_here/' matches no parameter path "
    r"\(everything would be loaded\); paths are e.g. 'blocks/0/w'",
  ):
    pretrained.init_state(trainer, {})  # before anything is read
  config.dont_load = '^ln_f/'
  pretrained.check_dont_load(trainer)


# --- Hugging Face directories ------------------------------------------------------------------------


@pytest.fixture(scope='module')
def gpt2_dir(tmp_path_factory):
  transformers = pytest.importorskip('transformers')
  path = str(tmp_path_factory.mktemp('hf_gpt2'))
  transformers.GPT2LMHeadModel(
    transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=64, n_layer=2, n_head=4)
  ).save_pretrained(path)
  return path


def _variant(src, dst, edit_tensors=None, edit_config=None, truncate=False):
  import json
  import shutil

  from safetensors.numpy import load_file, save_file

  os.makedirs(dst)
  with open(os.path.join(src, 'config.json')) as f:
    cfg = json.load(f)
  with open(os.path.join(dst, 'config.json'), 'w') as f:
    json.dump(edit_config(cfg) if edit_config else cfg, f)
  weights = os.path.join(dst, 'model.safetensors')
  if edit_tensors:
    tensors = load_file(os.path.join(src, 'model.safetensors'))
    edit_tensors(tensors)
    save_file(tensors, weights, metadata={'format': 'pt'})
  else:
    shutil.copy(os.path.join(src, 'model.safetensors'), weights)
  if truncate:
    with open(weights, 'r+b') as f:
      f.truncate(os.path.getsize(weights) - 1000)
  return dst


HF_CASES = {  # name -> (variant kwargs, the one-line error)
  'missing tensor': (
    dict(edit_tensors=lambda t: t.pop('transformer.ln_f.weight')),
    r"Zoo parameters with no HF tensor \(1\): \['ln_f/scale'\]",
  ),
  'extra tensor': (
    dict(edit_tensors=lambda t: t.update({'transformer.h.0.extra.weight': t['transformer.ln_f.weight']})),
    r"HF tensors the model does not use \(1\): \['transformer.h.0.extra.weight'\]",
  ),
  'wrong shape': (
    dict(edit_tensors=lambda t: t.update({'transformer.ln_f.weight': t['transformer.ln_f.weight'][:60]})),
    r"transformer.ln_f.weight \(60,\) gives shape \(60,\) for zoo parameter 'ln_f/scale', which "
    r'expects \(64,\)',
  ),
  'wrong dtype': (
    dict(edit_tensors=lambda t: t.update({'transformer.ln_f.weight': t['transformer.ln_f.weight'].astype('int32')})),
    r"transformer.ln_f.weight holds I32 values, but zoo parameter 'ln_f/scale' is float32: weights "
    r'must be floating point',
  ),
  'truncated file': (
    dict(truncate=True),
    r'model.safetensors is not a readable safetensors file \(truncated or '
    r'damaged\?\)',
  ),
  'config.json of another family': (
    dict(edit_config=lambda c: dict(c, model_type='llama')),
    r"config.json has model_type='llama', but config.model.name='gpt2' imports "
    r"\['gpt2'\]",
  ),
}


def test_bad_hugging_face_directories_are_one_line_each(gpt2_dir, tmp_path):
  """Each bad directory fails in train.py's order (config.json adopted, then the import) before anything compiles."""
  import models
  from checkpointing import hf_config
  from configs import gpt2 as gpt2_config
  from tests.conftest import build_trainer
  from training import pretrained

  for name, (kwargs, message) in HF_CASES.items():
    path = _variant(gpt2_dir, str(tmp_path / name.replace(' ', '_')), **kwargs)
    cfg = gpt2_config.get_config('fsdp,tiny')
    cfg.init_from, cfg.model.dtype = path, 'float32'
    with pytest.raises(errors.ConfigError) as e:
      hf_config.adopt(cfg, models.HF_FAMILIES)
      pretrained.init_state(build_trainer(cfg), models.HF_FAMILIES)
    assert '\n' not in str(e.value) and __import__('re').search(message, str(e.value)), (name, str(e.value))
  cfg = gpt2_config.get_config('fsdp,tiny')  # and with bfloat16 parameters, which numpy does not call floating
  cfg.init_from, cfg.model.param_dtype = str(tmp_path / 'wrong_dtype'), 'bfloat16'
  with pytest.raises(
    errors.ConfigError,
    match="ln_f.weight holds I32 values, but zoo parameter 'ln_f/scale' is bfloat16: weights must be floating point",
  ):
    hf_config.adopt(cfg, models.HF_FAMILIES)
    pretrained.init_state(build_trainer(cfg), models.HF_FAMILIES)


# --- Data ---------------------------------------------------------------------------------------------


def test_bad_data_is_one_line_each():
  """A record that transforms to another shape or dtype (met while batching, in the prefetch threads), an
  empty split, and token ids beyond the model's vocabulary (checked before compiling)."""
  import dataclasses

  import numpy as np

  import data
  from tests.test_data_offline import check, make

  records = [{'x': np.zeros(4, np.float32), 'mask': np.float32(1)} for _ in range(16)]
  ds = data.Dataset('handmade', train=records, eval=records, transform=dict)
  cases = {
    'wrong shape': (
      {'x': np.zeros(5, np.float32), 'mask': np.float32(1)},
      r"^examples of one batch differ in field 'x': float32 \((4,\) and float32 \(5|5,\) and float32 \(4),\) "
      r'\(example \d of the batch\): a record of the dataset does not transform to the layout of the others',
    ),
    'wrong dtype': (
      {'x': np.zeros(4, np.int64), 'mask': np.float32(1)},
      r"^examples of one batch differ in field 'x': (float32 \(4,\) and int64|int64 \(4,\) and float32) \(4,\)",
    ),
  }
  for _name, (record, message) in cases.items():
    bad = dataclasses.replace(ds, train=records[:5] + [record] + records[6:])
    with pytest.raises(errors.ConfigError, match=message):
      it = iter(bad.train_dataset(8, slice(0, 8), seed=0))
      for _ in range(4):
        next(it)
    with pytest.raises(errors.ConfigError, match=message):
      list(dataclasses.replace(ds, eval=bad.train).eval_batches(8, slice(0, 8)))
  with pytest.raises(
    errors.ConfigError,
    match=r"^the eval split of 'handmade' is empty: no examples to train or "
    r'evaluate on$',
  ):
    dataclasses.replace(ds, eval=[]).example_spec()
  with pytest.raises(errors.ConfigError, match=r'^the training split has 0 examples, fewer than one global batch'):
    dataclasses.replace(ds, train=[]).train_dataset(8, slice(0, 8), seed=0)
  text = make('lm', vocab_size=16, name='markov_text', seq_len=16, num_train=64, num_eval=8)
  with pytest.raises(
    errors.ConfigError,
    match=r'^the byte tokenizer has 260 ids but config.model.vocab_size=16: set '
    r'config.model.vocab_size >= 260 \(token ids would fall outside',
  ):
    check(text, data.build(text))


ENTRY_POINTS = sorted(
  ['train.py', 'search.py', 'export.py']
  + [os.path.join('benchmarks', f) for f in os.listdir(os.path.join(ROOT, 'benchmarks')) if f.endswith('.py')]
)


def test_every_entry_point_taking_a_config_parses_and_reports_it_as_train_py_does():
  """Scripts with a --config read it with cli.parse_flags (a bad file, field or flag value is one line) and
  end on bad input with one line (errors.one_line; export.py words its own); benchmarks/throughput.py, run
  here, also checks every field before it builds anything."""
  with_config = []
  for path in ENTRY_POINTS:
    source = open(os.path.join(ROOT, path)).read()
    if 'DEFINE_config_file' in source:
      with_config.append(path)
      assert 'app.run(main, flags_parser=cli.parse_flags)' in source, path
      assert 'errors.one_line()' in source or "SystemExit(f'shardzoo: export error" in source, path
  assert {'train.py', 'benchmarks/throughput.py', 'benchmarks/loss_parity.py'} <= set(with_config)
  r = subprocess.run(
    [sys.executable, 'benchmarks/throughput.py', '--config', 'configs/gpt2.py:tiny', '--config.optim.lr=-1'],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert (
    r.returncode == 1
    and r.stderr.strip() == 'shardzoo: config error: config.optim.lr=-1.0: must be a finite number >= 0'
  )
  assert r.stdout == '', r.stdout
  r = subprocess.run(
    [sys.executable, 'benchmarks/throughput.py', '--config', 'configs/gpt2.py:tiny', '--steps=0'],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1 and r.stderr.strip() == (
    'shardzoo: config error: --steps=0 --warmup=5: need at least 1 timed step and no negative warm-up'
  ), r.stderr[-2000:]


def test_overrides_are_checked_before_ml_collections_applies_them(monkeypatch):
  """An unknown field or a value of the wrong type is found by reading the config, not ml_collections' error
  text: its wording can change (here it says nothing useful) and the message stays the same, in either form."""
  monkeypatch.setattr(ml_collections.ConfigDict, '_generate_did_you_mean_message', lambda *a: 'reworded')
  path = os.path.join(ROOT, 'configs', 'gpt2.py')
  for extra in (['--config.model.emebd_dim=3'], ['--config.model.emebd_dim', '3']):
    with pytest.raises(SystemExit) as e:
      parse(['train.py', f'--config={path}:tiny', *extra])
    assert str(e.value) == (
      "shardzoo: config error: --config.model.emebd_dim=3: the config has no field 'emebd_dim'; "
      "did you mean 'embed_dim'?"
    )
  with pytest.raises(SystemExit) as e:
    parse(['train.py', f'--config={path}:tiny', '--config.modle.embed_dim=3'])
  assert str(e.value) == (
    "shardzoo: config error: --config.modle.embed_dim=3: the config has no section 'modle'; did you mean 'model'?"
  )
  for value, kind in (('1.5', 'an integer'), ('yes please', 'an integer')):
    with pytest.raises(SystemExit) as e:
      parse(['train.py', f'--config={path}:tiny', f'--config.batch_size={value}'])
    assert (
      str(e.value)
      == f'shardzoo: config error: flag --config.batch_size={value}: cannot parse {value!r} (must be {kind})'
    )
  with pytest.raises(SystemExit) as e:
    parse(['train.py', f'--config={path}:tiny', '--config.model.scan_layers=maybe'])
  assert str(e.value).endswith("cannot parse 'maybe' (must be True or False)")
  _, fv = parse(['train.py', f'--config={path}:tiny', '--config.model.embed_dim', '32', '--config.model.scan_layers=f'])
  assert (fv.config.model.embed_dim, fv.config.model.scan_layers) == (32, False)
