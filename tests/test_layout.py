"""The layout's rules, read from the source: which package may import which, and no top-level name that shadows a
library (`python script.py` puts the repository first on sys.path, so a top-level `evaluate.py` was imported by
lm-eval as Hugging Face's `evaluate`)."""

import ast
import importlib.metadata
import os
import sys

from tests.conftest import ROOT


def _imports(package: str) -> dict[str, set[str]]:
  """Every module under `package` -> the top-level packages and the modules it imports (anywhere in the file)."""
  found = {}
  for folder, _, files in os.walk(os.path.join(ROOT, package)):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        with open(path) as f:
          tree = ast.parse(f.read(), path)
        names = set()
        for node in ast.walk(tree):
          if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
          elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f'{node.module}.{a.name}' for a in node.names)}
        found[os.path.relpath(path, ROOT)] = names
  return found


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
  return [
    f'{path} imports {sorted(n for n in names if n.split(".")[0] in forbidden)}'
    for path, names in sorted(_imports(package).items())
    if any(n.split('.')[0] in forbidden for n in names)
  ]


def test_training_never_imports_generation():
  """The end-of-run sample goes through train.py (training/run.py returns a SampleRequest, generation decodes it):
  a decode never pulls in the optimizer, and training never depends on the decoding engine."""
  assert _offenders('training', ('generation',)) == []


def test_checkpointing_imports_neither_training_nor_generation():
  """Both read checkpoints; callers pass trees, so neither the optimizer nor the decoding engine comes with them."""
  assert _offenders('checkpointing', ('training', 'generation')) == []


def test_no_top_level_name_shadows_an_installed_library_or_the_standard_library():
  top = set()
  for entry in os.listdir(ROOT):
    path = os.path.join(ROOT, entry)
    if entry.endswith('.py'):
      top.add(entry[:-3])
    elif os.path.isdir(path) and any(f.endswith('.py') for f in os.listdir(path)):  # packages and namespace ones
      top.add(entry)
  installed = importlib.metadata.packages_distributions()
  clashes = [f'{name} (installed by {", ".join(installed[name])})' for name in sorted(top) if name in installed]
  clashes += [f'{name} (the standard library)' for name in sorted(top) if name in sys.stdlib_module_names]
  assert top and clashes == [], f'top-level names that shadow a library: {clashes}; rename them'
