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
--include_path). Prints lm-eval's results table; --out writes its results as JSON (a new file or an
earlier --out; --overwrite for another). Flags, task names and --out are checked before the model loads.
"""

from __future__ import annotations

import json
import os
import sys

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
flags.DEFINE_list('tasks', [], 'lm-eval task names (comma-separated).')
flags.DEFINE_string('include_path', None, 'A directory of extra task YAML files.')
flags.DEFINE_integer('num_fewshot', None, 'Few-shot examples per prompt (default: each task its own).')
flags.DEFINE_integer('limit', None, 'At most this many examples per task.')
flags.DEFINE_integer('batch_size', 8, 'Rows per scoring or generation call.')
flags.DEFINE_string('tokenizer', None, "'byte' or a local Hugging Face tokenizer directory (default: the run's).")
flags.DEFINE_string('out', None, 'Write the results as JSON here (a new file, or an earlier --out of evaluate_lm.py).')
flags.DEFINE_bool('overwrite', False, 'Let --out replace a file that is not an earlier --out (never a run file).')


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if bool(FLAGS.workdir) == bool(FLAGS.init_from) or not FLAGS.tasks:
    raise SystemExit('shardzoo: usage error: give --workdir RUN or --init_from HF_DIR (one of them), and --tasks')
  with errors.one_line():  # flags and files first: nothing is indexed or loaded for a command that is refused
    if FLAGS.out:
      guards.output_file(
        FLAGS.out, '--out', what='evaluate_lm.py --out (JSON results)', previous=is_results,
        overwrite=FLAGS.overwrite, inputs=[('--init_from', FLAGS.init_from), ('--tokenizer', FLAGS.tokenizer)],
      )  # fmt: skip
    import lm_eval  # noqa: PLC0415 (heavy: only here)

    from generation import lm_eval_model  # noqa: PLC0415 (imports lm_eval)

    lm_eval_model.check_flags(FLAGS.limit, FLAGS.num_fewshot, FLAGS.batch_size, FLAGS.include_path)
    tasks = lm_eval_model.task_manager(FLAGS.tasks, FLAGS.include_path)  # names resolved before the model loads
    gen, tok = generation.from_flags(
      FLAGS.config, FLAGS.workdir, FLAGS.step, FLAGS.init_from, FLAGS.tokenizer, cli.overridden(sys.argv)
    )
    results = lm_eval.simple_evaluate(
      model=lm_eval_model.ZooLM(gen, tok, batch_size=FLAGS.batch_size),
      tasks=FLAGS.tasks,
      num_fewshot=FLAGS.num_fewshot,
      limit=FLAGS.limit,
      task_manager=tasks,
    )
  print(lm_eval.utils.make_table(results))
  if FLAGS.out:
    kept = {k: results[k] for k in ('results', 'configs', 'versions') if k in results}
    guards.write_text(FLAGS.out, json.dumps(kept, indent=2, default=str))


def is_results(path: str) -> bool:
  """An earlier --out of evaluate_lm.py (a JSON object with lm-eval's 'results'), or an empty file."""
  if os.path.getsize(path) == 0:
    return True
  try:
    with open(path, encoding='utf-8') as f:
      got = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return False
  return isinstance(got, dict) and 'results' in got


if __name__ == '__main__':
  app.run(main, argv=generation.with_family_config(sys.argv), flags_parser=cli.parse_flags)
