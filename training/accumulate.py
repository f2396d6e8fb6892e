"""Gradient accumulation: one optimizer step's global batch run as `steps` micro-batches in a `lax.scan`.

The result is the big step's: per micro-batch the task gives *sums* (loss, hits, weight, as `Task.metric_sums`),
and the gradient of the loss sum is divided by the weight of the whole global batch (every token or example that
counts: masks, padding and packing included), so the update equals the one of the unsplit batch. Auxiliary losses
(`aux/aux_loss`, MoE) are means over a micro-batch's tokens; they enter with weight 1/steps, the mean over equal
micro-batches: exact for token means (the router z-loss, the dropped fraction), not for a product of two means
(the load-balancing loss E * sum_e f_e p_e, whose average over micro-batches is what MaxText and PyTorch
trainers optimise too). BatchNorm normalises each micro-batch by its own statistics and updates its running
averages once per micro-batch, in order, as PyTorch does under accumulation.

Nothing moves to split the batch: micro-batch i is rows i, i + steps, i + 2 steps, ... (MaxText's strided
split), so under any 'batch' rule every device keeps the rows it holds. The accumulator is float32 and
constrained to the parameters' shardings (reduce-scattered under FSDP, never replicated). Under FSDP each
micro-batch gathers the weights again (least memory); `gather_once` gathers them once before the scan instead
(more memory: the full weights over the batch axes stay alive, fewer collectives).

`gradients` takes any function of (params, model state, micro-batch) -> (sums, model state), so a pipelined
or otherwise wrapped forward composes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from errors import ConfigError
from partitioning import entry_axes, fmt_bytes, hlo

SumsFn = Callable[[Any, Any, dict], tuple[dict, Any]]  # (params, model state, batch) -> (metric sums, model state)
AUX_LOSS = 'aux/aux_loss'


def check(batch_size: int, steps: int, shards: int) -> None:
  """Each micro-batch must split evenly over the batch's shards: batch_size % (steps * shards) == 0."""
  if steps > 1 and batch_size % (steps * shards):
    raise ConfigError(
      f'config.batch_size={batch_size} is not divisible by config.grad_accum_steps={steps} x the {shards} batch '
      f'shards ({steps * shards}): each micro-batch of batch_size / grad_accum_steps rows is split over the shards'
    )


