"""Device meshes from config: `config.mesh` maps mesh axis name -> size (one size may be -1).

Hybrid meshes: `config.dcn_mesh` (same axis names, sizes default 1) spans slices over the slower network
(DCN: hosts or TPU slices joined by Ethernet/InfiniBand), while `config.mesh` stays the mesh inside one
slice (ICI / NVLink). Each mesh axis then has size mesh[a] * dcn_mesh[a], its DCN part the outer (major)
factor, so the rules name the combined axes as before. A slice is what the devices say (TPU `slice_index`),
else one process (one host), else, in one process (simulated CPU devices, dry runs), a contiguous block
of devices.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from errors import ShardingError
from partitioning.rules import fmt_mesh


def _items(mesh_cfg: Mapping[str, int]) -> list[tuple[str, int]]:
  items = list(mesh_cfg.items())
  if not items:
    raise ShardingError('config.mesh is empty: give at least one mesh axis, e.g. data=-1')
  for name, size in items:
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ShardingError(f'config.mesh.{name} = {size!r}: a mesh axis size must be a positive int or -1')
  if sum(size == -1 for _, size in items) > 1:
    raise ShardingError(
      f'config.mesh ({fmt_mesh(dict(items))}) has more than one -1; at most one axis may take "the rest of the devices"'
    )
  return items


def dcn_shape(mesh_cfg: Mapping[str, int], dcn_cfg: Mapping[str, int] | None) -> dict[str, int]:
  """The DCN size of every axis of `mesh_cfg` (1 where config.dcn_mesh says nothing), checked."""
  dcn = dict(dcn_cfg or {})
  for name, size in dcn.items():
    if name not in mesh_cfg:
      raise ShardingError(
        f'config.dcn_mesh.{name}: {name!r} is not an axis of config.mesh '
        f'({fmt_mesh(dict(mesh_cfg))}); the DCN mesh splits the same axes across slices'
      )
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ShardingError(
        f'config.dcn_mesh.{name} = {size!r}: a DCN axis size must be an int >= 1 (the number of slices along that axis)'
      )
  return {name: dcn.get(name, 1) for name in mesh_cfg}


def devices_needed(mesh_cfg: Mapping[str, int], dcn_cfg: Mapping[str, int] | None = None) -> int:
  """Devices a mesh config asks for, counting a -1 axis as 1 (used to size simulated CPU meshes)."""
  return math.prod(max(size, 1) for _, size in _items(mesh_cfg)) * math.prod(dcn_shape(mesh_cfg, dcn_cfg).values())


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int, platform: str = 'device') -> dict[str, int]:
  """Fills in the -1 axis and checks that the product of sizes equals the device count."""
  items = _items(mesh_cfg)
  known = math.prod(size for _, size in items if size != -1)
  if any(size == -1 for _, size in items):
    if num_devices % known:
      raise ShardingError(
        f'config.mesh ({fmt_mesh(dict(items))}): the fixed axes take {known} devices, which does not '
        f'divide the {num_devices} {platform} devices available'
      )
    items = [(n, num_devices // known if s == -1 else s) for n, s in items]
  shape = dict(items)
  if math.prod(shape.values()) != num_devices:
    raise ShardingError(
      f'config.mesh ({fmt_mesh(shape)}) needs {math.prod(shape.values())} devices, but there are '
      f'{num_devices} {platform} devices; change the mesh sizes so their product is {num_devices} '
      '(or use -1 for one axis)'
    )
  return shape


def fit_mesh_shape(
  mesh_cfg: Mapping[str, int],
  num_devices: int,
  platform: str = 'device',
) -> tuple[dict[str, int], str | None]:
  """On real accelerators: (sizes, None) when the config's mesh fits the devices; otherwise the mesh
  fitted to them, its largest axis (the preset's main strategy) taking every device and the others 1,
  with a note that says so and gives the flags that choose another layout."""
  items = _items(mesh_cfg)
  try:
    return resolve_mesh_shape(mesh_cfg, num_devices, platform), None
  except ShardingError:
    pass
  main = max(items, key=lambda it: math.inf if it[1] == -1 else it[1])[0]
  fitted = {name: num_devices if name == main else 1 for name, _ in items}
  flags = ' '.join(f'--config.mesh.{name}={size}' for name, size in fitted.items())
  return fitted, (
    f'config.mesh ({fmt_mesh(dict(items))}) asks for {devices_needed(mesh_cfg)} devices; there are '
    f'{num_devices} {platform} devices, so the mesh is fitted to them: {flags} (set these flags '
    'to choose another layout)'
  )


def fit_mesh(mesh_cfg: MutableMapping[str, int], dcn_cfg: Mapping[str, int] | None = None) -> str | None:
  """On GPUs/TPUs, fits the mesh config (config.mesh, updated in place) to the devices found
  (fit_mesh_shape; per slice when config.dcn_mesh has several) and returns the note saying so, or None when it
  fits already; on the CPU likewise where the user set the device count (user_cpu_devices), else nothing
  (simulated devices are sized to the mesh)."""
  platform = jax.devices()[0].platform
  if platform == 'cpu' and user_cpu_devices() is None:
    return None
  per_slice = _devices_per_slice(dcn_shape(mesh_cfg, dcn_cfg), jax.device_count(), platform)
  fitted, note = fit_mesh_shape(mesh_cfg, per_slice, platform)
  if note:
    mesh_cfg.update(fitted)
  return note


def check_platform() -> None:
  """Refuses to run on the CPU when an NVIDIA GPU or a TPU is attached but JAX cannot use it (a jaxlib without
  the CUDA plugin or libtpu): training would silently be ~100x slower. JAX_PLATFORMS=cpu says the CPU is meant."""
  if jax.default_backend() != 'cpu' or os.environ.get('JAX_PLATFORMS', '') == 'cpu':
    return
  present = accelerator_present()
  if present == 'gpu':
    raise ShardingError(
      'an NVIDIA GPU is present but JAX found only the CPU (a CPU-only jaxlib?): install the GPU '
      f'plugin, pip install "jax[cuda13]=={jax.__version__}" (or jax[cuda12]), or set '
      'JAX_PLATFORMS=cpu to run on the CPU on purpose'
    )
  if present == 'tpu':
    raise ShardingError(
      'a TPU is attached but JAX found only the CPU (no libtpu?): pip install '
      f'"jax[tpu]=={jax.__version__}", or set JAX_PLATFORMS=cpu to run on the CPU on purpose'
    )


def accelerator_present() -> str | None:
  """'gpu' or 'tpu' where such a chip is attached, found as JAX's own start-up finds them (device files; Google's
  PCI vendor and TPU device ids), else None."""
  try:
    from jax._src import hardware_utils  # private: where it moves, only NVIDIA's device files are looked at
  except ImportError:
    return 'gpu' if os.path.exists('/dev/nvidiactl') or os.path.exists('/dev/nvidia0') else None
  if hardware_utils.has_visible_nvidia_gpu():
    return 'gpu'
  return 'tpu' if hardware_utils.num_available_tpu_chips_and_device_id()[0] else None


# Where a user sets the number of CPU devices themselves (the entry points honour it: simulate_cpu_devices).
CPU_COUNT_FLAG = re.compile(r'--xla_force_host_platform_device_count=(\d+)')


def user_cpu_devices() -> tuple[int, str] | None:
  """(count, where it is set) when the environment sets the number of CPU devices (JAX_NUM_CPU_DEVICES, or
  --xla_force_host_platform_device_count in XLA_FLAGS), else None."""
  given = os.environ.get('JAX_NUM_CPU_DEVICES', '').strip()
  if given.isdigit() and int(given) > 0:
    return int(given), 'JAX_NUM_CPU_DEVICES'
  found = CPU_COUNT_FLAG.findall(os.environ.get('XLA_FLAGS', ''))
  return (int(found[-1]), 'XLA_FLAGS') if found else None


def cpu_devices_note() -> str:
  """For the mesh line on the CPU: whose number of devices it is (the user's, or simulated for the mesh)."""
  user = user_cpu_devices()
  if user:
    return f'as {user[1]} sets'
  return 'simulated, as many as the mesh needs; XLA_FLAGS=--xla_force_host_platform_device_count=N sets the number'


def simulate_cpu_devices(n: int, honour_environment: bool = False) -> None:
  """Asks the CPU backend for `n` devices. Must run before JAX initialises its backends. With
  `honour_environment` (the entry points), a count the user set (user_cpu_devices) is kept instead, and the mesh
  is then fitted to it (fit_mesh).

  On GPU/TPU machines this only affects the (unused) CPU backend; the real devices are used.

  It also widens XLA:CPU's intra-op thread pool (sized by the NPROC variable, else by the core
  count, with at least one thread per device). XLA:CPU runs independent collectives of one
  program concurrently on that pool; with as few threads as simulated devices, every thread can
  end up blocked in a rendezvous whose other participants are still queued behind them, and the
  run aborts after 40 s ("Termination timeout for all reduce"). We saw this once in ~2,500 steps
  of the default config; 4 threads per device costs ~8% of step time on 2 cores.
  """
  user = user_cpu_devices() if honour_environment else None
  os.environ.setdefault('NPROC', str(max(32, 4 * (user[0] if user else n))))
  if user is None:
    jax.config.update('jax_num_cpu_devices', n)


def make_mesh(
  mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None, dcn_cfg: Mapping[str, int] | None = None
) -> Mesh:
  """Builds a mesh with Auto axis types (GSPMD propagation between our explicit constraints); with a
  config.dcn_mesh of more than one slice, the hybrid ICI x DCN mesh (see the module docstring)."""
  devices = list(jax.devices() if devices is None else devices)
  dcn = dcn_shape(mesh_cfg, dcn_cfg)
  slices = math.prod(dcn.values())
  if slices == 1:
    shape = resolve_mesh_shape(mesh_cfg, len(devices), devices[0].platform)
    return jax.make_mesh(
      tuple(shape.values()), tuple(shape.keys()), axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=devices
    )
  platform = devices[0].platform
  per_slice = _devices_per_slice(dcn, len(devices), platform)
  try:
    ici = resolve_mesh_shape(mesh_cfg, per_slice, platform)
  except ShardingError as e:
    raise ShardingError(
      f'{e}, per slice: config.dcn_mesh ({fmt_mesh(dcn)}) splits the {len(devices)} devices '
      f'into {slices} slices of {per_slice}'
    ) from None
  grid = _hybrid_grid(tuple(ici.values()), tuple(dcn.values()), devices)
  return Mesh(grid, tuple(ici), axis_types=(jax.sharding.AxisType.Auto,) * len(ici))


def _devices_per_slice(dcn: Mapping[str, int], num_devices: int, platform: str) -> int:
  slices = math.prod(dcn.values())
  if num_devices % slices:
    raise ShardingError(
      f'config.dcn_mesh ({fmt_mesh(dcn)}) asks for {slices} slices, which does not divide the '
      f'{num_devices} {platform} devices'
    )
  return num_devices // slices


def slice_kind(devices: Sequence[jax.Device]) -> str:
  """What a DCN slice is among `devices`: 'slice' (TPU slice_index), 'process' (one host), or 'block'
  (one process: contiguous blocks of devices stand for slices)."""
  if len({getattr(d, 'slice_index', 0) for d in devices}) > 1:
    return 'slice'
  return 'process' if len({d.process_index for d in devices}) > 1 else 'block'


def _hybrid_grid(ici: tuple[int, ...], dcn: tuple[int, ...], devices: Sequence[jax.Device]) -> np.ndarray:
  kind, slices = slice_kind(devices), math.prod(dcn)
  if kind != 'block':
    try:
      return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=kind == 'process')
    except ValueError as e:  # the slices found are not the slices asked for
      raise ShardingError(f'config.dcn_mesh asks for {slices} slices of {math.prod(ici)} devices: {e}') from None
  # One process: block k of the devices (by id) is slice k; slice coordinates are the outer factor of each axis.
  blocks = np.array(sorted(devices, key=lambda d: d.id), dtype=object).reshape(dcn + ici)
  n = len(ici)
  interleaved = blocks.transpose([i for a in range(n) for i in (a, n + a)])
  return interleaved.reshape([d * i for d, i in zip(dcn, ici)])


