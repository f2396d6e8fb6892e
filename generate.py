r"""Generates text from a trained run or a Hugging Face model, with a KV cache sharded by the config's rules.

  python generate.py --workdir RUN [--step N] --prompt "Once upon a time" [--prompt ...] [--max_new_tokens 64]
  python generate.py --init_from HF_DIR_OR_HUB_ID --prompts prompts.jsonl --out out.jsonl \
      [--temperature 0.7] [--top_k 50] [--top_p 0.9] [--seed 0] [--config FILE[:args]] [--config.key=value ...]

The run's config comes from RUN/run_config.json (train.py writes it), or from --config (then --config.* overrides
apply). With --init_from and no --config, the family's config file (configs/gpt2.py, llama.py, moe.py) is used and
the architecture read from config.json. --prompts reads one JSON object per line and takes its "prompt". Prompts are
encoded with the run's tokenizer (config.dataset.tokenizer), the Hugging Face directory's, or --tokenizer. --out
writes one JSON object per prompt: {"prompt", "prompt_ids", "ids" (generated only), "text"}. Temperature 0 is greedy.
The mesh is the config's, fitted to the devices there are; the KV cache's sharding table is printed.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

import errors
import generation
from configs import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, "The config (default: the run's, or the family's).", lock_config=True)
flags.DEFINE_string('workdir', None, 'A run directory (its checkpoints/ are read).')
flags.DEFINE_integer('step', None, 'The checkpoint step (default: the latest).')
flags.DEFINE_string('init_from', None, 'A Hugging Face model directory or hub id (instead of --workdir).')
flags.DEFINE_multi_string('prompt', [], 'A prompt (repeat for several).')
flags.DEFINE_string('prompts', None, 'A JSONL file: one {"prompt": ...} object per line.')
flags.DEFINE_integer('max_new_tokens', 32, 'Tokens to generate per prompt (fewer where the stop token comes).')
flags.DEFINE_float('temperature', 1.0, 'Sampling temperature; 0 is greedy.')
flags.DEFINE_integer('top_k', 0, 'Sample among the k most probable tokens (0: all).')
flags.DEFINE_float('top_p', 1.0, 'Sample among the most probable tokens whose probability reaches p (1: all).')
flags.DEFINE_integer('seed', 0, 'Sampling seed.')
flags.DEFINE_string('out', None, 'Write the results here as JSONL.')
flags.DEFINE_string('tokenizer', None, "'byte' or a local Hugging Face tokenizer directory (default: the run's).")


def read_prompts() -> list[str]:
  prompts = list(FLAGS.prompt)
  if FLAGS.prompts:
    with open(FLAGS.prompts) as f:
      for n, line in enumerate(f, 1):
        if line.strip():
          row = json.loads(line)
          if not isinstance(row, dict) or not isinstance(row.get('prompt'), str):
            raise errors.ConfigError(f'{FLAGS.prompts}:{n}: a JSON object with a "prompt" string is needed')
          prompts.append(row['prompt'])
  if not prompts:
    raise errors.ConfigError('no prompts: give --prompt TEXT (repeatable) or --prompts FILE.jsonl')
  return prompts


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if bool(FLAGS.workdir) == bool(FLAGS.init_from):
    raise SystemExit('shardzoo: usage error: give --workdir RUN or --init_from HF_DIR (one of them)')
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore detail at INFO
  with errors.one_line():
    sampling = generation.Sampling(FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed)
    sampling.check()
    prompts = read_prompts()
    gen, tok = generation.from_flags(FLAGS.config, FLAGS.workdir, FLAGS.step, FLAGS.init_from, FLAGS.tokenizer)
    ids = [generation.encode(tok, p) for p in prompts]
    rows, _, slots = gen.shapes(ids, sampling)
    print(gen.cache_table(rows, slots))
    t0 = time.perf_counter()
    out = gen.generate(ids, sampling, tok.eos_id)
    took = time.perf_counter() - t0
    results = [
      dict(prompt=p, prompt_ids=g.prompt_ids, ids=g.ids, text=tok.decode([i for i in g.ids if i != tok.eos_id]))
      for p, g in zip(prompts, out, strict=True)
    ]
    for r in results:
      print(f'--- {r["prompt"]!r}\n{r["text"]}')
    print(f'{sum(len(g.ids) for g in out)} tokens in {took:.2f}s (with compilation)')
    if FLAGS.out:
      with open(FLAGS.out, 'w') as f:
        for r in results:
          f.write(json.dumps(r) + '\n')


if __name__ == '__main__':
  app.run(main, argv=generation.with_family_config(sys.argv), flags_parser=cli.parse_flags)
