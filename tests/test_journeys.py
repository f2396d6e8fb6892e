"""The fine-tuner's loop, end to end and offline (docs/your_data.md's walk-through): your own JSON Lines from the
command line on each language-model family, a model trained on them answering its training prompts through
generation for each kind of tokenizer (the byte tokenizer, a Hugging Face tokenizer that adds <s>, one that adds
nothing, and chats through the byte tokenizer's chat template), generate.py's chats and the commands the run
prints, lm-eval on a local task, and an export whose transformers pipeline gives the same greedy text; then the
first-contact defects of issue 44, each pinned.

The four runs are trained once per module (80 steps of the tiny GPT-2 on 16 rows: each reaches accuracy 1) and
shared by the tests that read them; they have one shape (a vocabulary of 260 rows), so they share one compile.
Llama and the mixture of experts take the same command line (test_each_tiny_config_...).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import data  # noqa: E402
import errors  # noqa: E402
import generation  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
import train  # noqa: E402
import training  # noqa: E402
from checkpointing import run_config  # noqa: E402
from configs import cli, schema  # noqa: E402
from tests.conftest import ROOT, subprocess_env  # noqa: E402
from training import export  # noqa: E402
from training import run as steps  # noqa: E402

tokenizers = pytest.importorskip('tokenizers')
transformers = pytest.importorskip('transformers')

EXAMPLES = os.path.join(ROOT, 'examples', 'reverse')
ROWS = 16  # training rows (examples/reverse/train.jsonl's first ones), every one answered after training
STEPS = 80
# kind -> (tokenizer, rows)
KINDS = {
  'byte': ('byte', 'pairs'),
  'hf_bos': ('bos', 'pairs'),
  'hf_plain': ('plain', 'pairs'),
  'chat': ('byte', 'chats'),
}


def pairs() -> list[dict]:
  with open(os.path.join(EXAMPLES, 'train.jsonl')) as f:
    return [json.loads(line) for line in f][:ROWS]


def chat_of(row: dict) -> list[dict]:
  return [{'role': 'user', 'content': row['prompt'][:-1]}, {'role': 'assistant', 'content': row['completion']}]


def char_tokenizer(path, bos: bool) -> str:
  """A character-level Hugging Face tokenizer built offline; with `bos`, tok(text) adds <s> as Llama's does."""
  chars = list('abcdefghijklmnopqrstuvwxyz=')
  specials = ['<pad>', '<s>', '</s>', '<unk>']
  tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(specials + chars)}, '<unk>'))
  tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex('.'), 'isolated')
  tk.add_special_tokens(specials)
  tk.decoder = tokenizers.decoders.Fuse()
  if bos:
    tk.post_processor = tokenizers.processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tk, bos_token='<s>', eos_token='</s>', pad_token='<pad>', unk_token='<unk>'
  ).save_pretrained(path)
  return str(path)


def parse(argv: list[str]):
  """A command line's config as train.py gets it (a fresh flag set, as app.run parses one)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True, sys_argv=argv)
  cli.parse_flags(argv, fv)
  return fv.config


def own_data_argv(family: str, train_files: str, kind: str, tokenizer: str, *extra: str) -> list[str]:
  """docs/your_data.md's command line: a tiny config and your own file, no config file written."""
  keys = (
    ['--config.dataset.messages_key=messages']
    if kind == 'chats'
    else ['--config.dataset.prompt_key=prompt', '--config.dataset.completion_key=completion']
  )
  return [
    'train.py',
    f'--config={ROOT}/configs/{family}.py:tiny',
    '--config.dataset.name=json',
    f'--config.dataset.train_files={train_files}',
    f'--config.dataset.eval_files={train_files}',
    *keys,
    f'--config.dataset.tokenizer={tokenizer}',
    *extra,
  ]


class Run:
  def __init__(self, kind, workdir, rows, out, result):
    self.kind, self.workdir, self.rows, self.out, self.result = kind, workdir, rows, out, result
    self._decoded = None

  def prompts(self) -> list:
    return [chat_of(r)[:1] if self.kind == 'chat' else r['prompt'] for r in self.rows]

  def decoded(self):
    """(Generator, tokenizer, prompt ids, greedy texts) of every training prompt, as generate.py loads the run:
    decoded once per run (one compile), read by each test."""
    if self._decoded is None:
      gen, tok = generation.from_flags(None, self.workdir, None, None)
      self._decoded = (gen, tok, *greedy(gen, tok, self.prompts()))
    return self._decoded


