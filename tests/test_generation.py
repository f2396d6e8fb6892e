"""Generation with a KV cache (generation/): greedy tokens of models imported from Hugging Face are
transformers' generate(do_sample=False) in float32 (GPT-2; Llama with grouped-query attention, tied and untied
heads and llama3 rope scaling; Mixtral), for a batch of prompts of different lengths decoded together; every
decode step's logits are a full forward pass's over the same tokens; tensor-parallel and FSDP decoding equal one
device; scanned and unrolled stacks alike; sampling options are seeded and cut what they say; bad input is one
line."""

import json
import logging
import os
import sys

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import generation  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
import train  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402
from configs import llama as llama_config  # noqa: E402
from configs import moe as moe_config  # noqa: E402
from configs import vit as vit_config  # noqa: E402
from errors import ConfigError  # noqa: E402
from generation import engine  # noqa: E402
from models import kernels  # noqa: E402
from tests import children
from tests.conftest import BACKEND_COMPILE, ROOT, build_trainer, recorded_compile_events, subprocess_env  # noqa: E402
from tests.test_hf_export import tiny_gpt2_with_tokenizer  # noqa: E402
from tests.test_hf_families import LLAMA3_ROPE, save, zoo_config  # noqa: E402
from training import tasks  # noqa: E402

STEP_ATOL = 1e-5  # a decode step's logits against a full forward pass over the same tokens (fp32)
PROMPTS = [[5, 17, 3, 9, 22, 41, 7], [12], [8, 30, 2, 2]]  # different lengths, decoded as one left-padded batch
NEW = 6


def hf_greedy(hf_model, prompt, eos, new=NEW):
  with torch.no_grad():
    out = hf_model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      do_sample=False,
      max_new_tokens=new,
      eos_token_id=eos,
      pad_token_id=0,
    )
  return out[0, len(prompt) :].tolist()


def zoo(config_file, arg, path, devices=None, **model):
  cfg = zoo_config(config_file, arg, path, **model)
  if devices is not None:
    cfg.mesh.update({k: 1 for k in cfg.mesh})
  mesh = partitioning.make_mesh(cfg.mesh, devices)
  return generation.load(cfg, mesh)


