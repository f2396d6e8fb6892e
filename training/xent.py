"""Softmax cross-entropy for the tasks (training/tasks.py): its gradient written out, its reductions in one pass
over the logits on GPUs, and the language-model loss in chunks along the length (`chunked_softmax_xent`,
config.model.loss_chunks), so the (B, L, V) logits never exist in full, in the forward pass or the backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import ConfigError
from partitioning import active_mesh, logical_spec, shard_logical, suspend_rules


def loss_and_hits(logits: jax.Array, targets: jax.Array, mask: Any) -> tuple[jax.Array, jax.Array, Any]:
  """(softmax_xent, argmax == target as float32, mask): a task's per-example loss, accuracy and weight."""
  loss, argmax = _xent_and_argmax(logits, targets)
  return loss, (argmax == targets).astype(jnp.float32), mask


def softmax_xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Softmax cross-entropy of integer targets over the last axis, as optax's, with its gradient written out:
  g (softmax - one_hot(targets)) in one elementwise pass over the logits. Autodiff of optax's scatters the
  target's gradient into a zero array of the logits' shape first: one more pass over the whole logits."""
  return _xent_and_argmax(logits, targets)[0]


@jax.custom_vjp
def _xent_and_argmax(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(softmax_xent, argmax over the last axis): the accuracy's argmax comes from the loss's reduction."""
  return _softmax_xent_fwd(logits, targets)[0]


_logged: set[str] = set()  # the choices logged once per process
_lse_passes: contextvars.ContextVar[str] = contextvars.ContextVar('shardzoo_logsumexp_passes', default='auto')


def logsumexp_argmax_one_pass(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log(sum(exp(x))) in float32, argmax) over the last axis, reading x once: one reduction carries the running
  maximum, the sum of exp(x - maximum), rescaled when the maximum grows (flash attention's online softmax), and
  the maximum's first index. jax.nn.logsumexp reads x twice, the maximum first, and jnp.argmax once more (XLA
  merges the argmax into the sum's pass on the whole logits, not in the loss_chunks loop). On CPU it is less
  accurate than two passes (docs/performance.md), so softmax_xent uses it on GPUs only."""
  x = x.astype(jnp.float32)

  def combine(a, b):
    (m1, s1, i1), (m2, s2, i2) = a, b
    hi = jnp.maximum(m1, m2)
    scale = jnp.exp(jnp.where(m1 == m2, 0.0, jnp.minimum(m1, m2) - hi))  # m1 == m2 == -inf: 1, not exp(nan)
    total = jnp.where(m1 >= m2, s1 + s2 * scale, s1 * scale + s2)
    return hi, total, jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))  # ties: the first

  axis = x.ndim - 1
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
  init = (np.float32(-np.inf), np.float32(0.0), np.int32(np.iinfo(np.int32).max))
  hi, total, argmax = jax.lax.reduce((x, jnp.ones_like(x), index), init, combine, (axis,))
  return hi + jnp.log(total), argmax


LOGSUMEXP_CHOICES = ('auto', 'one', 'two')
LOGSUMEXP_SAID = {
  'auto': 'in one pass on GPUs (running maximum and sum), two passes (maximum, then sum) on other platforms',
  'one': 'in one pass (forced)',
  'two': 'in two passes (forced)',
}  # logged


@contextlib.contextmanager
def logsumexp_passes(choice: str):
  """Traces the cross-entropy's log-sum-exp (and the accuracy's argmax) with 'one' or 'two' passes over the
  logits on every platform, whatever softmax_xent would pick; 'auto' leaves the choice to it (the benchmarks'
  --logsumexp flag: throughput.py and loss_parity.py compare them on a GPU)."""
  if choice not in LOGSUMEXP_CHOICES:
    raise ValueError(f'logsumexp_passes({choice!r}): one of {LOGSUMEXP_CHOICES}')
  token = _lse_passes.set(choice)
  try:
    yield
  finally:
    _lse_passes.reset(token)


def _two_passes(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jax.nn.logsumexp(x, axis=-1), jnp.argmax(x, axis=-1).astype(jnp.int32)


def _logsumexp_argmax(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One pass over the logits on GPUs (`logsumexp_argmax_one_pass`), jax.nn.logsumexp's two and jnp.argmax
  elsewhere, decided when the step is lowered for its platform; `logsumexp_passes` forces either."""
  forced = _lse_passes.get()
  said = LOGSUMEXP_SAID[forced]
  if said not in _logged:
    _logged.add(said)
    logging.info('loss: log-sum-exp of the logits %s', said)
  if forced != 'auto':
    return logsumexp_argmax_one_pass(logits) if forced == 'one' else _two_passes(logits)
  return jax.lax.platform_dependent(
    logits, cuda=logsumexp_argmax_one_pass, rocm=logsumexp_argmax_one_pass, default=_two_passes
  )


