"""The user guide holds together: the docs site builds in strict mode, the README's links resolve, the README stays a
short guide, the tables of contents (docs/index.md, the README's list) follow mkdocs.yml's nav, the one source of
which pages there are, and library code and user pages carry no calendar dates (measured figures and their dates
belong on docs/performance.md, their history on docs/changelog.md). Every command block of README.md and docs/ runs
as written (tests/doc_commands.py), or says by name why it cannot here (a download, a GPU, ...)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import doc_commands
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
DOCS = ROOT / 'docs'
DATED_PAGES = {'performance.md', 'changelog.md'}  # the measured record and its history
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


def nav_pages(nav: list) -> list[str]:
  """mkdocs.yml's nav flattened to its pages, in order: entries are `Title: page.md`, `Title: [entries]` or a bare
  `page.md` (a link elsewhere, `Title: https://...`, is no page)."""
  pages = []
  for entry in nav:
    for value in entry.values() if isinstance(entry, dict) else [entry]:
      if isinstance(value, list):
        pages += nav_pages(value)
      elif value.endswith('.md'):
        pages.append(value)
  return pages


def _nav() -> list[str]:
  return nav_pages(yaml.safe_load((ROOT / 'mkdocs.yml').read_text())['nav'])


def linked_pages(text: str, prefix: str = '') -> list[str]:
  """The .md pages a Markdown text links to under `prefix` (e.g. 'docs/'), anchors dropped, in order of first
  link."""
  text = re.sub(r'```.*?```', '', text, flags=re.S)
  pages = []
  for target in LINK.findall(text):
    page = target.partition('#')[0]
    if page.startswith(prefix) and page.endswith('.md') and '/' not in page[len(prefix) :]:
      page = page[len(prefix) :]
      if page not in pages:
        pages.append(page)
  return pages


def toc_mismatch(nav: list[str], toc: list[str], where: str) -> list[str]:
  """How a table of contents differs from the nav's pages: pages it misses, pages the nav lacks, and its order."""
  problems = [f"{where} misses {p} (in mkdocs.yml's nav)" for p in nav if p not in toc]
  problems += [f"{where} lists {p}, which mkdocs.yml's nav lacks" for p in toc if p not in nav]
  if not problems and toc != nav:
    problems.append(f"{where} lists the pages in another order than mkdocs.yml's nav: {toc} against {nav}")
  return problems


def test_toc_mismatch_is_found():
  """The comparison itself: a missing page, an extra one and another order are each reported."""
  nav = ['a.md', 'b.md', 'c.md']
  assert toc_mismatch(nav, nav, 'x') == []
  assert toc_mismatch(nav, ['a.md', 'b.md', 'd.md'], 'x') == [
    "x misses c.md (in mkdocs.yml's nav)",
    "x lists d.md, which mkdocs.yml's nav lacks",
  ]
  assert 'another order' in toc_mismatch(nav, ['b.md', 'a.md', 'c.md'], 'x')[0]
  assert nav_pages([{'Home': 'a.md'}, {'S': [{'B': 'b.md'}, 'c.md']}]) == nav
  text = '[a](a.md) [a again](a.md#x) [b](docs/b.md) [web](https://x.org/c.md)\n```\n[c](c.md)\n```\n'
  assert linked_pages(text) == ['a.md'] and linked_pages(text, 'docs/') == ['b.md']


def test_every_page_is_in_the_nav():
  """A page in docs/ that the nav lacks is built but unreachable from the site's menu."""
  pages = sorted(p.name for p in DOCS.glob('*.md'))
  problems = toc_mismatch(sorted(_nav()), pages, 'docs/')
  assert problems == [], '\n'.join(problems)


def test_index_follows_the_nav():
  """docs/index.md links every page of the nav but itself, in the nav's order, and no other."""
  nav = [p for p in _nav() if p != 'index.md']
  problems = toc_mismatch(nav, linked_pages((DOCS / 'index.md').read_text()), 'docs/index.md')
  assert problems == [], '\n'.join(problems)


def test_readme_documentation_list_follows_the_nav():
  """The README's '## Documentation' list links every page of the nav but the index (linked at its top)."""
  section = re.search(r'^## Documentation\n(.*?)(?=^## |\Z)', README.read_text(), flags=re.M | re.S)
  assert section, "README.md has no '## Documentation' section"
  nav = [p for p in _nav() if p != 'index.md']
  problems = toc_mismatch(nav, linked_pages(section.group(1), 'docs/'), "README.md's Documentation list")
  assert problems == [], '\n'.join(problems)


