"""One default per config field: configs/schema.py FIELDS declares it, schema.complete fills it in, and the code
reads `config.x`. These tests fail where a second default is written: a `config.get('x', default)` in the code,
or a config file restating a default in every variant it builds."""

import ast
import os
import subprocess
import sys

import ml_collections
import pytest

import data  # noqa: F401  (registers the choices of the dataset fields it owns)
from configs import schema
from tests.conftest import ROOT, subprocess_env
from tests.test_configs import MODULES

# The code that handles configs before they are complete (completing and checking them) reads them with .get.
COMPLETES = ('configs/schema.py', 'configs/cli.py')

# Leaf names of the fields every config has once completed: a one-argument .get of them is a hidden default too
# (None), where the field can only be missing from an incomplete config.
EVERY_CONFIG = {
  path.rpartition('.')[2]
  for path, f in schema.FIELDS.items()
  if f.only is None and (not path.startswith('model.') or path.rpartition('.')[2] in ('name', *schema.EVERY_FAMILY))
} | {'model', 'dataset', 'optim', 'lora', 'pipeline'}
LEAVES = {path.rpartition('.')[2] for path in schema.FIELDS} | {'model', 'dataset', 'optim', 'lora', 'pipeline'}


def _config_like(node: ast.AST, aliases: set[str]) -> bool:
  """An expression that holds a config or one of its sections: config, cfg, lora_cfg, trainer.config,
  config.model, self.cfg ..., or a name bound to one in the same module (m = config.model)."""
  text = ast.unparse(node)
  if isinstance(node, ast.Name) and node.id in aliases:
    return True
  return any(
    part in ('config', 'cfg') or part.endswith(('_config', '_cfg')) for part in text.replace('(', '.').split('.')
  )


def second_defaults(source: str) -> list[tuple[int, str]]:
  """(line, field) of each `<config>.get('<field>', default)`, `getattr(<config>, '<field>', default)`,
  `<config>.get('<field>') or <constant>`, and one-argument `<config>.get('<field>')` of a field every config has,
  in one module's source."""
  tree = ast.parse(source)
  aliases: set[str] = set()
  for _ in range(2):  # names bound to configs, and names bound to those
    for n in ast.walk(tree):
      if isinstance(n, ast.Assign) and _config_like(n.value, aliases):
        aliases |= {t.id for t in n.targets if isinstance(t, ast.Name)}
  or_default = {  # get calls whose `or` supplies a constant in place of None
    id(n.values[0])
    for n in ast.walk(tree)
    if isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or)
    if any(isinstance(v, ast.Constant) and v.value is not None for v in n.values[1:])
  }
  out = []
  for n in ast.walk(tree):
    if not isinstance(n, ast.Call) or not n.args:
      continue
    if isinstance(n.func, ast.Attribute) and n.func.attr == 'get':
      receiver, args = n.func.value, n.args
    elif isinstance(n.func, ast.Name) and n.func.id == 'getattr' and len(n.args) == 3:
      receiver, args = n.args[0], n.args[1:]
    else:
      continue
    key = args[0]
    if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and _config_like(receiver, aliases)):
      continue
    if key.value in LEAVES and (len(args) > 1 or id(n) in or_default) or (len(args) == 1 and key.value in EVERY_CONFIG):
      out.append((n.lineno, key.value))
  return sorted(out)


def python_files() -> list[str]:
  listed = subprocess.run(['git', 'ls-files', '*.py'], cwd=ROOT, capture_output=True, text=True, check=True)
  return [f for f in listed.stdout.split() if not f.startswith('tests/') and f not in COMPLETES]


def test_the_code_reads_fields_without_a_default_of_its_own():
  found = []
  for path in python_files():
    with open(os.path.join(ROOT, path), encoding='utf-8') as f:
      found += [f'{path}:{line} ({field})' for line, field in second_defaults(f.read())]
  assert not found, (
    'config.get(field, default) writes a second default (configs/schema.py FIELDS has the one): read config.field '
    f'instead: {found}'
  )


