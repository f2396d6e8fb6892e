"""Every entry point guards its inputs as train.py does (guards.py, and each entry point's own checks): a table of
mistakes per entry point, each case one `shardzoo:` line naming its culprit, no traceback, and every file of the
directory the cases point at byte-for-byte as it was (no output written over a user's file, nothing written into a
run). The cases of one entry point run in one process (tests/mistakes.py), the entry points' processes at once."""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

import errors
import guards
from checkpointing import run_config
from configs import schema
from errors import ConfigError
from generation import engine
from tests import children
from tests.conftest import ROOT, subprocess_env, tiny_config

# {S}: the sandbox (a run, a ViT run, prompt files, a user's notes). (argv, what the one line must contain.)
TABLES = {
  'generate': [
    (['--workdir', '{S}/run', '--prompts', '{S}/missing.jsonl'], '--prompts={S}/missing.jsonl: no such file'),
    (['--workdir', '{S}/run', '--prompts', '{S}/adir'], '--prompts={S}/adir is a directory, not a file'),
    (['--workdir', '{S}/run', '--prompts', '{S}/broken.jsonl'], '{S}/broken.jsonl:3: not JSON (Expecting'),
    (['--workdir', '{S}/run', '--prompts', '{S}/latin1.jsonl'], '{S}/latin1.jsonl:2: not UTF-8 text'),
    (
      ['--workdir', '{S}/run', '--prompts', '{S}/number.jsonl'],
      '{S}/number.jsonl:1: "prompt" is a number, not a string',
    ),
    (
      ['--workdir', '{S}/run', '--prompts', '{S}/chat_number.jsonl'],
      'chat_number.jsonl:2: messages[1] has "content": 5',
    ),
    (['--workdir', '{S}/run', '--prompts', '{S}/list.jsonl'], '{S}/list.jsonl:1: a list, not a JSON object'),
    (['--workdir', '{S}/run', '--prompts', '{S}/empty.jsonl'], 'no prompts: give --prompt'),
    (
      ['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/nodir/out.jsonl'],
      'its directory {S}/nodir does not exist',
    ),
    (
      ['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/notes.txt/o.jsonl'],
      'its directory {S}/notes.txt is a file, not a directory',
    ),
    (['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/run/run_config.json'], 'is a file of the run in {S}/run'),
    (['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/run/sharding_table.txt'], 'is a file of the run in'),
    (['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/run/checkpoints/1/x.jsonl'], 'is a file of the run in'),
    (
      ['--workdir', '{S}/run', '--prompts', '{S}/prompts.jsonl', '--out', '{S}/prompts.jsonl', '--overwrite'],
      '--out={S}/prompts.jsonl is also --prompts',
    ),
    (['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/notes.txt'], 'exists and is not an earlier generate.py'),
    (
      ['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/results.json'],
      'exists and is not an earlier generate.py',
    ),
    (['--workdir', '{S}/run', '--prompt', 'a', '--out', '{S}/adir'], '--out={S}/adir is a directory'),
    (
      ['--workdir', '{S}/run', '--prompt', 'a', '--tokenizer', '{S}/adir', '--out', '{S}/adir/x.jsonl', '--overwrite'],
      '--out={S}/adir/x.jsonl is inside --tokenizer={S}/adir, which this command reads',
    ),
    (['--workdir', '{S}/missing', '--prompt', 'a'], '--workdir {S}/missing does not exist'),
    (['--workdir', '{S}/notes.txt', '--prompt', 'a'], '--workdir {S}/notes.txt is a file, not a directory'),
    (['--workdir', '{S}/run/checkpoints', '--prompt', 'a'], "is a run's checkpoints/ directory (steps [1])"),
    (['--workdir', '{S}/run/checkpoints/1', '--prompt', 'a'], "one checkpoint step's directory"),
    (['--workdir', '{S}/vit', '--prompt', 'a'], "config.task='classification' (model 'vit'): generation needs a"),
    (['--workdir', '{S}/run', '--prompt', 'a', '--config.mesh.tensor=1'], '--config.mesh.tensor=1: --config.* flags'),
    (['--prompt', 'a'], 'usage error: give --workdir RUN or --init_from'),
    (['--workdir', '{S}/run', '--prompt', 'a', '--temperature', '-1'], 'temperature=-1.0: must be >= 0'),
    (['--init_from', '{S}/adir', '--prompt', 'a'], "--init_from='{S}/adir' is not a Hugging Face model directory"),
  ],
  'evaluate_lm': [
    (['--workdir', '{S}/run', '--tasks', 't', '--limit', '0'], '--limit=0: must be at least 1'),
    (['--workdir', '{S}/run', '--tasks', 't', '--limit', '-5'], '--limit=-5: must be at least 1'),
    (['--workdir', '{S}/run', '--tasks', 't', '--batch_size', '0'], '--batch_size=0: must be an integer >= 1'),
    (['--workdir', '{S}/run', '--tasks', 't', '--num_fewshot', '-1'], '--num_fewshot=-1: must be >= 0'),
    (['--workdir', '{S}/run', '--tasks', 't', '--include_path', '{S}/nodir'], '--include_path={S}/nodir: no such'),
    (['--workdir', '{S}/run', '--tasks', 't', '--include_path', '{S}/notes.txt'], 'is a file: give the directory'),
    (
      ['--workdir', '{S}/run', '--tasks', 'zoo_tsk,hellaswagg', '--include_path', '{S}/tasks'],
      "--tasks: 'hellaswagg' not among lm-eval's tasks and {S}/tasks's YAML files ('hellaswagg': did you mean",
    ),
    (['--workdir', '{S}/run', '--tasks', 't', '--out', '{S}/nodir/r.json'], 'its directory {S}/nodir does not exist'),
    (['--workdir', '{S}/run', '--tasks', 't', '--out', '{S}/run/run_config.json'], 'is a file of the run in {S}/run'),
    (['--workdir', '{S}/run', '--tasks', 't', '--out', '{S}/notes.txt'], 'exists and is not an earlier evaluate_lm'),
    (['--workdir', '{S}/run', '--tasks', 't', '--out', '{S}/prompts.jsonl'], 'exists and is not an earlier'),
    (['--workdir', '{S}/run'], 'usage error: give --workdir RUN or --init_from HF_DIR (one of them), and --tasks'),
  ],
  'train': [
    (['--config', 'configs/gpt2.py:tiny', '--workdir', '{S}/notes.txt'], '--workdir {S}/notes.txt is a file, not a'),
    (['--config', 'configs/gpt2.py:tiny', '--workdir', '{S}/run/checkpoints'], 'is inside the checkpoints/ of the run'),
    (
      ['--config', 'configs/gpt2.py:tiny', '--workdir', '{S}/run/checkpoints/1/new'],
      'checkpoints/ of the run in {S}/run',
    ),
    (
      ['--workdir', '{S}/new', '--config.total_steps=3'],
      '--config.total_steps=3: --config.* flags override a --config',
    ),
  ],
  'search': [
    (
      ['--config', 'configs/gpt2.py:tiny', '--devices', '8', '--device_kind', 'cpu', '--micro_batches=-2,abc'],
      "['abc'] not",
    ),
    (
      ['--config', 'configs/gpt2.py:tiny', '--devices', '8', '--device_kind', 'cpu', '--micro_batches=0'],
      '[0] would split',
    ),
    (
      ['--config', 'configs/gpt2.py:tiny', '--devices', '8', '--device_kind', 'cpu', '--out', '{S}/notes.txt'],
      'notes.txt',
    ),
  ],
  'export': [
    (['--workdir', '{S}/missing', '--out', '{S}/hf'], '--workdir {S}/missing does not exist'),
    (['--workdir', '{S}/run/checkpoints', '--out', '{S}/hf'], "is a run's checkpoints/ directory"),
    (['--workdir', '{S}/run', '--out', '{S}/notes.txt'], '{S}/notes.txt'),
  ],
}


