"""Train state, its shardings, sharded initialisation, and the jitted train/eval steps.

`build()` does everything that needs no device memory: abstract model and optimizer state,
logical axes, PartitionSpecs, NamedShardings, and validation of every parameter, optimizer
leaf and batch field against the rules. Activations are validated when a step is traced
(`compile_step`), still before anything compiles.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import partitioning
from errors import ConfigError, NonFiniteError
from models import layers
from partitioning import AxisRules, context, pipeline
from training import accumulate, optim, tasks

FIRST_NONFINITE = 'first_nonfinite_param'  # train metrics key: index into Trainer.trained_paths(), -1 if none


@flax.struct.dataclass
class TrainState:
  step: Any
  params: Any  # pure dict of arrays, as nnx.to_pure_dict gives
  opt_state: Any
  model_state: Any  # non-parameter model variables (e.g. BatchNorm statistics); often {}
  # What the task keeps besides (Task.task_state): e.g. {'reference': the starting params} for DPO; often {}.
  task_state: Any = dataclasses.field(default_factory=dict)


def state_tree(state: TrainState) -> dict[str, Any]:
  """The train state as checkpoints hold it: checkpointing saves and restores dicts, not TrainStates. A task's
  state is there only where the task keeps one (checkpoints of other tasks are unchanged)."""
  tree = {'step': state.step, 'params': state.params, 'opt_state': state.opt_state, 'model_state': state.model_state}
  return tree | ({'task_state': state.task_state} if state.task_state else {})


def train_state(tree: dict[str, Any]) -> TrainState:
  """state_tree's inverse (a restored checkpoint)."""
  return TrainState(tree['step'], tree['params'], tree['opt_state'], tree['model_state'], tree.get('task_state', {}))


@dataclasses.dataclass
class Trainer:
  """Everything derived from (config, mesh) before any array is allocated."""

  config: ml_collections.ConfigDict
  mesh: Mesh
  rules: AxisRules
  task: Any
  make_model: Callable[[nnx.Rngs], nnx.Module]
  graphdef: Any
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract: TrainState  # ShapeDtypeStruct leaves
  axes: TrainState  # logical axis names per leaf
  specs: TrainState  # PartitionSpec per leaf
  shardings: TrainState  # NamedSharding per leaf
  batch_abstract: dict[str, jax.ShapeDtypeStruct]
  batch_shardings: dict[str, NamedSharding]
  seen: set[str]  # logical names used by params, state, batches and (once traced) activations
  labels: Any = None  # 'train' / 'frozen' per parameter (config.freeze, train_only, LoRA); None: all train
  balance: int = 1  # context shards the rows are load-balanced over (config.context_load_balance); 1: natural order
  pipeline: Any = None  # the partitioning.pipeline.Schedule of a ('layers', 'stage') rule, or None

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def checkpoint_target(self) -> dict[str, Any]:
    """The train state as a checkpoint restores it (state_tree), each leaf a ShapeDtypeStruct carrying its
    NamedSharding: orbax reads each shard straight into place."""
    return state_tree(partitioning.sharded_abstract(self.abstract, self.shardings))

  def trained_paths(self) -> list[str]:
    """Paths of the parameters that train, in the order of the train step's per-parameter flags."""
    leaves = jax.tree_util.tree_leaves_with_path(self.abstract.params)
    labels = jax.tree.leaves(self.labels) if self.labels is not None else ['train'] * len(leaves)
    return [partitioning.path_str(p) for (p, _), label in zip(leaves, labels) if label == 'train']

  def warnings(self) -> list[str]:
    """Unused rules, and mesh axes no rule uses (everything is replicated over them)."""
    # The 'layers' axis exists only with scanned (stacked) layers; one rule list serves both settings of
    # config.model.scan_layers, so its rule is idle, not forgotten, when they are unrolled.
    idle = {'layers', 'dense_layers'} if self.config.model.get('scan_layers') is False else set()  # None: no stack
    if not self.config.model.get('first_dense_layers'):  # a mixture of experts' dense layers first: none here
      idle.add('dense_layers')
    if not self.config.lora.rank:  # likewise the adapters' axis, LoRA off
      idle.add('lora_rank')
    idle |= set(layers.CACHE_AXES)  # the KV cache's rules serve generation, which a train step never traces
    out = [f'{r} is used by no parameter or activation' for r in self.rules.unused(self.seen | idle)]
    if self.config.context_load_balance and self.balance == 1:
      out.append(
        "config.context_load_balance is set, but no rule shards 'length' over more than one device: "
        'rows keep their natural order'
      )
    used_mesh = {a for r in self.rules.rules if r.logical in self.seen for a in r.mesh_axes}
    for name, size in self.mesh.shape.items():
      if size > 1 and name not in used_mesh:
        out.append(
          f'mesh axis {name!r} (size {size}) is used by no rule: every array is replicated over '
          'it and its devices repeat the same work'
        )
    return out