def _softmax_xent_fwd(logits, targets):
  lse, argmax = _logsumexp_argmax(logits)
  loss = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return (loss, argmax), (logits, targets, lse)


def _softmax_xent_bwd(residuals, g):
  logits, targets, lse = residuals
  g = g[0]  # the argmax has no gradient
  hit = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1) == targets[..., None]
  dlogits = g[..., None] * (jnp.exp(logits - lse[..., None]) - hit)
  return dlogits.astype(logits.dtype), None


_xent_and_argmax.defvjp(_softmax_xent_fwd, _softmax_xent_bwd)


def check_loss_chunks(chunks: int, L: int) -> int:
  """The tokens of a row in one loss chunk, L / chunks; a length the chunks do not divide is a ConfigError."""
  if L % chunks:
    raise ConfigError(
      f'config.model.loss_chunks={chunks} does not divide the sequence length {L} '
      f'(config.dataset.seq_len): {L} tokens per row cannot be cut into {chunks} equal chunks; use a '
      f'divisor of {L}, or 0 (no chunking)'
    )
  return L // chunks


def chunked_softmax_xent(
  model: Any, x_BLD: jax.Array, targets_BL: jax.Array, weight_BL: jax.Array, weight_sum: jax.Array, chunks: int
) -> tuple[jax.Array, jax.Array]:
  """(sum of weight x float32 softmax cross-entropy, sum of weight x argmax hit) of logits `model.head(x_BLD)`,
  computed `chunks` chunks of B x L/chunks tokens at a time, so only one chunk's (B, L/chunks, V) logits exist
  at once. `weight_sum` is the caller's sum of `weight_BL` (one reduction of it serves both).

  Under differentiation each chunk's gradients are made in the forward pass (`_fused_xent`): the head's
  vjp is applied to the chunk's logit gradient right away, the head's weight gradient summed over chunks and
  the hidden states' gradient kept, both scaled by the loss's cotangent in the backward pass. The head runs
  once forward and once backward, as on the whole-logits path; nothing is recomputed.

  Chunk c holds the positions c, c + chunks, c + 2 chunks, ... of every row (a strided cut): a length sharded
  over mesh axes (context parallelism: contiguous blocks of L/n positions per device) leaves every chunk
  sharded the same way, L/(chunks n) positions per device, so the loop runs on every device at once. The batch
  keeps its sharding, and the head its own ('vocab' sharded as the rules say).

  The head's weight gradient is a sum over the batch. Where the batch is split over mesh axes the head's
  weights are not split over (data parallelism), each chunk's sum would be all-reduced inside the loop, once
  per chunk: the head's weights are instead broadcast along those axes (`_Head`: a leading dimension, one
  slice per device group, no copy across devices) and the head is vmapped over groups of the batch, so each
  device accumulates its own partial gradient through the loop and the sum over groups, one all-reduce, comes
  after it. Suffixes: C chunks, l = L / C, G groups."""
  B, L, D = x_BLD.shape
  Lc = check_loss_chunks(chunks, L)
  spec = logical_spec(('batch', 'length'), (B, L))  # None outside partitioning.use_rules
  length_axes = jax.tree.leaves(spec[1]) if spec is not None and len(spec) > 1 else []  # trailing Nones dropped
  n = math.prod(active_mesh().shape[a] for a in length_axes)
  if Lc % n:
    raise ConfigError(
      f'config.model.loss_chunks={chunks}: a chunk holds {Lc} positions of each row, which the '
      f"{n} shards of the sequence ('length' over mesh axes {', '.join(length_axes)}) do not divide; "
      f'use a loss_chunks that divides {L // n} (the positions per shard)'
    )
  act = (None, 'batch', 'length', 'embed')
  cut = lambda y_BL: shard_logical(y_BL.reshape(B, Lc, chunks).transpose(2, 0, 1), act[:3])
  x_CBlD = shard_logical(x_BLD.reshape(B, Lc, chunks, D).transpose(2, 0, 1, 3), act)
  head = _Head.of(model, B, jax.ShapeDtypeStruct((B, Lc, D), x_BLD.dtype))
  return _fused_xent(head, head.weights, x_CBlD, cut(targets_BL), cut(weight_BL.astype(jnp.float32)), weight_sum)


