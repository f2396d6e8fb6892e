"""Your own data (data/files.py): JSON Lines, parquet, text and Hugging Face datasets through the grain pipelines;
prompt/completion and chat SFT with the loss on the answers only; chat rendering against transformers; packed
against unpacked loss; a tiny model learning completions end to end; exact resumption; mixtures; bad input."""

import dataclasses
import gzip
import json
import logging
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

import data
import models
import partitioning
import train
import training
from checkpointing import run_config
from configs import cli, llama, llama_sft, schema
from data import pipeline, text, tokens
from errors import ConfigError
from tests import children, conftest
from training import export, tasks

datasets = pytest.importorskip('datasets')
tokenizers = pytest.importorskip('tokenizers')
transformers = pytest.importorskip('transformers')

CHARS = list('abcdefghijklmnopqrstuvwxyz0123456789 .,?!:')
SPECIALS = ['<pad>', '<s>', '</s>', '<unk>', '<|system|>', '<|user|>', '<|assistant|>', '<|end|>']
# A ChatML-like template; the {% generation %} markers let transformers compute its own assistant mask
# (return_assistant_tokens_mask), the reference the chat documents are checked against.
TEMPLATE = (
  '{{ bos_token }}{% for m in messages %}'
  "{% if m['role'] == 'assistant' %}{{ '<|assistant|>' }}{% generation %}{{ m['content'] + '<|end|>' }}"
  '{% endgeneration %}'
  "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
VOCAB = 64  # the model's vocabulary (the tokenizer has 50 ids)


def save_tokenizer(path, template: str | None = TEMPLATE) -> str:
  """A character-level Hugging Face tokenizer built offline (every character one id), saved to `path`."""
  vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
  tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex('.'), 'isolated')
  tk.add_special_tokens(SPECIALS)
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tk, bos_token='<s>', eos_token='</s>', pad_token='<pad>', unk_token='<unk>', chat_template=template
  ).save_pretrained(path)
  return str(path)


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
  return save_tokenizer(tmp_path_factory.mktemp('tokenizer'))


def write_jsonl(path, rows, gz: bool = False) -> str:
  with (gzip.open if gz else open)(path, 'wt') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')
  return str(path)


FAMILY = {'lm': 'gpt2', 'mlm': 'bert', 'text_classification': 'bert', 'classification': 'cnn'}  # task -> a model


def make(task: str = 'lm', vocab_size: int = VOCAB, **dataset) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = task
  c.dataset = ml_collections.ConfigDict(dataset)
  c.model = ml_collections.ConfigDict(dict(name=FAMILY.get(task, 'gpt2'), vocab_size=vocab_size))
  return schema.complete(c)  # the task's dataset fields and the family's model fields at their defaults


def pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
  """Prompt/completion pairs of a deterministic mapping: the completion is the prompt's letters reversed."""
  rng = np.random.default_rng(seed)
  words = [''.join(rng.choice(list('abcdefgh'), size=int(rng.integers(2, 5)))) for _ in range(n)]
  return [{'prompt': f'{w}:', 'completion': w[::-1]} for w in words]


