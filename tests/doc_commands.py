"""The command blocks of README.md and docs/*.md, extracted and run as a user runs them (tests/test_docs.py).

A command block is a fenced block marked `bash` (output and synopses with placeholders are `text`). Each line is a
command (a backslash continues it; `#` starts a comment): `python SCRIPT ARGS` or `python -c CODE`, run from the
repository root. A block that needs what the suite has not (a download, a GPU, several machines) is marked on the
line above its fence, `<!-- not run: NAME ... -->`, with NAME one of NOT_RUN, and is skipped by that name. A block
whose training commands the suite may shorten further says how in the same place, `<!-- run with: ARGS -->` (e.g. a
smaller eval split): ARGS are appended to each of its `train.py` commands that trains, as the step count is.

How it runs cheaply (`run_pages`): one process imports the libraries the entry points use once (JAX, TensorFlow,
transformers, lm-eval: about 10 s), then forks a child per command, which runs the script as `python SCRIPT` would
(runpy, a fresh absl flag set, its own JAX backend), so a command costs its own work and not those imports. The
commands run in order in one temporary directory (a `/tmp/` path is rewritten to it), so a
later block uses an earlier block's run (train, then generate from it); all pages share that directory, and a
command repeated word for word on another page (the README's loop, walked through on its page), its comment aside,
runs once; the children share a JAX compilation cache, so a program two commands compile compiles once. A
`train.py` command that trains (not `--dry_run`) gets `--config.total_steps=STEPS` appended: the point is that the
command runs as written, not its full length.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
# Why a block is not run, by name (the marker's first word).
NOT_RUN = {
  'download': 'needs a dataset or model from the network',
  'gpu': 'needs a GPU',
  'tpu': 'needs a TPU',
  'hosts': 'needs several machines or processes started together',
  'install': 'installs packages',
  'suite': 'runs the test suite itself',
  'minutes': 'takes minutes even on the tiny sizes (benchmarks, plan searches)',
}
STEPS = 3  # what a training command is cut to
COMMAND_LANGS = ('bash', 'sh', 'shell', 'console')
FENCE = re.compile(r'^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$', re.M | re.S)
MARK = re.compile(r'<!--\s*not run:\s*(?P<name>[\w-]+)(?P<why>[^>]*)-->\s*$')
RUN_WITH = re.compile(r'<!--\s*run with:\s*(?P<args>[^>]*?)\s*-->\s*$')


@dataclasses.dataclass
class Block:
  page: str  # its path from the repository root
  line: int  # of the opening fence
  lang: str
  commands: list[str]
  not_run: str | None  # the marker's name
  run_with: tuple[str, ...] = ()  # `<!-- run with: ARGS -->`: appended to its training commands

  @property
  def where(self) -> str:
    return f'{self.page}:{self.line}'


def commands_of(body: str, indent: str = '') -> list[str]:
  """The command lines of a block's text, continued lines joined (blank and comment-only lines dropped)."""
  out, pending = [], ''
  for raw in body.splitlines():
    line = raw[len(indent) :] if raw.startswith(indent) else raw
    line = line.lstrip() if pending else line  # a continued line's indent is layout, not words
    if line.rstrip().endswith('\\'):
      pending += line.rstrip()[:-1].rstrip() + ' '
      continue
    command, pending = (pending + line).strip(), ''
    if command and not command.startswith('#'):
      out.append(command)
  return out


def words_of(command: str) -> list[str]:
  """A command line's words as the shell splits them, up to a comment (a word starting with `#`)."""
  words = shlex.split(command)
  return words[: next((i for i, w in enumerate(words) if w.startswith('#')), len(words))]


def blocks(path: Path) -> list[Block]:
  """Every fenced block of a Markdown page that holds commands (`bash` and the like), with its marker."""
  text = path.read_text()
  out = []
  for m in FENCE.finditer(text):
    lang = m['lang'].strip().split()[0] if m['lang'].strip() else ''
    if lang not in COMMAND_LANGS:
      continue
    line = text.count('\n', 0, m.start()) + 1
    before = text[: m.start()].rstrip('\n').rsplit('\n', 1)[-1]
    mark, run_with = MARK.search(before), RUN_WITH.search(before)
    page = str(path.relative_to(ROOT))
    commands = commands_of(m['body'], m['indent'])
    extra = tuple(shlex.split(run_with['args'])) if run_with else ()
    out.append(Block(page, line, lang, commands, mark['name'] if mark else None, extra))
  return out


def argv_of(command: str, tmp: str, run_with: tuple[str, ...] = ()) -> list[str]:
  """The command's words with the page's /tmp/ paths in `tmp`, and a training run cut to STEPS steps (and given
  its block's `run_with` arguments)."""
  words = [w.replace('/tmp/', f'{tmp}/') for w in words_of(command)]
  if words[:2] == ['python', 'train.py'] and '--dry_run' not in words:
    words += [f'--config.total_steps={STEPS}', *run_with]
  return words