def _chunk_logits(head: _Head, weights: list[jax.Array], x_BlD: jax.Array) -> jax.Array:
  """One chunk's float32 logits."""
  return head.apply(weights, shard_logical(x_BlD, ('batch', 'length', 'embed'))).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_xent(head, weights, x_CBlD, t_CBl, w_CBl, total):
  """(sum of w x loss, sum of w x hit) over chunks: the forward pass alone (evaluation, no gradients)."""
  weights = head.cast(weights)

  def body(_, xs):
    x_BlD, t_Bl, w_Bl = xs
    loss_Bl, correct_Bl, _ = loss_and_hits(_chunk_logits(head, weights, x_BlD), t_Bl, None)
    return None, (loss_Bl * w_Bl, correct_Bl * w_Bl)

  return _summed(jax.lax.scan(body, None, (x_CBlD, t_CBl, w_CBl))[1])


def _summed(per_token: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The per-token sums after the chunk loop, so a sharded batch reduces them once, not once per chunk."""
  return tuple(shard_logical(y_CBl, (None, 'batch', 'length')).sum() for y_CBl in per_token)


def _fused_xent_fwd(head, weights, x_CBlD, t_CBl, w_CBl, total):
  """The sums, with each chunk's gradients of the loss sum made as the chunk is scored: softmax_xent's logit
  gradient w (softmax - one_hot(target)) through the head's vjp. They are scaled by 1 / sum(w) here and by the
  cotangent x sum(w) in the backward pass, so for the usual mean loss (cotangent 1 / sum(w)) the gradients are
  rounded as on the whole-logits path."""
  scale = 1.0 / jnp.maximum(total, 1.0)  # total: sum(w)
  narrow = head.cast(weights)  # the conversion's gradient is the identity: dw is summed in float32 below

  def body(dweights, xs):
    x_BlD, t_Bl, w_Bl = xs
    logits_BlV, vjp = jax.vjp(functools.partial(_chunk_logits, head), narrow, x_BlD)
    (loss_Bl, argmax_Bl), softmax_residuals = _softmax_xent_fwd(logits_BlV, t_Bl)
    dlogits_BlV, _ = _softmax_xent_bwd(softmax_residuals, (w_Bl * scale, None))
    dw, dx_BlD = vjp(dlogits_BlV)
    dweights = head.constrain([a + b.astype(jnp.float32) for a, b in zip(dweights, dw)])
    return dweights, (loss_Bl * w_Bl, (argmax_Bl == t_Bl).astype(jnp.float32) * w_Bl, dx_BlD)

  zeros = head.constrain([jnp.zeros(w.shape, jnp.float32) for w in weights])
  dweights, (loss_CBl, correct_CBl, dx_CBlD) = jax.lax.scan(body, zeros, (x_CBlD, t_CBl, w_CBl))
  return _summed((loss_CBl, correct_CBl)), (dweights, dx_CBlD, scale)


def _fused_xent_bwd(head, residuals, cotangents):
  dweights, dx_CBlD, scale = residuals
  g = cotangents[0] / scale  # the accuracy sum has no gradient
  dx_CBlD = (g * dx_CBlD.astype(jnp.float32)).astype(dx_CBlD.dtype)
  return [(g * d).astype(t) for d, t in zip(dweights, head.dtypes)], dx_CBlD, None, None, None


_fused_xent.defvjp(_fused_xent_fwd, _fused_xent_bwd)


def _only_cast_to(jaxpr: Any, var: Any) -> Any:
  """The dtype `var` is converted to where every use of it in `jaxpr` is that one conversion, else None."""
  uses = [e for e in jaxpr.eqns if any(u is var for u in e.invars)]
  if not uses or any(o is var for o in jaxpr.outvars) or any(e.primitive.name != 'convert_element_type' for e in uses):
    return None
  to = {jnp.dtype(e.params['new_dtype']) for e in uses}
  return to.pop() if len(to) == 1 else None


@dataclasses.dataclass(frozen=True, eq=False)
class _Head:
  """A model's output head as a function of the parameters it reads (`apply(weights, x)`), for
  `chunked_softmax_xent`. The parameters are found by tracing the head once (the ones its jaxpr reads); the
  model's other parameters and state enter as constants (stop_gradient: the head does not read them).

  With G > 1 groups the weights are broadcast to (G, *shape), one group per device group along the leading batch
  mesh axes that shard none of the head's weights, sharded over those axes first and then as the rules shard
  the weight, so each device holds its usual slice; the head is vmapped over groups with the rules suspended
  (the mapped dimension carries the batch's leading axes, which the rules would give the inner batch
  dimension) and the logits constrained after it."""

  graphdef: Any
  leaves: tuple[jax.Array, ...]  # the model's parameters, flattened (constants)
  treedef: Any
  rest: Any  # the model's other state
  used: tuple[int, ...]  # the leaves the head reads
  weights: list[jax.Array]  # those leaves, broadcast to (G, *shape) where G > 1
  shardings: tuple[Any, ...] | None  # of the weights, None outside a mesh
  size: int  # G
  narrow: tuple[Any, ...]  # per weight, the dtype the head only ever converts it to (None: used as it is)

  @property
  def dtypes(self) -> list[Any]:
    return [self.leaves[i].dtype for i in self.used]

  @classmethod
  def of(cls, model: Any, B: int, x_BlD: jax.ShapeDtypeStruct) -> _Head:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    variables = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    leaves, treedef = jax.tree.flatten(params)
    assert len(variables) == len(leaves), 'a parameter Variable that is not one array'
    rest = jax.tree.map(jax.lax.stop_gradient, rest)
    apply = lambda ls, x: nnx.merge(graphdef, jax.tree.unflatten(treedef, ls), rest).head(x)
    jaxpr = jax.make_jaxpr(apply)([jax.ShapeDtypeStruct(l.shape, l.dtype) for l in leaves], x_BlD).jaxpr
    read = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    used = tuple(i for i, v in enumerate(jaxpr.invars[: len(leaves)]) if id(v) in read)
    narrow = tuple(_only_cast_to(jaxpr, jaxpr.invars[i]) for i in used)
    constants = tuple(jax.lax.stop_gradient(l) for l in leaves)
    weights, shardings, size = [leaves[i] for i in used], None, 1
    spec = logical_spec(('batch',), (B,))
    if spec is not None:  # else no rules: one device, or sharding left to the compiler
      mesh = active_mesh()
      specs = [
        logical_spec(variables[i].get_metadata().get('out_sharding') or (None,) * leaves[i].ndim, leaves[i].shape)
        for i in used
      ]
      taken = {a for s in specs for a in jax.tree.leaves(tuple(s))}
      axes = []
      for a in jax.tree.leaves(spec[0]) if len(spec) else []:  # the leading batch axes no head weight is split over
        if a in taken:
          break
        axes.append(a)
      size = math.prod(mesh.shape[a] for a in axes)
      if size == 1:
        shardings = tuple(NamedSharding(mesh, s) for s in specs)
      else:
        group = tuple(axes) if len(axes) > 1 else axes[0]
        shardings = tuple(NamedSharding(mesh, P(group, *s)) for s in specs)
        weights = [
          jax.lax.with_sharding_constraint(jnp.broadcast_to(w, (size, *w.shape)), sh)
          for w, sh in zip(weights, shardings)
        ]
    return cls(graphdef, constants, treedef, rest, used, weights, shardings, size, narrow)

  def cast(self, weights: list[jax.Array]) -> list[jax.Array]:
    """The weights the head only converts (a float32 table read in bf16) converted once, before the chunk loop:
    inside it XLA converts the whole table again for every chunk (read and written per chunk, and the bf16 copy
    alive beside the logits)."""
    return self.constrain([w if d is None else w.astype(d) for w, d in zip(weights, self.narrow)])

  def constrain(self, arrays: list[jax.Array]) -> list[jax.Array]:
    """Arrays shaped like the weights (their gradient sums), sharded like them."""
    if self.shardings is None:
      return arrays
    return [jax.lax.with_sharding_constraint(a, s) for a, s in zip(arrays, self.shardings)]

  def _one(self, weights: list[jax.Array], x_blD: jax.Array) -> jax.Array:
    leaves = list(self.leaves)
    for i, w in zip(self.used, weights):
      leaves[i] = w
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves), self.rest).head(x_blD)

  def apply(self, weights: list[jax.Array], x_BlD: jax.Array) -> jax.Array:
    if self.size == 1:
      return self._one(weights, x_BlD)
    B, l, D = x_BlD.shape

    def one(weights, x_blD):
      with suspend_rules():
        return self._one(weights, x_blD)

    logits_GblV = jax.vmap(one)(weights, x_BlD.reshape(self.size, B // self.size, l, D))
    return shard_logical(logits_GblV.reshape(B, l, -1), ('batch', 'length', 'vocab'))
