r"""Evaluates a trained run or a Hugging Face model on lm-evaluation-harness tasks, sharded as its config says.

  python evaluate_lm.py --init_from HF_DIR_OR_HUB_ID --tasks hellaswag,lambada_openai [--limit 100] [--out results.json]
  python evaluate_lm.py --workdir RUN [--step N] --tasks my_task --include_path DIR_WITH_TASK_YAMLS
      [--num_fewshot K] [--batch_size 8] [--config FILE[:args]] [--config.key=value ...]

The model and its tokenizer are loaded as generate.py loads them (generation/loading.py: run_config.json or --config;
a Hugging Face directory with its family's config): the run's config.dataset.tokenizer (byte or Hugging Face), the
directory's, or --tokenizer. lm-eval's model adapter is generation/lm_eval_model.py (loglikelihood,
loglikelihood_rolling, generate_until, scored and encoded as lm-eval's Hugging Face backend does, texts beginning
as training begins them).
Tasks need their data where lm-eval finds it (the Hugging Face cache, or local files named by a task YAML under
--include_path). Prints lm-eval's results table; --out writes its results as JSON.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

import errors
import generation
from configs import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, "The config (default: the run's, or the family's).", lock_config=True)
flags.DEFINE_string('workdir', None, 'A run directory (its checkpoints/ are read).')
flags.DEFINE_integer('step', None, 'The checkpoint step (default: the latest).')
flags.DEFINE_string('init_from', None, 'A Hugging Face model directory or hub id (instead of --workdir).')
flags.DEFINE_list('tasks', [], 'lm-eval task names (comma-separated).')
flags.DEFINE_string('include_path', None, 'A directory of extra task YAML files.')
flags.DEFINE_integer('num_fewshot', None, 'Few-shot examples per prompt (default: each task its own).')
flags.DEFINE_integer('limit', None, 'At most this many examples per task.')
flags.DEFINE_integer('batch_size', 8, 'Rows per scoring or generation call.')
flags.DEFINE_string('tokenizer', None, "'byte' or a local Hugging Face tokenizer directory (default: the run's).")
flags.DEFINE_string('out', None, 'Write the results as JSON here.')


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if bool(FLAGS.workdir) == bool(FLAGS.init_from) or not FLAGS.tasks:
    raise SystemExit('shardzoo: usage error: give --workdir RUN or --init_from HF_DIR (one of them), and --tasks')
  import lm_eval  # noqa: PLC0415 (heavy: only here)

  from generation import lm_eval_model  # noqa: PLC0415 (imports lm_eval)

  with errors.one_line():
    gen, tok = generation.from_flags(
      FLAGS.config, FLAGS.workdir, FLAGS.step, FLAGS.init_from, FLAGS.tokenizer, cli.overridden(sys.argv)
    )
    results = lm_eval.simple_evaluate(
      model=lm_eval_model.ZooLM(gen, tok, batch_size=FLAGS.batch_size),
      tasks=FLAGS.tasks,
      num_fewshot=FLAGS.num_fewshot,
      limit=FLAGS.limit,
      task_manager=lm_eval_model.task_manager(FLAGS.tasks, FLAGS.include_path),
    )
  print(lm_eval.utils.make_table(results))
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({k: results[k] for k in ('results', 'configs', 'versions') if k in results}, f, indent=2, default=str)


if __name__ == '__main__':
  app.run(main, argv=generation.with_family_config(sys.argv), flags_parser=cli.parse_flags)