def unsupported(command: str) -> str | None:
  """Why a command cannot be run here (only `python SCRIPT` and `python -c`), or None."""
  try:
    words = words_of(command)
  except ValueError as e:
    return f'{command!r}: {e}'
  if words[:1] != ['python'] or len(words) < 2:
    return (
      f'{command!r}: only `python SCRIPT ...` and `python -c CODE` run here; mark the block `<!-- not run: ... -->`'
    )
  if words[1] != '-c' and not (ROOT / words[1]).is_file():
    return f'{command!r}: {words[1]} is not a file of the repository'
  return None


# --- Running them: one process imports, a forked child runs each command ----------------------------------------


def _preload() -> None:
  """What the entry points import, imported once before any child is forked (no JAX backend is started: each
  child starts its own, for the devices its command asks)."""
  importlib.import_module('configs.cli')  # first: it sets TensorFlow's logging before TensorFlow is imported
  import clu.metric_writers  # noqa: F401  (TensorFlow)
  import lm_eval  # noqa: F401
  import torch  # noqa: F401
  import transformers  # noqa: F401

  import checkpointing  # noqa: F401
  import data  # noqa: F401
  import generation  # noqa: F401
  import models  # noqa: F401
  import partitioning  # noqa: F401
  import planning  # noqa: F401
  import training  # noqa: F401
  import training.run  # noqa: F401


def _compilation_cache(directory: str) -> None:
  """A JAX compilation cache the children inherit (set before any is forked): a program that several commands
  compile (one model's train step under two data sources, a decode for a run's sample and for generate.py)
  compiles once, as it would for a user with a cache. The children run one at a time, so they never write it at
  once."""
  import jax  # noqa: PLC0415

  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def _child(argv: list[str], log: str) -> None:
  """In the forked child: stdout and stderr to `log`, then the command as `python ...` runs it and ends
  (tests/children.py's exit: status, traceback, threads joined, the command's own atexit handlers)."""
  from tests import children  # noqa: PLC0415

  fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  sys.stdout = os.fdopen(1, 'w', buffering=1)
  sys.stderr = os.fdopen(2, 'w', buffering=1)
  atexit._clear()  # noqa: SLF001  (this process's handlers are not the command's)
  if argv[1] == '-c':
    sys.argv = ['-c', *argv[3:]]
    os._exit(children._run(argv[2], code=True))  # noqa: SLF001
  sys.argv = argv[1:]
  os._exit(children._run(str(ROOT / argv[1])))  # noqa: SLF001


def run_command(argv: list[str], log: str, timeout: float) -> tuple[int, float]:
  """(exit status, seconds) of one command run in a forked child."""
  t0 = time.perf_counter()
  pid = os.fork()
  if pid == 0:
    _child(argv, log)
  deadline = t0 + timeout
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status), time.perf_counter() - t0
    if time.perf_counter() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      return -9, time.perf_counter() - t0
    time.sleep(0.05)


def run_pages(pages: list[Path], report: str, timeout: float = 300) -> None:
  """Runs every command of every block of `pages` that is not marked, in order, in one temporary directory (a
  page's `/tmp/` paths in it, so later blocks and pages use earlier runs); a command given again as it was run
  already (the README's quickstart repeated on a page) is not run twice. Writes {page: [{where, command, status,
  seconds, log}]} to `report` (JSON)."""
  os.chdir(ROOT)
  sys.path.insert(0, str(ROOT))
  _preload()
  ran, results = {}, {}
  with tempfile.TemporaryDirectory(prefix='shardzoo_docs_') as tmp, tempfile.TemporaryDirectory() as cache:
    _compilation_cache(cache)
    _run_in(pages, tmp, ran, results, timeout)
  with open(report, 'w') as f:
    json.dump(results, f, indent=1)


def _run_in(pages: list[Path], tmp: str, ran: dict, results: dict, timeout: float) -> None:
  """run_pages's loop, in `tmp` (removed afterwards with the runs' checkpoints): `ran` {a command's words: where it
  ran}, `results` the report, filled in."""
  for page in pages:
    results[str(page.relative_to(ROOT))] = out = []
    for block in blocks(page):
      if block.not_run:
        continue
      for command in block.commands:
        if why := unsupported(command):
          out.append(dict(where=block.where, command=command, status=None, seconds=0.0, log=why))
          continue
        words = tuple(words_of(command))  # the same command with another comment (a page's note) runs once
        if words in ran:
          out.append(dict(where=block.where, command=command, status=0, seconds=0.0, log=f'as run at {ran[words]}'))
          continue
        log = os.path.join(tmp, f'command_{len(ran)}.log')
        status, seconds = run_command(argv_of(command, tmp, block.run_with), log, timeout)
        with open(log, errors='replace') as f:
          text = f.read()
        out.append(dict(where=block.where, command=command, status=status, seconds=seconds, log=text[-4000:]))
        if status == 0:
          ran[words] = block.where


if __name__ == '__main__':  # python tests/doc_commands.py REPORT.json [PAGE.md ...]
  run_pages([Path(p).resolve() for p in sys.argv[2:]] or PAGES, sys.argv[1])