def test_the_scan_finds_what_it_is_for():
  source = (
    'def f(config, cfg, lora_cfg, c):\n'
    "  a = config.get('grad_accum_steps', 1)\n"  # 2: a second default
    "  b = getattr(cfg, 'tie_embeddings', True)\n"  # 3: another
    '  m = config.model\n'
    "  d = m.get('dtype', 'float32')\n"  # 5: through an alias
    "  e = lora_cfg.get('rank')\n"  # 6: a field every config has: a hidden None
    "  f = config.model.get('max_len')\n"  # a family's field: whether it has one
    "  g = c.get('type_vocab_size', 2)\n"  # a Hugging Face config.json dict, not a config
    "  h = config.get('not_a_field', 3)\n"
    "  i = cfg.get('sample_by') or 'line'\n"  # 10: a default through `or`
    "  j = config.model.get('vocab_size') or config.dataset.get('vocab_size')\n"  # whichever the config has
  )
  found = second_defaults(source)
  assert found == [(2, 'grad_accum_steps'), (3, 'tie_embeddings'), (5, 'dtype'), (6, 'rank'), (10, 'sample_by')]


def variants(name, module) -> list[str]:
  """Every preset x size (and task word) a config file builds."""
  words = [[p] for p in module.RULES]
  if hasattr(module, 'SIZES'):
    words = [w + [s] for w in words for s in module.SIZES]
  if name == 'bert':
    words += [w + ['classify'] for w in words]
  if name == 'llama_sft':
    words += [w + ['lora'] for w in words]
  return [','.join(w) for w in words]


def test_no_config_file_restates_a_default_everywhere(monkeypatch):
  """A config file sets what it changes. A field set to the schema's default in every variant the file builds
  restates the default (a second home for it); one that equals the default in some variants only is those
  variants' choice (a real size's recipe), and stays."""
  monkeypatch.setattr(schema, 'complete', lambda config: config)  # what each file writes itself
  restated = []
  for name, module in MODULES:
    written = [schema.leaves(module.get_config(arg)) for arg in variants(name, module)]
    for path, field in schema.FIELDS.items():
      default = field.default
      if callable(default) or default is schema.REQUIRED:
        continue
      values = [w[path] for w in written if path in w]
      if values and len(values) == len(written) and all(v == default and type(v) is type(default) for v in values):
        restated.append(f'configs/{name}.py: config.{path}={default!r}')
  assert not restated, f'config files restating the schema default in every variant: {restated}'


def test_language_model_configs_take_your_own_data_from_the_command_line(tmp_path):
  """Every LM config parses docs/your_data.md's own-data flags (fields it does not write itself), at any size."""
  from absl import flags
  from ml_collections import config_flags

  from configs import cli

  data = tmp_path / 'my.jsonl'
  data.write_text('{"prompt": "a", "completion": "b"}\n')
  own = dict(
    name='json',
    train_files=str(data),
    eval_files=str(data),
    prompt_key='prompt',
    completion_key='completion',
    messages_key='',
    tokenizer='byte',
    cache_dir=str(tmp_path / 'cache'),
    sample_by='paragraph',
    no_assistant='error',
  )
  for name, module in MODULES:
    for arg in [a for a in (None, 'tiny') if a is None or 'tiny' in getattr(module, 'SIZES', {})]:
      if module.get_config(arg).task != 'lm':
        continue
      argv = ['train.py', f'--config={ROOT}/configs/{name}.py' + (f':{arg}' if arg else '')]
      argv += [f'--config.dataset.{k}={v}' for k, v in own.items()]
      fv = flags.FlagValues()
      config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True, sys_argv=argv)
      cli.parse_flags(argv, fv)
      schema.check(fv.config)
      assert {k: fv.config.dataset[k] for k in own} == own, (name, arg)