@pytest.fixture(scope='module', params=sorted(KINDS))
def run(request, tmp_path_factory):
  """A tiny model of the kind's family trained on its rows by train.py's own steps, from the documented flags."""
  kind = request.param
  tok_kind, rows_kind = KINDS[kind]
  tmp = tmp_path_factory.mktemp(kind)
  rows = pairs()
  path = tmp / 'train.jsonl'
  path.write_text(''.join(json.dumps({'messages': chat_of(r)} if rows_kind == 'chats' else r) + '\n' for r in rows))
  tok = 'byte' if tok_kind == 'byte' else char_tokenizer(tmp / 'tokenizer', bos=tok_kind == 'bos')
  config = parse(
    own_data_argv(
      'gpt2', str(path), rows_kind, tok, f'--config.total_steps={STEPS}', '--config.batch_size=16',
      '--config.dataset.seq_len=48', f'--config.eval_every={STEPS}', f'--config.log_every={STEPS}',
      '--config.model.vocab_size=260',  # one shape for every kind: the byte tokenizer's (a character one has 31)
    )
  )  # fmt: skip
  schema.check(config)
  workdir = str(tmp / 'run')
  out = tmp / 'train.out'
  with open(out, 'w') as f, _stdout_to(f):
    result = train.train_and_evaluate(config, workdir)
  return Run(kind, workdir, rows, out.read_text(), result)


class _stdout_to:
  """sys.stdout to a file for the block (train.py's progress lines: `say` writes to sys.stdout)."""

  def __init__(self, f):
    self.f = f

  def __enter__(self):
    self.saved, sys.stdout = sys.stdout, self.f

  def __exit__(self, *exc):
    sys.stdout = self.saved


def greedy(gen, tok, prompts, new: int = 12) -> tuple[list[list[int]], list[str]]:
  ids = [generation.encode(tok, p) for p in prompts]
  out = gen.generate(ids, generation.Sampling(max_new_tokens=new, temperature=0.0), tok.eos_id)
  return ids, [tok.decode([i for i in g.ids if i != tok.eos_id]) for g in out]


# --- The loop: train on your file from the command line, generate the training answers -----------------------------


def test_each_kind_of_tokenizer_gets_its_training_answers_back_from_generation(run):
  """The decode's prompt ids are the first ids of the row training made of the same text (its pipeline's own
  batch, the reference), and greedy decoding of the trained model gives back every training answer."""
  assert run.result['eval']['accuracy'] > 0.99, run.result['eval']
  config = run_config.load(run.workdir)
  _, tok, ids, texts = run.decoded()
  assert texts == [r['completion'] for r in run.rows]
  ds = data.build(config)
  for i, p in enumerate(ids):
    trained = (ds.eval_transform or ds.transform).map(ds.eval[i])['inputs']
    assert list(trained[: len(p)]) == p, (run.kind, trained[: len(p) + 2], p)
  begins = {'byte': 257, 'chat': 257, 'hf_bos': 1, 'hf_plain': tok.encode(run.rows[0]['prompt'])[0]}[run.kind]
  assert ids[0][0] == begins  # the tokenizer's own start: <|bos|>, <s>, or the text itself


def test_the_run_says_where_its_checkpoint_is_and_the_commands_that_use_it_work(run, tmp_path):
  """The end-of-run lines name the checkpoint and the generate and export commands as typed; generate.py's prompts
  from the printed command (a chat run: --chat) and from a --prompts file of the other rows ({"messages": [...]} or
  {"prompt": ...}) get the ids of the prompts that gave the training answers. (The doc-block test runs generate.py
  as the pages type it, --chat included.)"""
  assert f'checkpoint: {run.workdir}/checkpoints/{STEPS} ' in run.out, run.out[-2000:]
  assert f'export:   python export.py --workdir {run.workdir} --out {run.workdir}/hf' in run.out
  (printed,) = re.findall(r'^generate: (python generate\.py .*)$', run.out, re.M)
  flag, first = ('--chat', run.rows[0]['prompt'][:-1]) if run.kind == 'chat' else ('--prompt', run.rows[0]['prompt'])
  assert shlex.split(printed) == ['python', 'generate.py', '--workdir', run.workdir, flag, first]
  prompts = tmp_path / 'prompts.jsonl'
  rows = [{'messages': p} if run.kind == 'chat' else {'prompt': p} for p in run.prompts()[1:]]
  prompts.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  given = generation.read_prompts(*(([], [first]) if run.kind == 'chat' else ([first], [])), str(prompts))
  _, tok, ids, _ = run.decoded()
  assert [generation.encode(tok, p) for p in given] == ids
  (tmp_path / 'bad.jsonl').write_text('{"prompt": "a"}\n{"text": "b"}\n')
  with pytest.raises(errors.ConfigError, match=r'bad.jsonl:2: .*a JSON object with a "prompt" string or "messages"'):
    generation.read_prompts([], [], str(tmp_path / 'bad.jsonl'))


