r"""Per-device memory of the train step train.py compiles, for GPUs or TPUs, on a machine with neither.

  python benchmarks/compiled_memory.py --config configs/gpt2.py --config.batch_size=16 --config.dataset.pack=False
  python benchmarks/compiled_memory.py --config configs/llama.py --devices 8      # the config's mesh over 8 H100s
  python benchmarks/compiled_memory.py --cases      # docs/performance.md's table: ours vs the torch peer
  python benchmarks/compiled_memory.py --config configs/llama.py --target tpu_v5p  # over a v5p slice of 8 chips
  python benchmarks/compiled_memory.py --cases --kernels 0                    # + kernels and memory traffic per step
  python benchmarks/compiled_memory.py --config configs/gpt2.py --kernels 20  # by kind, and the 20 that move the most
  python benchmarks/compiled_memory.py --config configs/gpt2.py --config.batch_size=64 --accum 1,2,4,8  # micro-batches
  python benchmarks/compiled_memory.py --config configs/gpt2.py --target cpu  # this machine's CPU (no plugin needed)

The step is built as train.py builds it and compiled for compile-only devices of the target (planning/targets.py):
a GPU (`--target`, default an H100 SXM 80GB: a name from planning/gpu_targets or a .txtpb file) or a TPU slice
(`--target tpu_v4|tpu_v5e|tpu_v5p|tpu_v6e`), or this machine's CPU devices (`--target cpu`: the simulated devices,
no plugin); attention makes the choice it makes there (cuDNN, Pallas, XLA). `--accum 1,2,4,8` compiles the step at
each config.grad_accum_steps (the same global batch in that many micro-batches): a row each.
Printed per case: the peak (arguments + temporaries + outputs not aliased to donated inputs: what XLA's buffer
assignment reserves), the arguments (parameters, optimizer state, batch), the temporaries, the attention
kernels chosen and the compile time. With --devices 1 (the default for --cases) every mesh axis is 1; otherwise
the config's mesh runs over that many devices (GPUs 8 to a host; TPU chips as one slice, planning.targets.tpu_topology).
With --kernels, also the kernels one step launches and the bytes they read and write, counted from the compiled
program (partitioning.hlo.kernels: every fusion, library call and copy, loop bodies once per trip), by kind (matmul,
attention, reduction, elementwise, ...): what the step moves through memory, where a GPU is bandwidth-bound.

--cases compiles the batches of the GPU benchmark (docs/performance.md, "GPUs") and, for an H100, prints them beside the
peak the torch peer measured on an H100 on 2026-11-23 (`benchmarks/throughput.py --peer torch`; constants here)
and the peak our step measured there that day, before the changes since (planning/targets.py's validation).

Needs the target's compiler, no device: JAX's CUDA plugin (`pip install "jax[cuda13]==0.10.2"`) or libtpu
(`pip install "jax[tpu]==0.10.2"`); JAX_PLATFORMS=cpu is set here.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import errors  # noqa: E402
from configs import cli, schema  # noqa: E402
from partitioning import hlo  # noqa: E402

# name -> (config file, overrides, torch peer's peak GiB, our step's peak GiB; both measured on one H100 80GB on
# 2026-11-23 with benchmarks/throughput.py, ours before the changes since; None: not measured)
CASES = {
  'gpt2-16': ('configs/gpt2.py', {'batch_size': 16, 'dataset.pack': False}, 9.97, 13.45),
  'gpt2-32': ('configs/gpt2.py', {'batch_size': 32, 'dataset.pack': False}, None, 24.7),
  'llama-8': ('configs/llama.py', {'batch_size': 8, 'dataset.pack': False}, 20.9, 42.6),
  # within the peer's memory (docs/performance.md): MLPs recomputed, the loss in 8 chunks
  'llama-8-a8': (
    'configs/llama.py',
    {'batch_size': 8, 'dataset.pack': False, 'model.remat': 'attention', 'model.loss_chunks': 8},
    20.9,
    None,
  ),
  'vit-256': ('configs/vit.py', {'batch_size': 256}, 22.8, 23.45),
  'resnet-256': ('configs/resnet.py', {'batch_size': 256}, 10.6, 10.86),
}
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'A config file (configs/*.py[:arg]).', lock_config=False)
flags.DEFINE_boolean('cases', False, f'Compile the benchmark batches {list(CASES)} instead of --config.')
flags.DEFINE_string(
  'target',
  'h100_sxm',
  'What to compile for: a TPU chip (tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e), or a '
  'GPU: a name from planning/gpu_targets or a .txtpb file.',
)
flags.DEFINE_integer(
  'devices', None, 'GPUs or TPU chips to compile for (default: as many as the mesh asks; 1 with --cases).'
)
flags.DEFINE_alias('gpus', 'devices')  # its name before TPUs
flags.DEFINE_list('accum', None, 'config.grad_accum_steps values to compile, a row each (default: as configured).')
flags.DEFINE_integer(
  'kernels',
  None,
  'Also count the kernels one step launches and the bytes they read and write '
  '(partitioning.hlo.kernels), by kind; with --config, list this many of the largest.',
)

GiB = 2**30


def compile_for(config, target: str, count: int | None, kernels: bool = False) -> dict:
  """The train step of `config` compiled for `count` devices of `target`: per-device bytes and what was chosen;
  with `kernels`, the kernels one step launches (partitioning.hlo.kernels)."""
  import models
  import partitioning
  import training
  from models import attention
  from planning import targets
  from training import profiling

  n = partitioning.devices_needed(config.mesh) if count is None else count
  if target == 'cpu':  # simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N for N > 1)
    import jax

    devices = jax.devices('cpu')[:n]
  else:
    devices = targets.compile_devices(target, n)
  mesh_cfg = {a: 1 for a in config.mesh} if n == 1 else config.mesh
  t0 = time.perf_counter()
  mesh = partitioning.make_mesh(mesh_cfg, devices)
  trainer = training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))
  try:
    compiled = training.compile_step(trainer, training.jit_train_step(trainer))
  except Exception as e:  # the TPU compiler refuses a step over the chip's memory: a row saying so
    if (line := errors.out_of_device_memory(e)) is None:
      raise
    return dict(
      over=line,
      mesh=dict(mesh.shape),
      device=devices[0].device_kind,
      attention=attention.decisions(),
      seconds=time.perf_counter() - t0,
    )
  m = compiled.memory_analysis()
  batch = partitioning.tree_bytes_per_device(
    trainer.batch_abstract, {k: v.spec for k, v in trainer.batch_shardings.items()}, mesh.shape
  )
  return dict(
    peak=profiling.compiled_memory(compiled),
    state=m.argument_size_in_bytes - batch,
    batch=batch,
    temp=m.temp_size_in_bytes,
    mesh=dict(mesh.shape),
    device=devices[0].device_kind,
    attention=attention.decisions(),
    seconds=time.perf_counter() - t0,
    kernels=hlo.kernels(compiled.as_text()) if kernels else None,
  )


@errors.one_line()  # bad input: one line, no traceback
def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if FLAGS.cases == (FLAGS.config is not None):
    raise app.UsageError('give one of --config or --cases')
  from planning import candidates

  if FLAGS.config is not None and FLAGS.accum:
    name = config_flags.get_config_filename(FLAGS['config'])
    runs = []
    for steps in FLAGS.accum:
      config = FLAGS.config.copy_and_resolve_references()
      config.grad_accum_steps = int(steps)
      runs.append((f'{name} accum {steps}', config, None, None))
  elif FLAGS.config is not None:
    runs = [(config_flags.get_config_filename(FLAGS['config']), FLAGS.config, None, None)]
  else:
    runs = []
    for name, (path, overrides, _, _) in CASES.items():
      config = candidates.load_module(path).get_config(None)
      config.update_from_flattened_dict(overrides)
      runs.append((name, config, *CASES[name][2:]))
  h100 = FLAGS.target == 'h100_sxm'  # the measured columns are an H100's
  rows = [
    ('case', 'mesh', 'peak', 'state', 'batch', 'temporaries')
    + (('torch peer (H100)', 'ours then (H100)') if h100 else ())
    + ('s',)
    + (('kernels', 'traffic') if FLAGS.kernels is not None else ())
  ]
  import models  # noqa: F401  (it and training register the choices of the fields they own: schema.check)
  import training  # noqa: F401

  for name, config, torch_peak, then in runs:
    schema.check(config)  # before compiling
    r = compile_for(
      config,
      FLAGS.target,
      FLAGS.devices if FLAGS.config is not None else (FLAGS.devices or 1),
      kernels=FLAGS.kernels is not None,
    )
    summary = hlo.kernel_summary(r['kernels']) if r.get('kernels') is not None else None
    gib = lambda b: f'{b / GiB:.2f} GiB'
    measured = ('-' if torch_peak is None else f'{torch_peak:.2f} GiB', '-' if then is None else f'{then:.2f} GiB')
    figures = (
      (gib(r['peak']), gib(r['state']), gib(r['batch']), gib(r['temp']))
      if 'over' not in r
      else ('over', '-', '-', r['over'].split(': ', 1)[-1])
    )  # the compiler's own words: what it needed, what there is
    rows.append(
      (name, 'x'.join(f'{k}={v}' for k, v in r['mesh'].items() if v > 1) or '1 device', *figures)
      + (measured if h100 else ())
      + (f'{r["seconds"]:.0f}',)
      + (
        (str(summary['total'][0]), f'{summary["total"][1] / 1e9:.1f} GB')
        if summary
        else ('-', '-')
        if FLAGS.kernels is not None
        else ()
      )
    )
    print(' | '.join(rows[-1]), flush=True)
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  print(f'\nper device, compiled for {r["device"]} ({FLAGS.target}), nothing run:')
  print('\n'.join('  '.join(c.rjust(w) for c, w in zip(row, widths)) for row in rows))
  for d in r['attention']:
    print(f'attention: {d}')
  if FLAGS.config is not None and r.get('kernels'):
    print_kernels(r['kernels'], FLAGS.kernels)


def print_kernels(kernels: list, top: int) -> None:
  """Kernels per step and the bytes they move, by kind, then the `top` that move the most."""
  print('\nkernels of one step (bytes: operands read and results written, per device; loops times their trips):')
  for kind, (n, b) in hlo.kernel_summary(kernels).items():
    print(f'  {kind:>16}  {n:6d} kernels  {b / 1e9:8.2f} GB')
  for k in sorted(kernels, key=lambda k: -k.bytes * k.times)[:top]:
    print(f'  {k.bytes * k.times / 1e9:8.3f} GB  {k.kind:>12}  x{k.times:<3d} {k.name}  {k.op_name[:100]}')


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line too