def full_forward_logits(gen, rows):
  """Every position's logits of each row of tokens from the model's plain forward pass (no cache), right-padded
  to one length (causal: the padding changes no earlier position; dropless MoE routing is per token)."""

  @jax.jit
  def run(params, model_state, tokens_BL):
    out = tasks.eval_view(nnx.merge(gen.graphdef, params, model_state, copy=True))(tokens_BL)
    return out[0] if isinstance(out, tuple) else out

  L = -(-max(len(r) for r in rows) // 8) * 8  # a multiple of the MoE's group_size
  tokens_BL = np.asarray([r + [0] * (L - len(r)) for r in rows], np.int32)
  return np.asarray(run(gen.params, gen.model_state, tokens_BL))


def check_parity(gen, hf_model, eos=None):
  got = gen.generate(PROMPTS, generation.Sampling(max_new_tokens=NEW, temperature=0.0), eos, keep_logits=True)
  full = full_forward_logits(gen, [p + g.ids for p, g in zip(PROMPTS, got, strict=True)])
  for b, (p, g) in enumerate(zip(PROMPTS, got, strict=True)):
    assert g.ids == hf_greedy(hf_model, p, eos), p
    # step j's logits (after the prompt and j generated tokens) are the full pass's at position len(p) + j - 1
    np.testing.assert_allclose(g.logits, full[b, len(p) - 1 : len(p) - 1 + len(g.ids)], atol=STEP_ATOL, rtol=0)
  return got


def check_one_row(gen, got):
  """The first prompt alone, a decode without the batch axis (models/layers.py Attention._cached), gives the batch's
  first row: its tokens, and its logits within STEP_ATOL."""
  sampling = generation.Sampling(max_new_tokens=NEW, temperature=0.0)
  if gen.shapes(PROMPTS[:1], sampling)[0] != 1:  # a mesh that splits the rows: the same weights on one device
    one_device = lambda tree: jax.device_put(tree, jax.devices()[0])
    kw = dict(max_len=gen.max_len, vocab=gen.vocab)
    gen = generation.Generator(gen.graphdef, one_device(gen.params), one_device(gen.model_state), **kw)
  (one,) = gen.generate(PROMPTS[:1], sampling, keep_logits=True)
  assert one.ids == got[0].ids
  np.testing.assert_allclose(one.logits, got[0].logits, atol=STEP_ATOL, rtol=0)


# --- GPT-2 ------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def gpt2_dir(tmp_path_factory):
  torch.manual_seed(0)
  hf_cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
  return save(transformers.GPT2LMHeadModel(hf_cfg).eval(), tmp_path_factory.mktemp('hf_gpt2'))


@pytest.mark.parametrize('arg,scan', [('fsdp_tp,tiny', True), ('tp,tiny', False)])
def test_gpt2_greedy_is_transformers_and_steps_are_full_forward_passes(gpt2_dir, arg, scan):
  path, hf_model = gpt2_dir
  check_parity(zoo(gpt2_config, arg, path, scan_layers=scan), hf_model)


def test_a_bfloat16_decode_stores_its_weights_in_bfloat16_and_decodes_the_same_tokens(gpt2_dir):
  """decode_config narrows param_dtype to a narrower compute dtype: half the bytes a step reads, no cast per step;
  the layers cast float32 weights to bfloat16 anyway, so the tokens and logits equal the float32-stored weights'."""
  path, _ = gpt2_dir
  gen = zoo(gpt2_config, 'tp,tiny', path, scan_layers=False, dtype='bfloat16')
  floats = [x for x in jax.tree.leaves(gen.params) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
  assert {x.dtype for x in floats} == {jax.numpy.dtype('bfloat16')}
  wide = jax.tree.map(lambda x: x.astype('float32') if x.dtype == jax.numpy.bfloat16 else x, gen.params)
  kept = generation.Generator(gen.graphdef, wide, gen.model_state, rules=gen.rules, mesh=gen.mesh)
  sampling = generation.Sampling(max_new_tokens=NEW, temperature=0.0)
  for a, b in zip(
    gen.generate(PROMPTS, sampling, keep_logits=True), kept.generate(PROMPTS, sampling, keep_logits=True)
  ):
    assert a.ids == b.ids
    np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_a_one_device_decode_runs_the_kernel_and_decodes_as_xla_does(gpt2_dir, dtype, monkeypatch, caplog):
  """On one CPU device a decode step's weight matmuls, the tied head's included, run through the decode kernel
  (models/kernels), and the prefill's too in bfloat16 on AVX-512 BF16 and in both on AVX2 (its GEMM), said once in
  the log. In float32 its tokens
  are transformers' and its logits XLA's dot's (config.decode_matmul='xla') within STEP_ATOL; in bfloat16 the
  prefill's logits are XLA's within bfloat16's rounding (the sums' order differs, so later tokens may part at a
  near tie)."""
  path, hf_model = gpt2_dir
  gen = zoo(gpt2_config, 'tp,tiny', path, devices=jax.devices()[:1], scan_layers=False, dtype=dtype)
  if not kernels.available():
    pytest.skip(f'the decode kernel is not available here: {kernels._loaded()[1]}')
  taken, matmul = [], kernels.matmul

  def counted(spec, x, w, out_dtype):
    out = matmul(spec, x, w, out_dtype)
    if out is not None:
      taken.append((spec, kernels.plan(spec, x.shape, w.shape)[0]))
    return out

  monkeypatch.setattr(kernels, 'matmul', counted)
  monkeypatch.setattr(engine, '_logged', set())
  xla = generation.Generator(gen.graphdef, gen.params, gen.model_state, rules=gen.rules, mesh=gen.mesh, matmul='xla')
  sampling = generation.Sampling(max_new_tokens=NEW, temperature=0.0)
  with caplog.at_level(logging.INFO):
    got = gen.generate(PROMPTS, sampling, keep_logits=True)
    gen.generate(PROMPTS[:1], sampling)  # a second program: the choice is not said again
  assert {'bld,dhk->blhk', 'bld,vd->blv'} <= {spec for spec, _ in taken}
  prefill = kernels.f32_gemm() or (dtype == 'bfloat16' and kernels.bf16_gemm())
  assert any(rows > kernels.MAX_ROWS for _, rows in taken) == prefill
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('decode matmuls:')]
  assert len(said) == 1 and 'models/kernels/matvec.cc' in said[0], said
  taken.clear()
  for p, a, b in zip(PROMPTS, got, xla.generate(PROMPTS, sampling, keep_logits=True), strict=True):
    if dtype == 'float32':
      assert a.ids == b.ids == hf_greedy(hf_model, p, None), p
      np.testing.assert_allclose(a.logits, b.logits, atol=STEP_ATOL, rtol=0)
    else:
      np.testing.assert_allclose(a.logits[0], b.logits[0], atol=2.0**-7 * np.abs(b.logits[0]).max(), rtol=0)
  assert taken == []  # 'xla' traced no kernel call


def test_a_batch_past_the_kernels_rows_decodes_through_packed_panels_as_xla_does(gpt2_dir, monkeypatch):
  """A float32 batch of more than MAX_ROWS rows: each decode step's matmuls run the float32 GEMM over W's panels,
  packed once outside the loop (`prepack`) where it runs PREPACK_MIN_STEPS steps or more (a decode of one token
  packs nothing); its tokens are XLA's and transformers', its logits XLA's within STEP_ATOL."""
  if not kernels.f32_gemm():
    pytest.skip('the float32 GEMM runs on CPUs with AVX2 or AVX-512')
  path, hf_model = gpt2_dir
  gen = zoo(gpt2_config, 'tp,tiny', path, devices=jax.devices()[:1], scan_layers=False, dtype='float32')
  packed, matmul = [], kernels.matmul

  def counted(spec, x, w, out_dtype):
    if kernels._prepack.get():
      packed.append(kernels.plan(spec, x.shape, w.shape)[0])
    return matmul(spec, x, w, out_dtype)

  monkeypatch.setattr(kernels, 'matmul', counted)
  monkeypatch.setattr(engine, 'PREPACK_MIN_STEPS', NEW - 1)
  prompts = (PROMPTS * 4)[: kernels.MAX_ROWS + 2]
  gen.generate(prompts, generation.Sampling(max_new_tokens=1, temperature=0.0))
  assert packed == []
  sampling = generation.Sampling(max_new_tokens=NEW, temperature=0.0)
  got = gen.generate(prompts, sampling, keep_logits=True)
  assert packed and all(rows == len(prompts) for rows in packed)
  xla = generation.Generator(gen.graphdef, gen.params, gen.model_state, rules=gen.rules, mesh=gen.mesh, matmul='xla')
  for p, a, b in zip(prompts, got, xla.generate(prompts, sampling, keep_logits=True), strict=True):
    assert a.ids == b.ids, p
    np.testing.assert_allclose(a.logits, b.logits, atol=STEP_ATOL, rtol=0)
  for p, a in zip(PROMPTS, got):
    assert a.ids == hf_greedy(hf_model, p, None), p


def test_a_one_device_decode_without_the_kernel_warns_once(gpt2_dir, monkeypatch, caplog):
  """Where the kernel would run but is not available (no compiler, a failed build), the decode falls back to XLA's
  dot and says so once, as a warning: the decode is slower than it could be."""
  gen = zoo(gpt2_config, 'tp,tiny', gpt2_dir[0], devices=jax.devices()[:1], scan_layers=False)
  monkeypatch.setattr(kernels, '_loaded', lambda: (None, 'no C++ compiler found ($CXX, g++ or c++)'))
  monkeypatch.setattr(engine, '_logged', set())
  with caplog.at_level(logging.INFO):
    assert gen.decode_kernel() is False and gen.decode_kernel() is False
  said = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith('decode matmuls:')]
  why = 'the kernel is not available: no C++ compiler found ($CXX, g++ or c++)'
  assert said == [(logging.WARNING, f"decode matmuls: XLA's dot ({why})")], said


