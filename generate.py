r"""Generates text from a trained run or a Hugging Face model, with a KV cache sharded by the config's rules.

  python generate.py --workdir RUN [--step N] --prompt "Once upon a time" [--prompt ...] [--max_new_tokens 64]
  python generate.py --workdir RUN --chat "Capital of France?"          # a chat turn, through the chat template
  python generate.py --init_from HF_DIR_OR_HUB_ID --prompts prompts.jsonl --out out.jsonl \
      [--temperature 0.7] [--top_k 50] [--top_p 0.9] [--seed 0] [--config FILE[:args]] [--config.key=value ...]

The run's config comes from RUN/run_config.json (train.py writes it), or from --config (then --config.* overrides
apply). With --init_from and no --config, the family's config file (configs/gpt2.py, llama.py, moe.py) is used with
the architecture, compute dtype and lengths of config.json (a --config.model.* flag sets one instead). Prompts get
the ids training gave the same text (data/tokens.py): --prompt as a prompt/completion row's prompt, --chat and
{"messages": [...]} rows of --prompts through the chat template with its generation prompt; --prompts reads one
JSON object per line, {"prompt": ...} or {"messages": [...]}. The tokenizer is the run's (config.dataset.tokenizer,
or a Markov language's letters), the Hugging Face directory's, or --tokenizer. --out writes one JSON object per
prompt: {"prompt", "prompt_ids", "ids" (generated only), "text"}. Greedy by default (temperature 0), as
transformers. --out must be new or an earlier --out (--overwrite for another file; never an input or a run's
file), checked before any work. The mesh is the config's, fitted to the devices there are; the KV cache's
sharding table is printed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

import errors
import generation
import guards
from configs import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, "The config (default: the run's, or the family's).", lock_config=True)
flags.DEFINE_string('workdir', None, 'A run directory (its checkpoints/ are read).')
flags.DEFINE_integer('step', None, 'The checkpoint step (default: the latest).')
flags.DEFINE_string('init_from', None, 'A Hugging Face model directory or hub id (instead of --workdir).')
flags.DEFINE_multi_string('prompt', [], 'A prompt (repeat for several).')
flags.DEFINE_multi_string('chat', [], "A user's turn, rendered by the chat template (repeat for several chats).")
flags.DEFINE_string('prompts', None, 'A JSONL file: one {"prompt": ...} or {"messages": [...]} object per line.')
flags.DEFINE_integer(
  'max_new_tokens',
  None,
  'Tokens to generate per prompt (fewer where the stop token comes); default 32, or what the model has room for.',
)
DEFAULT_NEW_TOKENS = 32
flags.DEFINE_float('temperature', 0.0, 'Sampling temperature; 0 (the default) is greedy.')
flags.DEFINE_integer('top_k', 0, 'Sample among the k most probable tokens (0: all).')
flags.DEFINE_float('top_p', 1.0, 'Sample among the most probable tokens whose probability reaches p (1: all).')
flags.DEFINE_integer('seed', 0, 'Sampling seed.')
flags.DEFINE_string('out', None, 'Write the results here as JSONL (a new file, or an earlier --out of generate.py).')
flags.DEFINE_bool(
  'overwrite', False, 'Let --out replace a file that is not an earlier --out (never an input or a run file).'
)
flags.DEFINE_string('tokenizer', None, "'byte' or a local Hugging Face tokenizer directory (default: the run's).")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if bool(FLAGS.workdir) == bool(FLAGS.init_from):
    raise SystemExit('shardzoo: usage error: give --workdir RUN or --init_from HF_DIR (one of them)')
  with errors.one_line():
    if FLAGS.out:  # before any work: a refused --out costs nothing, and no file of the user's is replaced
      guards.output_file(
        FLAGS.out, '--out', what='generate.py --out (JSON Lines of results)', previous=is_results,
        overwrite=FLAGS.overwrite,
        inputs=[('--prompts', FLAGS.prompts), ('--init_from', FLAGS.init_from), ('--tokenizer', FLAGS.tokenizer)],
      )  # fmt: skip
    sampling = generation.Sampling(
      FLAGS.max_new_tokens or DEFAULT_NEW_TOKENS, FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed
    )
    sampling.check()
    prompts = generation.read_prompts(FLAGS.prompt, FLAGS.chat, FLAGS.prompts)
    gen, tok = generation.from_flags(
      FLAGS.config, FLAGS.workdir, FLAGS.step, FLAGS.init_from, FLAGS.tokenizer, cli.overridden(sys.argv)
    )
    ids = [generation.encode(tok, p) for p in prompts]
    if FLAGS.max_new_tokens is None and gen.max_len:  # the default fits the model's positions where it can
      room = gen.max_len - max(len(i) for i in ids)
      sampling = dataclasses.replace(sampling, max_new_tokens=max(1, min(DEFAULT_NEW_TOKENS, room)))
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
      shown = r['prompt'] if isinstance(r['prompt'], str) else r['prompt'][-1]['content']
      print(f'--- {shown!r}\n{r["text"]}')
    print(f'{sum(len(g.ids) for g in out)} tokens in {took:.2f}s (with compilation)')
    if FLAGS.out:
      guards.write_text(FLAGS.out, ''.join(json.dumps(r) + '\n' for r in results))


RESULT_KEYS = {'prompt', 'prompt_ids', 'ids', 'text'}


def is_results(path: str) -> bool:
  """An earlier --out of generate.py (its first line a result), or an empty file."""
  first = guards.first_json_line(path)
  return os.path.getsize(path) == 0 or (isinstance(first, dict) and RESULT_KEYS <= set(first))


if __name__ == '__main__':
  app.run(main, argv=generation.with_family_config(sys.argv), flags_parser=cli.parse_flags)