def test_user_pages_carry_no_calendar_dates():
  """A dated figure on a user page goes stale unseen; it belongs in the performance page's tables."""
  pages = [p for p in DOCS.glob('*.md') if p.name not in DATED_PAGES] + [README]
  dated = [
    f'{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}'
    for path in pages
    for i, line in enumerate(path.read_text().splitlines(), 1)
    if DATE.search(line)
  ]
  assert dated == [], 'dated figures belong on docs/performance.md:\n' + '\n'.join(dated)


# --- The command blocks, run as written (tests/doc_commands.py) ---------------------------------------------------

LOOKS_LIKE_A_COMMAND = re.compile(r'^\s*(python|pip|pytest|bash|tfds|hf) ', re.M)


def test_a_blocks_commands_are_its_lines_joined_and_without_comments():
  body = 'python a.py --x=1 \\\n    --y="a b"   # why\n\n# a comment line\npython -c "print(1)  # kept"\n'
  assert doc_commands.commands_of(body) == [
    'python a.py --x=1 --y="a b"   # why',
    'python -c "print(1)  # kept"',
  ]
  assert doc_commands.words_of('python a.py --x=1 --y="a b"   # why') == ['python', 'a.py', '--x=1', '--y=a b']
  assert doc_commands.argv_of('python train.py --workdir /tmp/r', '/T') == [
    'python', 'train.py', '--workdir', '/T/r', f'--config.total_steps={doc_commands.STEPS}',
  ]  # fmt: skip
  assert doc_commands.argv_of('python train.py --dry_run', '/T', ('--config.x=1',)) == [
    'python', 'train.py', '--dry_run'
  ]  # fmt: skip
  assert doc_commands.argv_of('python train.py', '/T', ('--config.x=1',))[-1] == '--config.x=1'
  assert doc_commands.unsupported('tfds build lm1b').startswith("'tfds build lm1b': only `python SCRIPT ...`")


def test_every_command_block_is_runnable_or_marked_with_a_known_reason():
  """A block of commands says `bash`; the suite runs it unless the line above its fence says why not, by one of
  doc_commands.NOT_RUN's names; a command the runner cannot run is in a marked block."""
  problems = []
  for page in doc_commands.PAGES:
    text = page.read_text()
    for m in doc_commands.FENCE.finditer(text):
      lang = m['lang'].strip()
      if lang not in doc_commands.COMMAND_LANGS and not lang and LOOKS_LIKE_A_COMMAND.search(m['body']):
        problems.append(f'{page.name}:{text.count(chr(10), 0, m.start()) + 1}: commands in a block not marked bash')
    for block in doc_commands.blocks(page):
      if block.not_run and block.not_run not in doc_commands.NOT_RUN:
        problems.append(f'{block.where}: not run for an unknown reason {block.not_run!r}')
      elif not block.not_run:
        problems += [f'{block.where}: {why}' for c in block.commands if (why := doc_commands.unsupported(c))]
  assert problems == [], '\n'.join(problems)


@pytest.fixture(scope='module')
def doc_runs(tmp_path_factory):
  """Every runnable command of README.md and docs/*.md, run once (tests/doc_commands.py: one process imports,
  a forked child per command); the report and what it cost."""
  report = tmp_path_factory.mktemp('doc_commands') / 'report.json'
  env = {**subprocess_env(), 'HF_HUB_OFFLINE': '1'}
  t0 = time.perf_counter()
  run = subprocess.run(
    [sys.executable, str(ROOT / 'tests' / 'doc_commands.py'), str(report)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(report.read_text()), time.perf_counter() - t0


RUN_PAGES = sorted(
  str(p.relative_to(ROOT)) for p in doc_commands.PAGES if any(not b.not_run for b in doc_commands.blocks(p))
)


@pytest.mark.parametrize('page', RUN_PAGES)
def test_every_command_block_runs_as_written(doc_runs, page):
  report, _ = doc_runs
  failed = [
    f'{r["where"]}: {r["command"]}\n  exit {r["status"]}:\n{r["log"]}' for r in report[page] if r['status'] != 0
  ]
  assert failed == [], '\n'.join(failed)
