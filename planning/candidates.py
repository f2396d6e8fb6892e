"""Candidate plans: mesh factorisations (and, over several hosts, axis orders) x rule sets x remat policies.

A plan is what a config file says about parallelism: `config.mesh` (ordered, outermost axis first: with
several hosts the leading axes are the ones that cross them), `config.logical_axis_rules` and
`config.model.remat`. Rule sets are the config file's presets plus variants generated from them
(`rule_variants`). Where a rule set pipelines the layers (('layers', 'stage'), docs/pipelines.md), the
pipeline's micro-batch count is searched too (`microbatch_counts`): the stage count is the mesh's 'stage' size.
A plan that does not fit the device is tried again in micro-batches (`config.grad_accum_steps`: the same global
batch in 2, 4, ... parts; planning/search.py). Nothing here imports JAX or a model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from errors import ConfigError

Rules = tuple[tuple[str, object], ...]


@dataclasses.dataclass(frozen=True)
class Candidate:
  mesh: tuple[tuple[str, int], ...]  # ordered (axis, size), outermost first
  rules_name: str  # 'fsdp', 'tp', 'tp-vocab_replicated', ...
  rules: Rules
  remat: str | None  # None: the config's own (families without remat)
  microbatches: int = 0  # config.pipeline.microbatches where the rules pipeline the layers over 'stage'; else 0
  micro: int = 1  # config.grad_accum_steps: micro-batches per optimizer step

  @property
  def mesh_dict(self) -> dict[str, int]:
    return dict(self.mesh)

  @property
  def stages(self) -> int:
    """The pipeline stages of the plan: 'stage''s size where the first 'layers' rule names it, else 1."""
    target = next((t for name, t in self.rules if name == 'layers'), None)
    named = (target,) if isinstance(target, str) else (target or ())
    return self.mesh_dict.get('stage', 1) if 'stage' in named else 1

  def label(self) -> str:
    mesh = ' '.join(f'{a}={s}' for a, s in self.mesh if s > 1) or 'one device'
    return (
      f'{mesh} | {self.rules_name}'
      + (f' | micro={self.microbatches}' if self.microbatches else '')
      + (f' | remat={self.remat}' if self.remat else '')
      + (f' | {self.micro} micro-batches' if self.micro > 1 else '')
    )


# A pipeline of S stages is searched with S, 2 S and 4 S micro-batches (bubble (S - 1) / (M + S - 1): about 1/2,
# 1/3 and 1/5 of the iterations for large S), those that divide the batch.
MICROBATCH_FACTORS = (1, 2, 4)


def microbatch_counts(stages: int, batch: int | None) -> list[int]:
  """The micro-batch counts searched for a pipeline of `stages` (a global batch they do not divide is left out)."""
  return [f * stages for f in MICROBATCH_FACTORS if batch is None or batch % (f * stages) == 0]