HUGE_PAGES = kernels.huge_pages  # the real one, for the test that counts its calls


def test_a_cpu_decode_s_weights_are_moved_onto_huge_pages_said_once(gpt2_dir, monkeypatch, caplog):
  """generation.load moves a CPU decode's weights onto 2 MB pages (kernels.huge_pages; here every leaf, the tiny
  model's being under the 1 MiB it takes), said once in the log; where the OS refuses, the log says why."""
  from tests.test_decode_kernel import huge_pages_here

  moved = []
  monkeypatch.setattr(kernels, 'huge_pages', lambda tree: moved.append(tree) or HUGE_PAGES(tree, least=0))
  monkeypatch.setattr(engine, '_logged', set())
  with caplog.at_level(logging.INFO):
    gen = zoo(gpt2_config, 'tp,tiny', gpt2_dir[0], devices=jax.devices()[:1], scan_layers=False)
    gen.huge_pages()
  assert len(moved) == 2 and moved[0] is gen.params
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('decode weights on')]
  where = 'decode weights on 2 MB pages: ' if huge_pages_here() else 'decode weights on 4 KB pages: '
  assert len(said) == 1 and said[0].startswith(where), said


# --- Llama (grouped-query attention; tied and untied heads; llama3 rope scaling) and Mixtral ---------------

