"""Pipeline parallelism as a rule: ('layers', 'stage') cuts a stacked (scanned) layer stack into stages.

Each device along the 'stage' mesh axis holds a contiguous 1/S of the stack (the rule shards the stacked
'layers' dimension like any other). The batch is split into M micro-batches (micro-batch i = rows i, i + M,
i + 2M, ...: every device keeps the rows it holds) that flow through the stages. One iteration runs every stage
at once: a `vmap` over a [stages, micro-batch, ...] buffer whose stage dimension is sharded over 'stage'
(`spmd_axis_name`), then the buffer moves one stage on, a roll of that dimension that XLA compiles to a
collective-permute. A scan runs R x M + S - 1 iterations; the S - 1 extra ones are the bubble, where some stages
compute on nothing. The backward pass is autodiff of the scan (the transposed roll is a permute the other way).
A layer may return scalars beside x (a mixture of experts' load-balancing and z-losses): each stage sums its
layers' per iteration, the bubble's iterations count zero, and the sums over stages and iterations, divided by M,
come back with the output (the mean over micro-batches, as gradient accumulation takes it), gradients included.

Schedules: GPipe (repeats R = 1) and circular (R > 1): the stack is cut into R x S virtual stages of
N / (R S) layers, virtual stage v on device v mod S, so a micro-batch goes round the devices R times and the
bubble shrinks to (S - 1) / (R M + S - 1). The stack stays stored contiguously (the same parameter layout as
any other rule, so checkpoints move between layouts unchanged): each step first re-lays it into the circular
order, an all-to-all over 'stage' of the weights (and of their gradients after the backward).

Everything outside the stack (embeddings, heads, the loss) is ordinary SPMD, where a rule may give 'stage' to
'batch' as one more batch axis. Inside the pipeline the rules are the active ones with 'stage' taken out: the
stage dimension is the vmapped one. The remat policy applies per stage iteration (one stage's layers on one
micro-batch). This module never imports a model: it runs a function of (one layer's weights, x, *args).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import ConfigError
from partitioning.rules import AxisRules, entry_axes
from partitioning.shard import active_context, logical_spec, use_rules

STAGE = 'stage'  # the mesh axis a pipeline's stages lie along


@dataclasses.dataclass(frozen=True)
class Schedule:
  """S stages, M micro-batches, R repeats (1: GPipe; > 1: circular)."""

  stages: int
  microbatches: int
  repeats: int = 1

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of stage iterations that compute on nothing: (S - 1) / (R M + S - 1)."""
    return (self.stages - 1) / self.iterations

  def describe(self) -> str:
    kind = 'GPipe' if self.repeats == 1 else f'circular, {self.repeats} repeats'
    return (
      f'pipeline: {self.stages} stages x {self.microbatches} micro-batches ({kind}), {self.iterations} iterations, '
      f'bubble {self.bubble:.1%}'
    )


def stages_of(rules: AxisRules, mesh_shape: dict[str, int]) -> int:
  """How many stages the rules cut a stacked 'layers' dimension into: the 'stage' axis size where the first
  rule for 'layers' names it, else 1."""
  spec = rules.spec(('layers',)) if 'layers' in rules.logical_names else P()
  return mesh_shape.get(STAGE, 1) if spec and STAGE in entry_axes(spec[0]) else 1