def chats(n: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    w = ''.join(rng.choice(list('abcdef'), size=int(rng.integers(1, 4))))
    turns = [{'role': 'user', 'content': f'say {w}'}, {'role': 'assistant', 'content': w}]
    if i % 3 == 0:
      turns = [{'role': 'system', 'content': 'be brief'}, *turns, {'role': 'user', 'content': 'again'}]
      turns.append({'role': 'assistant', 'content': w + w})
    out.append({'messages': turns, 'id': i})
  return out


def take(ds, n: int, global_batch: int = 8, rows: slice = slice(0, 8), seed: int = 0):
  it = iter(ds.train_dataset(global_batch, rows, seed))
  out = [next(it) for _ in range(n)]
  it.close()
  return out


# --- Chats: rendered token for token as transformers renders them, the loss on the assistant turns ----------


def test_chats_render_as_transformers_with_the_loss_on_its_assistant_tokens(tok_dir):
  hf = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
  doc = text.ChatDocument(tokens.tokenizer(tok_dir), 'messages')
  for chat in chats(12):
    ref = hf.apply_chat_template(chat['messages'], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    d = doc.map(chat)
    ids = np.r_[d['inputs'], d['targets'][-1]]
    np.testing.assert_array_equal(ids, ref['input_ids'])  # token for token
    np.testing.assert_array_equal(d['mask'], np.asarray(ref['assistant_masks'])[1:])  # targets = ids[1:]
    assert d['mask'].sum() > 0


def test_a_tokenizer_without_a_chat_template_is_one_error(tmp_path, tok_dir):
  plain = save_tokenizer(tmp_path / 'plain', template=None)
  path = write_jsonl(tmp_path / 'c.jsonl', chats(4))
  cfg = make(name='json', train_files=path, eval_files=path, messages_key='messages', seq_len=32, tokenizer=plain)
  with pytest.raises(ConfigError, match=r"tokenizer '.*plain' has none"):
    data.build(cfg)
  ds = data.build(make(name='json', train_files=path, eval_files=path, messages_key='messages', seq_len=32))
  assert ds.tokenizer.name == 'byte'  # the byte tokenizer has a chat template of its own (data/tokens.py)


# --- Sources: JSON Lines (plain and gzipped), parquet, text and Hugging Face datasets -------------------------


def test_every_source_reads_the_same_rows(tmp_path, tok_dir):
  rows = pairs(40)
  write_jsonl(tmp_path / 'a.jsonl', rows[:25])
  write_jsonl(tmp_path / 'b.jsonl.gz', rows[25:], gz=True)
  whole = datasets.Dataset.from_list(rows)
  whole.to_parquet(str(tmp_path / 'all.parquet'))
  datasets.DatasetDict({'train': whole, 'test': whole}).save_to_disk(str(tmp_path / 'saved'))
  common = dict(prompt_key='prompt', completion_key='completion', seq_len=16, tokenizer=tok_dir, pack=True)
  sources = {
    'json': make(name='json', train_files=f'{tmp_path}/a.jsonl,{tmp_path}/b.jsonl.gz', eval_files=f'{tmp_path}/*.gz'),
    'parquet': make(name='parquet', train_files=f'{tmp_path}/all.parquet', eval_files=f'{tmp_path}/all.parquet'),
    'hf': make(name='hf', path=str(tmp_path / 'saved'), train_files='train', eval_files='test'),
  }
  got = {}
  for name, cfg in sources.items():
    cfg.dataset.update(common)
    ds = data.build(cfg)
    assert len(ds.train) == 40, name
    assert [ds.train[i]['completion'] for i in range(40)] == [r['completion'] for r in rows], name
    got[name] = take(ds, 3)
  for name in ('parquet', 'hf'):
    for a, b in zip(got['json'], got[name]):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f'{name} {k}')
  # A dataset repository laid out as on the hub (train/test files), by its directory, and a hub id that is not
  # in the Hugging Face cache (offline): one line.
  (tmp_path / 'repo').mkdir()
  write_jsonl(tmp_path / 'repo' / 'train.jsonl', rows)
  write_jsonl(tmp_path / 'repo' / 'test.jsonl', rows[:5])
  repo = make(name='hf', path=str(tmp_path / 'repo'), train_files='train', eval_files='test', **common)
  assert len(data.build(repo).eval) == 5
  with pytest.raises(ConfigError, match=r"config.dataset.path='nobody/no_such_dataset' .*not loadable"):
    data.build(make(name='hf', path='nobody/no_such_dataset', train_files='train', eval_files='test', **common))
  # Plain text files: one document per line (or per file), language modelling on every token.
  (tmp_path / 't1.txt').write_text('hello there\nsecond line\n')
  (tmp_path / 't2.txt').write_text('third\n')
  cfg = make(name='text', train_files=f'{tmp_path}/t*.txt', eval_files=f'{tmp_path}/t2.txt', seq_len=8)
  cfg.dataset.tokenizer = tok_dir
  ds = data.build(cfg)
  assert [ds.train[i]['text'] for i in range(3)] == ['hello there', 'second line', 'third']
  assert ds.train.where(2).endswith('t2.txt line 1')
  cfg.dataset.sample_by = 'document'
  assert len(data.build(cfg).train) == 2


# --- SFT: the loss on the answers only; packed rows keep documents apart and equal unpacked rows ------------


def sft_config(tmp_path, tok_dir, pack: bool, **dataset) -> ml_collections.ConfigDict:
  """The tiny GPT-2 of tests/conftest.py on prompt/completion JSONL with the offline tokenizer."""
  train_file = write_jsonl(tmp_path / 'train.jsonl', pairs(512))
  eval_file = write_jsonl(tmp_path / 'eval.jsonl', pairs(64, seed=1))
  cfg = conftest.tiny_config('dp')  # data parallel: the quickest to compile
  cfg.model.vocab_size = VOCAB
  cfg.dataset = ml_collections.ConfigDict(
    dict(
      name='json',
      train_files=train_file,
      eval_files=eval_file,
      prompt_key='prompt',
      completion_key='completion',
      tokenizer=tok_dir,
      seq_len=16,
      pack=pack,
      **dataset,
    )
  )
  return schema.complete(cfg)


def test_prompt_tokens_get_no_loss_and_no_gradient(tmp_path, tok_dir):
  cfg = sft_config(tmp_path, tok_dir, pack=True)
  ds = data.build(cfg)
  tok = ds.tokenizer
  b = take(ds, 1)[0]
  # The weight is 1 exactly on the completion's tokens and </s>: what follows ':' in each document (which begins
  # as tok(text) begins a text: this tokenizer adds no <s>).
  for r in range(8):
    for s in np.unique(b['segment_ids'][r][b['segment_ids'][r] > 0]):
      seg = b['segment_ids'][r] == s
      ins, tgs, m = b['inputs'][r][seg], b['targets'][r][seg], b['mask'][r][seg]
      colon = int(np.flatnonzero(ins == tok.encode(':')[0])[0])
      np.testing.assert_array_equal(m, (np.arange(len(ins)) >= colon).astype(np.float32))
      np.testing.assert_array_equal(tgs[m > 0], np.r_[ins[:colon][::-1], tok.eos_id])  # the reversed prompt
  # The gradient of the task's loss reaches no prompt position's logits, and every completion position's.
  logits = jax.random.normal(jax.random.key(0), (*b['inputs'].shape, VOCAB))
  task = tasks.get('lm')

  def loss(logits):
    m = tasks._sums(*task.per_example(logits, b), {})
    return m['loss_sum'] / m['weight']

  g = np.asarray(jax.grad(loss)(logits))
  assert not np.abs(g[b['mask'] == 0]).any()
  assert (np.abs(g[b['mask'] > 0]).sum(-1) > 0).all()


def _eval_sums(cfg) -> dict[str, float]:
  """Loss, correct and weight summed over the whole eval split by the compiled eval step (one init seed)."""
  trainer = conftest.build_trainer(cfg)
  state = training.init_state(trainer)
  step = training.jit_eval_step(trainer)
  ds = data.build(cfg)
  sums = [
    jax.device_get(step(state, data.to_global(b, trainer.batch_shardings, cfg.batch_size)))
    for b in ds.eval_batches(cfg.batch_size, slice(0, cfg.batch_size))
  ]
  return {k: float(sum(np.float64(s[k]) for s in sums)) for k in ('loss_sum', 'correct_sum', 'weight')}


@pytest.mark.parametrize('family', ['gpt2', 'llama'])
def test_packed_rows_give_the_loss_of_one_document_per_row(tmp_path, tok_dir, family):
  """Every eval document scored packed (several per row: segment ids, positions restarting) and one per row:
  the same loss sum in fp32, so no document attends to another and positions restart."""
  results = {}
  for pack in (True, False):
    cfg = sft_config(tmp_path, tok_dir, pack)
    if family == 'llama':
      cfg.model = llama.get_config('tiny').model
      cfg.model.update(vocab_size=VOCAB, max_len=16, scan_layers=False)
      cfg.logical_axis_rules = llama.get_config('fsdp_tp,tiny').logical_axis_rules
      cfg.mesh = llama.get_config('fsdp_tp,tiny').mesh
    results[pack] = _eval_sums(cfg)
  packed, unpacked = results[True], results[False]
  assert packed['weight'] == unpacked['weight'] > 0
  np.testing.assert_allclose(packed['loss_sum'], unpacked['loss_sum'], rtol=1e-5)
  assert packed['correct_sum'] == unpacked['correct_sum']


@pytest.mark.slow
def test_a_tiny_model_learns_the_completions_end_to_end(tmp_path, tok_dir):
  """train.py on prompt/completion JSONL: eval accuracy on the completions (reversed prompts) reaches ~1."""
  cfg = sft_config(tmp_path, tok_dir, pack=True)
  cfg.update(total_steps=200, log_every=100, eval_every=200, checkpoint_every=0)
  cfg.optim.update(lr=1e-2, warmup_steps=20)
  result = train.train_and_evaluate(cfg, str(tmp_path / 'run'))
  assert result['eval']['accuracy'] > 0.97, result['eval']


# --- Exact resumption, any number of processes; mixtures ------------------------------------------------------


@pytest.mark.slow
def test_train_py_resumes_an_sft_run_bitwise(tmp_path, tok_dir):
  """6 steps in one run, and 3 + 3 steps in two (the second resumes model, optimizer and data position from the
  checkpoint): the same weights, bit for bit. A constant learning rate after warmup (min_lr_ratio=1), so the
  schedule does not depend on total_steps."""

  def run(workdir, steps):
    cfg = sft_config(tmp_path, tok_dir, pack=True)
    cfg.update(total_steps=steps, checkpoint_every=3, eval_every=6, log_every=3)
    cfg.optim.update(warmup_steps=1, min_lr_ratio=1.0)
    return train.train_and_evaluate(cfg, str(tmp_path / workdir))['state']

  full = run('full', 6)
  run('split', 3)
  resumed = run('split', 6)
  assert int(resumed.step) == 6
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), jax.device_get(full.params))


