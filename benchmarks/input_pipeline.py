r"""Throughput of the input pipelines alone (no model): examples/s of one process's train batches, and for the
language-model pipelines the token cache's build rate (tokens/s, and per core) beside the packed rate, against
what the model the batch feeds consumes on one H100 (NEEDS).

  python benchmarks/input_pipeline.py                  # all pipelines below
  python benchmarks/input_pipeline.py --only lm1b --batch 64 --seq_len 1024
  python benchmarks/input_pipeline.py --only jsonl --tokenizer bpe --token_cache off   # tokenized as read (before)
  python benchmarks/input_pipeline.py --only imagenet_jpeg --workers 2                  # decoded in 2 processes
  python benchmarks/input_pipeline.py --only lm1b jsonl --workers 0 2                  # packed here, then in 2

Pipelines:
  imagenet_jpeg  a TFDS dataset prepared here with ImageNet-sized JPEGs (500x375, smooth random content):
                 JPEG decode (tfds) + random-resized crop to 224 + flip + normalise
  imagenet2012   tfds.testing.mock_data: small decoded random images (no JPEG decode): crop + resize + normalise
  cifar10        tfds.testing.mock_data: pad-crop + flip + normalise at 32x32
  lm1b           tfds.testing.mock_data (its sentences are ~15 characters): byte tokenizer + packing
                 into rows of seq_len
  sentences      a TFDS text dataset prepared here with lm1b-like sentences (~130 bytes): same pipeline
  markov         the default offline dataset (in memory)
  jsonl          your own data (data/files.py): a generated JSON Lines file of --jsonl_mb MB of prompt/completion
                 pairs (~140 + ~420 bytes of words), converted once to a memory-mapped Arrow cache, then
                 tokenized (--tokenizer: 'byte', 'bpe' (an 8,192-id byte-level BPE trained here on the file's
                 own text) or a Hugging Face tokenizer directory) and packed whole into rows of seq_len with the
                 loss on the completions; prints the caches' build times and the process's peak memory
                 (resident, and of it anonymous: not file pages the OS can drop)
Each runs the real `data.build(config).train_dataset(...)` iterator: warm-up batches, then timed ones, once per
--workers count (config.dataset.num_workers: images decoded, text packed in that many worker processes; 0: here).
The TFDS mocks (lm1b, imagenet2012, cifar10) exist in this process only: with workers, lm1b reads its token cache.
--token_cache off reads the text pipelines as before the token cache (each document tokenized when read, in the
packing thread); on (the default) builds the token cache first (timed: its rate is the tokenization rate).

  python benchmarks/input_pipeline.py --only jsonl --jsonl_mb 1024 --batch 16 --seq_len 1024   # GPT-2's batch
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

import data  # noqa: E402
from configs import schema  # noqa: E402

MOCK_EXAMPLES = 4096
# What one H100 consumes, from docs/performance.md (training throughput against PyTorch): GPT-2 124M at 16 x 1024
# runs 441.0k tokens/s, 35.6% MFU of the 989 TFLOP/s bf16 peak at ~0.80 GFLOP per token (6N plus attention); the
# image models' images/s there. The input must deliver at least this per process to keep that GPU busy.
NEEDS = {
  'tokens': (0.356 * 989e12 / (6 * 124.4e6 + 6 * 12 * 1024 * 768), 'GPT-2 124M on one H100'),
  'images': (3_037, 'ViT-B/16 on one H100 (ResNet-50: 5,639 images/s)'),
}


def register_builders() -> None:
  """The locally prepared TFDS datasets, registered by main() only: worker processes (--workers) import this
  module again, and a second registration of a builder's name is an error."""

  class ShardzooJpegs(tfds.core.GeneratorBasedBuilder):
    """ImageNet-like JPEGs (500x375, smooth random colours), prepared locally: no download."""

    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {
            'image': tfds.features.Image(shape=(None, None, 3), encoding_format='jpeg'),
            'label': tfds.features.ClassLabel(num_classes=1000),
          }
        ),
      )

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples(512), 'validation': self._generate_examples(64)}

    def _generate_examples(self, n):
      rng = np.random.default_rng(0)
      for i in range(n):
        coarse = rng.integers(0, 256, (12, 16, 3)).astype(np.float32)
        image = np.repeat(np.repeat(coarse, 32, 0), 32, 1)[:375, :500] + rng.normal(0, 12, (375, 500, 3))
        yield i, {'image': np.clip(image, 0, 255).astype(np.uint8), 'label': int(rng.integers(1000))}

  class ShardzooSentences(tfds.core.GeneratorBasedBuilder):
    """lm1b-like sentences (random words, 8-40 of them, ~130 bytes on average), prepared locally."""

    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples(5000), 'test': self._generate_examples(100)}

    def _generate_examples(self, n):
      rng = np.random.default_rng(0)
      words = [''.join(rng.choice(list('etaoinshrdlucmfwyp'), size=rng.integers(1, 9))) for _ in range(5000)]
      for i in range(n):
        yield i, {'text': ' '.join(rng.choice(words, size=rng.integers(8, 41))) + ' .'}