def split(batch: Mapping[str, jax.Array], steps: int) -> dict[str, jax.Array]:
  """[B, ...] -> [steps, B / steps, ...] per field; micro-batch i is rows i, i + steps, i + 2 steps, ..."""
  return {k: v.reshape(v.shape[0] // steps, steps, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}


def stacked(shardings: Mapping[str, NamedSharding]) -> dict[str, NamedSharding]:
  """The shardings of `split`'s output: an unsharded leading micro-batch axis before each field's own."""
  return {k: NamedSharding(s.mesh, PartitionSpec(None, *s.spec)) for k, s in shardings.items()}


def without_axes(shardings: Any, axes: set[str]) -> Any:
  """`shardings` (a tree of NamedSharding) with the mesh axes `axes` dropped: replicated over them."""

  def one(s: NamedSharding) -> NamedSharding:
    keep = [tuple(a for a in entry_axes(e) if a not in axes) for e in s.spec]
    return NamedSharding(s.mesh, PartitionSpec(*(e if len(e) > 1 else (e[0] if e else None) for e in keep)))

  return jax.tree.map(one, shardings)


def batch_axes(shardings: Mapping[str, NamedSharding]) -> set[str]:
  """The mesh axes any batch field's leading (rows) dimension is sharded over."""
  return {a for s in shardings.values() if len(s.spec) for a in entry_axes(s.spec[0])}


def _objective(sums: dict, weight: jax.Array, steps: int) -> jax.Array:
  """What one micro-batch adds to the step's loss: its loss sum over the global weight, its aux loss / steps."""
  loss = sums['loss_sum'] / jnp.maximum(weight, 1.0)
  return loss + sums[AUX_LOSS] / steps if AUX_LOSS in sums else loss


def metrics_of(sums: dict, steps: int) -> dict[str, jax.Array]:
  """The task's logged metrics from the summed micro-batch sums: loss and accuracy over the global weight,
  aux entries averaged over micro-batches. With steps=1, exactly `Task.loss`'s metrics."""
  w = jnp.maximum(sums['weight'], 1.0)
  aux = {k[4:]: v / steps for k, v in sums.items() if k.startswith('aux/')}
  return {'loss': sums['loss_sum'] / w, 'accuracy': sums['correct_sum'] / w, **aux}


def gradients(
  sums_fn: SumsFn,
  params: Any,
  model_state: Any,
  batch: dict[str, jax.Array],
  *,
  steps: int,
  param_shardings: Any,
  batch_shardings: Mapping[str, NamedSharding],
  gather_once: bool = False,
) -> tuple[Any, dict[str, jax.Array], Any]:
  """(gradients of the global batch's loss, its metrics, the new model state), from `steps` micro-batches.

  Trace inside jit. Gradients come back in `param_shardings`, in each parameter's dtype (accumulated in
  float32). With steps=1 this is one value_and_grad of the whole batch and nothing more."""

  def objective(p, state, micro, weight):
    sums, state = sums_fn(p, state, micro)
    return _objective(sums, sums['weight'] if weight is None else weight, steps), (sums, state)

  grad = jax.value_and_grad(objective, has_aux=True)
  if steps == 1:
    (_, (sums, model_state)), grads = grad(params, model_state, batch, None)
    return jax.tree.map(jax.lax.with_sharding_constraint, grads, param_shardings), metrics_of(sums, 1), model_state

  # The global batch's weight comes first: each micro-batch's loss sum is divided by it, which keeps the aux
  # losses at weight 1/steps. It depends only on the batch (masks), so XLA drops the forward pass traced here.
  total, _ = sums_fn(params, model_state, batch)
  weight = total['weight']
  zeros = {k: jnp.zeros(v.shape, jnp.float32) for k, v in total.items()}
  micro = jax.tree.map(jax.lax.with_sharding_constraint, split(batch, steps), stacked(batch_shardings))
  if gather_once:  # full weights over the batch axes, gathered before the loop and kept through it
    gathered = without_axes(param_shardings, batch_axes(batch_shardings))
    params = jax.tree.map(jax.lax.with_sharding_constraint, params, gathered)

  def body(carry, micro):
    acc, sums, state = carry
    micro = jax.tree.map(jax.lax.with_sharding_constraint, micro, dict(batch_shardings))
    # Tied to the micro-batch, the weights are not loop-invariant: XLA cannot hoist their gathers out of the
    # loop (which would keep every gathered weight alive through it) unless gather_once asks for that.
    p, micro = (params, micro) if gather_once else jax.lax.optimization_barrier((params, micro))
    (_, (s, state)), g = grad(p, state, micro, weight)
    acc = jax.tree.map(
      lambda a, g, sh: jax.lax.with_sharding_constraint(a + g.astype(jnp.float32), sh), acc, g, param_shardings
    )
    sums = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), sums, s)
    return (acc, sums, state), None

  acc = jax.tree.map(
    lambda p, sh: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), sh), params, param_shardings
  )
  (acc, sums, model_state), _ = jax.lax.scan(body, (acc, zeros, model_state), micro)
  sums['weight'] = weight  # the same number, summed once rather than over micro-batches
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc, params)
  return grads, metrics_of(sums, steps), model_state


def per_step_collectives(hlo_text: str, num_devices: int) -> dict[str, tuple[int, int]]:
  """{op: (runs, result bytes per device)} of one step of a compiled program: a collective in the micro-batch
  loop counted once per micro-batch (the audit's static counts take a loop body once)."""
  out: dict[str, tuple[int, int]] = {}
  for c in hlo.collectives(hlo_text, num_devices):
    runs, nbytes = out.get(c.op, (0, 0))
    out[c.op] = (runs + c.times, nbytes + c.times * c.bytes)
  return dict(sorted(out.items()))


def describe(hlo_text: str, num_devices: int, config: Any) -> str:
  """One line for the run's log: the collectives of one optimizer step, and what the other gathering choice
  would gather (an estimate from this program: weights gathered in the loop once per micro-batch, or before it)."""
  steps, gather_once = config.grad_accum_steps, config.accum_gather_once
  stats = per_step_collectives(hlo_text, num_devices)
  text = ', '.join(f'{op} x{n} ({fmt_bytes(b)})' for op, (n, b) in stats.items()) or 'none'
  gathers = [c for c in hlo.collectives(hlo_text, num_devices) if c.op == 'all-gather']
  in_loop = sum(c.bytes for c in gathers if c.times >= steps)
  outside = sum(c.bytes * c.times for c in gathers if c.times < steps)
  if gather_once:
    other = f'config.accum_gather_once=False would gather about {fmt_bytes(steps * outside + in_loop)} (less memory)'
  else:
    other = f'config.accum_gather_once=True would gather about {fmt_bytes(in_loop + outside)} (more memory)'
  return f'{steps} micro-batches; collectives per optimizer step: {text}; {other}'