def test_the_export_is_a_transformers_model_whose_greedy_text_is_generate_pys(run, tmp_path):
  """export.py's directory: AutoTokenizer encodes as the run did (the byte tokenizer written as a Hugging Face
  one, chat template included; a Hugging Face tokenizer copied), and transformers' text-generation pipeline gives
  generate.py's greedy text, prompts and chats alike."""
  if run.kind.startswith('hf'):
    pytest.skip("a Hugging Face tokenizer is copied as it is (test_your_data.py's Llama SFT export)")
  config = run_config.load(run.workdir)
  trainer = training.build(
    config, partitioning.make_mesh(config.mesh), lambda rngs: models.create(config.model, rngs, config.lora)
  )
  out = str(tmp_path / 'hf')
  export.export_hf(trainer, f'{run.workdir}/checkpoints', out, models.HF_FAMILIES)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  _, tok, ids, texts = run.decoded()
  pipe = transformers.pipeline('text-generation', out)
  for prompt, p_ids, text in zip(run.prompts()[:4], ids[:4], texts[:4], strict=True):
    if run.kind == 'chat':
      assert hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)['input_ids'] == p_ids
      reply = pipe(prompt, max_new_tokens=12, do_sample=False)[0]['generated_text'][-1]['content']
    else:
      assert hf_tok(prompt)['input_ids'] == p_ids
      reply = pipe(prompt, max_new_tokens=12, do_sample=False, return_full_text=False)[0]['generated_text']
    assert reply == text
  with open(os.path.join(out, 'config.json')) as f:
    written = json.load(f)
  assert (written['bos_token_id'], written['eos_token_id']) == (tok.bos_id, tok.eos_id)


def test_evaluate_lm_scores_a_local_task_on_a_byte_run(run, tmp_path):
  """evaluate_lm.py's adapter on a byte-tokenizer run: examples/reverse/reverse.yaml over the training rows
  scores every answer exactly (lm-eval's TemplateLM needs only encode and decode); a task of --include_path's
  alone is looked up there without indexing lm-eval's own."""
  if run.kind != 'byte':
    pytest.skip('one lm-eval run: the byte tokenizer, which lm-eval had no path for')
  import lm_eval

  from generation import lm_eval_model

  rows = tmp_path / 'rows.jsonl'
  rows.write_text(''.join(json.dumps(r) + '\n' for r in run.rows))
  with open(os.path.join(EXAMPLES, 'reverse.yaml')) as f:
    (tmp_path / 'reverse.yaml').write_text(f.read().replace('examples/reverse/eval.jsonl', str(rows)))
  gen, tok, _, _ = run.decoded()
  results = lm_eval.simple_evaluate(
    model=lm_eval_model.ZooLM(gen, tok, batch_size=16),
    tasks=['reverse'],
    task_manager=lm_eval_model.task_manager(['reverse'], str(tmp_path)),
  )
  assert results['results']['reverse']['exact_match,none'] == 1.0, results['results']
  local = lm_eval_model.task_manager(['reverse'], str(tmp_path))  # lm-eval's own tasks not indexed: ~10 s saved
  assert 'reverse' in local.all_tasks and 'lambada_openai' not in local.all_tasks


# --- Own data on every language-model config; fields that follow others --------------------------------------------