def write_jsonl(path: str, megabytes: float) -> int:
  """Prompt/completion pairs of random words up to `megabytes`, written line by line (bounded memory)."""
  rng = np.random.default_rng(0)
  words = [''.join(rng.choice(list('etaoinshrdlucmfwyp'), size=rng.integers(1, 9))) for _ in range(5000)]
  lines, size, target = 0, 0, megabytes * 2**20
  with open(path, 'w') as f:
    while size < target:
      block = []
      picks = rng.integers(0, len(words), (1000, 120)).tolist()
      for row, n, m in zip(picks, rng.integers(15, 30, 1000).tolist(), rng.integers(45, 90, 1000).tolist()):
        prompt, answer = ' '.join(words[i] for i in row[:n]), ' '.join(words[i] for i in row[n : n + m])
        block.append(json.dumps({'prompt': prompt + ' ?', 'completion': answer + ' .'}))
      text = '\n'.join(block) + '\n'
      f.write(text)
      size, lines = size + len(text), lines + len(block)
  return lines


def memory() -> dict[str, float]:
  """This process's peak resident memory and its anonymous part now, GiB (Linux /proc)."""
  fields = {}
  with open('/proc/self/status') as f:
    for line in f:
      key, _, value = line.partition(':')
      if key in ('VmHWM', 'RssAnon', 'RssFile'):
        fields[key] = int(value.split()[0]) / 2**20
  return fields


def config(task: str, **dataset) -> ml_collections.ConfigDict:
  """The task's config with `dataset` and every other dataset field at its default (configs/schema.py)."""
  model = {'name': 'gpt2' if task == 'lm' else 'cnn'}
  return schema.complete(ml_collections.ConfigDict(dict(task=task, dataset=dataset, model=model)))


def measure(cfg: ml_collections.ConfigDict, batch: int, steps: int, warmup: int = 3) -> dict[str, float]:
  t0 = time.perf_counter()
  ds = data.build(cfg)  # builds the token cache the first time (text pipelines, --token_cache on)
  built = time.perf_counter() - t0
  it = iter(ds.train_dataset(batch, slice(0, batch), seed=0))
  for _ in range(warmup):
    next(it)
  t0, masked, tokens = time.perf_counter(), 0.0, 0
  for _ in range(steps):
    b = next(it)
    masked += float(b['mask'].sum())
    tokens += b['targets'].size if 'targets' in b else 0
  dt = time.perf_counter() - t0
  it.close()
  return {
    'examples/s': steps * batch / dt,
    'targets/s': masked / dt,
    'row tokens/s': tokens / dt,
    'ms/batch': 1000 * dt / steps,
    'build s': built,
    'cache': getattr(ds.cached.train, 'meta', None) if ds.cached else None,
  }


def cache_line(r: dict) -> str:
  """The token cache's build: seconds, tokens/s and per core (its `seconds` covers tokenizing and writing)."""
  meta = r['cache']
  if meta is None:
    return '  (no token cache: documents tokenized as they are read)'
  rate = meta['ids'] / max(meta['seconds'], 1e-9)
  return (
    f'  (token cache: {meta["documents"]:,} documents, {meta["ids"]:,} tokens built in {meta["seconds"]:.1f}s: '
    f'{rate:,.0f} tokens/s, {rate / os.cpu_count():,.0f} per core; reused by later runs)'
  )


def need_line(rate: float, what: str) -> str:
  need, model = NEEDS[what]
  return f'  ({rate / need:.2f}x what {model} consumes: {need:,.0f} {what}/s)'


