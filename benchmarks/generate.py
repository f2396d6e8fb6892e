r"""Generation speed beside transformers and beside the machine's own bound: time to first token, tokens/s and
per-token latency, greedy, no stop token.

  python benchmarks/generate.py --family gpt2 --batches 1,32 --prompt_len 128 --new_tokens 64 --dtype float32
  python benchmarks/generate.py --family gpt2 --batches 1,32 --prompt_len 128 --new_tokens 64 --dtype bfloat16
  python benchmarks/generate.py --family llama --layers 4 --hidden 512 --heads 8 --kv_heads 2 --mlp 1408 --vocab 32000

Built so that it cannot flatter either side:
* every side runs in a process of its own (`--side`, started by this script), the sides strictly alternating
  (`--rounds` of ours, theirs / theirs, ours); a third process measures the machine (copy bandwidth, FLOP rate);
* each process times `--reps` repetitions after a warm-up; the table gives medians and the spread (min-max);
* the 1-minute load average is read before the run and before and after each process, and the CPU time of other
  programs during each process (/proc/stat less this run's own): a busy machine (load over --max_load, or others
  using over --max_load cores while a side ran) is refused, or with --busy its rows are flagged 'BUSY';
* the same prompts (seeded by the batch size) go to both sides, and their greedy tokens are compared (equal in
  float32; in bfloat16 the two libraries round differently, and a near tie may go the other way: the column then
  says how many rows are equal and where the earliest of the others parts).

The bound beside each figure is a roofline: the larger of the bytes a step must move over the machine's read
bandwidth and the FLOPs it must do over its matmul rate. A decode step reads every weight it multiplies with once
(the tied head's too; not the rows of position tables) and the KV cache up to its length (its mean over the decode),
and does 2 FLOPs per weight per row plus its attention (4 per cached key element per row); at batch 1 the bytes
bound it, at batch 32 the FLOPs. The bandwidth is the fastest read of 256 MiB by a jitted sum and, on a CPU, by
numpy's sums in a thread per core and by the decode kernel itself (models/kernels: one row times the 256 MiB as a
matrix), on 2 MB pages as a CPU decode's weights are (generation.load): a decode step reads, and writes almost
nothing, so an in-place copy's rate (bytes read + written, printed beside it) is not one it can reach. The prefill
needs 2 FLOPs per weight per token plus its causal attention, at best at the rate of a jitted 2048^3 matmul (the
fastest of float32, the compute dtype and, for bfloat16 on a CPU with AVX-512 BF16, the decode kernel's GEMM), and
reads the weights once.
'of bound' is bound / measured: 100% is the machine's limit.

The Hugging Face model is built from its config class with random weights (torch.manual_seed(0)) and saved; the zoo
imports the same directory (generation.load, one device) and decodes with its KV cache (generation/engine.py);
transformers generates from the same weights: on CPU with its default (dynamic) cache, on a GPU with its static
cache and torch.compile (benchmarks/gpu_run.sh). The time to first token is a run of one new token (prefill
included), the per-token latency (total - first) / (new - 1) of the same repetition.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('HF_HUB_OFFLINE', '1')

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum('family', 'gpt2', ['gpt2', 'llama'], 'Model family.')
flags.DEFINE_string('batches', '1,32', 'Batch sizes, comma-separated.')
flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens per row.')
flags.DEFINE_integer('new_tokens', 64, 'Tokens generated per row.')
flags.DEFINE_string('dtype', None, 'Compute dtype (default: float32 on CPU, bfloat16 on GPU).')
flags.DEFINE_integer('layers', None, 'Override the number of layers (a smaller model where the real one is too slow).')
flags.DEFINE_integer('hidden', None, 'Override the width.')
flags.DEFINE_integer('heads', None, 'Override the number of heads.')
flags.DEFINE_integer('kv_heads', None, 'Override the number of kv heads (llama).')
flags.DEFINE_integer('mlp', None, 'Override the MLP width.')
flags.DEFINE_integer('vocab', None, 'Override the vocabulary.')
flags.DEFINE_bool('torch_compile', None, 'transformers with static cache + torch.compile (default: on a GPU only).')
flags.DEFINE_enum('decode_matmul', 'auto', ['auto', 'xla'], "Ours: config.decode_matmul ('xla': XLA's dot only).")
flags.DEFINE_integer('reps', 5, 'Timed repetitions per side and batch (after a warm-up).')
flags.DEFINE_integer('rounds', 1, 'Processes per side, alternating ours/theirs, theirs/ours, ...')
flags.DEFINE_float('max_load', 0.3, 'Busiest the machine may be: 1-minute load average, and cores used by others.')
flags.DEFINE_integer('wait', 0, 'Seconds to wait for the load average to fall below --max_load before refusing.')
flags.DEFINE_bool('busy', False, 'Run on a busy machine anyway, its rows flagged BUSY (development, not figures).')
flags.DEFINE_bool('inline', False, 'Run the sides in this process (the smoke test; not figures: flagged INLINE).')
flags.DEFINE_integer('probe_mib', 256, 'Size of the bandwidth probe (well beyond the caches).')
flags.DEFINE_integer('probe_matmul', 2048, 'Side of the FLOP-rate probe matmul.')
flags.DEFINE_enum('side', None, ['ours', 'theirs', 'machine'], 'Internal: the one side this process measures.')
flags.DEFINE_string('path', None, 'Internal: the saved Hugging Face model.')
flags.DEFINE_string('out', None, 'Internal: where this process writes its JSON.')


# ---- the model, its bytes and FLOPs ----


def hf_config():
  import transformers

  o = {k: getattr(FLAGS, k) for k in ('layers', 'hidden', 'heads', 'kv_heads', 'mlp', 'vocab')}
  if FLAGS.family == 'gpt2':
    return transformers.GPT2Config(
      n_layer=o['layers'] or 12, n_embd=o['hidden'] or 768, n_head=o['heads'] or 12, n_inner=o['mlp'],
      vocab_size=o['vocab'] or 50257, n_positions=1024,
    )  # fmt: skip
  return transformers.LlamaConfig(  # Llama 3.2 1B's shapes
    vocab_size=o['vocab'] or 128256, hidden_size=o['hidden'] or 2048, intermediate_size=o['mlp'] or 8192,
    num_hidden_layers=o['layers'] or 16, num_attention_heads=o['heads'] or 32, num_key_value_heads=o['kv_heads'] or 8,
    head_dim=(o['hidden'] or 2048) // (o['heads'] or 32), rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=2048, rope_parameters=dict(rope_type='default', rope_theta=500_000.0),
  )  # fmt: skip


def save_model(path: str) -> dict:
  """Builds and saves the Hugging Face model; what the bound needs to know of its shapes."""
  import torch
  import transformers

  torch.manual_seed(0)
  hf = hf_config()
  model = (transformers.GPT2LMHeadModel if FLAGS.family == 'gpt2' else transformers.LlamaForCausalLM)(hf).eval()
  model.save_pretrained(path)
  params = sum(p.numel() for p in model.parameters())
  table = dict(model.named_parameters())
  # A step reads a row of these, not the whole table: the position table, and an input embedding not tied to the
  # head.
  rows_only = [n for n in table if n.endswith(('wpe.weight',))]
  if not hf.tie_word_embeddings:
    rows_only += [n for n in table if n.endswith('embed_tokens.weight')]
  embeddings = [n for n in table if n.endswith(('wte.weight', 'wpe.weight', 'embed_tokens.weight', 'lm_head.weight'))]
  heads = hf.num_attention_heads
  head_dim = (hf.head_dim if hasattr(hf, 'head_dim') else None) or hf.hidden_size // heads  # GPT-2's has none
  return dict(
    params=params,
    read=params - sum(table[n].numel() for n in rows_only),
    matmul=params - sum(table[n].numel() for n in embeddings),
    hidden=hf.hidden_size,
    layers=hf.num_hidden_layers,
    heads=heads,
    kv_heads=getattr(hf, 'num_key_value_heads', None) or heads,
    head_dim=head_dim,
    vocab=hf.vocab_size,
  )


def prompts_for(B: int, vocab: int) -> list[list[int]]:
  return np.random.default_rng(B).integers(0, vocab, (B, FLAGS.prompt_len)).tolist()


def repeat(fn, reps: int) -> list[tuple[float, float, object]]:
  """(time of 1 new token, time of new_tokens, the latter's output) per repetition."""
  out = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(1)
    t1 = time.perf_counter()
    got = fn(FLAGS.new_tokens)
    out.append((t1 - t0, time.perf_counter() - t1, got))
  return out


# ---- the sides, each in its own process ----


def zoo_generator(path: str, dtype: str):
  import jax

  import generation
  import models
  import partitioning
  from checkpointing import hf_config as adopt
  from configs import gpt2 as gpt2_config
  from configs import llama as llama_config

  config = (gpt2_config if FLAGS.family == 'gpt2' else llama_config).get_config('dp')
  config.mesh.update({k: 1 for k in config.mesh})
  config.init_from, config.dont_load = path, ''
  config.model.update(dtype=dtype)  # the real size's unrolled layers (generation.load unrolls a scanned run's too)
  config.decode_matmul = FLAGS.decode_matmul
  adopt.adopt(config, models.HF_FAMILIES)
  return generation.load(config, partitioning.make_mesh(config.mesh, jax.devices()[:1]))


def run_ours(shapes: dict, dtype: str) -> dict:
  import jax

  import generation

  gen = zoo_generator(FLAGS.path, dtype)
  out = dict(
    device=jax.devices()[0].device_kind,
    param_dtypes=sorted({str(x.dtype) for x in jax.tree.leaves(gen.params)}),
    matmul='the matvec kernel' if gen.decode_kernel() else "XLA's dot",
  )
  # The memory's read rate moved by a third between runs minutes apart on CPU-2: it is read again in this process
  # just before and after each batch's repetitions, and the bound of that batch uses the faster of the two.
  # (numpy asks Linux for huge pages for arrays of 4 MiB and more: the probe is on 2 MB pages, as the weights are)
  probe = np.ones(FLAGS.probe_mib << 18, np.float32) if jax.devices()[0].platform == 'cpu' else None
  for B in [int(b) for b in FLAGS.batches.split(',')]:
    prompts = prompts_for(B, shapes['vocab'])
    fn = lambda n: [g.ids for g in gen.generate(prompts, generation.Sampling(max_new_tokens=n, temperature=0.0))]
    # The cache's slots follow the new tokens' bucket (generation.cache_slots), so the one-token run that times
    # the first token is a program of its own: both are compiled here, not inside a repetition.
    fn(FLAGS.new_tokens)
    fn(1)
    read_before = numpy_read_bandwidth(probe) if probe is not None else None
    reps = repeat(fn, FLAGS.reps)
    read_after = numpy_read_bandwidth(probe) if probe is not None else None
    rows, _, slots = gen.shapes(prompts, generation.Sampling(FLAGS.new_tokens))
    out[B] = dict(
      times=[r[:2] for r in reps],
      tokens=reps[-1][2],
      cache=gen.cache_bytes_per_device(rows, slots),
      read=[read_before, read_after] if probe is not None else None,
    )
  return out


def run_theirs(shapes: dict, dtype: str, device: str) -> dict:
  import torch
  import transformers

  cls = transformers.GPT2LMHeadModel if FLAGS.family == 'gpt2' else transformers.LlamaForCausalLM
  model = cls.from_pretrained(FLAGS.path).eval().to(device=device, dtype=getattr(torch, dtype))
  compiled = device == 'cuda' if FLAGS.torch_compile is None else FLAGS.torch_compile
  if compiled:
    model.generation_config.cache_implementation = 'static'
    model.forward = torch.compile(model.forward, mode='reduce-overhead', fullgraph=True)
  kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
  out = dict(
    peer='static cache + torch.compile' if compiled else 'default (dynamic) cache',
    versions=f'transformers {transformers.__version__} on torch {torch.__version__}',
  )
  for B in [int(b) for b in FLAGS.batches.split(',')]:
    x = torch.tensor(prompts_for(B, shapes['vocab']), device=device)
    mask = torch.ones_like(x)

    def fn(n):
      with torch.no_grad():
        got = model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
      if device == 'cuda':
        torch.cuda.synchronize()
      return got[:, FLAGS.prompt_len :].tolist()

    fn(FLAGS.new_tokens)  # warm-up (and torch.compile's compilation)
    fn(1)
    reps = repeat(fn, FLAGS.reps)
    out[B] = dict(times=[r[:2] for r in reps], tokens=reps[-1][2])
  return out


def numpy_read_bandwidth(x: np.ndarray) -> float:
  """Bytes per second numpy's sums read from x, split across a thread per core (numpy's sum releases the GIL)."""
  parts = np.array_split(x, os.cpu_count() or 1)

  def once():
    threads = [threading.Thread(target=p.sum) for p in parts]
    for t in threads:
      t.start()
    for t in threads:
      t.join()

  once()
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    once()
    times.append(time.perf_counter() - t0)
  return x.nbytes / min(times)


def kernel_matmul(a, b):
  """a @ b through the decode kernel (models/kernels), as a decode step's matmuls (a few rows) or a prefill's
  GEMM runs."""
  from models import kernels

  with kernels.decode_matmuls(True):
    return kernels.matmul('mk,kn->mn', a, b, a.dtype)


def run_machine(dtype: str) -> dict:
  """Memory bandwidth and matmul FLOP rate, each the best of 10 after a warm-up."""
  import jax
  import jax.numpy as jnp

  from models import kernels

  def best(fn, *args, n=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
    return min(times)

  # well beyond any cache; the copy is in place (donated), so no fresh pages: each byte read and written once
  copy = jax.jit(lambda a: a * 1.0000001, donate_argnums=0)
  x = copy(jnp.ones((FLAGS.probe_mib << 18,), jnp.float32))
  kernels.huge_pages(x)  # on 2 MB pages, as generation.load puts a CPU decode's weights
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    x = jax.block_until_ready(copy(x))
    times.append(time.perf_counter() - t0)
  copy_bw = 2 * x.nbytes / min(times)
  readers = {'jitted sum': x.nbytes / best(jax.jit(lambda a: a.reshape(4096, -1).sum(axis=1)), x)}
  cpu_kernel = jax.devices()[0].platform == 'cpu' and kernels.available()
  if jax.devices()[0].platform == 'cpu':  # XLA's sum may read below the memory's rate
    readers['numpy, a thread a core'] = numpy_read_bandwidth(np.asarray(x))
  if cpu_kernel:
    one_row = jax.jit(lambda w, r: kernel_matmul(r, w.reshape(r.shape[1], -1)))
    readers['the decode kernel'] = x.nbytes / best(one_row, x, jnp.ones((1, 4096), jnp.float32))
  reader, read_bw = max(readers.items(), key=lambda kv: kv[1])
  flops, n = {}, FLAGS.probe_matmul
  for dt in sorted({'float32', dtype}):
    a = jnp.ones((n, n), dt)
    flops[dt] = 2 * n**3 / best(jax.jit(lambda a, b: a @ b), a, a, n=20 if jax.devices()[0].platform == 'gpu' else 5)
  # the decode kernel's GEMMs may beat XLA's dot: the bound takes the fastest
  if cpu_kernel and kernels.f32_gemm() and n <= kernels.GEMM_MAX_ROWS:
    a = jnp.ones((n, n), jnp.float32)
    flops['float32, the decode kernel'] = 2 * n**3 / best(jax.jit(kernel_matmul), a, a, n=5)
  if cpu_kernel and dtype == 'bfloat16' and kernels.bf16_gemm():
    a = jnp.ones((n, n), dtype)
    flops['bfloat16, the decode kernel'] = 2 * n**3 / best(jax.jit(kernel_matmul), a, a, n=5)
  return dict(
    platform=jax.devices()[0].platform,
    device=jax.devices()[0].device_kind,
    copy_bw=copy_bw,
    read_bw=read_bw,
    reader=reader,
    readers=readers,
    bandwidth=read_bw,
    flops=flops,
    flop_rate=max(flops.values()),
  )


# ---- the run: processes, load, table ----


def cpu_busy() -> float:
  """Seconds of CPU time the whole machine has spent busy (Linux /proc/stat; 0 elsewhere)."""
  try:
    with open('/proc/stat') as f:
      user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
  except OSError:
    return 0.0
  return (user + nice + system + irq + softirq + steal) / os.sysconf('SC_CLK_TCK')


def side(name: str, path: str, dtype: str | None) -> tuple[dict, dict]:
  """Runs one side in a process of its own (--inline: in this one): (its JSON, the machine's load around it)."""
  out = os.path.join(path, f'{name}.json')
  argv = [a for a in sys.argv[1:] if not a.startswith(('--side', '--path', '--out'))]
  argv += [f'--side={name}', f'--path={path}', f'--out={out}'] + ([f'--dtype={dtype}'] if dtype else [])
  load0, busy0, t0 = os.getloadavg()[0], cpu_busy(), time.time()
  who = resource.RUSAGE_SELF if FLAGS.inline else resource.RUSAGE_CHILDREN
  ours0 = resource.getrusage(who)
  if FLAGS.inline:
    FLAGS([sys.argv[0], *argv])
    measure()
    FLAGS.side = None
  else:
    subprocess.run([sys.executable, os.path.abspath(__file__), *argv], check=True)
  ours1 = resource.getrusage(who)
  wall = time.time() - t0
  own = (ours1.ru_utime + ours1.ru_stime) - (ours0.ru_utime + ours0.ru_stime)
  others = max(0.0, cpu_busy() - busy0 - own) / wall  # cores kept busy by other programs, on average
  with open(out) as f:
    return json.load(f), dict(load_before=load0, load_after=os.getloadavg()[0], others=others, wall=wall)


def spread(xs: list[float], scale: float = 1.0, fmt: str = '.1f') -> str:
  xs = sorted(x * scale for x in xs)
  return f'{statistics.median(xs):{fmt}} ({xs[0]:{fmt}}-{xs[-1]:{fmt}})'


def measure() -> None:
  """The side FLAGS.side names, its JSON written to FLAGS.out."""
  shapes = json.loads(open(os.path.join(FLAGS.path, 'shapes.json')).read()) if FLAGS.side != 'machine' else {}
  dtype = FLAGS.dtype
  if FLAGS.side == 'ours':
    got = run_ours(shapes, dtype)
  elif FLAGS.side == 'theirs':
    got = run_theirs(shapes, dtype, 'cuda' if shapes['platform'] == 'gpu' else 'cpu')
  else:
    got = run_machine(dtype or 'float32')
  with open(FLAGS.out, 'w') as f:
    json.dump(got, f)


def main(argv) -> None:
  if FLAGS.side is not None:
    return measure()

  deadline = time.time() + FLAGS.wait  # a run's own load takes about 3 minutes to decay below 0.3
  while (load := os.getloadavg()[0]) > FLAGS.max_load and time.time() < deadline:
    time.sleep(15)
  if load > FLAGS.max_load and not FLAGS.busy:
    sys.exit(
      f'shardzoo: the machine is busy (1-minute load average {load:.2f} > --max_load {FLAGS.max_load}): figures '
      'taken now would be wrong; wait for it to be quiet (--wait SECONDS), or pass --busy for a development run '
      '(rows flagged BUSY)'
    )
  path = tempfile.mkdtemp(prefix='shardzoo_generate_bench_')
  try:
    machine, machine_load = side('machine', path, None)
    dtype = FLAGS.dtype or ('bfloat16' if machine['platform'] == 'gpu' else 'float32')
    shapes = save_model(path) | dict(platform=machine['platform'])
    with open(os.path.join(path, 'shapes.json'), 'w') as f:
      json.dump(shapes, f)
    runs = {'ours': [], 'theirs': []}
    for r in range(FLAGS.rounds):
      for name in ('ours', 'theirs') if r % 2 == 0 else ('theirs', 'ours'):
        runs[name].append(side(name, path, dtype))
        ld = runs[name][-1][1]
        print(
          f'{name}, round {r + 1}: {ld["wall"]:.0f} s, load average {ld["load_before"]:.2f} -> {ld["load_after"]:.2f}, '
          f"others' cores {ld['others']:.2f}",
          flush=True,
        )
  finally:
    shutil.rmtree(path, ignore_errors=True)
  print(table(shapes, machine, machine_load, runs, dtype, load))


def table(shapes: dict, machine: dict, machine_load: dict, runs: dict, dtype: str, load: float) -> str:
  from partitioning import fmt_bytes

  size = np.dtype(dtype if dtype != 'bfloat16' else 'float16').itemsize
  P, N, bw = FLAGS.prompt_len, FLAGS.new_tokens, machine['bandwidth']
  loads = [machine_load] + [ld for side in runs.values() for _, ld in side]
  busy = max(ld['others'] for ld in loads) > FLAGS.max_load or load > FLAGS.max_load
  ours0, theirs0 = runs['ours'][0][0], runs['theirs'][0][0]
  lines = [
    f'{FLAGS.family}: {shapes["params"] / 1e6:.1f}M parameters, {dtype} (ours stored as {ours0["param_dtypes"]}), '
    f'prompt {P}, {N} new tokens, {FLAGS.reps} repetitions x {FLAGS.rounds} process(es) per side; '
    f'decode matmuls: {ours0["matmul"]}; '
    f'{machine["device"]}; {theirs0["versions"]}, {theirs0["peer"]}',
    f'machine: read bandwidth {bw / 1e9:.1f} GB/s (the fastest reader: {machine["reader"]}; '
    + ', '.join(f'{k} {v / 1e9:.1f}' for k, v in machine['readers'].items())
    + f"; an in-place copy moved {machine['copy_bw'] / 1e9:.1f}, read + written; a CPU's bounds use the read rate "
    "around ours' repetitions, the last column), matmul "
    + ', '.join(f'{k} {v / 1e9:.0f} GFLOP/s' for k, v in machine['flops'].items()),
    f"load average at the start {load:.2f}; per process (before/after, ours included; others' cores): "
    + '; '.join(f'{ld["load_before"]:.2f}/{ld["load_after"]:.2f}, {ld["others"]:.2f}' for ld in loads)
    + ('  ** BUSY: not figures **' if busy else '')
    + ('  ** INLINE (the sides in one process): not figures **' if FLAGS.inline else ''),
    '',
    '| batch | ours TTFT ms | transformers TTFT ms | TTFT bound ms | ours ms/token | transformers ms/token | '
    'bound ms/token | ours of bound | ours tokens/s | transformers tokens/s | speed-up | same tokens | KV cache | '
    'read GB/s around ours |',
    '|' + '---|' * 14,
  ]
  for B in [int(b) for b in FLAGS.batches.split(',')]:
    col = lambda name: (
      [t1 for got, _ in runs[name] for t1, _ in got[str(B)]['times']],
      [(tn - t1) / (N - 1) for got, _ in runs[name] for t1, tn in got[str(B)]['times']],
      [B * N / tn for got, _ in runs[name] for _, tn in got[str(B)]['times']],
    )
    (o_ttft, o_lat, o_tps), (h_ttft, h_lat, h_tps) = col('ours'), col('theirs')
    # the read rate around ours' repetitions (each process's, before and after: the fastest), else the probe's
    around = [r for got, _ in runs['ours'] for r in (got[str(B)].get('read') or [])]
    bw = max(around) if around else machine['bandwidth']
    cache_row = 2 * shapes['layers'] * shapes['kv_heads'] * shapes['head_dim'] * size  # bytes per token of one row
    context = P + (N - 1) / 2  # the mean cache length of a decode step
    attention = 4 * shapes['layers'] * shapes['heads'] * shapes['head_dim']  # FLOPs per row per cached token
    step = max(  # the roofline: bytes at the read bandwidth, or FLOPs at the matmul rate
      (shapes['read'] * size + B * cache_row * context) / bw,
      (2 * (shapes['matmul'] + shapes['hidden'] * shapes['vocab']) * B + attention * B * context)
      / machine['flop_rate'],
    )
    flops = (
      2 * shapes['matmul'] * B * P
      + 2 * shapes['layers'] * B * P * P * shapes['hidden']
      + 2 * shapes['hidden'] * shapes['vocab'] * B
    )
    prefill = max(flops / machine['flop_rate'], shapes['read'] * size / bw)
    # ours' every process against the peer's first; each side's processes against its own first (determinism)
    same = ' / '.join(
      dict.fromkeys(agreement(got[str(B)]['tokens'], theirs0[str(B)]['tokens']) for got, _ in runs['ours'])
    )
    if any(got[str(B)]['tokens'] != side[0][0][str(B)]['tokens'] for side in runs.values() for got, _ in side):
      same += " (a side's processes disagree among themselves)"
    lines.append(
      f'| {B} | {spread(o_ttft, 1e3, ".0f")} | {spread(h_ttft, 1e3, ".0f")} | {prefill * 1e3:.0f} | '
      f'{spread(o_lat, 1e3)} | {spread(h_lat, 1e3)} | {step * 1e3:.1f} | {step / statistics.median(o_lat):.0%} | '
      f'{spread(o_tps)} | {spread(h_tps)} | {statistics.median(o_tps) / statistics.median(h_tps):.2f}x | {same} | '
      f'{fmt_bytes(ours0[str(B)]["cache"])} | '
      + ('/'.join(f'{r / 1e9:.1f}' for r in around) if around else '-')
      + ' |'
      + (' BUSY' if busy else '')
      + (' INLINE' if FLAGS.inline else '')
    )
  return '\n'.join(lines)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
  """'True' when every row's greedy tokens equal the peer's; else how many rows do, and the token at which the
  earliest of the others parts (1 = the first new token): in bfloat16 the libraries round differently, and one near
  tie taken the other way changes the rest of a row."""
  parts = [
    next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None if len(o) == len(t) else min(len(o), len(t)))
    for o, t in zip(ours, theirs, strict=True)
  ]
  if all(p is None for p in parts):
    return 'True'
  first = min(p for p in parts if p is not None) + 1
  return f'{sum(p is None for p in parts)}/{len(parts)} rows (the first other parts at token {first})'


if __name__ == '__main__':
  app.run(main)