def test_the_data_position_resumes_exactly_with_another_process_count(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / 'c.jsonl', chats(90))
  for pack in (True, False):
    ds = data.build(
      make(
        name='json',
        train_files=path,
        eval_files=path,
        messages_key='messages',
        seq_len=24,
        tokenizer=tok_dir,
        pack=pack,
      )
    )
    whole = ds.train_iterator(8, slice(0, 8), 3)
    expected = [next(whole) for _ in range(20)][12:]  # crosses an epoch (90 chats, 8 rows)
    halves = [ds.train_iterator(8, rows, 3) for rows in (slice(0, 4), slice(4, 8))]
    for h in halves:
      for _ in range(12):
        next(h)
    saved = [json.loads(json.dumps(h.get_state())) for h in halves]
    resumed = ds.train_iterator(8, slice(0, 8), 3)
    resumed.set_state(saved)
    for e in expected:
      got = next(resumed)
      for k in e:
        np.testing.assert_array_equal(got[k], e[k], err_msg=f'pack={pack} {k}')
    for it in (whole, resumed, *halves):
      it.close()


def test_each_process_reads_only_its_rows(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / 'p.jsonl', pairs(200))
  cfg = make(name='json', train_files=path, eval_files=path, prompt_key='prompt', completion_key='completion')
  cfg.dataset.update(seq_len=16, tokenizer=tok_dir, pack=True)
  ds = data.build(cfg)
  read = []
  for rows in (slice(0, 4), slice(4, 8)):
    source = ds.cached.train  # what the pipeline reads: the rows' token cache
    seen = set()

    class Recorder:  # the rows' indices this process reads
      def __len__(self):
        return len(source)

      def __getitem__(self, i):
        seen.add(int(i))
        return source[i]

    take(dataclasses.replace(ds, cached=dataclasses.replace(ds.cached, train=Recorder()), prefetch=1), 5, rows=rows)
    read.append(seen)
  assert read[0] and read[1] and not read[0] & read[1]