def num_slices(mesh: Mesh, dcn_cfg: Mapping[str, int] | None) -> int:
  return math.prod(dcn_shape(dict(mesh.shape), dcn_cfg).values())


def describe_dcn(mesh: Mesh, dcn_cfg: Mapping[str, int] | None) -> str:
  """E.g. 'data=2 across slices x data=1 x fsdp=4 within each; a slice is one process'."""
  dcn = dcn_shape(dict(mesh.shape), dcn_cfg)
  ici = {a: mesh.shape[a] // dcn[a] for a in dcn}
  kind = {
    'slice': 'a TPU slice',
    'process': 'one process',
    'block': 'a block of devices of this one process (simulated)',
  }[slice_kind(list(mesh.devices.flat))]
  return (
    f'{fmt_mesh({a: n for a, n in dcn.items() if n > 1})} across slices x {fmt_mesh(ici)} within each; '
    f'a slice is {kind}'
  )


def dcn_coordinates(mesh: Mesh, dcn_cfg: Mapping[str, int] | None) -> np.ndarray:
  """For each device position of `mesh` (flattened, = the partition id of a program compiled on it), the
  index of its DCN slice (0 when there is one slice)."""
  dcn = tuple(dcn_shape(dict(mesh.shape), dcn_cfg).values())
  ici = tuple(s // d for s, d in zip(mesh.devices.shape, dcn))
  pos = np.indices(mesh.devices.shape).reshape(len(dcn), -1)
  return np.ravel_multi_index([p // i for p, i in zip(pos, ici)], dcn)


def start_mesh(mesh_cfg: MutableMapping[str, int]) -> tuple[Mesh, str | None]:
  """For one-process entry points (benchmarks, export.py), before JAX has started: simulated CPU devices for
  the mesh, the CPU-only-jaxlib-on-a-GPU check, the mesh fitted to the accelerators (config.mesh updated in
  place) and built. Returns (mesh, the fitting note or None). train.py does the same steps across its main()
  (devices, several processes) and train_and_evaluate()."""
  simulate_cpu_devices(devices_needed(mesh_cfg), honour_environment=True)
  check_platform()
  note = fit_mesh(mesh_cfg)
  return make_mesh(mesh_cfg), note
