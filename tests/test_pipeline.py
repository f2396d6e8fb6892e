"""Pipeline parallelism (partitioning/pipeline.py): pipelined training equals 1 device (the mixtures of experts with
their per-layer losses too); only collective-permutes cross 'stage' inside the pipeline; checkpoints move between
pipeline and FSDP; bad numbers fail before compiling."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import partitioning
import training
from checkpointing import checkpointer
from configs import deepseek_v3, gpt2, llama, moe
from errors import ConfigError
from partitioning import AxisRules, hlo, pipeline
from partitioning.shard import use_rules
from planning import candidates
from planning import search as search_lib
from tests.conftest import all_eqns, build_trainer, train_steps
from training import flops
from training.trainer import state_tree

FAMILIES = {'gpt2': gpt2, 'llama': llama}
# fp32, 2 AdamW steps: the pipeline sums each weight's gradient over micro-batches and iterations, in another
# order than one device (measured worst case 2e-6 on the parameters).
RTOL, ATOL = 1e-5, 1e-5


def config(
  family: str, mesh: dict | None = None, microbatches: int = 4, repeats: int = 1, remat: str = 'none', accum: int = 1
):
  """The family's tiny size with 4 layers and 16 rows; with a mesh, the pp preset's rules on it."""
  c = FAMILIES[family].get_config('pp,tiny')
  c.update(batch_size=16, total_steps=2, grad_accum_steps=accum)
  # Adam moves a near-zero gradient's weight by ~lr whatever its rounding: a long warmup keeps those steps small.
  c.optim.warmup_steps = 100
  c.model.update(num_layers=4, remat=remat)
  c.dataset.seq_len = 16
  c.pipeline.update(microbatches=microbatches, repeats=repeats)
  c.mesh = dict(stage=1, data=1, fsdp=1, tensor=1) if mesh is None else {'data': 1, 'fsdp': 1, 'tensor': 1, **mesh}
  # the pp preset's rules, with tensor parallelism where the mesh has it
  c.logical_axis_rules = [
    ('batch', ('data', 'fsdp', 'stage')),
    ('layers', 'stage'),
    ('embed', 'fsdp'),
    ('embed', None),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('vocab', 'tensor'),
    ('length', None),
    ('kv', None),
    ('norm', None),
  ]
  return c


_STARTS: dict = {}
_TRAINED: dict = {}


def start(family: str) -> training.TrainState:
  """The family's 1-device initial state, on the host. Every case starts from it: one init program per family
  (a pipelined init equals it: test_checkpoint_moves_between_pipeline_and_fsdp)."""
  if family not in _STARTS:
    _STARTS[family] = jax.device_get(training.init_state(build_trainer(config(family), jax.devices()[:1])))
  return _STARTS[family]


def trained(family: str, mesh: dict | None = None, repeats: int = 1, remat: str = 'none', accum: int = 1):
  """(trainer, params after 2 steps on the task's synthetic batches, initial params), built once per case."""
  key = (family, json.dumps(mesh, sort_keys=True), repeats, remat, accum)
  if key not in _TRAINED:
    c = config(family, mesh, repeats=repeats, remat=remat, accum=accum)
    trainer = build_trainer(c, None if mesh else jax.devices()[:1])
    state = train_steps(trainer, jax.device_put(start(family), trainer.shardings), 2)
    _TRAINED[key] = trainer, jax.device_get(state.params), start(family).params
  return _TRAINED[key]


# stage = 2 and 4, GPipe and circular, with data parallelism, fsdp and tensor; one with remat per stage iteration
# (the 1-device reference keeps everything). By default three cases hold every one of these; `pytest --all-presets`
# adds GPT-2 under GPipe with fsdp (as Llama's stage=4 case) and at stage=4 with data parallelism (as Llama's
# stage=2 case): each compile here costs seconds on 2 cores.
CASES = [
  ('gpt2', dict(stage=2, tensor=4), 2, 'none'),
  ('llama', dict(stage=4, fsdp=2), 1, 'full'),
  ('llama', dict(stage=2, data=2, tensor=2), 2, 'none'),
]
MORE_CASES = [
  ('gpt2', dict(stage=2, fsdp=4), 1, 'none'),
  ('gpt2', dict(stage=4, data=2), 1, 'none'),
]


def pytest_generate_tests(metafunc):
  every = metafunc.config.getoption('--all-presets')
  if 'mesh' in metafunc.fixturenames:
    cases = CASES + MORE_CASES if every else CASES
    metafunc.parametrize('family,mesh,repeats,remat', cases, ids=lambda v: str(v).replace(' ', ''))
  if 'moe_family' in metafunc.fixturenames:
    metafunc.parametrize('moe_family', sorted(MOE_FAMILIES) if every else MOE_DEFAULT)


def test_pipeline_trains_as_one_device(family, mesh, repeats, remat):
  trainer, params, start = trained(family, mesh, repeats, remat)
  _check_as_one_device(family, mesh, repeats, remat, trainer, params, start)


def test_pipeline_composes_with_gradient_accumulation():
  """2 accumulated micro-batches of 8 rows, each pipelined in 4 of 2 rows: the unaccumulated 1-device step."""
  mesh = dict(stage=2, tensor=4)
  trainer, params, start = trained('gpt2', mesh, accum=2)
  _check_as_one_device('gpt2', mesh, 1, 'none', trainer, params, start)


def _check_as_one_device(family, mesh, repeats, remat, trainer, params, start):
  assert trainer.pipeline == pipeline.Schedule(mesh['stage'], 4, repeats)
  _, params_1, _ = trained(family)
  kernel = lambda p: p['blocks']['layers']['mlp']['up']['layer']['kernel']
  assert np.abs(kernel(params) - kernel(start)).min() > 0  # every layer's weights moved
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params, params_1)
  # each device holds its stage's 1/S of the stack
  kernel = trainer.specs.params['blocks']['layers']['mlp']['up']['layer']['kernel']
  assert kernel[0] == 'stage'
  if remat != 'none':  # the stage iteration is rematerialised: a remat around the stage's scan over its layers
    jaxpr = training.trace(trainer, training.jit_train_step(trainer)).jaxpr.jaxpr
    remats = [e for e in all_eqns(jaxpr) if e.primitive.name.startswith('remat')]
    assert any(s.primitive.name == 'scan' for e in remats for s in all_eqns(e.params['jaxpr']))


