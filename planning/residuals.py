"""What a train step keeps for its backward pass, per device, read from JAX's autodiff instead of a compiler.

The plan search's memory model for a GPU/TPU target compiled on CPU. There the CPU's buffer assignment is no
guide: it reports several times a GPU's temporaries, and it does not see remat (the CPU's per-layer figures
barely change between policies that change a GPU's peak by gigabytes). What the backward needs is decided by
JAX, not by the backend: `jax.vjp`'s residuals, which the remat policies choose. So:

    est = residuals.estimate(trainer, stand_in=attention.gpu_stand_in, compiler_options=...)
    est.fused, est.written, est.largest        # bytes per device

1. The loss's forward is traced under `jax.vjp` (nested jits inlined). Its residuals are walked back through
   the operations XLA fuses into their consumers (`FUSED`: cheap elementwise arithmetic, broadcasts,
   converts, reshapes, transposes, sharding constraints, checkpoint names) to values it cannot recompute that
   way: outputs of matmuls, convolutions, custom kernels (fused attention), reductions, gathers, loops, and
   of the elementwise functions XLA's GPU fusion counts as expensive (tanh, erf, logistic, log, ...).
   Those are kept until the backward reads them: `fused`, the least a step keeps.
2. A value that a matmul, convolution or custom kernel read from memory in the forward (a library call reads
   its operands from memory, so the forward wrote it) is kept too when the backward needs it, since XLA
   reuses a written buffer rather than recompute it: `written` adds those (a LayerNorm's output, a bf16 copy
   of a weight). The truth lies between, depending on what the target's compiler fuses into its GEMMs.
3. `largest`: the backward's largest new array beside the kept values: the gradient of the largest kept value
   wider than the compute dtype (the narrowest float kept), in the compute dtype (a language model's float32
   logits: the head's backward runs in bf16), and nothing for a kept value already in the compute dtype (bf16
   logits: the compiled programs write the gradient over them).
4. Bytes per device: a function returning exactly those values is compiled on the plan's mesh (XLA's sharding
   propagation, as for the step itself; nothing runs) and each output's shard shape read.

Device memory of a step ~ its arguments (parameters, optimizer state, batch) + (fused + written) / 2 + largest.
benchmarks/memory_model.py compares it with the step compiled for one H100 where JAX's CUDA plugin is installed;
its measured error is on docs/performance.md ("Plan search").

This module imports no model: it works on a training.Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

import partitioning
import training

# Primitives XLA fuses into whatever consumes them: a backward that needs their output can recompute it
# from their inputs inside its own fusion. Not here: what XLA's GPU fusion counts as expensive and will not
# duplicate into a second consumer (tanh, erf, log, logistic, sin, pow, ...): their outputs are kept.
FUSED = frozenset(
  """
  abs add and broadcast_in_dim convert_element_type copy copy_p div eq exp exp2 expand_dims ge gt integer_pow
  iota is_finite le lt max min mul name ne neg not or reshape rsqrt select_n sharding_constraint sign sqrt
  square squeeze sub transpose xor
""".split()
)
# Primitives that read their operands from memory (library calls, custom kernels): the forward wrote those.
READS_MEMORY = frozenset(
  (
    'dot_general',
    'conv_general_dilated',
    'custom_vjp_call',
    'custom_vjp_call_jaxpr',
    'custom_jvp_call',
    'ragged_dot_general',
  )
)


@dataclasses.dataclass(frozen=True)
class Estimate:
  fused: float  # bytes per device of what the backward needs that fusion cannot recompute
  written: float  # fused + what the forward wrote to memory for a matmul/convolution/kernel and the backward reads
  largest: float  # bytes per device of the backward's largest new array beside the kept values (see `from_compiled`)

  @property
  def kept(self) -> float:
    """The estimate: the midpoint of fused and written."""
    return 0.5 * (self.fused + self.written)


def _kept_values(closed: jcore.ClosedJaxpr) -> tuple[list[Any], list[Any]]:
  """(fused, written-only) variables of a jaxpr whose outputs are the residuals."""
  jaxpr = closed.jaxpr
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  read = {
    v for e in jaxpr.eqns if e.primitive.name in READS_MEMORY for v in e.invars if not isinstance(v, jcore.Literal)
  }
  fused, written, seen = [], [], set()
  stack = [v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)]
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    eqn = producer.get(v)
    if eqn is None:  # a parameter or batch field: already in the step's arguments
      continue
    if eqn.primitive.name not in FUSED:
      fused.append(v)
      continue
    if v in read:
      written.append(v)  # kept as written: the backward reads it, not what it was made from
      continue
    stack.extend(x for x in eqn.invars if not isinstance(x, jcore.Literal))
  return fused, written


def trace(trainer: training.Trainer, stand_in: Callable[[], contextlib.AbstractContextManager] | None = None):
  """The traced (not compiled) function returning the values the backward keeps, and how many are fused-only.
  Trace in the caller's thread (attention's stand-in is a context variable); compile anywhere."""

  def residuals(params, model_state, batch):
    with partitioning.use_rules(trainer.rules, trainer.mesh, balance=trainer.balance > 1, pipeline=trainer.pipeline):
      _, vjp = jax.vjp(lambda p: training.loss_of(trainer, model_state, batch)(p)[0], params)
    return jax.tree.leaves(vjp)

  # Under gradient accumulation the backward keeps one micro-batch's values at a time.
  steps = trainer.config.grad_accum_steps
  micro = {
    k: jax.ShapeDtypeStruct((v.shape[0] // steps, *v.shape[1:]), v.dtype) for k, v in trainer.batch_abstract.items()
  }
  args = (trainer.abstract.params, trainer.abstract.model_state, micro)
  with stand_in() if stand_in else contextlib.nullcontext(), jax.disable_jit():  # nested jits inlined
    closed = jax.make_jaxpr(residuals)(*args)
  fused, written = _kept_values(closed)
  jaxpr = closed.jaxpr.replace(outvars=fused + written, debug_info=None)
  fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, closed.consts))
  shardings = jax.tree.leaves((trainer.shardings.params, trainer.shardings.model_state, trainer.batch_shardings))
  traced = jax.jit(fn, in_shardings=tuple(shardings)).trace(*jax.tree.leaves(args))
  return traced, len(fused)


def from_compiled(compiled: Any, num_fused: int) -> Estimate:
  """Bytes per device of each output of the compiled residual function (its shard shapes)."""
  sizes = []
  for aval, sharding in zip(jax.tree.leaves(compiled.out_info), compiled.output_shardings):
    shape = sharding.shard_shape(aval.shape)
    dtype = np.dtype(aval.dtype)
    sizes.append((math.prod(shape), dtype.itemsize, jnp.issubdtype(dtype, jnp.floating)))
  fused = float(sum(n * b for n, b, _ in sizes[:num_fused]))
  written = fused + float(sum(n * b for n, b, _ in sizes[num_fused:]))
  narrow = min((b for _, b, f in sizes if f), default=4)  # the compute dtype's bytes
  largest = float(max((n * narrow for n, b, f in sizes if f and b > narrow), default=0))
  return Estimate(fused, written, largest)


def estimate(trainer: training.Trainer, stand_in=None, compiler_options: dict | None = None) -> Estimate:
  traced, num_fused = trace(trainer, stand_in)
  return from_compiled(traced.lower().compile(compiler_options=compiler_options), num_fused)
