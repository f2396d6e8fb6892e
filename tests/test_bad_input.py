"""Bad input, tried systematically (issue 12): every field of every config file with a value of the wrong type
and values out of range, an unknown field and a misspelled preset on the command line, bad data and bad
Hugging Face directories. Each gives one ConfigError line naming the culprit and what is allowed, before
anything compiles."""
import os

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

import errors
import train
from configs import schema
from tests.conftest import ROOT
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
    for path, value in schema.leaves(cfg).items():
      assert path in schema.FIELDS, f'{name}: config.{path} is described nowhere (configs/schema.py FIELDS)'
      for bad in schema.FIELDS[path].bad_values():
        cases += 1
        with pytest.raises(errors.ConfigError) as e:
          schema.check(with_value(cfg, path, bad))
        message = str(e.value)
        assert message.startswith(f'config.{path}={bad!r}: must be ' if path not in schema.OPAQUE else
                                  f'config.{path}='), (name, message)
        assert '\n' not in message, message
        clear += 1
  print(f'config fields: {cases} bad values over {len(list(configs()))} configs, {clear} one-line errors')
  assert cases > 500


def test_train_py_checks_the_schema_before_building_anything(monkeypatch):
  cfg = with_value(FAMILIES['gpt2'].get_config('tiny'), 'optim.lr', -1.0)
  monkeypatch.setattr(train.partitioning, 'fit_mesh', lambda *a: pytest.fail('built before the schema check'))
  with pytest.raises(errors.ConfigError, match=r'^config.optim.lr=-1.0: must be a number >= 0$'):
    train.train_and_evaluate(cfg, None, dry_run=True)
  with pytest.raises(errors.ConfigError, match=r"^config.model.num_haeds is not a field shardzoo knows"):
    train.train_and_evaluate(with_value(FAMILIES['gpt2'].get_config('tiny'), 'model.num_haeds', 4), None)


def parse(argv):
  """train.py's command line parsed as app.run does (a fresh flag set reading these arguments)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, lock_config=True, sys_argv=argv)
  return schema.parse_flags(argv, fv), fv


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_command_line_unknown_field_misspelled_preset_and_wrong_type(name):
  module = FAMILIES[name]
  path = os.path.join(ROOT, 'configs', f'{name}.py')
  field = next(p for p, f in schema.FIELDS.items() if f.kind is int and p in schema.leaves(module.get_config())
               and '.' in p)
  section, key = field.rsplit('.', 1)
  typo = key[1] + key[0] + key[2:]
  cases = [
      ([f'--config.{section}.{typo}=3'], rf"^shardzoo: config error: --config.{section}.{typo}=3: the config has no "
                                         rf"field '{typo}'; did you mean '{key}'\?$"),
      ([f'--config.{field}=abc'], rf"^shardzoo: config error: flag --config.{field}=abc: .*'abc' \(must be an "
                                  r'integer\)$'),
  ]
  presets = list(module.RULES)
  argv0 = ['train.py', f'--config={path}:{presets[0]}x']
  with pytest.raises(SystemExit, match=rf"^shardzoo: config error: flag --config={path}:{presets[0]}x: Error whilst "
                                       rf"parsing config file: .*{presets[0]}x.*{presets[0]}"):
    parse(argv0)
  for extra, message in cases:
    with pytest.raises(SystemExit, match=message):
      parse(['train.py', f'--config={path}', *extra])
  _, fv = parse(['train.py', f'--config={path}', f'--config.{field}=7'])
  assert schema.leaves(fv.config)[field] == 7