def test_a_config_file_that_sets_only_what_it_changes_is_completed_before_the_overrides(tmp_path):
  """A user's config file without the defaults: loaded, completed, its unset fields overridden on the command
  line."""
  from absl import flags
  from ml_collections import config_flags

  from configs import cli

  file = tmp_path / 'mine.py'
  file.write_text(
    'import ml_collections\n\n\ndef get_config():\n'
    '  return ml_collections.ConfigDict(dict(task="lm", batch_size=8, total_steps=3, mesh=dict(data=8),\n'
    '    logical_axis_rules=[("batch", "data")], optim=dict(lr=1e-3), dataset=dict(name="markov", seq_len=16),\n'
    '    model=dict(name="gpt2", vocab_size=16, max_len=16, num_layers=1, num_heads=2, embed_dim=8, mlp_dim=16,\n'
    '      norm_eps=1e-5)))\n'
  )
  argv = ['train.py', f'--config={file}', '--config.grad_accum_steps=2', '--config.model.remat=full']
  argv += ['--config.dataset.train_files=x.jsonl', '--config.optim.b2=0.99']
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True, sys_argv=argv)
  cli.parse_flags(argv, fv)
  config = fv.config
  schema.check(config)
  assert (config.grad_accum_steps, config.model.remat, config.dataset.train_files) == (2, 'full', 'x.jsonl')
  assert (config.optim.b2, config.optim.weight_decay, config.lora.rank, config.dcn_mesh.to_dict()) == (
    0.99,
    schema.FIELDS['optim.weight_decay'].default,
    0,
    {'data': 1},
  )
  assert 'num_experts' not in config.model and 'augment' not in config.dataset  # not this family's, nor task's


def test_complete_fills_the_family_task_and_optimizer_fields_and_keeps_what_is_set():
  config = ml_collections.ConfigDict(
    dict(task='classification', model=dict(name='vit', attention='xla'), optim=dict(name='sgd'), dataset=dict())
  )
  schema.complete(config)
  assert config.model.attention == 'xla' and config.model.scan_layers is False and 'logits_dtype' not in config.model
  assert config.optim.momentum == 0.9 and 'b1' not in config.optim
  assert config.dataset.augment is None and 'tokenizer' not in config.dataset and 'train_files' not in config.dataset
  config.optim.name = 'adamw'  # --config.optim.name=adamw on an SGD config: check fills what AdamW reads
  config.lock()
  schema.complete(config)
  assert config.optim.b2 == 0.95 and config.is_locked


def test_an_owned_field_checked_before_its_owner_registered_is_a_programming_error():
  """The fields whose choices other modules own are checked once those are imported (train.py imports them right
  after its first check): a check without them asserts, it never passes silently. models and data own all an LM
  config's (a decoding process imports no training/)."""
  code = (
    'import sys\n'
    'from configs import gpt2, schema\n'
    "c = gpt2.get_config('tiny')\n"
    "c.model.attention = 'xla'\n"
    'schema.check(c, owned=False)\n'
    "print('jax imported:', 'jax' in sys.modules)\n"
    'try:\n'
    '  schema.check(c)\n'
    'except AssertionError as e:\n'
    '  print(e)\n'
    'import data, models\n'
    'schema.check(c)\n'
    "print('checked; training imported:', 'training' in sys.modules)\n"
  )
  r = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=60
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert 'jax imported: False' in r.stdout and 'was never imported: import it before configs.schema.check' in r.stdout
  assert 'checked; training imported: False' in r.stdout, r.stdout


@pytest.mark.parametrize('path', sorted(p for p, f in schema.FIELDS.items() if f.owner))
def test_each_owned_default_is_one_of_its_owners_choices(path):
  field = schema.FIELDS[path]
  assert field.default in (schema.REQUIRED, None, *field.choices())


def test_configs_import_no_owner():
  """The owners register with the schema (owners -> configs): configs/ imports none of them, not even lazily."""
  owners = ('training', 'models', 'data', 'partitioning')
  for path in sorted(os.listdir(os.path.join(ROOT, 'configs'))):
    if not path.endswith('.py'):
      continue
    with open(os.path.join(ROOT, 'configs', path), encoding='utf-8') as f:
      tree = ast.parse(f.read())
    for n in ast.walk(tree):
      names = (
        [a.name for a in n.names]
        if isinstance(n, ast.Import)
        else [n.module or '']
        if isinstance(n, ast.ImportFrom)
        else []
      )
      assert not [m for m in names if m.split('.')[0] in owners], f'configs/{path}:{n.lineno} imports {names}'
      if isinstance(n, ast.Attribute) and n.attr == 'import_module':
        raise AssertionError(f'configs/{path}:{n.lineno} imports a module by name')
