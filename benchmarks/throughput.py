r"""Throughput of the exact train step train.py runs, optionally beside the same model in PyTorch.

  python benchmarks/throughput.py --config configs/gpt2.py --peer torch
  python benchmarks/throughput.py --config configs/llama.py --config.batch_size=8 --peer torch
  python benchmarks/throughput.py --config configs/vit.py --config.batch_size=256 --config.model.attention=xla
  python benchmarks/throughput.py --config configs/gpt2.py:tiny --steps 3 --warmup 1     # CPU smoke test

Same build and jit as train.py (training.build + jit_train_step, compiled ahead of time), on one
synthetic batch of the config's global batch size (the task's fields: random tokens / images, one
document per row). On GPUs/TPUs the config's mesh is fitted to the devices found (as train.py does);
on CPU it runs on simulated devices. Prints one table: median step time over --steps after --warmup,
tokens/s or examples/s, TFLOP/s per device and MFU (model FLOPs from the model's matmuls: the PaLM
count and the causal-correct one, training/flops.py), peak device memory, compile time.

--peer torch runs the same architecture in PyTorch (transformers / torchvision, torch.compile, bf16
autocast, SDPA, fused AdamW or SGD) on the same batch in a child process (benchmarks/torch_peer.py),
before JAX takes the GPU, and prints the ratio; where torch is missing, and on TPUs, it says so and goes on.
--profile DIR captures a jax.profiler trace of 3 steps and prints the costliest device ops.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import errors  # noqa: E402
import models  # noqa: E402
import partitioning  # noqa: E402
import training  # noqa: E402
from configs import cli, schema  # noqa: E402
from models import attention, layers  # noqa: E402
from training import flops, profiling  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/gpt2.py[:preset].', lock_config=True)
flags.DEFINE_integer('steps', 15, 'Timed steps (the median is reported).')
flags.DEFINE_integer('warmup', 5, 'Untimed steps first (clocks up, autotuning, allocator).')
flags.DEFINE_enum(
  'timing',
  'pipelined',
  profiling.TIMINGS,
  'pipelined: the host dispatches each step while the '
  'device runs the one before, as train.py does (and as the torch peer is timed); blocking: wait for '
  "each step before dispatching the next (the host's dispatch counts in the step).",
)
flags.DEFINE_enum('peer', 'none', ['none', 'torch'], 'Also run the same model in PyTorch and print the ratio.')
flags.DEFINE_bool('peer_compile', True, 'torch.compile the peer (off: eager, for CPU smoke tests).')
flags.DEFINE_float('peak_tflops', None, 'Peak TFLOP/s per device for MFU (default: from the device kind).')
flags.DEFINE_string('profile', None, 'Capture a profile of 3 steps into this directory and list the top ops.')
flags.DEFINE_string('out', None, 'Also write the results as JSON here.')
flags.DEFINE_enum(
  'logsumexp',
  'auto',
  training.xent.LOGSUMEXP_CHOICES,
  "The loss's log-sum-exp: auto (one pass over the logits on GPUs, two elsewhere), or one / two passes on any device.",
)
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'torch_peer.py')


def peer_spec(config, device: str) -> dict:
  """What benchmarks/torch_peer.py needs to build the same model and optimizer."""
  m = config.model
  # The peer's only recomputation is whole layers (HF gradient checkpointing): for our policies that rerun
  # matmuls ('full', 'attention'); 'dots' reruns none, nor does the peer without it (the same work, not the same
  # memory: docs/performance.md).
  policy = layers.remat_policy(m.get('remat'))  # None: a family without a layer stack
  spec = dict(
    family=m.name,
    task=config.task,
    optim=config.optim.to_dict(),
    remat=policy in ('full', 'attention'),
    remat_policy=policy,
    dtype=m.dtype,
    steps=FLAGS.steps,
    warmup=FLAGS.warmup,
    compile=FLAGS.peer_compile,
    device=device,
    grad_accum_steps=config.grad_accum_steps,  # the same micro-batches: the same work per step
  )
  if m.name == 'resnet':
    spec['resnet'] = dict(
      block=m.block,
      stage_sizes=list(m.stage_sizes),
      width=m.width,
      num_classes=m.num_classes,
      stride_in_1x1=m.stride_in_1x1,
    )
  elif (family := models.HF_FAMILIES.get(m.name)) and family.to_config:  # the config.json an export writes
    spec['hf_config'] = family.to_config(m)
  else:
    return {}
  if m.get('num_experts'):  # the zoo's router losses, added to the peer's loss from its router logits
    spec['moe_aux'] = [m.top_k, m.aux_loss_weight, m.router_z_loss_weight]
  return spec


def peer_device() -> tuple[str | None, str]:
  """Where the torch peer runs: beside JAX's accelerator, an NVIDIA GPU ('cuda'); on the CPU where JAX runs on
  one (CI's smoke test); (None, why) on a TPU, where a CPU peer would be no comparison."""
  on_cpu = os.environ.get('JAX_PLATFORMS', '') == 'cpu'
  present = None if on_cpu else partitioning.accelerator_present()
  if present == 'tpu':
    return None, 'no PyTorch peer on TPUs: the peer is torch.compile on a CUDA GPU, or on the CPU beside a CPU run'
  return ('cuda' if present == 'gpu' else 'cpu'), ''


def run_peer(config, batch: dict[str, np.ndarray], device: str) -> dict:
  """Runs the torch peer in a child process on `batch`; {'ok': False, 'reason': ...} when it cannot."""
  spec = peer_spec(config, device)
  if not spec:
    return {'ok': False, 'reason': f'no PyTorch peer for model {config.model.name!r}'}
  with tempfile.TemporaryDirectory() as tmp:
    paths = {k: os.path.join(tmp, f) for k, f in (('spec', 'spec.json'), ('batch', 'batch.npz'), ('out', 'out.json'))}
    with open(paths['spec'], 'w') as f:
      json.dump(spec, f)
    np.savez(paths['batch'], **batch)
    r = subprocess.run(
      [sys.executable, PEER, '--spec', paths['spec'], '--batch', paths['batch'], '--out', paths['out']],
      capture_output=True,
      text=True,
    )
    if not os.path.exists(paths['out']):
      return {'ok': False, 'reason': f'peer exited {r.returncode}: {(r.stderr or r.stdout)[-800:]}'}
    with open(paths['out']) as f:
      return json.load(f)


def fmt_bytes(b: int | None) -> str:
  return '-' if b is None else partitioning.fmt_bytes(b)


@errors.one_line()  # bad input: one line, no traceback
def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  config = FLAGS.config
  if config is None:
    raise app.UsageError('--config is required, e.g. --config configs/gpt2.py')
  schema.check(config)  # every field's type and range, before anything is built
  if FLAGS.steps < 1 or FLAGS.warmup < 0:
    raise errors.ConfigError(
      f'--steps={FLAGS.steps} --warmup={FLAGS.warmup}: need at least 1 timed step and no negative warm-up'
    )
  if FLAGS.out and (os.path.isdir(FLAGS.out) or not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.out)))):
    raise errors.ConfigError(f'--out {FLAGS.out!r}: give a file path in an existing directory')
  task = training.tasks.get(config.task)
  batch_np = task.synthetic_batch(config, seed=config.seed)  # numpy: JAX has not touched a device yet
  unit = task.unit
  units_per_step = int(np.prod(batch_np[task.unit_field].shape))

  # --- The peer first: JAX would take most of the GPU's memory once its backend starts ---------------
  peer = None
  if FLAGS.peer == 'torch':
    device, why = peer_device()
    if device is None:
      peer = {'ok': False, 'reason': why}
    else:
      print(f'running the PyTorch peer ({device}) ...', flush=True)
      peer = run_peer(config, batch_np, device)

  # --- Our step, exactly as train.py builds it --------------------------------------------------------
  mesh, note = partitioning.start_mesh(config.mesh)
  if note:
    print(note)
  phases, t0 = {}, time.perf_counter()

  def phase(name):  # seconds since the last phase ended
    nonlocal t0
    phases[name], t0 = time.perf_counter() - t0, time.perf_counter()

  trainer = training.build(config, mesh, lambda rngs: models.create(config.model, rngs, config.lora))
  phase('build')
  with training.xent.logsumexp_passes(FLAGS.logsumexp):
    step = training.compile_step(trainer, training.jit_train_step(trainer))
  phase('compile step')
  profiling.check_fits({'train step': step}, jax.devices()[0], config)  # as train.py: before allocating the state
  compile_s = phases['compile step']
  step_flops = flops.step_flops(trainer)
  phase('count FLOPs')
  state = jax.block_until_ready(training.init_state(trainer))
  phase('init state')
  batch = partitioning.shard(batch_np, trainer.batch_shardings)
  state, times, dispatch = profiling.time_steps(
    step, state, batch, warmup=FLAGS.warmup, steps=FLAGS.steps, timing=FLAGS.timing
  )
  phase('timed steps')
  step_s = statistics.median(times)
  device = jax.devices()[0]
  peak, peak_from = flops.describe_peak(device, FLAGS.peak_tflops)
  n = jax.device_count()
  ours = dict(
    step_s=step_s,
    units_per_s=units_per_step / step_s,
    tflops=step_flops.per_device_tflops(step_s, n),
    tflops_palm=step_flops.per_device_tflops(step_s, n, causal=False),
    peak_memory=profiling.peak_memory(device),
    compiled_memory=profiling.compiled_memory(step),
    compile_s=compile_s,
    step_times=times,
    phases=phases,
    timing=FLAGS.timing,
    dispatch_s=statistics.median(dispatch),
  )
  if FLAGS.profile:
    tracer = profiling.StepProfiler(FLAGS.profile, first=1, num=3)
    for i in range(1, 4):
      tracer.before(i)
      state, _ = step(state, batch)
      tracer.after(i, state)

  # --- Report -----------------------------------------------------------------------------------------
  m = config.model
  print(
    f'\n{m.name} ({config.size}, {training.num_params(trainer):,} params), global batch '
    f'{config.batch_size}'
    + (f' in {config.grad_accum_steps} micro-batches' if config.grad_accum_steps > 1 else '')
    + f', {units_per_step:,} {unit}/step, mesh {dict(mesh.shape)} on {n} {device.device_kind}'
  )
  print(
    f'model: dtype {m.dtype}, params {m.param_dtype}'
    + ''.join(f', {k}={m[k]}' for k in ('scan_layers', 'remat', 'logits_dtype') if k in m)  # the family's options
    + (f', loss in {m.loss_chunks} chunks' if 'loss_chunks' in m and m.loss_chunks > 1 else '')
    + f'; optimizer {config.optim.name}'
  )
  for d in attention.decisions():
    print(f'attention: {d}')
  if task.unit == 'tokens' or FLAGS.logsumexp != 'auto':
    print('loss: log-sum-exp ' + training.xent.LOGSUMEXP_SAID[FLAGS.logsumexp])
  print('seconds: ' + ', '.join(f'{k} {v:.1f}' for k, v in phases.items()))
  print(
    f'timing: {FLAGS.timing}, median of {FLAGS.steps} steps after {FLAGS.warmup}; the host dispatches a step in '
    f'{1e3 * ours["dispatch_s"]:.2f} ms ({100 * ours["dispatch_s"] / step_s:.0f}% of the step: '
    + ('the host keeps up' if ours['dispatch_s'] < 0.8 * step_s else 'host-bound')
    + ')'
  )
  print(
    f'FLOPs/step: {step_flops.causal / 1e12:.3f} T causal-correct, {step_flops.palm / 1e12:.3f} T PaLM count; '
    f'peak: {peak_from}'
  )
  mfu = lambda tflops: '-' if peak is None else f'{100 * tflops / peak:.1f}%'
  rows = [
    ('', 'step (ms)', f'{unit}/s', 'TFLOP/s/dev', 'MFU', 'MFU (PaLM)', 'peak mem', 'compile (s)'),
    (
      'shardzoo',
      f'{1e3 * step_s:.1f}',
      f'{ours["units_per_s"]:,.0f}',
      f'{ours["tflops"]:.1f}',
      mfu(ours['tflops']),
      mfu(ours['tflops_palm']),
      fmt_bytes(ours['peak_memory'])
      + ('' if ours['peak_memory'] else f' (compiled {fmt_bytes(ours["compiled_memory"])})'),
      f'{compile_s:.1f}',
    ),
  ]
  if peer is not None and peer.get('ok'):
    ps = peer['step_time_s']
    tf = step_flops.per_device_tflops(ps, 1)
    rows.append(
      (
        f'torch{"" if peer.get("compiled") else " (eager)"}',
        f'{1e3 * ps:.1f}',
        f'{units_per_step / ps:,.0f}',
        f'{tf:.1f}',
        mfu(tf),
        mfu(step_flops.per_device_tflops(ps, 1, False)),
        fmt_bytes(peer.get('peak_memory_bytes')),
        f'{peer.get("first_step_s", 0):.1f}',
      )
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  print()
  for r in rows:
    print('  '.join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
  if peer is not None:
    if peer.get('ok'):
      ratio = (units_per_step / step_s) / (units_per_step / peer['step_time_s']) * (1 if n == 1 else 1 / n)
      print(
        f'\nratio shardzoo / torch: {ratio:.2f}x {unit}/s'
        + (f' (per device; ours on {n} devices)' if n > 1 else '')
        + (f'; peer notes: {"; ".join(peer["notes"])}' if peer.get('notes') else '')
      )
      ours['ratio'] = ratio
    else:
      print(f'\ntorch peer skipped: {peer.get("reason")}')
  if FLAGS.profile:
    print(f'\nprofile of 3 steps in {FLAGS.profile} (TensorBoard profile plugin, or the perfetto trace):')
    ops = profiling.top_ops(FLAGS.profile, k=None)
    for name, ms, count in ops[:20]:
      print(f'  {ms / 3:9.2f} ms/step  x{count / 3:<5g} {name[:110]}')
    print('by kind:')
    for kind, ms, count in profiling.op_kinds(ops):
      print(f'  {ms / 3:9.2f} ms/step  x{count / 3:<5g} {kind}')
    t = ours['device_time'] = profiling.device_time(FLAGS.profile)
    print(
      f'device busy {t["busy"] / 3:.2f} of {t["span"] / 3:.2f} ms/step (idle {t["idle"] / 3:.2f}: gaps between '
      f'ops, host work); {t["ops"] / 3:g} ops/step, {t["short"] / 3:g} shorter than 5 us '
      f'({t["short_ms"] / 3:.2f} ms)'
    )
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump(
        dict(
          config=config.to_json(),
          ours=ours,
          peer=peer,
          flops=vars(step_flops),
          attention=attention.decisions(),
          logsumexp=FLAGS.logsumexp,
          device=device.device_kind,
        ),
        f,
        indent=1,
        default=str,
      )


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)  # a bad --config is one line too
