r"""Bytes per step that cross DCN: a pipeline across hosts against FSDP across hosts (docs/pipelines.md).

  python benchmarks/pipeline_dcn.py                       # Llama-3-8B-shaped, 64 devices over 8 hosts
  python benchmarks/pipeline_dcn.py --layers 8 --batch 64 # fewer layers (same per-layer shapes), quicker
  python benchmarks/pipeline_dcn.py --plans pipeline --repeats 2   # the circular schedule

Both plans are the Llama config's presets on 64 simulated CPU devices, 8 to a host (config.dcn_mesh: a host is
a contiguous block of 8 devices), scanned layers, bf16 compute, full remat; the train step is built and compiled
abstractly as train.py's --dry_run and the plan search do (nothing allocated):
  pipeline   rules 'pp': stage=8 across hosts x fsdp=8 within each (each host holds 1/8 of the layers)
  fsdp       rules 'fsdp': fsdp=64, 8 across hosts x 8 within each
Printed per plan: every collective whose group spans hosts, with its runs per step (loop trip counts), result
bytes per device over the step and bytes each device sends (ring algorithms, planning/cost.MOVED).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import partitioning  # noqa: E402

HOSTS, PER_HOST = 8, 8


def plans(microbatches: int) -> dict:
  return {
    'pipeline': ('pp', dict(stage=1, data=1, fsdp=8, tensor=1), dict(stage=8), microbatches),
    'fsdp': ('fsdp', dict(data=1, fsdp=8, tensor=1), dict(fsdp=8), 1),
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--layers', type=int, default=32, help='Llama-3-8B has 32; fewer keep its per-layer shapes')
  p.add_argument('--batch', type=int, default=128, help='global batch rows (micro-batch rows must divide by fsdp)')
  p.add_argument('--seq_len', type=int, default=2048)
  p.add_argument('--microbatches', type=int, default=16)
  p.add_argument('--repeats', type=int, default=1, help='> 1: the circular schedule')
  p.add_argument('--plans', default='pipeline,fsdp')
  args = p.parse_args()
  partitioning.simulate_cpu_devices(HOSTS * PER_HOST)

  import jax

  import models
  import training
  from configs import llama
  from partitioning import hlo
  from planning import cost

  for name in args.plans.split(','):
    preset, mesh_cfg, dcn_cfg, micro = plans(args.microbatches)[name]
    c = llama.get_config(f'{preset},llama3_8b')
    c.model.update(num_layers=args.layers, scan_layers=True, dtype='bfloat16', remat='full')
    c.dataset.seq_len = args.seq_len
    c.batch_size = args.batch
    c.pipeline.update(microbatches=micro, repeats=args.repeats if name == 'pipeline' else 1)
    c.mesh = mesh_cfg
    c.dcn_mesh = {a: dcn_cfg.get(a, 1) for a in mesh_cfg}
    mesh = partitioning.make_mesh(c.mesh, jax.devices(), dcn_cfg=c.dcn_mesh)
    trainer = training.build(c, mesh, lambda rngs, c=c: models.create(c.model, rngs))
    t0 = time.perf_counter()
    compiled = training.compile_step(trainer, training.jit_train_step(trainer))
    secs = time.perf_counter() - t0
    host = partitioning.dcn_coordinates(mesh, c.dcn_mesh)
    text = compiled.as_text()
    per_op: dict[str, list[float]] = {}
    for col in hlo.collectives(text, mesh.size):
      if hlo.hosts_spanned(col.groups, lambda i: host[i]) > 1:
        s = per_op.setdefault(f'{col.op} over {"+".join(hlo.mesh_axes(col.groups, dict(mesh.shape)))}', [0, 0, 0])
        s[0] += col.times
        s[1] += col.times * col.bytes
        s[2] += col.times * col.bytes * cost.MOVED[col.op](col.group_size)
    total_result = sum(v[1] for v in per_op.values())
    total_sent = sum(v[2] for v in per_op.values())
    print(
      f'\n{name}: mesh {dict(mesh.shape)}, {partitioning.describe_dcn(mesh, c.dcn_mesh)}; '
      f'{args.layers} layers, batch {args.batch} x {args.seq_len}; compiled in {secs:.0f}s'
      + (f'; {trainer.pipeline.describe()}' if trainer.pipeline else '')
    )
    for op, (runs, result, sent) in sorted(per_op.items()):
      print(f'  {op:40s} runs {runs:6.0f}  result {result / 2**30:9.3f} GiB  sent {sent / 2**30:9.3f} GiB per device')
    print(
      f'  crossing DCN per step: {total_result / 2**30:.3f} GiB of results, {total_sent / 2**30:.3f} GiB sent per '
      f'device, {total_sent * mesh.size / 2**30:.1f} GiB by all {mesh.size} devices'
    )


if __name__ == '__main__':
  main()