def schedule(
  rules: AxisRules,
  mesh_shape: dict[str, int],
  *,
  microbatches: int,
  repeats: int,
  scan_layers: bool,
  num_layers: int | None,
  batch_size: int,
  dense_first: int | None = None,
) -> Schedule | None:
  """The pipeline a config asks for (None where no rule maps 'layers' to a 'stage' axis of size > 1), checked
  against the config's numbers (config.pipeline.*, config.model.scan_layers, num_layers and first_dense_layers,
  config.batch_size) before anything is built: one ConfigError naming them. `dense_first`: a mixture of experts'
  dense layers first, a stack of their own that runs before the pipeline, which cuts the rest (None: a model
  without them)."""
  S = stages_of(rules, mesh_shape)
  if S == 1:
    return None
  M, R = int(microbatches), int(repeats)
  if not scan_layers:
    raise ConfigError(
      f"the rule ('layers', 'stage') pipelines a scanned layer stack over stage={S}, and config.model.scan_layers "
      'is False (unrolled layers have no stacked dimension to cut): set --config.model.scan_layers=True'
    )
  N, dense_first = num_layers, dense_first or 0
  if N is not None and (N - dense_first) % (S * R):
    layers = f'config.model.num_layers={N}'
    if dense_first:
      layers += f' - first_dense_layers={dense_first} = {N - dense_first} expert layers'
    raise ConfigError(
      f"{layers} is not divisible by stage={S} x config.pipeline.repeats={R} = {S * R} (the rule ('layers', "
      f"'stage'): each of the {S * R} pipeline stages holds the same number of layers"
      + (', and the dense layers first run before the pipeline)' if dense_first else ')')
    )
  if M < S:
    raise ConfigError(
      f'config.pipeline.microbatches={M} is fewer than the {S} pipeline stages (mesh axis stage={S}): every stage '
      f'needs a micro-batch in flight; use at least {S}'
    )
  B = batch_size
  if B % M:
    raise ConfigError(
      f'config.batch_size={B} is not divisible by config.pipeline.microbatches={M} (the pipeline splits the '
      'global batch into equal micro-batches)'
    )
  return Schedule(S, M, R)


def active() -> Schedule | None:
  """The schedule of the enclosing `use_rules` (trainer steps pass it), or None: no pipeline."""
  ctx = active_context()
  return None if ctx is None else ctx.pipeline