LLAMA_CASES = {  # name -> (LlamaConfig overrides, zoo preset, scan_layers)
  'gqa_untied_scanned': (dict(tie_word_embeddings=False), 'fsdp_tp,tiny', True),
  'gqa_tied_llama3_rope_unrolled': (
    dict(tie_word_embeddings=True, rope_parameters=dict(rope_theta=10_000.0, **LLAMA3_ROPE)),
    'tp,tiny',
    False,
  ),
}


@pytest.fixture(scope='module', params=sorted(LLAMA_CASES))
def llama_dir(request, tmp_path_factory):
  overrides, arg, scan = LLAMA_CASES[request.param]
  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
    **overrides,
  )
  path, model = save(transformers.LlamaForCausalLM(hf_cfg).eval(), tmp_path_factory.mktemp('hf_llama'))
  return path, model, arg, scan


def test_llama_greedy_is_transformers_and_steps_are_full_forward_passes(llama_dir):
  path, hf_model, arg, scan = llama_dir
  gen = zoo(llama_config, arg, path, scan_layers=scan)
  assert gen.layout.kv_heads == 4 and not gen.layout.scanned  # a decode runs its layers unrolled
  check_parity(gen, hf_model, eos=hf_model.generation_config.eos_token_id)


def test_one_row_decodes_each_prompt_as_the_batch_does(llama_dir):
  """A single row decodes without its batch axis (models/layers.py Attention._cached, generation/engine.py):
  each prompt alone gives transformers' tokens and the batch's logits."""
  path, hf_model, arg, scan = llama_dir
  gen = zoo(llama_config, arg, path, scan_layers=scan)
  sampling = generation.Sampling(max_new_tokens=NEW, temperature=0.0)
  for p, b in zip(PROMPTS, gen.generate(PROMPTS, sampling, keep_logits=True), strict=True):
    (one,) = gen.generate([p], sampling, keep_logits=True)
    assert one.ids == b.ids == hf_greedy(hf_model, p, None), p
    np.testing.assert_allclose(one.logits, b.logits, atol=STEP_ATOL, rtol=0)


def test_a_hugging_face_directory_decodes_with_its_own_dtype_and_lengths(tmp_path):
  """The family config (a training config: bfloat16, 2048 positions) gives way to config.json's dtype and
  max_position_embeddings, unless the command line sets them (`overridden`)."""
  from checkpointing import hf_config
  from generation import loading

  transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, head_dim=8, max_position_embeddings=128, dtype='float32',
  )).save_pretrained(tmp_path)  # fmt: skip
  for overridden, want in ((set(), ('float32', 128)), ({'model.dtype', 'model.max_len'}, ('bfloat16', 64))):
    cfg = llama_config.get_config()
    cfg.model.update(dtype='bfloat16', max_len=64 if overridden else cfg.model.max_len)
    cfg.init_from = str(tmp_path)
    loading.checkpoint_facts(cfg, overridden)
    hf_config.adopt(cfg, models.HF_FAMILIES)
    assert (cfg.model.dtype, cfg.model.max_len) == want, overridden