@pytest.mark.parametrize('family', ['gpt2', 'llama', 'moe'])
def test_each_tiny_config_takes_your_file_its_vocabulary_from_the_tokenizer_and_its_warmup_from_the_run(
  family, tmp_path
):
  """docs/your_data.md's flags on every language-model config: the run's steps up to the model built and traced
  (the model takes the byte tokenizer's 260 ids, the data opens), no config file written; a field set keeps its
  value."""
  path = str(tmp_path / 'rows.jsonl')
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in pairs())
  config = parse(own_data_argv(family, path, 'pairs', 'byte', '--config.total_steps=20'))
  schema.check(config)
  assert config.model.vocab_size is None and config.optim.warmup_steps == 2  # a tenth of a short run
  assert data.vocabulary(config) == "config.model.vocab_size=260: the byte tokenizer's ids"
  assert config.model.vocab_size == 260
  config = parse(own_data_argv(family, path, 'pairs', 'byte', '--config.total_steps=20'))
  mesh = steps.make_mesh(config)
  steps.adopt_pretrained(config, dry_run=False)
  ds = steps.open_data(config)
  trainer = steps.build(config, mesh).trainer
  trainer.task.check_data(config, ds.example_spec(), ds.vocab, ds.num_classes)
  assert config.model.vocab_size == 260 and 'prompt/completion pairs' in ds.description
  config = parse(
    own_data_argv(family, path, 'pairs', 'byte', '--config.model.vocab_size=300', '--config.optim.warmup_steps=7')
  )
  schema.check(config)
  assert data.vocabulary(config) is None and (config.model.vocab_size, config.optim.warmup_steps) == (300, 7)
  markov = parse(['train.py', f'--config={ROOT}/configs/{family}.py:tiny', '--config.dataset.vocab_size=8'])
  schema.check(markov)
  assert markov.model.vocab_size == 8  # the Markov language's symbols, followed


def test_every_language_model_config_takes_your_file_from_the_command_line(tmp_path):
  """The same flags on every language-model config file at tiny size (the decoder families' included): the
  vocabulary follows the byte tokenizer, the warmup the run's length, and the config checks."""
  path = str(tmp_path / 'rows.jsonl')
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in pairs())
  files = sorted(set(generation.loading.family_configs().values()))
  assert {'configs/gpt2.py', 'configs/llama.py', 'configs/moe.py', 'configs/qwen3.py'} <= set(files)
  for file in files:
    family = os.path.basename(file)[:-3]
    config = parse(own_data_argv(family, path, 'pairs', 'byte', '--config.total_steps=20'))
    schema.check(config)
    assert data.vocabulary(config) == "config.model.vocab_size=260: the byte tokenizer's ids", file
    assert (config.model.vocab_size, config.optim.warmup_steps) == (260, 2), file


def test_setting_a_fine_tune_configs_tokenizer_leaves_init_from_and_the_link_is_said(tmp_path):
  """configs/llama_sft.py: the tokenizer follows init_from until it is set; setting it writes nothing else."""
  config = parse(['train.py', f'--config={ROOT}/configs/llama_sft.py', '--config.dataset.tokenizer=byte'])
  assert (config.init_from, config.dataset.tokenizer) == ('meta-llama/Llama-3.2-1B-Instruct', 'byte')
  chats = tmp_path / 'chats.jsonl'
  chats.write_text(''.join(json.dumps({'messages': chat_of(r)}) + '\n' for r in pairs()))
  files = [f'--config.dataset.train_files={chats}', f'--config.dataset.eval_files={chats}']
  config = parse(['train.py', f'--config={ROOT}/configs/llama_sft.py', f'--config.init_from={tmp_path}/llama', *files])
  assert config.dataset.tokenizer == f'{tmp_path}/llama'
  assert schema.derived_from(config, 'dataset.tokenizer') == 'config.init_from'
  with pytest.raises(errors.ConfigError, match=r'\(it follows config.init_from: set config.dataset.tokenizer'):
    data.build(config)


# --- First contact ---------------------------------------------------------------------------------------------------


def test_data_files_and_keys_are_checked_before_the_model_is_built(tmp_path, monkeypatch):
  monkeypatch.setattr(steps, 'build', lambda *a: pytest.fail('the model was built before the data was checked'))
  path = tmp_path / 'rows.jsonl'
  path.write_text('{"prompt": "a=", "completion": "a"}\n{"prompt": "b="}\n')
  config = parse(own_data_argv('gpt2', str(path), 'pairs', 'byte'))
  t0 = time.perf_counter()
  with pytest.raises(errors.ConfigError, match=r"rows.jsonl line 2 has no 'completion'"):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  config = parse(own_data_argv('gpt2', str(tmp_path / 'missing*.jsonl'), 'pairs', 'byte'))
  with pytest.raises(errors.ConfigError, match=r"'.*missing\*.jsonl' matches no file"):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert time.perf_counter() - t0 < 20


def test_generation_from_a_directory_that_is_no_run_says_so(tmp_path):
  with pytest.raises(errors.ConfigError, match=r'^--workdir .*nowhere does not exist: give the directory a run'):
    generation.from_flags(None, str(tmp_path / 'nowhere'), None, None)