def _config(module: str, arg: str | None = None):
  import importlib  # noqa: PLC0415

  return schema.complete(importlib.import_module(f'configs.{module}').get_config(*([arg] if arg else [])))


@pytest.fixture(scope='module')
def sandbox(tmp_path_factory):
  """A run (its config, table and a step's folder), a ViT run, prompt files right and wrong, a user's files."""
  s = tmp_path_factory.mktemp('mistakes')
  run_config.save(tiny_config(), str(s / 'run'))
  (s / 'run' / 'sharding_table.txt').write_text('the run table\n')
  (s / 'run' / 'checkpoints' / '1' / 'state').mkdir(parents=True)
  run_config.save(_config('vit', 'tiny'), str(s / 'vit'))
  (s / 'adir').mkdir()
  (s / 'tasks').mkdir()
  (s / 'tasks' / 'zoo_tsk.yaml').write_text('task: zoo_tsk\ndataset_path: json\noutput_type: loglikelihood\n')
  files = {
    'notes.txt': 'my notes\n',
    'results.json': '{"results": {}}\n',
    'prompts.jsonl': '{"prompt": "ab"}\n',
    'broken.jsonl': '{"prompt": "ab"}\n\n{"prompt": "ab"\n',
    'number.jsonl': '{"prompt": 3}\n',
    'chat_number.jsonl': '{"prompt": "x"}\n{"messages": [{"role": "user", "content": "a"}, {"role": "user", '
    '"content": 5}]}\n',
    'list.jsonl': '["ab"]\n',
    'empty.jsonl': '\n',
  }
  for name, text in files.items():
    (s / name).write_text(text)
  (s / 'latin1.jsonl').write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
  return s