# Two real processes build the Arrow cache of one file at once (one shared cache_dir) and each reads its rows.
CHAT_BATCHES = r"""
import jax, ml_collections
import data, partitioning
from configs import schema

def global_batches():
  cfg = schema.complete(ml_collections.ConfigDict(dict(task='lm', dataset=dict(name='json', train_files=PATH,
      eval_files=PATH, messages_key='messages', tokenizer=TOKENIZER, seq_len=24, pack=True, cache_dir=CACHE))))
  ds = data.build(cfg)
  s = jax.sharding.NamedSharding(partitioning.make_mesh({'data': 8}), jax.P('data'))
  rows = data.local_rows(s, (8, 24))
  shardings = {k: s for k in ds.example_spec()}
  it = iter(ds.train_dataset(8, rows, 0))
  train = [data.to_global(next(it), shardings, 8) for _ in range(3)]
  it.close()
  return train, [data.to_global(b, shardings, 8) for b in ds.eval_batches(8, rows)]
"""


@pytest.mark.slow
def test_two_processes_share_the_cache_and_assemble_the_batches_of_one(tmp_path, tok_dir):
  from tests.test_data_multiprocess import WORKER  # noqa: PLC0415
  from tests.test_multiprocess import _free_port  # noqa: PLC0415

  path = write_jsonl(tmp_path / 'c.jsonl', chats(60))
  code = f'PATH, TOKENIZER, CACHE = {path!r}, {tok_dir!r}, {str(tmp_path / "cache")!r}\n' + CHAT_BATCHES
  port = _free_port()
  env = {**conftest.subprocess_env(2), 'PYTHONPATH': conftest.ROOT, 'HF_HUB_OFFLINE': '1'}
  procs = [
    children.Popen(
      [sys.executable, '-c', WORKER, f'127.0.0.1:{port}', str(i), code],
      cwd=conftest.ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(next(line for line in o.splitlines() if line.startswith('RESULT '))[7:]) for o, _ in outs]
  assert results[0] == results[1]
  namespace = {}
  exec(code, namespace)
  train, evals = namespace['global_batches']()  # this process: 8 devices
  for got, want in zip(results[0]['train'], train):
    for k in want:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
  assert results[0]['eval_sums'] == [float(np.asarray(b['mask']).sum()) for b in evals]


def test_a_mixture_draws_by_weight_deterministically_and_resumes(tmp_path, tok_dir):
  a = write_jsonl(tmp_path / 'a.jsonl', [{'text': 'aaaa'}] * 30)
  b = write_jsonl(tmp_path / 'b.jsonl', [{'text': 'bbbb'}] * 7)
  cfg = make(name='json', mixture=[(a, 3.0), (b, 1.0)], eval_files=b, seq_len=8, tokenizer=tok_dir)
  ds = data.build(cfg)
  assert isinstance(ds.train, pipeline.Mixture)
  run = take(ds, 10)
  first = np.concatenate([x['inputs'][:, 1] for x in run])  # the first character of each document
  share = np.mean(first == ds.tokenizer.encode('a')[0])
  assert share == pytest.approx(0.75, abs=0.02)
  it = ds.train_iterator(8, slice(0, 8), 0)
  for _ in range(4):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  resumed = ds.train_iterator(8, slice(0, 8), 0)
  resumed.set_state([state])
  for x in run[4:]:
    np.testing.assert_array_equal(next(resumed)['inputs'], x['inputs'])
  resumed.close()


# --- Bad input: one line each, naming the culprit -------------------------------------------------------------


def test_bad_input_is_one_line_naming_the_file_and_line(tmp_path, tok_dir):
  good = write_jsonl(tmp_path / 'good.jsonl', pairs(20))
  rows = pairs(6)
  del rows[4]['completion']
  missing = write_jsonl(tmp_path / 'missing.jsonl', rows)
  (tmp_path / 'empty.jsonl').write_text('')
  numbers = write_jsonl(tmp_path / 'numbers.jsonl', [{'prompt': 'a', 'completion': 7, 'id': 'x'}])
  (tmp_path / 'broken.jsonl').write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
  base = dict(name='json', prompt_key='prompt', completion_key='completion', seq_len=16, tokenizer=tok_dir)
  cases = [
    (dict(train_files=f'{good},{missing}', eval_files=good), rf'{missing} line 5 has no .completion.'),
    (dict(train_files=str(tmp_path / 'empty.jsonl'), eval_files=good), r'empty.jsonl is empty'),
    (dict(train_files=str(tmp_path / 'nothing*.jsonl'), eval_files=good), r"'.*nothing\*.jsonl' matches no file"),
    (dict(train_files=str(tmp_path / 'broken.jsonl'), eval_files=good), r'broken.jsonl cannot be read as json: .*row'),
    (dict(train_files=f'{good},{numbers}', eval_files=good), r"numbers.jsonl holds .*'completion': Value\('int64'\)"),
    (dict(train_files=good), r'needs config.dataset.eval_files'),
    (dict(train_files=good, eval_files=good, completion_key=None), r'prompt/completion pairs need both'),
    (dict(train_files=good, eval_files=good, prompt_key='question'), r"good.jsonl has no column 'question'"),
  ]
  for overrides, message in cases:
    with pytest.raises(ConfigError, match=message):
      data.build(make(**{**base, **overrides}))


def test_chats_without_an_answer_are_skipped_and_counted_or_an_error(tmp_path, tok_dir):
  rows = chats(10)
  rows[3]['messages'] = rows[3]['messages'][:1]  # the user's turn only
  path = write_jsonl(tmp_path / 'c.jsonl', rows)
  cfg = make(name='json', train_files=path, eval_files=path, messages_key='messages', seq_len=32, tokenizer=tok_dir)
  ds = data.build(cfg)
  assert len(ds.train) == 9 and f'{path} line 4' not in [ds.train.where(i) for i in range(9)]
  assert '1 chats without an assistant turn left out of train_files' in ds.description
  cfg.dataset.no_assistant = 'error'
  with pytest.raises(ConfigError, match=rf'{path} line 4 is a chat without an assistant turn \(1 such rows'):
    data.build(cfg)


def test_rows_longer_than_seq_len_are_truncated_and_counted_in_the_log(tmp_path, tok_dir, caplog):
  rows = [{'prompt': 'ab:', 'completion': 'x' * (40 if i % 2 else 3)} for i in range(16)]
  path = write_jsonl(tmp_path / 'long.jsonl', rows)
  for pack in (False, True):
    cfg = make(
      name='json',
      train_files=path,
      eval_files=path,
      prompt_key='prompt',
      completion_key='completion',
      seq_len=16,
      tokenizer=tok_dir,
      pack=pack,
    )
    ds = data.build(cfg)
    with caplog.at_level(logging.WARNING):
      caplog.clear()
      b = take(ds, 1, global_batch=4, rows=slice(0, 4))[0]
    assert b['inputs'].shape == (4, 16)
    logged = [r.getMessage() for r in caplog.records if 'truncated' in r.getMessage()]
    assert logged and re.search(r'long.jsonl line \d+ has 44 tokens, truncated to 17', logged[0]), logged


# --- configs/llama_sft.py: a model directory and chat JSONL -> train.py -> an export transformers loads -----


@pytest.mark.slow
def test_llama_sft_from_a_model_directory_to_an_export_transformers_loads(tmp_path):
  """The walk-through of docs/your_data.md on a tiny Llama saved by transformers, with the chat tokenizer in its
  directory: the config's real branch (init_from's config.json and tokenizer, chats, LoRA by the word 'lora')
  trains, and export writes a directory transformers loads, adapters merged and the chat template kept."""
  hf_dir = tmp_path / 'llama'
  hf_cfg = transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=True,
  )
  original = transformers.LlamaForCausalLM(hf_cfg)
  original.save_pretrained(hf_dir)
  save_tokenizer(hf_dir)
  path = write_jsonl(tmp_path / 'chats.jsonl', chats(40))
  cfg = llama_sft.get_config('dp,lora')
  cfg.init_from = str(hf_dir)  # the tokenizer follows (a field reference)
  cfg.dataset.update(train_files=path, eval_files=path, seq_len=32)
  cfg.model.update(dtype='float32', max_len=32)
  cfg.update(batch_size=8, total_steps=2, checkpoint_every=2, eval_every=2, log_every=1)
  workdir = str(tmp_path / 'run')
  result = train.train_and_evaluate(cfg, workdir)
  assert result['eval']['weight'] > 0 and np.isfinite(result['eval']['loss'])
  run = run_config.load(workdir)
  trainer = training.build(
    run, partitioning.make_mesh(run.mesh), lambda rngs: models.create(run.model, rngs, run.get('lora'))
  )
  out = str(tmp_path / 'hf_out')
  export.export_hf(trainer, f'{workdir}/checkpoints', out, models.HF_FAMILIES)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys']), info
  assert transformers.AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE
  q = lambda m: m.model.layers[0].self_attn.q_proj.weight.detach().numpy()
  assert not np.allclose(q(model), q(original))  # the adapters, trained, are merged in


