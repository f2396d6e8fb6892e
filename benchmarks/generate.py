r"""Generation speed beside transformers: time to first token, tokens/s and per-token latency, greedy, no stop token.

  python benchmarks/generate.py --family gpt2                      # GPT-2 124M shapes
  python benchmarks/generate.py --family llama                     # Llama 3.2 1B shapes (1.24B)
  python benchmarks/generate.py --family llama --layers 4 --hidden 1024 --heads 16 --kv_heads 4 --mlp 4096
  python benchmarks/generate.py --family gpt2 --batches 1,32 --prompt_len 128 --new_tokens 256 --dtype float32

The Hugging Face model is built from its config class with random weights (torch.manual_seed(0)) and saved; the zoo
imports the same directory (generation.load, one device) and decodes with its KV cache (generation/engine.py);
transformers generates from the same model in the same process: on CPU with its default (dynamic) cache, on a GPU with
its static cache and torch.compile. Each side is warmed up (compiled) on the same shapes before it is timed; the time
to first token is a run of one new token (prefill included), the per-token latency (total - first) / (new - 1).
Both sides must produce the same greedy tokens in float32 (checked; printed as 'same tokens').
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import generation  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
from checkpointing import hf_config  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402
from configs import llama as llama_config  # noqa: E402
from partitioning import fmt_bytes  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum('family', 'gpt2', ['gpt2', 'llama'], 'Model family.')
flags.DEFINE_string('batches', '1,32', 'Batch sizes, comma-separated.')
flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens per row.')
flags.DEFINE_integer('new_tokens', 256, 'Tokens generated per row.')
flags.DEFINE_string('dtype', None, 'Compute dtype (default: float32 on CPU, bfloat16 on GPU).')
flags.DEFINE_integer('layers', None, 'Override the number of layers (a smaller model where the real one is too slow).')
flags.DEFINE_integer('hidden', None, 'Override the width.')
flags.DEFINE_integer('heads', None, 'Override the number of heads.')
flags.DEFINE_integer('kv_heads', None, 'Override the number of kv heads (llama).')
flags.DEFINE_integer('mlp', None, 'Override the MLP width.')
flags.DEFINE_integer('vocab', None, 'Override the vocabulary.')
flags.DEFINE_bool('torch_compile', None, 'transformers with static cache + torch.compile (default: on a GPU only).')


def hf_model(family: str):
  import torch
  import transformers

  torch.manual_seed(0)
  o = {k: getattr(FLAGS, k) for k in ('layers', 'hidden', 'heads', 'kv_heads', 'mlp', 'vocab')}
  if family == 'gpt2':
    cfg = transformers.GPT2Config(
      n_layer=o['layers'] or 12, n_embd=o['hidden'] or 768, n_head=o['heads'] or 12, n_inner=o['mlp'],
      vocab_size=o['vocab'] or 50257, n_positions=1024,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()
  cfg = transformers.LlamaConfig(  # Llama 3.2 1B's shapes
    vocab_size=o['vocab'] or 128256, hidden_size=o['hidden'] or 2048, intermediate_size=o['mlp'] or 8192,
    num_hidden_layers=o['layers'] or 16, num_attention_heads=o['heads'] or 32, num_key_value_heads=o['kv_heads'] or 8,
    head_dim=(o['hidden'] or 2048) // (o['heads'] or 32), rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=2048, rope_parameters=dict(rope_type='default', rope_theta=500_000.0),
  )  # fmt: skip
  return transformers.LlamaForCausalLM(cfg).eval()


def zoo_generator(family: str, path: str, dtype: str) -> generation.Generator:
  config = (gpt2_config if family == 'gpt2' else llama_config).get_config('dp')
  config.mesh.update({k: 1 for k in config.mesh})
  config.init_from, config.dont_load = path, ''
  config.model.update(dtype=dtype, scan_layers=False)
  hf_config.adopt(config, models.HF_FAMILIES)
  mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
  return generation.load(config, mesh)


def timed(fn, repeats: int = 1) -> tuple[float, object]:
  best, out = float('inf'), None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t0)
  return best, out


def main(argv) -> None:
  import torch

  on_gpu = jax.devices()[0].platform == 'gpu'
  dtype = FLAGS.dtype or ('bfloat16' if on_gpu else 'float32')
  compiled = on_gpu if FLAGS.torch_compile is None else FLAGS.torch_compile
  device = 'cuda' if on_gpu else 'cpu'
  model = hf_model(FLAGS.family)
  n_params = sum(p.numel() for p in model.parameters())
  path = tempfile.mkdtemp(prefix='shardzoo_generate_bench_')
  model.save_pretrained(path)
  gen = zoo_generator(FLAGS.family, path, dtype)
  model = model.to(device=device, dtype=getattr(torch, dtype))
  kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
  if compiled:
    model.generation_config.cache_implementation = 'static'
    model.forward = torch.compile(model.forward, mode='reduce-overhead', fullgraph=True)
  print(
    f'{FLAGS.family}: {n_params / 1e6:.1f}M parameters, {dtype}, prompt {FLAGS.prompt_len}, {FLAGS.new_tokens} new '
    f'tokens, {jax.devices()[0].device_kind}; transformers {"static cache + torch.compile" if compiled else "default"}'
  )
  rows = []
  P, N = FLAGS.prompt_len, FLAGS.new_tokens
  for B in [int(b) for b in FLAGS.batches.split(',')]:
    prompts = np.random.default_rng(B).integers(0, model.config.vocab_size, (B, P)).tolist()
    ours = lambda n: gen.generate(prompts, generation.Sampling(max_new_tokens=n, temperature=0.0))
    ours(N)  # compiles the (B, P, S) program: max_new_tokens is traced, so 1 and N share it
    ttft, _ = timed(lambda: ours(1), 2)
    total, got = timed(lambda: ours(N))
    x = torch.tensor(prompts, device=device)
    theirs = lambda n: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, **kw)
    with torch.no_grad():
      theirs(min(N, 8))  # warm-up (and torch.compile's compilation)
      h_ttft, _ = timed(lambda: theirs(1), 2)
      h_total, h_out = timed(lambda: theirs(N))
    same = [g.ids for g in got] == h_out[:, P:].tolist()
    cache = gen.cache_bytes_per_device(*[gen.shapes(prompts, generation.Sampling(N))[i] for i in (0, 2)])
    lat, h_lat = (total - ttft) / (N - 1), (h_total - h_ttft) / (N - 1)
    rows.append(
      f'| {B} | {ttft * 1e3:.0f} ms | {B * N / total:,.1f} | {lat * 1e3:.1f} | {h_ttft * 1e3:.0f} ms | '
      f'{B * N / h_total:,.1f} | {h_lat * 1e3:.1f} | {h_total / total:.2f}x | {same} | {fmt_bytes(cache)} |'
    )
    print(rows[-1], flush=True)  # each batch as it is measured (a long run on a CPU)
  head = (
    '| batch | ours TTFT | ours tokens/s | ours ms/token | transformers TTFT | tokens/s | ms/token | speed-up '
    '| same tokens | KV cache |'
  )
  print('\n'.join([head, '|' + '---|' * 10, *rows]))


if __name__ == '__main__':
  app.run(main)
