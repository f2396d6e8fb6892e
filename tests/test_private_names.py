"""Private names stay private: no module outside tests/ imports or reads another first-party module's `_name`.
What another module needs is made public where it belongs (a proper name, a docstring line). The scan is the
source's syntax (ast): `from X import _name` and `X._name` where X names a first-party module or something
imported from one."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {'tests', 'docs', 'site', '__pycache__'}

# Known uses, each with why it is still here. A listed use that is gone fails the test too: remove its entry.
ALLOWED = {}


def _private(name: str) -> bool:
  return name.startswith('_') and not name.startswith('__')


def _first_party() -> set[str]:
  """The repository's top-level packages and modules (what `import X` finds from its root)."""
  names = {p.stem for p in ROOT.glob('*.py')}
  names |= {p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in SKIP and any(p.glob('*.py'))}
  return names


def private_uses(path: str, source: str, first_party: set[str]) -> list[tuple[int, str]]:
  """(line, use) for each `from X import _name` and each `A._name` (A bound by an import from a first-party
  module X) in one file. A script's sibling modules (benchmarks/ import each other by name) count as first-party."""
  tree = ast.parse(source, path)
  ours = lambda module: module.split('.')[0] in first_party
  bound: set[str] = set()  # names bound to first-party modules or to things imported from them
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      bound |= {a.asname or a.name.split('.')[0] for a in node.names if ours(a.name)}
    elif isinstance(node, ast.ImportFrom) and (node.level or ours(node.module or '')):
      for a in node.names:
        if _private(a.name):
          found.append((node.lineno, f'from {"." * node.level}{node.module or ""} import {a.name}'))
        bound.add(a.asname or a.name)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      chain, base = [node.attr], node.value
      while isinstance(base, ast.Attribute):
        chain.append(base.attr)
        base = base.value
      if isinstance(base, ast.Name) and base.id in bound:
        found.append((node.lineno, '.'.join([base.id, *reversed(chain)])))
  return sorted(found)


def _sources() -> list[Path]:
  found = []
  for dirpath, dirnames, filenames in os.walk(ROOT):
    here = Path(dirpath)
    dirnames[:] = [
      d for d in dirnames if not d.startswith('.') and d not in SKIP and not (here / d / 'pyvenv.cfg').exists()
    ]
    found += [here / f for f in filenames if f.endswith('.py')]
  return sorted(found)


def test_no_module_uses_another_modules_private_names():
  first_party = _first_party()
  uses, seen = [], set()
  for path in _sources():
    rel = str(path.relative_to(ROOT))
    siblings = set() if (path.parent / '__init__.py').exists() else {p.stem for p in path.parent.glob('*.py')}
    for line, use in private_uses(rel, path.read_text(), first_party | siblings):
      if (rel, use) in ALLOWED:
        seen.add((rel, use))
      else:
        uses.append(f'{rel}:{line}: {use}')
  assert uses == [], "another module's private names (make what is needed public where it belongs):\n" + '\n'.join(uses)
  stale = sorted(set(ALLOWED) - seen)
  assert stale == [], f'allowed uses that are gone; remove them from ALLOWED: {stale}'


def test_the_scan_finds_each_form():
  """The scan itself: imports of private names and attribute reads through first-party names are found; a
  library's private name, a module's own and a dunder are not."""
  source = '\n'.join(
    [
      'import jax',
      'import partitioning',
      'from models import llama as ll',
      'from training.trainer import Trainer, _split',
      'from .rules import _fmt',
      'jax._src.core',
      'partitioning.shard._CTX.get()',
      'll._hf_rope(c)',
      'Trainer._cache',
      '_own()',
      'partitioning.__name__',
    ]
  )
  assert private_uses('x.py', source, {'partitioning', 'models', 'training'}) == [
    (4, 'from training.trainer import _split'),
    (5, 'from .rules import _fmt'),
    (7, 'partitioning.shard._CTX'),
    (8, 'll._hf_rope'),
    (9, 'Trainer._cache'),
  ]