def test_the_documented_command_line_overrides_make_a_prompt_completion_mixture(tmp_path, tok_dir):
  """docs/your_data.md's flags on configs/llama_sft.py: prompt/completion files instead of chats, a mixture
  instead of train_files; they parse, pass the schema and build the dataset."""
  write_jsonl(tmp_path / 'a1.jsonl', pairs(30))
  write_jsonl(tmp_path / 'b.jsonl', pairs(10, seed=2))
  argv = [
    'train.py',
    f'--config={conftest.ROOT}/configs/llama_sft.py',
    f'--config.init_from={tok_dir}',
    '--config.dataset.messages_key=',
    '--config.dataset.prompt_key=prompt',
    '--config.dataset.completion_key=completion',
    '--config.dataset.train_files=',
    f"--config.dataset.mixture=(('{tmp_path}/a*.jsonl', 3.0), ('{tmp_path}/b.jsonl', 1))",
    f'--config.dataset.eval_files={tmp_path}/b.jsonl',
    '--config.dataset.seq_len=32',
  ]
  fv = flags.FlagValues()  # a fresh flag set reading these arguments, as app.run does
  config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True, sys_argv=argv)
  cli.parse_flags(argv, fv)
  cfg = fv.config
  schema.check(cfg)
  ds = data.build(cfg)
  assert ds.tokenizer.name == tok_dir and isinstance(ds.train, pipeline.Mixture) and len(ds.train) == 40
  assert 'prompt/completion pairs' in ds.description