def test_only_collective_permutes_cross_stage_inside_the_pipeline():
  """In the loops of the compiled step (the pipeline's iterations and their layers, forward and backward), the
  only collectives whose groups differ along 'stage' are collective-permutes; the circular schedule re-lays the
  weights (an all-to-all over 'stage') once per step, outside them."""
  trainer, _, _ = trained('gpt2', dict(stage=2, tensor=4), 2)
  text = training.compile_step(trainer, training.jit_train_step(trainer)).as_text()
  mesh_shape = dict(trainer.mesh.shape)
  crossing = [c for c in hlo.collectives(text, 8) if 'stage' in hlo.mesh_axes(c.groups, mesh_shape)]
  in_loops = {c.op for c in crossing if c.times > 1}
  assert in_loops == {'collective-permute'}, in_loops
  iterations = trainer.pipeline.iterations
  permutes = [c for c in crossing if c.op == 'collective-permute' and c.times > 1]
  assert {c.times for c in permutes} == {iterations}  # one rotation per iteration, forward and backward
  assert len(permutes) >= 2
  # the bubble printed with the audit
  line = partitioning.audit(training.compile_step(trainer, training.jit_train_step(trainer)), None, trainer.pipeline)
  assert 'pipeline: 2 stages x 4 micro-batches (circular, 2 repeats), 9 iterations, bubble 11.1%' in line


class _Iter:  # a data iterator's state for the checkpoint (test_checkpointing has the same stand-in)
  pos = 0

  def get_state(self):
    return b'{}'

  def set_state(self, state):
    pass

  def start_prefetch(self):
    pass


@pytest.mark.parametrize('saved_under,restored_under', [('pp', 'fsdp'), ('fsdp', 'pp')])
def test_checkpoint_moves_between_pipeline_and_fsdp(tmp_path, saved_under, restored_under):
  def trainer(under):
    c = config('gpt2', dict(stage=4, fsdp=2))
    if under == 'fsdp':  # the fsdp preset: no 'stage' axis, layers replicated
      c.mesh, c.logical_axis_rules = dict(data=1, fsdp=8, tensor=1), list(gpt2.RULES['fsdp'])
    return build_trainer(c)

  saver = trainer(saved_under)
  state = training.init_state(saver)
  if saved_under == 'pp':  # the pipelined init is the 1-device one (the training cases start from that)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state_tree(state)), state_tree(start('gpt2')))
  with checkpointer.Checkpointer(str(tmp_path), every_steps=1, keep=1) as ckpt:
    ckpt.save(1, state_tree(state), _Iter())
    ckpt.wait()
  expected = jax.device_get(state_tree(state))
  restorer = trainer(restored_under)
  with checkpointer.Checkpointer(str(tmp_path), every_steps=1, keep=1) as ckpt:
    restored = ckpt.restore(restorer.checkpoint_target(), _Iter())
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), expected)
  kernel = restored['params']['blocks']['layers']['mlp']['up']['layer']['kernel']
  assert kernel.sharding.spec == restorer.specs.params['blocks']['layers']['mlp']['up']['layer']['kernel']
  assert (kernel.sharding.spec[0] == 'stage') == (restored_under == 'pp')