def tree(root) -> dict[str, str]:
  """Every file and directory under `root`, with its bytes' hash."""
  out = {}
  for d, dirs, names in os.walk(root):
    for n in dirs:
      out[os.path.relpath(os.path.join(d, n), root) + '/'] = ''
    for n in names:
      with open(os.path.join(d, n), 'rb') as f:
        out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope='module')
def outcomes(sandbox):
  """Each entry point's table run in its own process, all at once; (results per entry point, seconds, tree before,
  tree after)."""
  before = tree(sandbox)
  fill = lambda a: [x.replace('{S}', str(sandbox)) for x in a]
  env = {**subprocess_env(), 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1'}
  t0 = time.perf_counter()
  procs = {
    entry: children.Popen(
      [sys.executable, 'tests/mistakes.py', entry], cwd=ROOT, env=env, text=True,
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    for entry in TABLES
  }  # fmt: skip
  for entry, proc in procs.items():
    proc.stdin.write(json.dumps([fill(a) for a, _ in TABLES[entry]]))
    proc.stdin.close()
  results = {}
  for entry, proc in procs.items():
    out = proc.stdout.read()
    proc.wait(timeout=300)
    assert proc.returncode == 0, (entry, proc.stderr.read()[-3000:])
    results[entry] = json.loads(out.splitlines()[-1])
  return results, time.perf_counter() - t0, before, tree(sandbox)


@pytest.mark.parametrize('entry', sorted(TABLES))
def test_each_mistake_is_one_line_naming_its_culprit_and_no_file_changes(entry, outcomes, sandbox):
  results, seconds, before, after = outcomes
  print(f'{entry}: {len(TABLES[entry])} cases; all tables {seconds:.1f}s')
  bad = []
  for (argv, want), got in zip(TABLES[entry], results[entry], strict=True):
    want = want.replace('{S}', str(sandbox))
    line = got['code'] if isinstance(got['code'], str) else None
    one = line is not None and line.startswith('shardzoo: ') and '\n' not in line and want in line
    if not one or got['raised'] or 'Traceback' in got['err']:
      bad.append((argv, want, got['code'], got['raised'] or got['err'][-500:]))
  assert not bad, '\n'.join(map(str, bad))
  assert after == before


def test_an_output_replaces_only_an_earlier_output_of_its_kind(tmp_path):
  earlier, mine = tmp_path / 'earlier.jsonl', tmp_path / 'mine.txt'
  earlier.write_text('{"ok": 1}\n')
  mine.write_text('mine\n')
  is_ours = lambda p: guards.first_json_line(p) == {'ok': 1}
  assert guards.output_file(str(earlier), '--out', what='x', previous=is_ours) == str(earlier)
  assert guards.output_file(str(tmp_path / 'new.jsonl'), '--out', what='x', previous=is_ours)
  with pytest.raises(ConfigError, match=r'exists and is not an earlier x: give a new path, or --overwrite'):
    guards.output_file(str(mine), '--out', what='x', previous=is_ours)
  guards.output_file(str(mine), '--out', what='x', previous=is_ours, overwrite=True)
  guards.write_text(str(mine), 'new\n')
  assert mine.read_text() == 'new\n' and sorted(os.listdir(tmp_path)) == ['earlier.jsonl', 'mine.txt']


@pytest.mark.parametrize(
  'prompt_len, new, max_len, fix',
  [
    (20, 8, 24, 'shorten the prompt to 16 tokens or ask for at most --max_new_tokens=4'),
    (10, 32, 32, 'ask for at most --max_new_tokens=22'),
    (40, 32, 32, 'shorten the prompt below 32 tokens and ask for fewer new ones'),
  ],
)
def test_a_prompt_too_long_is_told_a_fix_that_fits(prompt_len, new, max_len, fix):
  assert engine._fix(prompt_len, new, max_len) == fix


def test_a_refused_rerun_writes_nothing_into_the_run(tmp_path, monkeypatch):
  """A rerun refused where its starting point is chosen (another model's checkpoints: choose_start's metadata check,
  stood in for here so nothing compiles) leaves the run's table and config as they were."""
  import train  # noqa: PLC0415
  from training import run as steps  # noqa: PLC0415

  run = tmp_path / 'run'
  (run / 'checkpoints').mkdir(parents=True)
  (run / 'sharding_table.txt').write_text('the run table\n')
  (run / 'run_config.json').write_text('{"the": "run config"}\n')
  before = tree(run)

  def refuse(*a):
    raise errors.CheckpointError("parameter 'x': the model expects shape (256, 64), the checkpoint has (128, 64)")

  monkeypatch.setattr(steps, 'choose_start', refuse)
  with pytest.raises(errors.CheckpointError):
    train.train_and_evaluate(tiny_config(), str(run))
  assert tree(run) == before
  train.train_and_evaluate(tiny_config(), str(run), dry_run=True)  # a dry run does not write into a run either
  assert tree(run) == before


def test_rows_of_the_wrong_type_or_with_answers_cut_away_are_named_before_training(tmp_path, caplog):
  """Data rows (data/row_checks.py): numbers where text is due, named with their file and line; answers that
  config.dataset.seq_len cuts away entirely: an error where every row checked is cut, a warning with the count."""
  import data  # noqa: PLC0415
  from tests.test_your_data import make, write_jsonl  # noqa: PLC0415

  good = write_jsonl(tmp_path / 'good.jsonl', [{'prompt': 'ab:', 'completion': 'ba'}] * 4)
  nums = write_jsonl(tmp_path / 'nums.jsonl', [{'prompt': 3, 'completion': 4}] * 2)
  mixed = write_jsonl(tmp_path / 'mixed.jsonl', [{'prompt': 'a', 'completion': 'b'}, {'prompt': 5, 'completion': 'c'}])
  turn = lambda c: [{'role': 'user', 'content': c}, {'role': 'assistant', 'content': 'x'}]
  chat = write_jsonl(tmp_path / 'chat.jsonl', [{'messages': turn('a')}, {'messages': turn(5)}])
  long = write_jsonl(tmp_path / 'long.jsonl', [{'prompt': 'p' * 40, 'completion': 'ok'}] * 3)
  some = write_jsonl(
    tmp_path / 'some.jsonl', [{'prompt': 'p' * (40 if i == 1 else 2), 'completion': 'o'} for i in range(4)]
  )
  pc = dict(name='json', prompt_key='prompt', completion_key='completion', seq_len=16, tokenizer='byte')
  cases = [
    (dict(pc, train_files=nums, eval_files=good), rf"^{nums} line 1: 'prompt' is 3 \(int\), not text"),
    (dict(pc, train_files=mixed, eval_files=good), rf"^{mixed} line 2: 'prompt' is 5 \(int\), not text"),
    (
      dict(name='json', messages_key='messages', seq_len=32, tokenizer='byte', train_files=chat, eval_files=chat),
      rf"^{chat} line 2: a message's 'content' is 5 \(int\), not text",
    ),
    (
      dict(pc, train_files=good, eval_files=long),
      rf'^eval_files: every row checked \(3 of 3\) has its answer beyond config.dataset.seq_len=16 \(e.g. {long} '
      r'line 1: the answer starts at token 41\), so nothing would be evaluated: raise config.dataset.seq_len to at '
      'least 41',
    ),
  ]
  for dataset, message in cases:
    with pytest.raises(ConfigError, match=message):
      data.build(make(**dataset))
  with caplog.at_level('WARNING'):
    data.build(make(**dict(pc, train_files=some, eval_files=good)))
  assert any(
    f'1 of 4 train_files rows checked have their answer beyond config.dataset.seq_len=16 (e.g. {some} line 2)'
    in r.getMessage()
    for r in caplog.records
  ), caplog.text


def test_settings_that_do_nothing_are_warned_and_pipelines_named_where_they_cannot_run():
  """accum_gather_once without accumulation and pipeline.* without a stage rule: warnings. Accumulation that
  leaves the pipeline's micro-batches fewer rows than the shards inside it, and a pipelined run's rules for
  decoding: one ConfigError naming the fields."""
  import importlib  # noqa: PLC0415

  import partitioning  # noqa: PLC0415
  from generation import loading  # noqa: PLC0415
  from tests.conftest import build_trainer  # noqa: PLC0415

  gpt2 = importlib.import_module('configs.gpt2')
  c = schema.complete(gpt2.get_config('tiny'))
  c.accum_gather_once, c.pipeline.microbatches = True, 4
  assert schema.warnings(c) == [
    'config.accum_gather_once=True has no effect with config.grad_accum_steps=1: it gathers the weights once for '
    'all micro-batches of a step, and there is one',
    "config.pipeline.microbatches=4, repeats=1 have no effect: no rule maps 'layers' to the 'stage' mesh axis, so "
    'nothing is pipelined (docs/pipelines.md)',
  ]
  pp = schema.complete(gpt2.get_config('pp,tiny'))  # batch 32, 8 pipeline micro-batches, fsdp=2 inside
  assert schema.warnings(pp) == []
  pp.grad_accum_steps = 4
  with pytest.raises(
    ConfigError,
    match=r'^config.batch_size=32 / config.grad_accum_steps=4 / config.pipeline.microbatches=8 leaves 1 row\(s\) per '
    r'pipeline micro-batch, which the 2 batch shards inside the pipeline cannot split: make batch_size a multiple '
    'of 64',
  ):
    build_trainer(pp)
  pp.grad_accum_steps = 1
  mesh, _ = partitioning.start_mesh(pp.mesh)
  with pytest.raises(ConfigError, match=r'^config.logical_axis_rules pipeline the layers over stage=4 .*decode_rules'):
    loading.build(loading.decode_config(pp), mesh)


@pytest.mark.parametrize('token_cache', [True, False], ids=['while-the-token-cache-builds', 'in-a-loader-thread'])
def test_an_error_while_a_row_is_made_into_ids_names_the_row(tmp_path, monkeypatch, token_cache):
  """Where a row becomes ids (the token cache's build, or a grain loader thread without the cache), a tokenizer or
  template error is one line naming the row's file and line; so is one in the rows the build checks first."""
  import data  # noqa: PLC0415
  from data import row_checks, tokens  # noqa: PLC0415
  from tests.test_your_data import make, take, write_jsonl  # noqa: PLC0415

  chat = lambda said: {'messages': [{'role': 'user', 'content': said}, {'role': 'assistant', 'content': 'b'}]}
  rows = [chat('a')] * 8
  rows[3] = chat('bad')  # line 4: not among the rows the build's check tokenizes (0 and 7, with SAMPLE=2)
  path = write_jsonl(tmp_path / 'c.jsonl', rows)
  real = tokens.chat

  def broken(tok, messages, *a, **k):  # what a template meeting an unexpected value raises
    if messages[0]['content'] == 'bad':
      raise TypeError('can only concatenate str (not "int") to str')
    return real(tok, messages, *a, **k)

  monkeypatch.setattr(tokens, 'chat', broken)
  monkeypatch.setattr(row_checks, 'SAMPLE', 2)
  config = make(
    name='json', train_files=path, eval_files=path, messages_key='messages', seq_len=32, tokenizer='byte',
    token_cache=token_cache, cache_dir=str(tmp_path / 'cache'),
  )  # fmt: skip
  with pytest.raises(ConfigError, match=rf'^{path} line 4 cannot be made into ids: TypeError: can only concatenate'):
    take(data.build(config), 8, global_batch=4, rows=slice(0, 4))
  rows[3], rows[0] = chat('a'), chat('bad')  # now in the first row the build checks
  write_jsonl(tmp_path / 'c.jsonl', rows)
  with pytest.raises(ConfigError, match=rf'^{path} line 1 cannot be made into ids: TypeError: can only concatenate'):
    data.build(config)
