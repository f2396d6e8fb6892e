"""lm-eval on a zoo model (generation/lm_eval_model.py): a local task of each request type (multiple choice by
loglikelihood, loglikelihood_rolling perplexity, generate_until), over local JSONL files, gives per example the
results of lm-eval's Hugging Face backend (HFLM) on the same tiny imported GPT-2: loglikelihoods within 1e-4, the
same greedy flags and the same generated text; evaluate_lm.py runs a task from the command line."""

import json
import os
import sys

os.environ['HF_HUB_OFFLINE'] = '1'
os.environ['HF_DATASETS_OFFLINE'] = '1'

import numpy as np  # noqa: E402
import pytest  # noqa: E402

lm_eval = pytest.importorskip('lm_eval')

import generation  # noqa: E402
import partitioning  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402
from data import tokens  # noqa: E402
from generation import lm_eval_model  # noqa: E402
from tests import children  # noqa: E402
from tests.conftest import ROOT, subprocess_env  # noqa: E402
from tests.test_hf_export import tiny_gpt2_with_tokenizer  # noqa: E402
from tests.test_hf_families import zoo_config  # noqa: E402

LL_ATOL = 1e-4
WORDS = 'the quick brown fox jumps over the lazy dog'.split()


def write_tasks(root):
  rng = np.random.default_rng(0)
  docs = [
    dict(
      question=' '.join(rng.choice(WORDS, 4)),
      choices=[' '.join(rng.choice(WORDS, int(rng.integers(1, 4)))) for _ in range(3)],
      answer=int(rng.integers(0, 3)),
      text=' '.join(rng.choice(WORDS, int(rng.integers(5, 40)))),  # some longer than a 64-token window
    )
    for _ in range(6)
  ]
  data = root / 'data.jsonl'
  data.write_text(''.join(json.dumps(d) + '\n' for d in docs))
  common = f'dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n'
  (root / 'zoo_mc.yaml').write_text(
    'task: zoo_mc\n' + common + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
    'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
  )
  (root / 'zoo_ppl.yaml').write_text(
    'task: zoo_ppl\n' + common + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    'metric_list:\n  - metric: word_perplexity\n'
  )
  (root / 'zoo_gen.yaml').write_text(
    'task: zoo_gen\n' + common + 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
    'doc_to_target: "{{choices[0]}}"\ngeneration_kwargs:\n  until: ["dog"]\n  max_gen_toks: 8\n'
    '  do_sample: false\nmetric_list:\n  - metric: exact_match\n'
  )
  return str(root)


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('harness')
  path = str(root / 'hf')
  tiny_gpt2_with_tokenizer(path)
  (root / 'tasks').mkdir()
  return path, write_tasks(root / 'tasks')


def samples(model, include_path):
  # The local tasks' index alone, as evaluate_lm.py makes it (lm_eval_model.task_manager): indexing lm-eval's own
  # thousands of task files costs seconds and the tasks here are local.
  tasks = ['zoo_mc', 'zoo_ppl', 'zoo_gen']
  out = lm_eval.simple_evaluate(
    model=model, tasks=tasks, task_manager=lm_eval_model.task_manager(tasks, include_path),
    log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
  )  # fmt: skip
  return {task: [s['resps'] for s in rows] for task, rows in out['samples'].items()}


def test_per_example_results_are_lm_evals_hugging_face_backends(setup):
  pytest.importorskip('accelerate', reason='lm_eval.models.huggingface (HFLM) imports accelerate')
  from lm_eval.models.huggingface import HFLM

  path, include_path = setup
  cfg = zoo_config(gpt2_config, 'tp,tiny', path, pad_vocab_to=8)
  gen = generation.load(cfg, partitioning.make_mesh(cfg.mesh))
  ours = samples(lm_eval_model.ZooLM(gen, tokens.HFTokenizer(path), batch_size=4), include_path)
  theirs = samples(HFLM(pretrained=path, backend='causal', batch_size=4, device='cpu', dtype='float32'), include_path)
  assert ours.keys() == theirs.keys() == {'zoo_mc', 'zoo_ppl', 'zoo_gen'}
  for task in ours:
    assert len(ours[task]) == len(theirs[task]) == 6
    for a, b in zip(ours[task], theirs[task], strict=True):
      for x, y in zip(a, b, strict=True):
        x, y = x[0], y[0]
        if task == 'zoo_gen':
          assert x == y
        elif task == 'zoo_mc':
          assert abs(x[0] - y[0]) < LL_ATOL and x[1] == y[1], (x, y)
        else:
          assert abs(x - y) < LL_ATOL, (x, y)
  assert any(r[0][0] for r in ours['zoo_gen'])  # something was generated


def test_evaluate_lm_py_runs_a_local_task(setup, tmp_path):
  path, include_path = setup
  out = tmp_path / 'results.json'
  run = children.run(
    [sys.executable, 'evaluate_lm.py', '--init_from', path, '--tasks', 'zoo_mc', '--include_path', include_path,
     '--config.model.dtype=float32', '--out', str(out)],
    cwd=ROOT, env={**subprocess_env(), 'HF_DATASETS_OFFLINE': '1'}, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'zoo_mc' in run.stdout and 0 <= json.loads(out.read_text())['results']['zoo_mc']['acc,none'] <= 1


class Request:
  def __init__(self, *args):
    self.args = args


def test_scores_and_generations_are_transformers_without_lm_evals_backend(setup):
  """Independent of HFLM (which needs accelerate): loglikelihoods are the sums of transformers' log-softmax over
  the continuation's tokens (the context's trailing space moved to the continuation, as lm-eval does), a rolling
  loglikelihood of a text shorter than max_length is one window after the end-of-text token, and generate_until is
  transformers' greedy text cut at the stop sequence."""
  import torch
  import transformers

  path, _ = setup
  cfg = zoo_config(gpt2_config, 'tp,tiny', path, pad_vocab_to=8)
  lm = lm_eval_model.ZooLM(
    generation.load(cfg, partitioning.make_mesh(cfg.mesh)), tokens.HFTokenizer(path), batch_size=4
  )
  tok = transformers.AutoTokenizer.from_pretrained(path)
  model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()

  def reference(ctx_ids, cont_ids):
    with torch.no_grad():
      logits = model(torch.tensor([ctx_ids + cont_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(ctx_ids) - 1 : -1]
    return float(logp[torch.arange(len(cont_ids)), torch.tensor(cont_ids)].sum())

  pairs = [('the quick brown', ' fox'), ('lazy dog ', 'jumps over'), ('over the', ' lazy dog the quick')]
  got = lm.loglikelihood([Request(c, x) for c, x in pairs])
  for (c, x), (ll, _) in zip(pairs, got, strict=True):
    c, x = (c.rstrip(), c[len(c.rstrip()) :] + x)
    ctx, whole = tok(c)['input_ids'], tok(c + x)['input_ids']
    assert abs(ll - reference(ctx, whole[len(ctx) :])) < LL_ATOL
  string = 'the quick brown fox jumps over the lazy dog'
  (rolling,) = lm.loglikelihood_rolling([Request(string)])
  assert abs(rolling - reference([tok.eos_token_id], tok(string)['input_ids'])) < LL_ATOL
  (out,) = lm.generate_until([Request('the quick', {'until': ['dog'], 'max_gen_toks': 8, 'do_sample': False})])
  ids = tok('the quick')['input_ids']
  with torch.no_grad():
    hf = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=tok.eos_token_id)
  assert out == tok.decode(hf[0, len(ids) :], skip_special_tokens=True).split('dog')[0]