@pytest.mark.parametrize(
  'change,message',
  [
    (dict(num_layers=6), 'config.model.num_layers=6 is not divisible by stage=4 x config.pipeline.repeats=1 = 4'),
    (dict(repeats=2), 'config.model.num_layers=4 is not divisible by stage=4 x config.pipeline.repeats=2 = 8'),
    (dict(microbatches=2), 'config.pipeline.microbatches=2 is fewer than the 4 pipeline stages'),
    (dict(microbatches=6), 'config.batch_size=16 is not divisible by config.pipeline.microbatches=6'),
    (dict(scan_layers=False), "the rule ('layers', 'stage') pipelines a scanned layer stack over stage=4"),
  ],
)
def test_bad_pipeline_numbers_fail_before_building(change, message):
  c = config('gpt2', dict(stage=4, fsdp=2))
  for k, v in change.items():
    (c.pipeline if k in ('microbatches', 'repeats') else c.model)[k] = v
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    build_trainer(c)


def test_plan_search_scores_micro_batch_counts_with_the_bubble():
  """Pipelined plans are searched once per micro-batch count; the compiled step runs every stage in every
  iteration, so fewer micro-batches (a larger bubble) cost more FLOPs per device and more predicted compute."""
  c = config('llama')
  c.model.num_layers = 2  # one proxy per plan: 2 stages of one layer
  mesh = (('stage', 2), ('data', 1), ('fsdp', 4), ('tensor', 1))
  rules = {'pp': tuple(tuple(r) for r in c.logical_axis_rules)}
  generated = {
    (cand.stages, cand.microbatches)
    for cand in candidates.generate(8, ['stage', 'data', 'fsdp', 'tensor'], rules, [None], 1, 16)
  }
  # S, 2 S and 4 S micro-batches where they divide the 16 rows; 0 where stage=1 (nothing to pipeline)
  assert generated == {(1, 0), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)}
  search = search_lib.Search(c, models.create, flops.chip('cpu'), 8)
  plans = [candidates.Candidate(mesh, 'pp', rules['pp'], None, m) for m in (2, 4)]  # 8: 2 rows over fsdp=4
  result = search.run(plans)
  assert result.compiled == 2 and not result.pruned
  by_micro = {s.candidate.microbatches: s for s in result.ranked}
  assert by_micro[2].profile.bubble == pytest.approx(1 / 3) and by_micro[4].profile.bubble == pytest.approx(1 / 5)
  # FLOPs per device ~ (M + S - 1) / M of the work; the predicted time weighs them against the collectives (under
  # FSDP each iteration gathers its stage's weights again, so more micro-batches are not always faster)
  assert by_micro[4].profile.flops < by_micro[2].profile.flops
  assert by_micro[4].prediction.compute_s < by_micro[2].prediction.compute_s


def test_pipeline_sums_aux_over_layers_and_averages_micro_batches_not_the_bubble():
  """pipeline.run's aux: each layer's scalars summed over the layers and averaged over the micro-batches, as a loop
  over the micro-batches gives, value and gradients; a circular schedule (S=2, R=2) over M=3 micro-batches (not a
  multiple of S) runs 2 of its 14 stage iterations in the bubble, which would add to the totals and to the
  gradients if they counted."""
  S, R, M, N, B, D = 2, 2, 3, 4, 24, 4  # 8 rows a micro-batch, over data=4
  mesh = partitioning.make_mesh(dict(stage=S, data=4))
  rules = AxisRules([('batch', ('data', 'stage')), ('batch', 'stage'), ('layers', 'stage'), ('embed', None)])
  w_NDD = jax.random.normal(jax.random.key(0), (N, D, D)) / 2
  x_BD = jax.random.normal(jax.random.key(1), (B, D))

  def layer(w, x):
    y = jnp.tanh(x @ w)
    return y, {'energy': jnp.mean(y**2), 'one': jnp.ones(())}

  def objective(w, x):  # the output and the aux both in the loss: the aux's gradient reaches the weights
    with use_rules(rules, mesh, pipeline=pipeline.Schedule(S, M, R)):
      y, aux = pipeline.run(layer, w, x, x_axes=('batch', 'embed'))
    return jnp.sum(y**2) + 3 * aux['energy'], (y, aux)

  def reference(w, x):  # micro-batch i = rows i, i + M, ...; no pipeline
    ys, aux = [], {'energy': 0.0, 'one': 0.0}
    for i in range(M):
      y = x[i::M]
      for n in range(N):
        y, a = layer(w[n], y)
        aux = {k: aux[k] + a[k] / M for k in aux}
      ys.append(y)
    y = jnp.stack(ys, 1).reshape(x.shape)
    return jnp.sum(y**2) + 3 * aux['energy'], (y, aux)

  w_sharded = jax.device_put(w_NDD, NamedSharding(mesh, P('stage')))
  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(w_sharded, x_BD)
  (_, (y_1, aux_1)), grads_1 = jax.value_and_grad(reference, has_aux=True)(w_NDD, x_BD)
  assert S * pipeline.Schedule(S, M, R).iterations - S * R * M == 2  # stage iterations in the bubble
  assert float(aux['one']) == N  # every layer once per micro-batch, averaged: no bubble iteration counted
  np.testing.assert_allclose(aux['energy'], aux_1['energy'], rtol=1e-6)
  np.testing.assert_allclose(y, y_1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grads, grads_1, rtol=1e-5, atol=1e-6)