def run(
  layer: Callable[..., Any],
  weights: Any,
  x: jax.Array,
  *args: Any,
  x_axes: Sequence[str | None],
  policy: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Applies the N stacked layers of `weights` (leading dimension N in every leaf) to x in order, as the
  pipeline of the active schedule: `layer(w, x, *args) -> (x, aux)` is one layer with its weights `w`, aux a
  dict of scalars (a mixture of experts' losses and statistics; {} for none). `x` is (B, ...) with logical axes
  `x_axes` ('batch' first); an arg with a leading batch dimension B is split into micro-batches with x, other
  args (None, broadcast rows) pass as they are. `policy`: the remat policy of one stage iteration (None: keep
  everything).

  Returns (y, aux): aux is each entry summed over the N layers and averaged over the M micro-batches, what
  gradient accumulation over the same M micro-batches gives (training/accumulate.py): equal to the whole batch's
  for means over tokens. Each stage sums its layers' aux per iteration, and the iterations of the bubble (a stage
  holding no micro-batch) count zero, so their gradient is zero too."""
  ctx = active_context()
  sched, mesh = ctx.pipeline, ctx.mesh
  S, M, R = sched.stages, sched.microbatches, sched.repeats
  N = jax.tree.leaves(weights)[0].shape[0]
  B = x.shape[0]
  if N % (S * R) or B % M:
    raise ConfigError(
      f'a pipeline of {S} stages x {R} repeats over {M} micro-batches cannot cut a stack of {N} layers and a '
      f'batch of {B} rows'
    )
  per, b = N // (S * R), B // M
  inner_rules = ctx.rules.without(STAGE)
  inner = lambda: use_rules(inner_rules, mesh, ctx.seen, ctx.balance, pipeline=None)  # the stage dim is vmapped

  def constrain(a: jax.Array, head: tuple, names: Sequence[str | None]) -> jax.Array:
    """a's leading dims `head` (mesh axes), then dims named by `names`; the rest left to XLA."""
    with inner():
      spec = logical_spec(tuple(names), a.shape[len(head) : len(head) + len(names)])
    rest = len(spec or ()) + len(head)
    return jax.lax.with_sharding_constraint(
      a, NamedSharding(mesh, P(*head, *(spec or ()), *(P.UNCONSTRAINED,) * (a.ndim - rest)))
    )

  # Weights [N, ...] -> [S, R, per, ...]: virtual stage v = r S + s (layers v per .. (v + 1) per - 1) on device s.
  # For R = 1 a reshape of the stored layout; for R > 1 an all-to-all over 'stage'.
  def lay(w):
    w = w.reshape(R, S, per, *w.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(STAGE, *(P.UNCONSTRAINED,) * (w.ndim - 1))))

  w_SR = jax.tree.map(lay, weights)

  def micro(a):  # [B, ...] -> [M, b, ...], micro-batch i = rows i, i + M, ...; every stage sees them all
    return constrain(a.reshape(b, M, *a.shape[1:]).swapaxes(0, 1), (None,), ('batch',))

  batched = [getattr(a, 'ndim', 0) > 0 and a.shape[0] == B for a in args]
  x_M = micro(x)
  args_M = [micro(a) if bt else a for a, bt in zip(args, batched)]

  def stage(w_R, x, t, s):
    """One stage's layers for the micro-batch it holds at iteration t: stage s runs item t - s. Returns its
    output and its layers' aux summed, zero in the bubble (no item: t - s outside 0 .. R M - 1)."""
    item = jnp.clip(t - s, 0, R * M - 1)
    r, m = item // M, item % M
    w_per = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, r, keepdims=False), w_R)
    a = [jax.lax.dynamic_index_in_dim(arg, m, keepdims=False) if bt else arg for arg, bt in zip(args_M, batched)]
    with inner():
      x, aux = jax.lax.scan(lambda x, w: layer(w, x, *a), x, w_per)
    held = (t - s >= 0) & (t - s < R * M)
    return x, {k: jnp.where(held, v.sum(0), 0.0) for k, v in aux.items()}

  if policy is not None:
    stage = jax.checkpoint(stage, policy=policy)
  stages = jax.vmap(stage, in_axes=(0, 0, None, 0), spmd_axis_name=STAGE)
  stage_ids = jnp.arange(S)

  # Stage 0 reads micro-batch t mod M from its row of `store` at iteration t: the inputs at first, put there
  # before the loop (the rows of the other stages stay zero), so no iteration reads a value every stage holds (its
  # gradient would be summed over the stages every iteration). Circular: the last stage's output of micro-batch
  # (t - S) mod M reaches stage 0 at iteration t and is written over that input, read again at t - S + M >= t.
  first_only = (stage_ids == 0).reshape(S, *(1,) * (x_M.ndim))
  store = constrain(jnp.where(first_only, x_M[None], 0), (STAGE, None), x_axes[:1])  # [S, M, b, ...]

  def iteration(carry, t):
    prev, store = carry  # each stage's last output [S, b, ...]; stage 0's micro-batches [S, M, b, ...]
    rotated = jnp.roll(prev, 1, axis=0)  # stage s receives stage s - 1's output: a collective-permute
    if R > 1:
      back = jnp.maximum(t - S, 0) % M
      old = jax.lax.dynamic_index_in_dim(store, back, axis=1, keepdims=False)
      store = jax.lax.dynamic_update_index_in_dim(store, jnp.where(t >= S, rotated, old), back, axis=1)
    first = jax.lax.dynamic_index_in_dim(store, t % M, axis=1, keepdims=False)
    x_in = jnp.where(first_only[:, 0], first, rotated)
    x_in = constrain(x_in, (STAGE,), x_axes[:1])
    out, aux = stages(w_SR, x_in, t, stage_ids)
    # Both kept whole: picking the last stage's row (or summing aux over the stages) here would broadcast it, or
    # all-reduce it over 'stage', every iteration.
    return (out, store), (out, aux)

  buf = constrain(jnp.zeros((S, b, *x.shape[1:]), x.dtype), (STAGE,), x_axes[:1])
  _, (ys, aux) = jax.lax.scan(iteration, (buf, store), jnp.arange(sched.iterations))
  y_M = ys[sched.iterations - M :, S - 1]  # the last stage's outputs of the last repeat, in micro-batch order
  return y_M.swapaxes(0, 1).reshape(x.shape), {k: v.sum() / M for k, v in aux.items()}