def test_mixtral_greedy_is_transformers_and_steps_are_full_forward_passes(tmp_path):
  torch.manual_seed(0)
  hf_cfg = transformers.MixtralConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.2,
  )
  path, hf_model = save(transformers.MixtralForCausalLM(hf_cfg).eval(), tmp_path / 'hf_mixtral')
  gen = zoo(moe_config, 'ep,tiny', path, scan_layers=True, group_size=8)
  check_parity(gen, hf_model)


# --- Sharded decoding equals one device -------------------------------------------------------------


def test_tensor_parallel_and_fsdp_decoding_equal_one_device(llama_dir):
  path, _, _, scan = llama_dir
  sampling = generation.Sampling(max_new_tokens=NEW, temperature=0.0)
  one = zoo(llama_config, 'fsdp,tiny', path, jax.devices()[:1], scan_layers=scan)
  assert one.mesh.size == 1
  ref = one.generate(PROMPTS, sampling, keep_logits=True)
  for arg, spec in (('tp,tiny', "'data', 'tensor')"), ('fsdp,tiny', "('data', 'fsdp')")):
    gen = zoo(llama_config, arg, path, scan_layers=scan)
    assert gen.mesh.size == 8
    for r, g in zip(ref, gen.generate(PROMPTS, sampling, keep_logits=True), strict=True):
      assert g.ids == r.ids, arg
      np.testing.assert_allclose(g.logits, r.logits, atol=STEP_ATOL, rtol=0)
    rows, _, slots = gen.shapes(PROMPTS, sampling)
    assert rows == (4 if arg == 'tp,tiny' else 8)  # 3 prompts padded to the devices 'cache_batch' is split over
    table = gen.cache_table(rows, slots)
    assert spec in table and 'KV cache: ' in table, table


# --- A decode builds no training machinery ----------------------------------------------------------------------

_DECODE_ONLY = """
import json, sys
import jax
import partitioning
partitioning.simulate_cpu_devices(8)
import generation, models
from checkpointing import hf_config
from configs import gpt2
cfg = gpt2.get_config('fsdp_tp,tiny')
cfg.init_from, cfg.dont_load = sys.argv[1], ''
hf_config.adopt(cfg, models.HF_FAMILIES)
gen = generation.load(cfg, partitioning.make_mesh(cfg.mesh))
gen.generate([[1, 2, 3]], generation.Sampling(2, temperature=0.0))
print(json.dumps(dict(
  training=sorted(m for m in sys.modules if m.split('.')[0] == 'training'),
  weights=sum(x.nbytes for x in jax.tree.leaves((gen.params, gen.model_state))),
  live=sum(a.nbytes for a in jax.live_arrays()),
)))
"""


