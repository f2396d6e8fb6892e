"""Runs one entry point's `main` on many command lines in one process, for tests/test_guards.py: each command line
parsed as app.run parses it (cli.parse_flags; generate.py's and evaluate_lm.py's family config added first), then
`main` called with stdout and stderr captured. Prints a JSON list: per case the exit code (or SystemExit's
message), what was printed, and the traceback of any other exception.

  python tests/mistakes.py generate < cases.json      # cases.json: a JSON list of argv lists (no program name)
"""

import contextlib
import importlib
import io
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(entry: str, cases: list[list[str]]) -> list[dict]:
  module = importlib.import_module(entry)
  from absl import flags  # noqa: PLC0415 (after the entry point defines its flags)

  from configs import cli  # noqa: PLC0415

  results = []
  for args in cases:
    argv = [f'{entry}.py', *args]
    flags.FLAGS.unparse_flags()
    out, err, code, raised = io.StringIO(), io.StringIO(), None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        if entry in ('generate', 'evaluate_lm'):
          import generation  # noqa: PLC0415

          argv = generation.with_family_config(argv)
        module.main(cli.parse_flags(argv))
        code = 0
      except SystemExit as e:
        code = e.code
      except BaseException:  # noqa: BLE001 (what the test reports: a traceback where one line was due)
        raised = traceback.format_exc()
    results.append(dict(argv=args, code=code, out=out.getvalue(), err=err.getvalue(), raised=raised))
  return results


if __name__ == '__main__':
  print(json.dumps(run(sys.argv[1], json.load(sys.stdin))))