def split_model(model: nnx.Module) -> tuple[Any, dict, dict]:
  """A model's graph, its parameters and the rest of its state, the last two as plain dicts (a TrainState's
  params and model_state)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def _check_pipelined_rows(B: int, A: int, M: int, batch_spec: PartitionSpec, mesh_shape: dict[str, int]) -> None:
  """The global batch B runs as A accumulation micro-batches, each cut into the pipeline's M micro-batches, whose
  rows split over the batch's shards inside the pipeline (its mesh axes but 'stage'). ConfigError naming the three
  fields where that leaves a pipeline micro-batch the shards cannot split."""
  entry = batch_spec[0] if len(batch_spec) else None
  names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
  inner = math.prod(mesh_shape[a] for a in names if a != pipeline.STAGE)
  if B % (A * M * inner):
    rows = f'{B / (A * M):g} row(s)'
    raise ConfigError(
      f'config.batch_size={B} / config.grad_accum_steps={A} / config.pipeline.microbatches={M} leaves {rows} per '
      f'pipeline micro-batch, which the {inner} batch shards inside the pipeline cannot split: make batch_size a '
      f'multiple of {A * M * inner}, or lower grad_accum_steps or pipeline.microbatches'
    )


def build(config: ml_collections.ConfigDict, mesh: Mesh, make_model: Callable[[nnx.Rngs], nnx.Module]) -> Trainer:
  rules = AxisRules(config.logical_axis_rules)
  rules.check_mesh(mesh.shape)
  schedule_ = pipeline.schedule(  # its bad numbers before the rules' errors
    rules,
    dict(mesh.shape),
    microbatches=config.pipeline.microbatches,
    repeats=config.pipeline.repeats,
    scan_layers=bool(config.model.get('scan_layers')),  # None: a family without a layer stack
    num_layers=config.model.get('num_layers'),
    dense_first=config.model.get('first_dense_layers'),  # None: a family without dense layers first
    batch_size=config.batch_size,
  )
  task = tasks.get(config.task, config)

  seen: set[str] = set()
  model = partitioning.place_model(make_model, rules, mesh, seed=config.seed, seen=seen)
  param_shapes, param_axes = model.abstract['params'], model.axes['params']
  labels = trainable(config, param_shapes)
  tx, schedule = optim.make_optimizer(config.optim, config.total_steps, labels)
  opt_shapes = jax.eval_shape(tx.init, param_shapes)
  opt_axes = partitioning.opt_state_axes(opt_shapes, param_shapes, param_axes)

  # A task's frozen reference is the parameters again, with their axes and shardings.
  kept = {k: {'reference': param_shapes}[k] for k in task.task_state(config)}
  abstract = TrainState(
    jax.ShapeDtypeStruct((), jnp.int32), param_shapes, opt_shapes, model.abstract['model_state'], kept
  )
  axes = TrainState((), param_axes, opt_axes, model.axes['model_state'], {k: param_axes for k in kept})
  resolve = lambda shapes, names, kind: partitioning.tree_specs(shapes, names, rules, mesh.shape, kind=kind, seen=seen)
  specs = TrainState(
    PartitionSpec(),
    model.specs['params'],
    resolve(opt_shapes, opt_axes, 'optimizer state'),
    model.specs['model_state'],
    {k: model.specs['params'] for k in kept},
  )

  # Batches: check the global batch against the 'batch' rule first, for the clearest message.
  B = config.batch_size
  batch_spec = rules.spec(('batch',), what='the global batch')
  partitioning.check_batch(B, batch_spec, mesh.shape)
  shards = partitioning.entry_size(batch_spec[0] if len(batch_spec) else None, mesh.shape)
  accumulate.check(B, config.grad_accum_steps, shards)  # every micro-batch splits over the shards
  if schedule_ is not None:  # and each of those again into the pipeline's, over the shards inside it
    _check_pipelined_rows(B, config.grad_accum_steps, schedule_.microbatches, batch_spec, dict(mesh.shape))
  batch_abstract = {
    k: jax.ShapeDtypeStruct((B,) + tuple(shape), dtype) for k, (shape, dtype) in task.example_shapes(config).items()
  }
  batch_axes = task.fields(config)
  batch_specs = resolve(batch_abstract, {k: batch_axes[k] for k in batch_abstract}, 'batch field')
  return Trainer(
    config,
    mesh,
    rules,
    task,
    make_model,
    model.graphdef,
    tx,
    schedule,
    abstract,
    axes,
    specs,
    partitioning.named_shardings(specs, mesh),
    batch_abstract,
    partitioning.named_shardings(batch_specs, mesh),
    seen,
    labels,
    _balance(config, rules, mesh),
    schedule_,
  )


def _balance(config: ml_collections.ConfigDict, rules: AxisRules, mesh: Mesh) -> int:
  """The context shards config.context_load_balance balances each row over (1: off, or 'length' unsharded); a
  task without causal rows, or a length that 2 x the shards do not divide, is a ConfigError."""
  if not config.context_load_balance:
    return 1
  if config.task != 'lm':
    raise ConfigError(
      f'config.context_load_balance balances causal attention across context shards, and task '
      f"{config.task!r} has none (its attention sees every token, so its shards' work is already "
      'equal): set it to False'
    )
  with partitioning.use_rules(rules, mesh, balance=True):
    return context.balanced_shards(config.batch_size, config.dataset.seq_len)


def trainable(config: ml_collections.ConfigDict, params: Any) -> Any:
  """'train'/'frozen' labels from config.freeze / config.train_only (regexes over parameter paths);
  with LoRA (config.lora.rank > 0) only the adapters train unless train_only says otherwise."""
  freeze, train_only = config.freeze or None, config.train_only or None
  if config.lora.rank and not train_only:
    train_only = r'(^|/)lora_[ab]$'
  if not (freeze or train_only):
    return None
  return optim.trainable_labels(params, freeze, train_only)


def task_state(trainer: Trainer, params: Any) -> dict[str, Any]:
  """The task's state at the start (Task.task_state): the reference is the starting parameters."""
  return {k: {'reference': params}[k] for k in trainer.abstract.task_state}


