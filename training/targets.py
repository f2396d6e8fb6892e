"""Compiling for a GPU on a machine without one.

XLA's GPU compiler needs no GPU: given a description of the target (compute capability, SM count, shared
memory, memory size: `training/gpu_targets/<name>.txtpb`), JAX's CUDA plugin makes compile-only devices of
that GPU, and a step jitted over a mesh of them compiles to the program that GPU would run: the same fusions,
kernels and buffer assignment. Nothing can run on them, but `compiled.memory_analysis()` is the GPU's memory:
arguments + temporaries + outputs not aliased to donated inputs matched the 9 peaks measured on an H100 80GB
(docs/gpu.md, "Memory"): 7 to 0.01 GiB, ViT-B/16 0.29 GiB under (-1.2%), GPT-2 at 32 x 1024 0.58 GiB over (+2.3%).

Needs the CUDA plugin beside jaxlib, on any machine (`pip install "jax[cuda13]==<jax version>"`, a few GB of
NVIDIA libraries), and JAX_PLATFORMS=cpu where there is no GPU. Autotuning needs a GPU, so the kernels'
tile sizes are XLA's defaults; memory does not depend on them.
"""
from __future__ import annotations

import glob
import math
import os

import jax

from errors import ConfigError

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpu_targets')
DEVICES_PER_HOST = 8


# training/flops.py chip name -> the target description it compiles with
CHIP_TARGETS = {'h100': 'h100_sxm'}
PLUGINS = ('jax_plugins.xla_cuda13', 'jax_plugins.xla_cuda12')


def plugin_installed() -> bool:
  """Whether JAX's CUDA plugin is installed (found without importing it)."""
  import importlib.util
  for name in PLUGINS:
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except ModuleNotFoundError:  # no jax_plugins package at all
      return False
  return False


def memory_target(chip: str, count: int, choice: str = 'auto') -> tuple[str | None, str]:
  """The GPU target to compile a plan's memory for, for `count` of a chip (training/flops.py name) planned on
  CPU, and why: `choice` 'auto' (the chip's target where the CUDA plugin is installed and the count lays out
  over hosts), 'none', or a target (name or file; gpu_devices then refuses a count it cannot lay out)."""
  if choice == 'none':
    return None, '--gpu_target=none'
  if choice != 'auto':
    target_config(choice)  # a known target, or one ConfigError naming the known ones
    return choice, f'--gpu_target={choice}'
  if chip not in CHIP_TARGETS:
    return None, f'no GPU target for {chip} in training/gpu_targets'
  if not plugin_installed():
    return None, f'JAX\'s CUDA plugin is not installed (pip install "jax[cuda13]=={jax.__version__}"; no GPU needed)'
  try:
    _hosts(count)
  except ConfigError as e:
    return None, str(e)
  return CHIP_TARGETS[chip], f'{chip} compiles as {CHIP_TARGETS[chip]}'


def _hosts(count: int) -> int:
  """Hosts of DEVICES_PER_HOST GPUs that `count` GPUs fill; ConfigError where they do not."""
  if count < 1:
    raise ConfigError(f'{count} GPUs asked for: compile for at least 1')
  hosts = math.ceil(count / DEVICES_PER_HOST)
  if count % hosts:
    raise ConfigError(f'{count} GPUs do not fill {hosts} hosts of {DEVICES_PER_HOST}: ask for a multiple of '
                      f'{DEVICES_PER_HOST}, or at most {DEVICES_PER_HOST}')
  return hosts


def known_targets() -> list[str]:
  return sorted(os.path.basename(p)[:-len('.txtpb')] for p in glob.glob(os.path.join(TARGETS_DIR, '*.txtpb')))


def target_config(target: str) -> str:
  """The text of a target description: a name from training/gpu_targets, or a path to a .txtpb file."""
  path = target if os.path.isfile(target) else os.path.join(TARGETS_DIR, f'{target}.txtpb')
  if not os.path.isfile(path):
    raise ConfigError(f'GPU target {target!r} is neither one of {known_targets()} (training/gpu_targets) nor a '
                      'file holding a GpuTargetConfigProto in text format')
  with open(path) as f:
    return f.read()


def gpu_devices(target: str, count: int = 1) -> list[jax.Device]:
  """`count` compile-only devices of GPU `target`, DEVICES_PER_HOST to a host (a mesh over them compiles for
  that many GPUs). ConfigError naming the install where JAX's CUDA plugin is missing."""
  text = target_config(target)
  hosts = _hosts(count)
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc('', 'cuda', target_config=text, topology=f'1x{hosts}x{count // hosts}')
  except (NotImplementedError, RuntimeError) as e:  # no 'cuda' topology factory: the plugin is not installed
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f'compiling for GPU target {target!r} needs JAX\'s CUDA plugin (no GPU needed): pip install '
                      f'"jax[cuda13]=={jax.__version__}", and run with JAX_PLATFORMS=cpu on a machine without a GPU '
                      f'({first})') from None
  return list(topology.devices)
