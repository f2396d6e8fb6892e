"""The user guide holds together: the docs site builds in strict mode, the README's links resolve, the README stays a
short guide, and library code carries no calendar dates (measured figures and their dates belong on
docs/performance.md)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
README_MAX_LINES = 300
DATE = re.compile(r'20\d\d-[01]\d-[0-3]\d')
LINK = re.compile(r'(?<!!)\[[^\]]*\]\(([^)\s]+)\)')  # [text](target), not images
NOT_LIBRARY = {'tests', 'benchmarks'}  # their figures and fixtures may carry dates


def _slug(heading: str) -> str:
  """A heading's anchor as GitHub and MkDocs' toc both make it for plain text: lower case, punctuation dropped,
  spaces as hyphens."""
  text = re.sub(r'[`*_]', '', heading.strip().lower())
  text = re.sub(r'[^\w\- ]', '', text)
  return text.replace(' ', '-')


def _anchors(md: Path) -> set[str]:
  text = re.sub(r'```.*?```', '', md.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
  return {_slug(m.group(1)) for m in re.finditer(r'^#{1,6}\s+(.+?)\s*$', text, flags=re.M)}


def _relative_links(md: Path) -> list[str]:
  text = re.sub(r'```.*?```', '', md.read_text(), flags=re.S)
  return [t for t in LINK.findall(text) if not re.match(r'[a-z][a-z0-9+.-]*:', t)]  # no http:, mailto:, ...


def broken_links(md: Path) -> list[str]:
  """The relative links of a Markdown file whose file, or anchor in it, does not exist."""
  broken = []
  for target in _relative_links(md):
    path, _, anchor = target.partition('#')
    dest = (md.parent / path).resolve() if path else md
    if not dest.exists():
      broken.append(f'{target}: no such file')
    elif anchor and dest.suffix == '.md' and anchor not in _anchors(dest):
      broken.append(f'{target}: no heading #{anchor} in {dest.name}')
  return broken


def test_readme_links_resolve():
  assert broken_links(README) == []


def test_readme_is_a_short_guide():
  lines = len(README.read_text().splitlines())
  assert lines <= README_MAX_LINES, f'README.md has {lines} lines; the depth belongs in docs/ pages'


def _library_sources() -> list[Path]:
  """The .py files outside tests/ and benchmarks/ (and outside any virtualenv or hidden directory)."""
  found = []
  for dirpath, dirnames, filenames in os.walk(ROOT):
    here = Path(dirpath)
    dirnames[:] = [
      d
      for d in dirnames
      if not d.startswith('.')
      and not (here == ROOT and d in NOT_LIBRARY)
      and not (here / d / 'pyvenv.cfg').exists()
      and d not in ('site', '__pycache__')
    ]
    found += [here / f for f in filenames if f.endswith('.py')]
  return found


def test_no_calendar_dates_in_library_code():
  dated = [
    f'{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}'
    for path in _library_sources()
    for i, line in enumerate(path.read_text().splitlines(), 1)
    if DATE.search(line)
  ]
  assert dated == [], 'dated figures belong on docs/performance.md:\n' + '\n'.join(dated)


def test_broken_links_are_found(tmp_path):
  """The link check itself: a missing file and a missing heading are reported, a good link is not."""
  (tmp_path / 'page.md').write_text('# A page\n\n## Some section, here\n')
  md = tmp_path / 'index.md'
  md.write_text('[a](page.md) [b](page.md#some-section-here) [c](gone.md) [d](page.md#gone) [e](https://x.org)\n')
  assert broken_links(md) == ['gone.md: no such file', 'page.md#gone: no heading #gone in page.md']


@pytest.mark.skipif(importlib.util.find_spec('mkdocs') is None, reason='mkdocs not installed (requirements-docs.txt)')
def test_docs_site_builds_strict(tmp_path):
  """mkdocs.yml's strict mode: a broken link or anchor, or a nav entry without its page, fails the build."""
  assert (ROOT / 'mkdocs.yml').exists(), 'mkdocs.yml is missing'
  env = dict(os.environ, NO_MKDOCS_2_WARNING='1')
  run = subprocess.run(
    [sys.executable, '-m', 'mkdocs', 'build', '--strict', '-f', str(ROOT / 'mkdocs.yml'), '-d', str(tmp_path / 'site')],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