MOE_FAMILIES = {'moe': moe, 'deepseek_v3': deepseek_v3}
# DeepSeek-V3 by default: its expert layers carry the aux losses through the stages as the plain mixture's do, and
# its latent attention and dense layer first add to them; `pytest --all-presets` trains both (each compile of these
# costs tens of seconds on 2 cores).
MOE_DEFAULT = ['deepseek_v3']


def moe_config(family: str, mesh: dict | None, accum: int = 1):
  """The family's tiny size with 2 expert layers (DeepSeek: after its dense one), 16 rows of 16 tokens, 4 pipeline
  micro-batches; with a mesh, the pp preset's rules (experts over 'expert' inside the stages, FSDP on embed)."""
  c = MOE_FAMILIES[family].get_config('pp,tiny')
  c.update(batch_size=16, total_steps=2, grad_accum_steps=accum)
  c.optim.warmup_steps = 100  # as config(): small steps, so near-zero gradients do not move weights by ~lr
  c.dataset.seq_len = 16
  c.model.update(num_layers=c.model.first_dense_layers + 2, group_size=16)
  c.pipeline.microbatches = 4
  if mesh is None:
    c.mesh = {k: 1 for k in c.mesh}
  return c


def _steps(trainer, start, steps=2):
  batches = [trainer.task.synthetic_batch(trainer.config, seed=i) for i in range(steps)]
  step = training.jit_train_step(trainer)
  state, out = jax.device_put(start, trainer.shardings), []
  for batch in batches:
    state, metrics = step(state, partitioning.shard(batch, trainer.batch_shardings))
    out.append(jax.device_get(metrics))
  return out, jax.device_get(state.params)


def test_mixture_of_experts_pipeline_trains_as_one_device(moe_family):
  """A mixture of experts under the pp preset (stage=2 x expert=2 x fsdp=2; DeepSeek's latent attention, its dense
  layer first before the pipeline): 2 steps, the loss, the aux losses and statistics of each step, the gradient norm
  and the parameters equal to one device's within fp32 tolerance. The reference accumulates the same 4 micro-batches
  (grad_accum_steps=4): the aux entries are averaged over micro-batches either way, which is the whole batch's value
  for the token means (router z-loss, dropped fraction) and not for the load-balancing loss, a product of two means
  (training/accumulate.py). Both start from the reference's initial state (one init program)."""
  family = moe_family
  trainer_1 = build_trainer(moe_config(family, None, accum=4), jax.devices()[:1])
  start_1 = jax.device_get(training.init_state(trainer_1))
  trainer = build_trainer(moe_config(family, {}))
  assert trainer.pipeline == pipeline.Schedule(2, 4, 1)
  specs = trainer.specs.params
  assert specs['blocks']['layers']['moe']['up'][:2] == ('stage', 'expert')  # each stage its layers' experts
  if family == 'deepseek_v3':  # the dense layer first is whole on every stage
    assert 'stage' not in jax.tree.leaves(specs['dense_blocks'], is_leaf=lambda s: isinstance(s, P))[0]
  got, params = _steps(trainer, start_1)
  want, params_1 = _steps(trainer_1, start_1)
  for step, (a, b) in enumerate(zip(got, want)):
    assert a['aux_loss'] > 0 and a['dropped_fraction'] > 0  # the aux losses count; capacity drops tokens
    for k in ('loss', 'grad_norm', 'aux_loss', 'load_balance_loss', 'router_z_loss', 'dropped_fraction'):
      np.testing.assert_allclose(a[k], b[k], rtol=RTOL, atol=ATOL, err_msg=f'{family} step {step}: {k}')
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params, params_1)


def test_expert_layers_the_stages_cannot_divide_are_one_error():
  """DeepSeek's dense layers first run before the pipeline, which cuts the expert layers: a count of those the
  stages do not divide is one error naming both fields and the rule, before anything is built."""
  c = moe_config('deepseek_v3', {})
  c.model.num_layers = 4
  with pytest.raises(
    ConfigError,
    match=r'num_layers=4 - first_dense_layers=1 = 3 expert layers is not divisible by '
    r"stage=2 x config.pipeline.repeats=1 = 2 \(the rule \('layers', 'stage'\)",
  ):
    build_trainer(c)