def test_the_mesh_line_says_whose_cpu_devices_and_a_users_count_is_honoured(monkeypatch):
  for var in ('XLA_FLAGS', 'JAX_NUM_CPU_DEVICES'):
    monkeypatch.delenv(var, raising=False)
  assert partitioning.cpu_devices_note().startswith('simulated, as many as the mesh needs')
  mesh = schema.complete(parse(['train.py', f'--config={ROOT}/configs/default.py', '--config.mesh.data=4'])).mesh
  assert partitioning.fit_mesh(mesh) is None  # simulated devices are sized to the mesh (train.py asks for 16)
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_foo=1 --xla_force_host_platform_device_count=8')
  assert partitioning.user_cpu_devices() == (8, 'XLA_FLAGS') and partitioning.cpu_devices_note() == 'as XLA_FLAGS sets'
  updates = []
  monkeypatch.setattr(partitioning.mesh.jax.config, 'update', lambda *a: updates.append(a))
  partitioning.simulate_cpu_devices(16, honour_environment=True)
  assert updates == []  # the user's count stands
  note = partitioning.fit_mesh(mesh)  # the 16-device mesh fitted to the 8 devices there are, and said
  assert note.startswith('config.mesh (data=4 x fsdp=2 x tensor=2) asks for 16 devices; there are 8 cpu devices')
  assert dict(mesh) == {'data': 8, 'fsdp': 1, 'tensor': 1}


def test_entry_points_print_no_info_lines_unless_verbose(monkeypatch):
  """A dry run prints its table and no INFO lines (JAX, TensorFlow, our modules: xent.py's), and its mesh line says
  whose CPU devices they are; --verbose sets absl's verbosity back to INFO."""
  env = subprocess_env()
  env['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
  argv = [sys.executable, 'train.py', '--config=configs/gpt2.py:tiny', '--dry_run']
  quiet = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert quiet.returncode == 0, quiet.stderr[-3000:]
  assert not re.search(r'^I\d{4} ', quiet.stdout + quiet.stderr, re.M), (quiet.stdout + quiet.stderr)[:3000]
  assert 'on 8 cpu devices (as XLA_FLAGS sets)' in quiet.stdout
  fv = flags.FlagValues()  # an entry point's flags, as train.py's global ones
  flags.DEFINE_bool('verbose', False, '', flag_values=fv)
  config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True)
  monkeypatch.setattr(flags, 'FLAGS', fv)
  said = []
  monkeypatch.setattr(cli.logging, 'set_verbosity', said.append)
  for extra in ([], ['--verbose']):
    fv.unparse_flags()
    cli.parse_flags(['train.py', f'--config={ROOT}/configs/gpt2.py:tiny', *extra], fv)
  assert said == [cli.logging.WARNING, cli.logging.INFO]


def test_pytest_stops_on_one_ctrl_c_with_its_workers(tmp_path):
  """pytest started as a shell starts a background job (SIGINT ignored), one SIGINT to it mid-test: it and its
  xdist workers are gone within seconds (tests/interrupt.py, which tests/conftest.py takes, restores the handler)."""
  (tmp_path / 'test_sleeps.py').write_text(
    'import os, time\n'
    'def test_sleeps():\n'
    f"  open({str(tmp_path / 'worker')!r}, 'w').write(str(os.getpid()))\n"
    '  time.sleep(300)\n'
  )
  argv = [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-p', 'tests.interrupt', '-n', '1', '-q']
  argv += ['-c', os.path.join(ROOT, 'pytest.ini'), '--rootdir', ROOT, str(tmp_path / 'test_sleeps.py')]
  ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child, as a shell's background job
  try:
    proc = subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  finally:
    signal.signal(signal.SIGINT, ignored)
  try:
    deadline = time.time() + 120
    while not (tmp_path / 'worker').exists() and time.time() < deadline and proc.poll() is None:
      time.sleep(0.2)
    worker = int((tmp_path / 'worker').read_text())
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=20)
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
      os.kill(worker, 0)  # the worker is gone too
  finally:
    if proc.poll() is None:
      proc.kill()


def test_one_hub_download_hint():
  """Every page and message names the hub's command line as huggingface_hub 2 installs it: `hf download`."""
  found = []
  for folder, _, files in os.walk(ROOT):
    if '/.' in folder or 'site' in folder.split(os.sep) or folder.startswith(os.path.join(ROOT, 'tests')):
      continue
    for name in files:
      if name.endswith(('.py', '.md')):
        with open(os.path.join(folder, name), errors='replace') as f:
          if 'huggingface-cli' in f.read():
            found.append(os.path.join(folder, name))
  assert found == []