def train_bpe(path: str, out: str, vocab: int = 8192) -> str:
  """A byte-level BPE of `vocab` ids trained on the first 32 MB of `path`'s text, saved as a Hugging Face
  tokenizer (begins texts with <s>, ends documents with </s>): a real tokenizer with nothing downloaded."""
  import tokenizers  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  def lines():
    with open(path) as f:
      read = 0
      for line in f:
        read += len(line)
        row = json.loads(line)
        yield row['prompt'] + ' ' + row['completion']
        if read > 32 * 2**20:
          return

  tk = tokenizers.Tokenizer(tokenizers.models.BPE())
  tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = tokenizers.decoders.ByteLevel()
  specials = ['<pad>', '<s>', '</s>']
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
  tk.train_from_iterator(lines(), trainer)
  tk.post_processor = tokenizers.processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tk, pad_token='<pad>', bos_token='<s>', eos_token='</s>'
  ).save_pretrained(out)
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--only', nargs='*', default=None)
  p.add_argument('--batch', type=int, default=128)
  p.add_argument('--steps', type=int, default=20)
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--threads', type=int, default=1, help='grain read threads for the map-style pipelines')
  p.add_argument('--workers', type=int, nargs='+', default=[0], help='config.dataset.num_workers: one run per count')
  p.add_argument('--jsonl_mb', type=float, default=1024, help='size of the generated JSON Lines file (jsonl)')
  p.add_argument('--tokenizer', default='byte', help="jsonl: 'byte', 'bpe' or a Hugging Face tokenizer directory")
  p.add_argument('--token_cache', default='on', choices=('on', 'off'), help='text pipelines: through the token cache')
  p.add_argument('--dir', default=None, help='where the jsonl file and its Arrow cache go (default: a temp dir)')
  args = p.parse_args()
  register_builders()
  b, n, cache = args.batch, args.threads, args.token_cache == 'on'
  text = lambda d, w: dict(token_cache=cache, cache_dir=os.path.join(d, 'cache'), num_workers=w)
  pipelines = {
    'imagenet_jpeg': lambda d, w: config(
      'classification',
      name='shardzoo_jpegs',
      data_dir=d,
      eval_split='validation',
      image_size=224,
      augment='inception_crop',
      num_threads=n,
      num_workers=w,
    ),
    'imagenet2012': lambda d, w: config('classification', name='imagenet2012', image_size=224, num_threads=n),
    'cifar10': lambda d, w: config('classification', name='cifar10', num_threads=n),
    'lm1b': lambda d, w: config('lm', name='lm1b', seq_len=args.seq_len, pack=True, **text(d, w)),
    'sentences': lambda d, w: config(
      'lm', name='shardzoo_sentences', data_dir=d, seq_len=args.seq_len, pack=True, **text(d, w)
    ),
    'markov': lambda d, w: config(
      'lm', name='markov', vocab_size=16, branching=4, smoothing=0.03, seq_len=64, num_train=65536, num_eval=100
    ),
    'jsonl': None,
  }
  print(
    f'batch {b}, {args.steps} timed batches, {n} read threads, {os.cpu_count()} CPU cores, token cache '
    f'{args.token_cache}, load average {os.getloadavg()[0]:.2f} (figures taken above 0.5 are not results)'
  )
  with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
    for name, make in pipelines.items():
      if args.only and name not in args.only:
        continue
      if name == 'jsonl':
        run_jsonl(tmp, args)
        continue
      if name in ('imagenet_jpeg', 'sentences'):
        t0 = time.perf_counter()
        tfds.builder(make(tmp, 0).dataset.name, data_dir=tmp, file_format='array_record').download_and_prepare()
        print(f'  (prepared {name} in {time.perf_counter() - t0:.0f}s)')
      for w in args.workers:
        if name in ('imagenet2012', 'cifar10', 'lm1b'):
          with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
            r = measure(make(tmp, w), b, args.steps)
        else:
          r = measure(make(tmp, w), b, args.steps)
        extra = f' | {r["targets/s"]:,.0f} packed tokens/s' if name in ('lm1b', 'sentences', 'markov') else ''
        print(
          f'{name:14s} {r["examples/s"]:10,.0f} examples/s | {r["ms/batch"]:7.1f} ms/batch{extra} | {w} workers',
          flush=True,
        )
        if name in ('lm1b', 'sentences'):
          print(cache_line(r) + '\n' + need_line(r['targets/s'], 'tokens'), flush=True)
        elif name.startswith('imagenet'):
          print(need_line(r['examples/s'], 'images'), flush=True)


def run_jsonl(tmp: str, args: argparse.Namespace) -> None:
  path = os.path.join(tmp, 'pairs.jsonl')
  t0 = time.perf_counter()
  rows = write_jsonl(path, args.jsonl_mb)
  size = os.path.getsize(path) / 2**20
  print(f'  (wrote {rows:,} rows, {size:,.0f} MB of JSON Lines in {time.perf_counter() - t0:.0f}s)', flush=True)
  tokenizer = args.tokenizer
  if tokenizer == 'bpe':
    t0 = time.perf_counter()
    tokenizer = train_bpe(path, os.path.join(tmp, 'bpe'))
    print(f'  (trained an 8,192-id byte-level BPE in {time.perf_counter() - t0:.0f}s)', flush=True)
  cfg = lambda cache, workers=0: config(
    'lm',
    name='json',
    train_files=path,
    eval_files=path,
    prompt_key='prompt',
    completion_key='completion',
    tokenizer=tokenizer,
    seq_len=args.seq_len,
    pack=True,
    cache_dir=os.path.join(tmp, 'cache'),
    token_cache=cache,
    num_workers=workers,
  )
  t0 = time.perf_counter()
  data.build(cfg(False))  # builds the Arrow cache once (train and eval are the same file)
  built, m = time.perf_counter() - t0, memory()
  print(f'  (Arrow cache built in {built:.0f}s; peak resident {m["VmHWM"]:.2f} GiB so far)', flush=True)
  for w in args.workers:
    r = measure(cfg(args.token_cache == 'on', w), args.batch, args.steps)
    m = memory()
    print(cache_line(r), flush=True)
    print(
      f'jsonl          {r["examples/s"]:10,.0f} packed rows/s | {r["ms/batch"]:7.1f} ms/batch | '
      f'{r["row tokens/s"]:,.0f} packed tokens/s ({r["targets/s"]:,.0f} trained on) | {w} workers | '
      f'peak resident {m["VmHWM"]:.2f} GiB, now '
      f'anonymous {m["RssAnon"]:.2f} GiB + file pages {m["RssFile"]:.2f} GiB (this process)',
      flush=True,
    )
    print(need_line(r['row tokens/s'], 'tokens'), flush=True)


if __name__ == '__main__':
  main()