def jit_init(trainer: Trainer, seed: int | None = None):
  """A jitted initialiser whose outputs are born in their shardings: each device computes only its
  own slices (partitionable threefry), so no device or host ever holds the full state."""
  seed = trainer.config.seed if seed is None else seed

  def init():
    with partitioning.use_rules(trainer.rules, trainer.mesh):  # model code may place what it creates
      _, params, rest = split_model(trainer.make_model(nnx.Rngs(seed)))
    return TrainState(jnp.zeros((), jnp.int32), params, trainer.tx.init(params), rest, task_state(trainer, params))

  return jax.jit(init, out_shardings=trainer.shardings)


# The initialiser runs once per run: on CPU, LLVM's optimisation of its machine code costs more compile time
# than it saves.
INIT_CPU_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}


def init_state(trainer: Trainer, seed: int | None = None) -> TrainState:
  """Creates model and optimizer state directly in their shardings."""
  cpu = trainer.mesh.devices.flat[0].platform == 'cpu'
  return jit_init(trainer, seed).lower().compile(compiler_options=INIT_CPU_COMPILE if cpu else None)()


def _task_args(task_state: Any) -> dict[str, Any]:
  """The keyword a task with a state of its own is given it by (metric_sums(model, batch, task_state=...))."""
  return {'task_state': task_state} if task_state else {}


