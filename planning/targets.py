"""Compiling for a GPU or a TPU on a machine without one.

XLA's GPU compiler needs no GPU: given a description of the target (compute capability, SM count, shared
memory, memory size: `planning/gpu_targets/<name>.txtpb`), JAX's CUDA plugin makes compile-only devices of
that GPU, and a step jitted over a mesh of them compiles to the program that GPU would run: the same fusions,
kernels and buffer assignment. Nothing can run on them, but `compiled.memory_analysis()` is the GPU's memory:
arguments + temporaries + outputs not aliased to donated inputs (how closely that matched peaks measured on an
H100: docs/performance.md).
Needs the CUDA plugin beside jaxlib, on any machine (`pip install "jax[cuda13]==<jax version>"`, a few GB of
NVIDIA libraries), and JAX_PLATFORMS=cpu where there is no GPU. Autotuning needs a GPU, so the kernels'
tile sizes are XLA's defaults; memory does not depend on them.

TPUs likewise: libtpu (`pip install "jax[tpu]==<jax version>"`) makes compile-only devices of a TPU
slice from its generation and chip grid (`jax.experimental.topologies`, as MaxText's ahead-of-time compile
does), and the step compiled over them is the TPU's program, with the TPU compiler's memory analysis, not yet
checked against a real TPU. With no TPU present libtpu still looks for one when it loads:
`tpu_devices` tells it there is none to find (environment variables, only where unset) so that it neither
queries a metadata server nor prints warnings, and lets several processes load it (its lockfile is for real
chips).
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
# TPU targets, named as training/flops.py's chips -> (libtpu's generation name, dimensions of its chip grid,
# chips per host: v5e and v6e hosts hold 2x4 chips, v4 and v5p hosts 2x2x1; v4 as megacore, one device per chip)
TPU_TARGETS = {
  'tpu_v4': ('v4', 3, (2, 2, 1)),
  'tpu_v5e': ('v5e', 2, (2, 4, 1)),
  'tpu_v5p': ('v5p', 3, (2, 2, 1)),
  'tpu_v6e': ('v6e', 2, (2, 4, 1)),
}


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


def libtpu_installed() -> bool:
  """Whether libtpu is installed (found without importing it)."""
  import importlib.util

  return importlib.util.find_spec('libtpu') is not None


def memory_target(chip: str, count: int, choice: str = 'auto') -> tuple[str | None, str]:
  """The target to compile a plan's memory for, for `count` of a chip (training/flops.py name) planned on CPU,
  and why: `choice` 'auto' (the chip's target where its compiler is installed, JAX's CUDA plugin or libtpu, and
  the count lays out), 'none', or a target (a TPU chip name, or a GPU target's name or file; compile_devices
  then refuses a count it cannot lay out)."""
  if choice == 'none':
    return None, '--compile_target=none'
  if choice != 'auto':
    if choice.startswith('tpu'):
      tpu_topology(choice, count)  # a known chip whose count makes a slice, or one ConfigError
    else:
      target_config(choice)  # a known target, or one ConfigError naming the known ones
    return choice, f'--compile_target={choice}'
  if chip in TPU_TARGETS:
    if not libtpu_installed():
      return None, f'libtpu is not installed (pip install "jax[tpu]=={jax.__version__}"; no TPU needed)'
    try:
      name, _ = tpu_topology(chip, count)
    except ConfigError as e:
      return None, str(e)
    return chip, f'{chip} compiles as a {name} slice'
  if chip not in CHIP_TARGETS:
    return None, f'no GPU target for {chip} in planning/gpu_targets'
  if not plugin_installed():
    return None, f'JAX\'s CUDA plugin is not installed (pip install "jax[cuda13]=={jax.__version__}"; no GPU needed)'
  try:
    _hosts(count)
  except ConfigError as e:
    return None, str(e)
  return CHIP_TARGETS[chip], f'{chip} compiles as {CHIP_TARGETS[chip]}'


def compile_devices(target: str, count: int = 1) -> list[jax.Device]:
  """`count` compile-only devices of `target`: a TPU chip (TPU_TARGETS, one slice) or a GPU target."""
  return tpu_devices(target, count) if target.startswith('tpu') else gpu_devices(target, count)


def _hosts(count: int) -> int:
  """Hosts of DEVICES_PER_HOST GPUs that `count` GPUs fill; ConfigError where they do not."""
  if count < 1:
    raise ConfigError(f'{count} GPUs asked for: compile for at least 1')
  hosts = math.ceil(count / DEVICES_PER_HOST)
  if count % hosts:
    raise ConfigError(
      f'{count} GPUs do not fill {hosts} hosts of {DEVICES_PER_HOST}: ask for a multiple of '
      f'{DEVICES_PER_HOST}, or at most {DEVICES_PER_HOST}'
    )
  return hosts


def known_targets() -> list[str]:
  return sorted(os.path.basename(p)[: -len('.txtpb')] for p in glob.glob(os.path.join(TARGETS_DIR, '*.txtpb')))


def target_config(target: str) -> str:
  """The text of a target description: a name from planning/gpu_targets, or a path to a .txtpb file."""
  path = target if os.path.isfile(target) else os.path.join(TARGETS_DIR, f'{target}.txtpb')
  if not os.path.isfile(path):
    raise ConfigError(
      f'GPU target {target!r} is neither one of {known_targets()} (planning/gpu_targets) nor a '
      f'file holding a GpuTargetConfigProto in text format (TPU chips: {sorted(TPU_TARGETS)})'
    )
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
    raise ConfigError(
      f"compiling for GPU target {target!r} needs JAX's CUDA plugin (no GPU needed): pip install "
      f'"jax[cuda13]=={jax.__version__}", and run with JAX_PLATFORMS=cpu on a machine without a GPU '
      f'({first})'
    ) from None
  return list(topology.devices)


def tpu_topology(target: str, count: int) -> tuple[str, dict]:
  """libtpu's name for a slice of `count` chips of TPU `target` (e.g. 'v5e:2x4', 'v5p:2x2x2') and the options
  that make it: the chips on a grid as near square (cube) as the hosts' chip grids tile, hosts filled first; fewer
  chips than a host holds are one smaller host. ConfigError where `count` makes no slice."""
  if target not in TPU_TARGETS:
    raise ConfigError(f'TPU target {target!r} is not one of {sorted(TPU_TARGETS)}')
  generation, rank, host = TPU_TARGETS[target]
  per_host = math.prod(host)
  if count < 1 or (count > per_host and count % per_host):
    raise ConfigError(
      f'{count} {target} chips make no slice: ask for 1 to {per_host} chips (one host) or a '
      f'multiple of {per_host} (hosts of {"x".join(map(str, host[:rank]))} chips)'
    )
  if count <= per_host:  # one host holding just these chips: its grid halved, largest side first
    dims = list(host)
    while math.prod(dims) > count and max(dims) % 2 == 0:
      dims[dims.index(max(dims))] //= 2
    if math.prod(dims) != count:
      raise ConfigError(f'{count} {target} chips make no slice: on one host ask for a power of 2 up to {per_host}')
    return f'{generation}:{"x".join(map(str, dims[:rank]))}', dict(chips_per_host_bounds=dims)
  dims = _grid(count, rank, host[:rank])
  return f'{generation}:{"x".join(map(str, dims))}', dict(chips_per_host_bounds=list(host))


def _grid(count: int, rank: int, tile: tuple[int, ...]) -> tuple[int, ...]:
  """`rank` sizes whose product is `count`, each a multiple of its `tile` size, sorted, the largest smallest."""
  best = None

  def grids(left: int, dims: tuple[int, ...]):
    if len(dims) == rank - 1:
      yield dims + (left,)
      return
    for d in range(1, left + 1):
      if left % d == 0:
        yield from grids(left // d, dims + (d,))

  for dims in grids(count, ()):
    if all(d % t == 0 for d, t in zip(dims, tile)) and list(dims) == sorted(dims):
      if best is None or max(dims) < max(best):
        best = dims
  if best is None:
    raise ConfigError(f'{count} chips do not tile by {"x".join(map(str, tile))}')
  return best


# No TPU here: tell libtpu so as it loads (only where unset), instead of its querying a metadata server and
# printing warnings; several processes (test workers, a search beside a benchmark) may load it at once.
_NO_TPU_ENV = dict(
  TPU_SKIP_MDS_QUERY='1',
  TPU_ACCELERATOR_TYPE='v5litepod-8',
  TPU_WORKER_HOSTNAMES='localhost',
  ALLOW_MULTIPLE_LIBTPU_LOAD='1',
)


def tpu_devices(target: str, count: int = 1) -> list[jax.Device]:
  """`count` compile-only devices of TPU `target` (TPU_TARGETS), one slice (tpu_topology). ConfigError naming the
  install where libtpu is missing."""
  name, options = tpu_topology(target, count)
  if not libtpu_installed():
    raise ConfigError(
      f'compiling for TPU target {target!r} needs libtpu (no TPU needed): pip install '
      f'"jax[tpu]=={jax.__version__}", and run with JAX_PLATFORMS=cpu on a machine without a TPU'
    )
  if TPU_TARGETS[target][0] == 'v4':
    options['chip_config_name'] = 'megacore'  # one device per chip, as JAX uses a v4
  for k, v in _NO_TPU_ENV.items():
    os.environ.setdefault(k, v)
  from jax.experimental import topologies

  return list(topologies.get_topology_desc(name, 'tpu', **options).devices)