def test_a_decode_imports_no_training_module_and_allocates_only_the_weights(gpt2_dir):
  """generation.load in a fresh process: no module of training/ is imported (so neither training.optim nor
  training.accumulate, nor any optimizer state), and the arrays alive after decoding are the weights alone."""
  r = children.run(
    [sys.executable, '-c', _DECODE_ONLY, gpt2_dir[0]],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got['training'] == [], got['training']  # training.optim, training.accumulate among them
  assert got['live'] == got['weights'] > 0, got


# --- Sampling, stop tokens, bad input -------------------------------------------------------------------


@pytest.fixture(scope='module')
def gpt2_gen(gpt2_dir):
  return zoo(gpt2_config, 'fsdp_tp,tiny', gpt2_dir[0], scan_layers=True)


def test_sampling_is_seeded_and_cut_by_top_k_and_top_p(gpt2_gen):
  run = lambda **kw: gpt2_gen.generate(PROMPTS, generation.Sampling(NEW, **kw), keep_logits=True)  # one compile each
  ids = lambda **kw: [g.ids for g in run(**kw)]
  greedy = ids(temperature=0.0)
  assert ids(seed=3) == ids(seed=3) != ids(seed=4)
  assert ids(top_p=1e-6, seed=5) == greedy  # the nucleus of the most probable token alone
  for kw in (dict(top_k=3, seed=1), dict(top_p=0.5, temperature=0.7, seed=2)):
    for g in run(**kw):
      for logits, token in zip(g.logits, g.ids, strict=True):  # step j's logits chose token j
        order = np.argsort(-logits)
        rank = int(np.where(order == token)[0][0])
        if 'top_k' in kw:
          assert rank < kw['top_k']
        else:
          p = jax.nn.softmax(logits[order] / kw['temperature'])
          assert float(np.sum(p[:rank])) < kw['top_p']  # the tokens before it had not reached top_p


def test_the_cache_holds_no_power_of_two_of_slots_it_never_fills():
  """P + new rounded to a power of two, or P + new's own bucket where fewer: a decode step reads every slot."""
  from generation.engine import cache_slots

  assert [cache_slots(128, 64), cache_slots(128, 65), cache_slots(8, 6), cache_slots(8, 3), cache_slots(8, 100)] == [
    192, 256, 16, 16, 128,
  ]  # fmt: skip


def test_a_row_stops_at_its_own_stop_token(gpt2_gen):
  greedy = [g.ids for g in gpt2_gen.generate(PROMPTS, generation.Sampling(NEW, temperature=0.0))]
  stop = greedy[0][2]
  got = gpt2_gen.generate(PROMPTS, generation.Sampling(NEW, temperature=0.0), [stop, None, None])
  assert got[0].ids == greedy[0][: greedy[0].index(stop) + 1]
  assert [g.ids for g in got[1:]] == greedy[1:]
  with recorded_compile_events() as compiles:  # max_new_tokens is traced: the bucket's program serves 3 as 6
    shorter = gpt2_gen.generate(PROMPTS, generation.Sampling(3, temperature=0.0))
  assert [g.ids for g in shorter] == [g[:3] for g in greedy] and BACKEND_COMPILE not in compiles, compiles


def test_bad_input_is_one_line(gpt2_gen):
  cases = [
    (dict(top_p=0.0), [[1]], r'^top_p=0.0: must be in \(0, 1\]'),
    (dict(top_p=1.5), [[1]], r'^top_p=1.5: must be in \(0, 1\]'),
    (dict(temperature=-1.0), [[1]], r'^temperature=-1.0: must be >= 0'),
    (
      dict(max_new_tokens=6),
      [[1], [1] * 27],
      r"^prompt 1 has 27 tokens: with max_new_tokens=6 that is 33, over the model's 32",
    ),
    (dict(max_new_tokens=4), [[1], []], r'^prompt 1 is empty'),
    (dict(max_new_tokens=4), [[1, 64]], r"^prompt 0 has token ids outside the model's vocabulary of 64 \(e.g. 64\)"),
  ]
  for kw, prompts, match in cases:
    with pytest.raises(ConfigError, match=match):
      gpt2_gen.generate(prompts, generation.Sampling(**kw))
  cfg = vit_config.get_config('dp,tiny')
  with pytest.raises(
    ConfigError, match=r"^config.task='classification' \(model 'vit'\): generation needs a language model"
  ):
    generation.decode_config(cfg)


# --- generate.py ------------------------------------------------------------------------------------


def run_generate(*args):
  return children.run(
    [sys.executable, 'generate.py', *args], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
  )


def test_generate_py_from_a_hugging_face_directory_is_transformers_greedy(tmp_path):
  """--init_from DIR (its family's config chosen from config.json, float32 as config.json says): the JSONL out holds the
  prompt's ids from the directory's tokenizer and transformers' greedy tokens; a directory without a tokenizer
  is one line."""
  path = str(tmp_path / 'hf')
  tiny_gpt2_with_tokenizer(path)
  out = tmp_path / 'out.jsonl'
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text('{"prompt": "lazy dog jumps", "completion": "ignored"}\n')
  run = run_generate(
    '--init_from', path, '--prompt', 'the quick', '--prompts', str(prompts), '--temperature', '0',
    '--max_new_tokens', '5', '--out', str(out),
  )  # fmt: skip
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'KV cache: ' in run.stdout and 'cache_batch' in run.stdout, run.stdout
  assert f"{path}: dtype='float32'" in run.stdout, run.stdout
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  tok = transformers.AutoTokenizer.from_pretrained(path)
  hf_model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
  assert [r['prompt'] for r in rows] == ['the quick', 'lazy dog jumps']
  for r in rows:
    assert r['prompt_ids'] == tok(r['prompt'])['input_ids']
    assert r['ids'] == hf_greedy(hf_model, r['prompt_ids'], tok.eos_token_id, 5), r
    assert r['text'] == tok.decode([i for i in r['ids'] if i != tok.eos_token_id]) and r['text'] in run.stdout
  for f in os.listdir(path):
    if f.startswith('tokenizer'):
      os.remove(os.path.join(path, f))
  run = run_generate('--init_from', path, '--prompt', 'the quick')
  assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith(
    f'shardzoo: config error: {path} has no tokenizer files'
  ), run.stderr[-2000:]


def test_generate_py_from_a_run_is_greedy_decoding_of_its_checkpoint(tmp_path):
  """--workdir RUN (run_config.json, the latest checkpoint, the run's byte tokenizer): greedy ids are those of
  the argmax of full forward passes (no cache) over the restored weights; a prompt too long is one line."""
  cfg = gpt2_config.get_config('fsdp_tp,tiny')
  cfg.model.update(vocab_size=260, max_len=32)
  cfg.dataset = ml_collections.ConfigDict(
    dict(name='markov_text', vocab_size=16, branching=4, smoothing=0.03, seed=0, seq_len=32, num_train=64,
         num_eval=16, tokenizer='byte')
  )  # fmt: skip
  cfg.update(batch_size=8, total_steps=2, checkpoint_every=2, eval_every=2, log_every=1, sample_len=0)
  state = train.train_and_evaluate(cfg, str(tmp_path))['state']
  out = tmp_path / 'out.jsonl'
  run = run_generate('--workdir', str(tmp_path), '--prompt', 'ab', '--temperature', '0', '--max_new_tokens', '4',
                     '--out', str(out))  # fmt: skip
  assert run.returncode == 0, run.stderr[-3000:]
  (row,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert row['prompt_ids'] == [257, 97, 98]  # as training begins a byte text: <|bos|>, then the bytes
  trainer = build_trainer(cfg)
  tokens = [257, 97, 98]
  forward = last_logits_of_a_full_pass(trainer, state, len(tokens) + 3)
  for _ in range(4):  # the reference: argmax of a full forward pass, one token at a time
    tokens.append(int(np.argmax(forward(tokens))))
  assert row['ids'] == tokens[3:], row
  run = run_generate('--workdir', str(tmp_path), '--prompt', 'a' * 30, '--max_new_tokens', '4')
  assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith(
    "shardzoo: config error: prompt 0 has 31 tokens: with max_new_tokens=4 that is 35, over the model's 32"
  ), run.stderr[-2000:]


def last_logits_of_a_full_pass(trainer, state, length):
  """tokens -> the last position's logits of a full forward pass over them. One compiled program serves every
  length up to `length`: the tokens are padded at the end, which a causal model's earlier positions never see."""
  run = jax.jit(lambda p, s, t: tasks.eval_view(nnx.merge(trainer.graphdef, p, s, copy=True))(t))

  def last_logits(tokens):
    padded = np.zeros((1, length), np.int32)
    padded[0, : len(tokens)] = tokens
    return np.asarray(run(state.params, state.model_state, padded)[0, len(tokens) - 1])

  return last_logits