def loss_of(
  trainer: Trainer, model_state: Any, batch: dict, task_state: Any = None
) -> Callable[[Any], tuple[Any, tuple[dict, Any]]]:
  """params -> (loss, (metrics, new model state)): what the train step differentiates (trace it under
  partitioning.use_rules)."""

  def loss_fn(params):
    model = nnx.merge(trainer.graphdef, params, model_state)
    loss, metrics = trainer.task.loss(model, batch, **_task_args(task_state))
    return loss, (metrics, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))

  return loss_fn


def sums_of(trainer: Trainer, task_state: Any = None) -> accumulate.SumsFn:
  """(params, model state, batch) -> (the task's metric sums, new model state): what a train step accumulates
  (trace it under partitioning.use_rules). `task_state`: the task's own (TrainState.task_state), held fixed."""

  def sums_fn(params, model_state, batch):
    model = nnx.merge(trainer.graphdef, params, model_state)
    sums = trainer.task.metric_sums(model, batch, **_task_args(task_state))
    return sums, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))

  return sums_fn


def train_step_fn(trainer: Trainer) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  tx, schedule = trainer.tx, trainer.schedule

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    with partitioning.use_rules(
      trainer.rules, trainer.mesh, seen=trainer.seen, balance=trainer.balance > 1, pipeline=trainer.pipeline
    ):
      # Gradients live where their parameters live (lets XLA reduce-scatter them under FSDP); with
      # config.grad_accum_steps > 1 they are summed over micro-batches in a scan (training/accumulate.py).
      grads, metrics, model_state = accumulate.gradients(
        sums_of(trainer, state.task_state),
        state.params,
        state.model_state,
        batch,
        steps=trainer.config.grad_accum_steps,
        param_shardings=trainer.shardings.params,
        batch_shardings=trainer.batch_shardings,
        gather_once=trainer.config.accum_gather_once,
      )
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    # The norm of what trains (the one clipping sees): frozen weights' gradients stay dead code that XLA removes.
    trained = (
      grads
      if trainer.labels is None
      else [g for g, label in zip(jax.tree.leaves(grads), jax.tree.leaves(trainer.labels)) if label == 'train']
    )
    # One flag: the loss and every trained gradient finite. Otherwise the step changes nothing but the step
    # counter: params, optimizer state and model state (BatchNorm averages) stay as they were. train.py reads it.
    # A gradient is finite where its sum of squares is: the sums the norm (and clipping) reduce anyway, so the
    # check reads no gradient again (separate isfinite reductions compiled to a kernel per gradient). A finite
    # gradient whose squares overflow float32 (an entry over ~1e19) counts as non-finite: its norm is inf, and
    # clipping by it would zero it.
    squares = [jnp.sum(jnp.square(g)) for g in jax.tree.leaves(trained)]
    leaf_finite = jnp.isfinite(jnp.stack(squares))
    finite = jnp.all(leaf_finite) & jnp.isfinite(metrics['loss'])
    keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    params, opt_state, model_state = keep_if_bad(
      (params, opt_state, model_state), (state.params, state.opt_state, state.model_state)
    )
    first_bad = jnp.where(jnp.all(leaf_finite), -1, jnp.argmin(leaf_finite))
    # The rate this step applies (or would have): the schedule runs on the optimizer's count of applied updates,
    # which skipped steps do not advance, not on state.step.
    lr = schedule(optim.schedule_step(state.opt_state, state.step))
    metrics = {
      **metrics,
      'grad_norm': jnp.sqrt(sum(squares)),
      'lr': lr,
      'nonfinite': 1.0 - finite.astype(jnp.float32),
      FIRST_NONFINITE: first_bad,
    }
    return TrainState(state.step + 1, params, opt_state, model_state, state.task_state), metrics

  return step