def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
  """Every ordered k-tuple of positive ints whose product is n."""
  if k == 1:
    return [(n,)]
  return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in factorisations(n // d, k - 1)]


def _hosts_along(sizes: Sequence[int], axis: int, per_host: int) -> int:
  """How many hosts one line of devices along `axis` reaches (devices ordered host-major, mesh row-major)."""
  stride = math.prod(sizes[axis + 1 :])
  return len({(i * stride) // per_host for i in range(sizes[axis])})


def axis_orders(sizes: Mapping[str, int], hosts: int) -> list[tuple[tuple[str, int], ...]]:
  """Orders of the mesh axes that put different axes across hosts, one per distinct placement (each axis's
  hosts spanned). Where some order puts the host boundary between axes (the leading axes span exactly the
  hosts: those axes run on DCN, the rest on ICI), only such orders; else (an axis must be split over hosts
  and within them) every distinct placement. With one host, the given order only."""
  base = tuple(sizes.items())
  if hosts <= 1:
    return [base]
  n = math.prod(sizes.values())
  seen, clean, other = set(), [], []
  for perm in itertools.permutations(base):
    order = [s for _, s in perm]
    sig = tuple(sorted((a, s, _hosts_along(order, i, n // hosts)) for i, (a, s) in enumerate(perm) if s > 1))
    if sig in seen:
      continue
    seen.add(sig)
    prefixes = [math.prod(order[:k]) for k in range(len(order) + 1)]
    (clean if hosts in prefixes else other).append(perm)
  return clean or other


def split_over_hosts(mesh: Sequence[tuple[str, int]], hosts: int) -> tuple[dict[str, int], dict[str, int]]:
  """A plan's ordered mesh over `hosts` hosts as (config.mesh, config.dcn_mesh): walking the axes outermost
  first, each takes as much of the remaining host count as its size shares with it (its outer part crosses
  hosts, on DCN; the rest stays inside a host). E.g. data=8 x fsdp=8 over 8 hosts -> mesh data=1 fsdp=8,
  dcn_mesh data=8 fsdp=1; fsdp=16 x tensor=4 over 8 -> mesh fsdp=2 tensor=4, dcn_mesh fsdp=8 tensor=1."""
  ici, dcn, left = {}, {}, hosts
  for axis, size in mesh:
    d = math.gcd(size, left)
    ici[axis], dcn[axis], left = size // d, d, left // d
  if left != 1:
    raise ConfigError(f'mesh {dict(mesh)} cannot be split over {hosts} hosts with its leading axes crossing them')
  return ici, dcn


def rule_variants(presets: Mapping[str, Sequence[tuple]]) -> dict[str, Rules]:
  """The presets, and variants of them: 'vocab' replicated where a preset shards it (the output head's
  gather and logits collectives against its memory), 'kv_heads' replicated where a preset shards it
  (allows tensor axes larger than the key/value head count). Duplicates are left out."""
  out: dict[str, Rules] = {}
  for name, rules in presets.items():
    rules = tuple((str(r[0]), r[1]) for r in rules)
    out.setdefault(name, rules)
    for logical in ('vocab', 'kv_heads'):
      if any(r[0] == logical and r[1] is not None for r in rules):
        variant = tuple((r[0], None) if r[0] == logical else r for r in rules)
        variant = tuple(dict.fromkeys(variant))  # a now-duplicated (name, None) once
        if variant not in out.values():
          out[f'{name}-{logical}_replicated'] = variant
  return out


def mesh_axes_of(rules_by_name: Mapping[str, Rules], config_mesh: Sequence[str]) -> list[str]:
  """The mesh axes the family knows: the config's mesh axes, then any other axis a rule set names."""
  axes = list(config_mesh)
  for rules in rules_by_name.values():
    for _, target in rules:
      for a in target if isinstance(target, (tuple, list)) else (target,):
        if a is not None and a not in axes:
          axes.append(a)
  return axes


def generate(
  num_devices: int,
  axes: Sequence[str],
  rules_by_name: Mapping[str, Rules],
  remats: Sequence[str | None],
  hosts: int = 1,
  batch: int | None = None,
) -> Iterator[Candidate]:
  """Every (mesh factorisation x axis order over hosts) x rule set x remat policy, mesh-major; pipelined plans
  once per micro-batch count (`microbatch_counts` of a global batch of `batch` rows)."""
  if num_devices < 1 or hosts < 1 or num_devices % hosts:
    raise ConfigError(
      f'--devices {num_devices} over --hosts {hosts}: the device count must be a positive multiple of the host count'
    )
  for sizes in factorisations(num_devices, len(axes)):
    for mesh in axis_orders(dict(zip(axes, sizes)), hosts):
      for (name, rules), remat in itertools.product(rules_by_name.items(), remats):
        stages = Candidate(mesh, name, rules, remat).stages
        for micro in microbatch_counts(stages, batch) if stages > 1 else [0]:
          yield Candidate(mesh, name, rules, remat, micro)


def load_module(config_file: str):
  """A config file as a module (its RULES, MESHES, SIZES, get_config)."""
  spec = importlib.util.spec_from_file_location('searched_config', config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def presets_of(config_file: str, arg: str | None, config: Any) -> dict[str, list]:
  """The config file's rule presets (its RULES dict, each preset built by its own get_config), plus the config's
  own rules when they are none of them (edited on the command line)."""
  module = load_module(config_file)
  size = config.size
  out = {}
  for name in getattr(module, 'RULES', {}):
    words = [name] + ([size] if size else [])
    out[name] = list(module.get_config(','.join(words)).logical_axis_rules)
  own = [tuple(r) for r in config.logical_axis_rules]
  if own not in [[tuple(r) for r in v] for v in out.values()]:
    out['config'] = own
  return out