def eval_step_fn(trainer: Trainer) -> Callable[[TrainState, dict], dict]:
  def step(state: TrainState, batch: dict) -> dict:
    with partitioning.use_rules(
      trainer.rules, trainer.mesh, seen=trainer.seen, balance=trainer.balance > 1, pipeline=trainer.pipeline
    ):
      model = tasks.eval_view(nnx.merge(trainer.graphdef, state.params, state.model_state))
      return trainer.task.metric_sums(model, batch, **_task_args(state.task_state))

  return step


def jit_train_step(trainer: Trainer):
  """One jax.jit with explicit in/out shardings and the state donated."""
  return jax.jit(
    train_step_fn(trainer),
    in_shardings=(trainer.shardings, trainer.batch_shardings),
    out_shardings=(trainer.shardings, trainer.replicated),
    donate_argnums=0,
  )


def jit_eval_step(trainer: Trainer):
  return jax.jit(
    eval_step_fn(trainer), in_shardings=(trainer.shardings, trainer.batch_shardings), out_shardings=trainer.replicated
  )


def trace(trainer: Trainer, jitted) -> Any:
  """Traces a step on abstract inputs: validates every activation constraint, compiles nothing."""
  return jitted.trace(trainer.abstract, trainer.batch_abstract)


def compile_step(trainer: Trainer, jitted) -> Any:
  """Ahead-of-time compiles a step once. Calling it with other shardings raises instead of recompiling."""
  return trace(trainer, jitted).lower().compile()


def num_params(trainer: Trainer) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(trainer.abstract.params))


class NonFiniteGuard:
  """The host side of config.on_nonfinite. The step has already skipped every non-finite update; `check`
  reads the flags of the steps run since the last check (a device sync: call it at log steps and before a
  checkpoint is written, not every step) and raises NonFiniteError under 'stop', or after
  `max_skips` bad steps in a row under 'skip'."""

  def __init__(self, trainer: Trainer, policy: str, max_skips: int):
    if policy not in ('stop', 'skip'):
      raise ConfigError(f"config.on_nonfinite={policy!r}: choose 'stop' or 'skip'")
    if max_skips < 1:
      raise ConfigError(f'config.max_nonfinite_skips={max_skips}: must be >= 1')
    self.paths, self.policy, self.max_skips = trainer.trained_paths(), policy, max_skips
    self.unchecked: list[tuple[int, dict]] = []
    self.in_a_row, self.skipped = 0, []

  def add(self, step: int, metrics: dict) -> None:
    self.unchecked.append((step, {k: metrics[k] for k in ('loss', 'nonfinite', FIRST_NONFINITE)}))

  def check(self, last_good: str) -> None:
    flags, self.unchecked = jax.device_get(self.unchecked), []
    for step, m in flags:
      if not m['nonfinite']:
        self.in_a_row = 0
        continue
      self.in_a_row += 1
      self.skipped.append(step)
      if self.policy == 'stop' or self.in_a_row >= self.max_skips:
        leaf = int(m[FIRST_NONFINITE])
        what = f'gradient of {self.paths[leaf]!r}' if leaf >= 0 else 'loss (gradients finite)'
        why = (
          "config.on_nonfinite='stop'; 'skip' skips such steps"
          if self.policy == 'stop'
          else f'{self.in_a_row} non-finite steps in a row (config.max_nonfinite_skips={self.max_skips})'
        )
        raise NonFiniteError(
          f'step {step}: non-finite {what}, loss {float(m["loss"]):.4g}; the update was '
          f'skipped and the run stopped ({why}); last good checkpoint: {last_good}'
        )
