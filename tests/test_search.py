"""The plan search (planning/, search.py): candidates, pruning, the HLO parser, the cost model, the plan file."""

import ast
import dataclasses
import os
import re

import jax
import pytest
from absl import flags
from ml_collections import config_flags

import models
import partitioning
import training
from configs import llama
from errors import ConfigError
from partitioning import hlo
from planning import candidates, cost, plan_file, report, residuals, stages
from planning import search as search_lib
from tests import children
from tests.conftest import ROOT
from training import flops

LLAMA = os.path.join(ROOT, 'configs', 'llama.py')


# --- Candidates -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('family', ['llama', 'gpt2', 'moe', 'vit', 'bert'])
def test_candidates_cover_every_preset(family):
  path = os.path.join(ROOT, 'configs', f'{family}.py')
  module = candidates.load_module(path)
  config = module.get_config(None)
  rules = candidates.rule_variants(candidates.presets_of(path, None, config))
  axes = candidates.mesh_axes_of(rules, list(config.mesh))
  cands = {(c.mesh, c.rules) for c in candidates.generate(8, axes, rules, [None])}
  for preset, mesh in module.MESHES.items():
    want = tuple((a, mesh.get(a, 1)) for a in axes)
    assert (want, rules[preset]) in cands, (family, preset)


def test_a_plan_that_splits_rows_balances_them():
  """A plan whose rules shard 'length' over several devices load-balances causal rows (as the cp presets do);
  one that does not, or a task without causal attention, keeps the natural order."""
  config = candidates.load_module(LLAMA).get_config('fsdp_tp,tiny')
  assert not config.context_load_balance
  rules = candidates.presets_of(LLAMA, 'fsdp_tp,tiny', config)
  plan = lambda name, **mesh: search_lib.apply(
    config,
    candidates.Candidate(
      tuple({'data': 1, 'fsdp': 1, 'context': 1, 'tensor': 1, **mesh}.items()), name, tuple(rules[name]), None
    ),
  )
  assert plan('cp', fsdp=2, context=4).context_load_balance
  assert not plan('cp', fsdp=8).context_load_balance and not plan('fsdp_tp', fsdp=4, tensor=2).context_load_balance
  with config.unlocked():
    config.dataset.seq_len = 40  # 4 and 8 context shards divide the rows; only 2 x 4 divides them into chunks
  assert plan('cp', fsdp=2, context=4).context_load_balance and not plan('cp', context=8).context_load_balance
  with config.unlocked():
    config.task = 'mlm'
  assert not plan('cp', fsdp=2, context=4).context_load_balance


def test_a_plan_that_a_model_option_refuses_is_pruned_with_its_reason():
  """A ConfigError raised while a candidate's step is traced (a loss_chunks that the context shards do not
  divide) prunes that candidate, named, instead of ending the search."""
  path = os.path.join(ROOT, 'configs', 'gpt2.py')
  config = candidates.load_module(path).get_config('tiny')
  with config.unlocked():
    config.model.loss_chunks = 16  # 4 positions per chunk: fine on one device, not over 8 context shards
  rules = candidates.presets_of(path, 'tiny', config)
  search = search_lib.Search(config, models.create, flops.chip('cpu'), 8)
  cand = candidates.Candidate((('data', 1), ('fsdp', 1), ('context', 8), ('tensor', 1)), 'cp', tuple(rules['cp']), None)
  with pytest.raises(search_lib.Pruned, match='loss chunks the context shards do not divide') as pruned:
    search.validate(cand)
  assert 'loss_chunks=16' in pruned.value.detail


def test_factorisations_and_host_orders():
  assert len(candidates.factorisations(64, 3)) == 28
  assert sorted(candidates.factorisations(8, 2)) == [(1, 8), (2, 4), (4, 2), (8, 1)]
  orders = candidates.axis_orders({'data': 8, 'fsdp': 8, 'tensor': 1}, hosts=8)
  # data across hosts (fsdp on NVLink), or fsdp across hosts (data on NVLink)
  assert {o[0][0] for o in orders} == {'data', 'fsdp'} and len(orders) == 2
  with pytest.raises(ConfigError, match='multiple of the host count'):
    list(candidates.generate(12, ['data'], {'dp': ()}, [None], hosts=8))
  # a plan over hosts as config.mesh (inside a host) x config.dcn_mesh (across them)
  split = candidates.split_over_hosts
  assert split((('data', 8), ('fsdp', 8), ('tensor', 1)), 8) == (
    {'data': 1, 'fsdp': 8, 'tensor': 1},
    {'data': 8, 'fsdp': 1, 'tensor': 1},
  )
  assert split((('fsdp', 16), ('tensor', 4)), 8) == ({'fsdp': 2, 'tensor': 4}, {'fsdp': 8, 'tensor': 1})
  assert split((('data', 2), ('fsdp', 32)), 8) == ({'data': 1, 'fsdp': 8}, {'data': 2, 'fsdp': 4})
  with pytest.raises(ConfigError, match='cannot be split over 4 hosts'):
    split((('data', 2), ('tensor', 3)), 4)


def test_bad_input_names_the_culprit(tmp_path):
  with pytest.raises(ConfigError, match="unknown device kind 'h1000'"):
    flops.chip('h1000')
  assert flops.chip('H100').name == 'h100'
  (tmp_path / 'dir.py').mkdir()
  with pytest.raises(ConfigError, match='is a directory'):
    plan_file.check_out_path(str(tmp_path / 'dir.py'))
  with pytest.raises(ConfigError, match='ending in .py'):
    plan_file.check_out_path(str(tmp_path / 'plan.txt'))
  with pytest.raises(ConfigError, match='does not exist'):
    plan_file.check_out_path(str(tmp_path / 'missing' / 'plan.py'))
  (tmp_path / 'old.py').write_text('kept')  # an existing file: only with --overwrite; the config file never
  with pytest.raises(ConfigError, match=r"old.py' exists; give another path, or --overwrite to replace it"):
    plan_file.check_out_path(str(tmp_path / 'old.py'))
  plan_file.check_out_path(str(tmp_path / 'old.py'), overwrite=True)
  with pytest.raises(ConfigError, match='is the config file the plan is made from'):
    plan_file.check_out_path(str(tmp_path / 'old.py'), overwrite=True, config_file=str(tmp_path / 'old.py'))
  assert (tmp_path / 'old.py').read_text() == 'kept'


# --- search.py: a spine over planning/stages.py ----------------------------------------------------------------


def test_search_py_is_a_spine_over_its_stages():
  """search.py's `main` takes planning/stages.py's steps in order, as train.py's `run` takes training/run.py's.
  Read with ast: importing search.py would define its flags beside train.py's."""
  tree = ast.parse(open(os.path.join(ROOT, 'search.py')).read())
  main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == 'main')
  assert main.end_lineno - main.lineno + 1 < 60


def test_the_search_request_is_checked_before_jax_starts(tmp_path, capsys):
  config = llama.get_config('tiny')
  counts = dict(stages.LEAST)
  given = dict(
    config=config,
    config_file=f'{LLAMA}:tiny',
    device_kind='h100',
    devices=8,
    hosts=1,
    counts=counts,
    remat='staged',
    micro_batches=['2', '4'],
    out=None,
    overwrite=False,
  )
  check = lambda **kw: stages.check_input(**{**given, **kw})
  req = check()
  assert req.source() == f'{LLAMA}:tiny' and req.target() == '8 x h100' and req.micro_batches == [2, 4]
  assert req.first == [config.model.remat] and 'dots' in req.remats and 'fsdp' in req.rules
  assert check(hosts=2).target() == '8 x h100 over 2 hosts' and check(remat='none,dots').first == ['none', 'dots']
  for kw, message in [
    (dict(devices=7, hosts=2), '--devices 7 --hosts 2: the device count must be a positive multiple of the host count'),
    (dict(counts={**counts, 'top': 0}), '--top=0: must be >= 1'),
    (dict(micro_batches=['2', 'x']), "--micro_batches=2,x: ['x'] not whole numbers"),
    (dict(micro_batches=['-2', '0', '4']), '--micro_batches=-2,0,4: [-2, 0] would split no batch (counts must be >= 2'),
    (dict(remat='bogus,none'), "--remat 'bogus,none': ['bogus'] not remat policies"),
    (dict(out=str(tmp_path / 'plan.txt')), 'ending in .py'),
    (dict(device_kind='h1000'), "unknown device kind 'h1000'"),
  ]:
    with pytest.raises(ConfigError, match=re.escape(message)):
      check(**kw)
  capsys.readouterr()
  config.grad_accum_steps = 4  # each plan sets its own: said, not silently replaced
  check()
  assert capsys.readouterr().out == (
    'WARNING config: config.grad_accum_steps=4 is not searched from: every plan is tried with 1 micro-batch, and '
    'those over the memory with --micro_batches=2,4\n'
  )


# --- The HLO replica-group parser -------------------------------------------------------------------------------


def test_replica_group_forms():
  assert hlo.replica_groups('{{0,1},{2,3}}') == [[0, 1], [2, 3]]
  assert hlo.replica_groups('{}', 4) == [[0, 1, 2, 3]]
  assert hlo.replica_groups('[2,4]<=[8]') == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo.replica_groups('[2,4]<=[4,2]T(1,0)') == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert hlo.replica_groups("mesh['a'=2,'b'=4] {'b'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo.replica_groups("mesh['a'=2,'b'=4] {'a'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert hlo.replica_groups("mesh['x'=8] {'x':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
  # ids laid out by an iota: mesh position (i, j) holds id 2j + i
  assert hlo.replica_groups("mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}") == [[0, 2], [1, 3]]


def test_groups_map_onto_mesh_axes_and_hosts():
  shape = {'data': 2, 'fsdp': 2, 'tensor': 2}  # partition i at np.unravel_index(i, (2, 2, 2))
  assert hlo.mesh_axes(((0, 1), (2, 3), (4, 5), (6, 7)), shape) == ('tensor',)
  assert hlo.mesh_axes(((0, 4), (1, 5), (2, 6), (3, 7)), shape) == ('data',)
  assert hlo.mesh_axes(((0, 2, 4, 6), (1, 3, 5, 7)), shape) == ('data', 'fsdp')
  host = lambda i: i // 4
  assert hlo.hosts_spanned(((0, 1), (2, 3)), host) == 1
  assert hlo.hosts_spanned(((0, 4), (1, 5)), host) == 2


HLO = """HloModule m, num_partitions=8

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[64]{0} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %ar = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups=mesh['a'=2,'b'=4] {'a'}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %rs = bf16[2]{0} reduce-scatter(%a), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %cp = f32[8]{0} collective-permute(%a), channel_id=4, source_target_pairs={{0,4},{4,0}}
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_collectives_count_loop_trips_and_groups():
  got = {c.name: c for c in hlo.collectives(HLO, 8)}
  assert (got['ag'].op, got['ag'].times, got['ag'].bytes, got['ag'].group_size) == ('all-gather', 12, 256, 8)
  assert got['ar'].times == 12 and got['ar'].groups[0] == (0, 4)
  assert (got['rs'].times, got['rs'].bytes, got['rs'].group_size) == (1, 4, 4)
  assert got['cp'].groups == ((0, 4), (4, 0))
  assert hlo.mesh_axes(got['ar'].groups, {'data': 2, 'fsdp': 4}) == ('data',)


def test_loop_flops_are_counted_once_per_trip():
  """XLA's cost analysis counts a while loop's body once; loop_dot_flops adds the other trips' matmuls, so a
  scanned chain of matmuls counts as the unrolled one does."""
  x, w = jax.numpy.ones((16, 32)), jax.numpy.ones((32, 32))
  scanned = lambda x, w: jax.lax.scan(lambda c, _: (jax.numpy.tanh(c @ w), None), x, None, length=6)[0]

  def unrolled(x, w):
    for _ in range(6):
      x = jax.numpy.tanh(x @ w)
    return x

  def flops_of(f):
    compiled = jax.jit(f).lower(x, w).compile(compiler_options=search_lib.FAST_CPU_COMPILE)
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return ca['flops'], hlo.loop_dot_flops(compiled.as_text())

  (body_once, extra), (ref, none) = flops_of(scanned), flops_of(unrolled)
  assert none == 0 and extra == 5 * 2 * 16 * 32 * 32
  assert body_once + extra == pytest.approx(ref, rel=1e-3)


GPU_HLO = """HloModule g

%fused_gather (param_0: f32[1024,512], param_1: s32[1024,1]) -> f32[1024] {
  %param_0 = f32[1024,512]{1,0} parameter(0)
  %neg = f32[1024,512]{1,0} negate(%param_0)
  %param_1 = s32[1024,1]{1,0} parameter(1)
  %g = f32[1024,1]{1,0} gather(%neg, %param_1), offset_dims={1}, collapsed_slice_dims={}, slice_sizes={1,1}
  ROOT %b = f32[1024]{0} bitcast(%g)
}

%fused_exp (param_0.1: f32[1024,512]) -> bf16[1024,512] {
  %param_0.1 = f32[1024,512]{1,0} parameter(0)
  %e = f32[1024,512]{1,0} exponential(%param_0.1)
  ROOT %c = bf16[1024,512]{1,0} convert(%e)
}

%fused_dus (param_0.2: f32[4,256], param_1.2: f32[1,256], param_2.2: s32[]) -> f32[4,256] {
  %param_0.2 = f32[4,256]{1,0} parameter(0)
  %param_1.2 = f32[1,256]{1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[4,256]{1,0} dynamic-update-slice(%param_0.2, %param_1.2, %param_2.2, %z)
}

%fused_scatter (param_0.3: f32[1000,64], param_1.3: s32[16,1], param_2.3: bf16[16,64]) -> f32[1000,64] {
  %param_0.3 = f32[1000,64]{1,0} parameter(0)
  %param_1.3 = s32[16,1]{1,0} parameter(1)
  %param_2.3 = bf16[16,64]{1,0} parameter(2)
  %u = f32[16,64]{1,0} convert(%param_2.3)
  ROOT %sc = f32[1000,64]{1,0} scatter(%param_0.3, %param_1.3, %u), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%gemm_comp (p0: bf16[1,256], p1: bf16[256,256]) -> f32[1,256] {
  %p0 = bf16[1,256]{1,0} parameter(0)
  %p1 = bf16[256,256]{1,0} parameter(1)
  ROOT %dot = f32[1,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,256], bf16[1,256], bf16[256,256])) -> (s32[], f32[4,256], bf16[1,256], bf16[256,256]) {
  %p = (s32[], f32[4,256]{1,0}, bf16[1,256]{1,0}, bf16[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %acc = f32[4,256]{1,0} get-tuple-element(%p), index=1
  %h = bf16[1,256]{1,0} get-tuple-element(%p), index=2
  %w = bf16[256,256]{1,0} get-tuple-element(%p), index=3
  %mm = f32[1,256]{1,0} fusion(%h, %w), kind=kCustom, calls=%gemm_comp, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %up = f32[4,256]{1,0} fusion(%acc, %mm, %i), kind=kLoop, calls=%fused_dus
  ROOT %t = (s32[], f32[4,256]{1,0}, bf16[1,256]{1,0}, bf16[256,256]{1,0}) tuple(%i, %up, %h, %w)
}

%cond (q: (s32[], f32[4,256], bf16[1,256], bf16[256,256])) -> pred[] {
  %q = (s32[], f32[4,256]{1,0}, bf16[1,256]{1,0}, bf16[256,256]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

ENTRY %main (a: f32[1024,512], t: s32[1024,1], q: bf16[2,128,4,64]) -> f32[1024] {
  %a = f32[1024,512]{1,0} parameter(0)
  %t = s32[1024,1]{1,0} parameter(1)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(2)
  %picked = f32[1024]{0} fusion(%a, %t), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(step)/take"}
  %probs = bf16[1024,512]{1,0} fusion(%a), kind=kLoop, calls=%fused_exp
  %sum = f32[1024]{0} reduce(%a, %zero), dimensions={1}, to_apply=%add
  %att = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax"
  %moved = bf16[2,128,4,64]{3,2,1,0} copy(%q)
  %table = f32[1000,64]{1,0} parameter(4)
  %rows = s32[16,1]{1,0} parameter(5)
  %grads = bf16[16,64]{1,0} parameter(6)
  %added = f32[1000,64]{1,0} fusion(%table, %rows, %grads), kind=kInput, calls=%fused_scatter
  %x8 = f32[8]{0} parameter(3)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%x8), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %w0 = (s32[], f32[4,256]{1,0}, bf16[1,256]{1,0}, bf16[256,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[1024]{0} bitcast(%picked)
}
"""


def test_kernels_and_their_bytes_of_a_gpu_program():
  """What a step launches and moves: fusions, library calls and copies, loop bodies once per trip; a fused gather
  reads its rows' elements, not its operand; a loop's in-place update writes its slice, an in-place scatter reads
  and writes the rows it adds to; reducers and fused computations are not kernels."""
  got = {k.name: k for k in hlo.kernels(GPU_HLO)}
  assert set(got) == {'picked', 'probs', 'sum', 'att', 'moved', 'added', 'ags', 'mm', 'up', 'lt'}  # not the -done
  assert got['added'].bytes == 16 * 64 * 4 + 16 * 4 + 16 * 64 * 2 + 16 * 64 * 4  # in place: the rows it adds to
  assert (got['ags'].kind, got['ags'].bytes) == ('collective', 8 * 4 + 64 * 4)
  assert (got['picked'].kind, got['picked'].op_name) == ('elementwise', 'jit(step)/take')
  assert got['picked'].bytes == 1024 * 4 + 1024 * 4 + 1024 * 4  # gathered elements, indices, result
  assert got['probs'].bytes == 1024 * 512 * (4 + 2)  # read whole, written in bf16
  assert (got['sum'].kind, got['sum'].bytes) == ('reduce', 1024 * 512 * 4 + 1024 * 4)
  assert (got['att'].kind, got['att'].bytes) == ('attention', 4 * 2 * 128 * 4 * 64 * 2)
  assert (got['moved'].kind, got['moved'].bytes) == ('copy', 2 * 2 * 128 * 4 * 64 * 2)
  assert (got['mm'].kind, got['mm'].times, got['mm'].bytes) == ('matmul', 4, 256 * 2 + 256 * 256 * 2 + 256 * 4)
  assert (got['up'].times, got['up'].bytes) == (4, 256 * 4 + 4 + 256 * 4)  # the row read and written, the index
  assert got['lt'].times == 4
  summary = hlo.kernel_summary(hlo.kernels(GPU_HLO))
  assert summary['matmul'] == (4, 4 * got['mm'].bytes)
  assert summary['total'][0] == 4 + 4 + 4 + 7  # 4 matmuls, 4 updates, 4 loop tests, 7 entry kernels


# --- The cost model ---------------------------------------------------------------------------------------------


def test_cost_model_ranks_a_bad_plan_below_a_good_one():
  h100 = flops.chip('h100')
  key = lambda op, axes, hosts=1: cost.CollectiveKey(op, axes, 8, hosts)
  good = cost.Profile(1e14, 1e11, 20 * 2**30, 10 * 2**30, 10 * 2**30, {key('all-gather', ('fsdp',)): (32, 4e9)})
  # the same FLOPs, twice the bytes and every collective across hosts
  bad = cost.Profile(1e14, 1e11, 20 * 2**30, 10 * 2**30, 10 * 2**30, {key('all-gather', ('fsdp',), 8): (64, 8e9)})
  over = cost.Profile(1e14, 1e11, 90 * 2**30, 10 * 2**30, 80 * 2**30, {})
  g, b, o = (cost.predict(p, h100, 64) for p in (good, bad, over))
  assert g.step_s < b.step_s and b.by_axes['fsdp (DCN)'] > 10 * g.by_axes['fsdp']
  assert g.fits and not o.fits and o.memory_gib == 90
  # the extrapolation over layers: X1 + (L - 1)(X2 - X1)
  two = good.combine(good, 2, -1)
  assert two.flops == good.flops and two.collectives == good.collectives
  assert search_lib.spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)


# --- A search on 8 simulated devices: pruning reasons, compiled scores, the plan file ----------------------------


def _tiny_llama():
  c = llama.get_config('fsdp,tiny')
  c.model.num_layers = 1  # one proxy compile per plan
  return c


@pytest.fixture(scope='module')
def searched():
  config = _tiny_llama()
  rules = candidates.rule_variants(llama.RULES)
  cpu = flops.chip('cpu')
  s = search_lib.Search(config, lambda m, r: models.create(m, r), cpu, 8)
  mesh = lambda **kw: tuple((a, kw.get(a, 1)) for a in ('data', 'fsdp', 'tensor'))
  conflict = (
    ('batch', 'data'),
    ('length', 'data'),
    ('embed', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('kv', None),
    ('vocab', None),
    ('norm', None),
    ('layers', None),
  )
  cands = [
    candidates.Candidate(mesh(fsdp=8), 'fsdp', rules['fsdp'], 'none'),
    candidates.Candidate(mesh(data=8), 'dp', rules['dp'], 'none'),
    candidates.Candidate(mesh(data=8), 'fsdp', rules['fsdp'], 'none'),  # same shardings as dp
    candidates.Candidate(mesh(tensor=8), 'dp', rules['dp'], 'none'),  # tensor unused
    candidates.Candidate(mesh(tensor=8), 'tp', rules['tp'], 'none'),  # 4 kv heads over 8
    candidates.Candidate(mesh(data=8), 'conflict', conflict, 'none'),  # 'length' finds 'data' taken
  ]
  return s, s.run(cands)


def test_pruning_reasons_are_counted_and_named(searched):
  _, result = searched
  assert result.considered == 6 and result.compiled == 2
  assert result.pruned == {
    'same shardings as an earlier plan (compiled once)': 1,
    'mesh axis of size > 1 that no rule uses (repeated work)': 1,
    'dimension not divisible by its mesh axes': 1,
    'conflicting rules (no free mesh axis)': 1,
  }
  assert 'kv_heads' in result.examples['dimension not divisible by its mesh axes']


def test_compiled_scores(searched):
  _, result = searched
  by = {s.candidate.rules_name: s for s in result.ranked}
  fsdp, dp = by['fsdp'], by['dp']
  # FSDP gathers parameters over 'fsdp'; data parallelism only all-reduces gradients over 'data'
  assert any(k.op == 'all-gather' and k.axes == ('fsdp',) for k in fsdp.profile.collectives)
  assert not any(k.op == 'all-gather' for k in dp.profile.collectives)
  assert {k.axes for k in dp.profile.collectives} == {('data',)}
  assert fsdp.profile.argument_bytes < dp.profile.argument_bytes  # parameters and Adam state sharded 8 ways
  assert all(s.prediction.step_s > 0 and s.mfu > 0 and s.prediction.fits for s in result.ranked)


def test_orders_over_hosts_share_one_compile():
  """data=2 x fsdp=4 over 2 hosts, in its two axis orders: one is compiled, and the other order's collectives,
  placed on hosts from the same program's groups, equal the ones its own compile gives (data across hosts:
  the gradient all-reduce on DCN; fsdp across hosts: the gathers on DCN)."""
  config = _tiny_llama()
  rules = tuple(llama.RULES['fsdp'])
  outer_data = candidates.Candidate((('data', 2), ('fsdp', 4), ('tensor', 1)), 'fsdp', rules, 'none')
  outer_fsdp = candidates.Candidate((('fsdp', 4), ('data', 2), ('tensor', 1)), 'fsdp', rules, 'none')
  s = search_lib.Search(config, lambda m, r: models.create(m, r), flops.chip('cpu'), 8, hosts=2)
  result = s.run([outer_data, outer_fsdp])
  assert result.compiled == 1 and len(result.ranked) == 2 and not result.pruned
  shared = {sc.candidate.mesh: sc.profile for sc in result.ranked}
  # the order that was not compiled, compiled on its own
  own = search_lib.Search(config, lambda m, r: models.create(m, r), flops.chip('cpu'), 8, hosts=2)
  assert own.run([outer_fsdp]).ranked[0].profile == shared[outer_fsdp.mesh]
  dcn = lambda p: {k.axes for k in p.collectives if k.hosts > 1}
  assert ('data',) in dcn(shared[outer_data.mesh]) and ('fsdp',) not in dcn(shared[outer_data.mesh])
  assert ('fsdp',) in dcn(shared[outer_fsdp.mesh]) and ('data',) not in dcn(shared[outer_fsdp.mesh])


def test_a_plan_over_hosts_is_scored_and_written_as_train_py_lays_it_out(monkeypatch):
  """data=3 x fsdp=2 over 2 hosts of 3 devices, in either order, is one layout as written (fsdp across the
  hosts, data within them: split_over_hosts): scored once, with fsdp's collectives across hosts and data's
  within. Its batch rule lists fsdp first, so each host reads one block of rows (what train.py's loader needs);
  written in the candidate's order, ('data', 'fsdp'), host 0 would hold rows 0, 2 and 4, which prunes a plan."""
  config = _tiny_llama()
  config.batch_size = 6
  rules = tuple(llama.RULES['fsdp'])
  data_first = candidates.Candidate((('data', 3), ('fsdp', 2), ('tensor', 1)), 'fsdp', rules, 'none')
  fsdp_first = candidates.Candidate((('fsdp', 2), ('data', 3), ('tensor', 1)), 'fsdp', rules, 'none')
  s = search_lib.Search(config, models.create, flops.chip('cpu'), 6, hosts=2)
  result = s.run([data_first, fsdp_first])
  assert len(result.ranked) == 1 and result.pruned == {'same shardings as an earlier plan (compiled once)': 1}
  across = {k.axes for k in result.ranked[0].profile.collectives if k.hosts > 1}
  assert ('fsdp',) in across and ('data',) not in across
  plan = search_lib.apply(config, data_first, hosts=2)
  assert dict(plan.dcn_mesh) == {'data': 1, 'fsdp': 2, 'tensor': 1}
  assert ('batch', ('fsdp', 'data')) in plan.logical_axis_rules and s._scattered_rows(data_first) is None
  written = search_lib.apply
  monkeypatch.setattr(search_lib, 'apply', lambda c, cand, hosts=1: _with_rules(written(c, cand, hosts), cand.rules))
  assert s._scattered_rows(data_first) == 'host 0 would hold rows [(0, 1), (2, 3), (4, 5)] of 6'
  result = search_lib.Search(config, models.create, flops.chip('cpu'), 6, hosts=2).run([data_first])
  assert not result.ranked and list(result.pruned) == [search_lib.SCATTERED_ROWS]


def _with_rules(config, rules):
  with config.unlocked():
    config.logical_axis_rules = [tuple(r) for r in rules]
  return config


def test_gpu_target_compiled_on_cpu_traces_attention_as_on_the_gpu(monkeypatch):
  """For a GPU target the search traces the step under attention.gpu_stand_in: 'blockwise' runs (per shard)
  where the GPU would run cuDNN, without XLA's L x L scores: fewer temporaries, the same FLOPs. They stay an
  upper bound (not the GPU's), and the bytes term stays off."""
  from models import attention

  monkeypatch.setattr(attention, 'BLOCKWISE_KEYS', 32)  # 8 blocks of keys
  config = _tiny_llama()
  config.model.update(dtype='bfloat16', max_len=256)
  config.dataset.seq_len = 256
  mesh = (('data', 8), ('fsdp', 1), ('tensor', 1))
  plan = [candidates.Candidate(mesh, 'dp', tuple(llama.RULES['dp']), 'none')]
  profiles = {}
  for stand_in in (None, attention.gpu_stand_in):
    s = search_lib.Search(config, lambda m, r: models.create(m, r), flops.chip('h100'), 8, stand_in=stand_in)
    assert not s.temporaries_known and not s.bytes_known
    profiles[stand_in] = s.run(plan).ranked[0].profile
  xla, blockwise = profiles.values()
  assert blockwise.temp_bytes < 0.5 * xla.temp_bytes and blockwise.flops == pytest.approx(xla.flops, rel=0.05)
  # the memory is modelled from what the backward keeps, not from the CPU's temporaries
  assert 0 < blockwise.kept_fused < blockwise.kept_written < xla.kept_written
  assert 'blockwise (causal, bfloat16, L=256, head_dim 8) standing in for cudnn (gpu_stand_in)' in attention.decisions()


def test_memory_compiled_for_the_target_devices_replaces_the_model():
  """With `memory_devices` (search.py passes the target GPU's compile-only devices, planning/targets.py, where
  JAX's CUDA plugin is installed) each plan's memory is its step compiled over those devices, exactly, instead
  of the residual model; FLOPs and collectives still come from the CPU compile. Here 8 other CPU devices stand
  in for the GPU's: the memory equals the step compiled over them directly."""
  config = _tiny_llama()
  mesh = (('data', 2), ('fsdp', 4), ('tensor', 1))
  plan = candidates.Candidate(mesh, 'fsdp', tuple(llama.RULES['fsdp']), 'none')
  other = jax.devices()[::-1]
  s = search_lib.Search(config, lambda m, r: models.create(m, r), flops.chip('h100'), 8, memory_devices=other)
  assert s.temporaries_known and not s.bytes_known
  built = []
  trainer = s._trainer
  s._trainer = lambda *a: built.append(a[2] if len(a) > 2 else None) or trainer(*a)
  scored = s.run([plan]).ranked[0]
  assert built.count(other) == 1  # the proxy (1 layer: the config itself) traced over the memory devices
  direct = s._trainer(search_lib.apply(config, plan), plan, other)
  mem = training.trace(direct, training.jit_train_step(direct)).lower().compile().memory_analysis()
  want = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
  assert scored.profile.memory == want and scored.profile.temp_bytes == mem.temp_size_in_bytes
  assert scored.profile.kept_written == 0 and scored.prediction.memory_range is None
  assert scored.prediction.memory_gib == pytest.approx(want / 2**30)
  assert any(k.axes == ('fsdp',) for k in scored.profile.collectives)  # from the CPU compile, as before


def test_a_plan_the_target_compiler_refuses_for_memory_is_over_memory():
  """The TPU compiler refuses a program over the chip's memory (RESOURCE_EXHAUSTED, at compile time): the plan is
  scored as over memory, with the temporaries the compiler said it needed, instead of ending the search."""
  import jax

  config = _tiny_llama()
  mesh = (('data', 2), ('fsdp', 4), ('tensor', 1))
  plan = candidates.Candidate(mesh, 'fsdp', tuple(llama.RULES['fsdp']), 'none')
  s = search_lib.Search(
    config, lambda m, r: models.create(m, r), flops.chip('tpu_v5e'), 8, memory_devices=jax.devices()[::-1]
  )

  class Refused:
    def lower(self):
      return self

    def compile(self):
      raise jax.errors.JaxRuntimeError(
        'RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for '
        'HLO temporaries (25.33G) exceeds available HBM (15.75G).'
      )

  s._memory_steps = lambda trainers, cand: [Refused() for _ in trainers]
  result = s.run([plan])
  scored = result.ranked[0]
  assert not scored.prediction.fits and scored.profile.temp_bytes == 25.33 * 2**30
  assert scored.prediction.memory_gib == pytest.approx(25.33 + scored.profile.argument_bytes / 2**30)
  assert result.pruned['over device memory (compiled)'] == 1


def test_which_target_the_memory_is_compiled_for():
  from planning import targets

  assert targets.memory_target('h100', 8, 'none') == (None, '--compile_target=none')
  assert targets.memory_target('h100', 8, 'h100_sxm')[0] == 'h100_sxm'
  assert targets.memory_target('a100', 8)[0] is None and 'no GPU target for a100' in targets.memory_target('a100', 8)[1]
  with pytest.raises(ConfigError, match=r"GPU target 'b300' is neither one of \['h100_sxm'\]"):
    targets.memory_target('h100', 8, 'b300')
  target, why = targets.memory_target('h100', 8)
  if targets.plugin_installed():
    assert target == 'h100_sxm'
    # 9 GPUs do not lay out over hosts of 8: 'auto' falls back to the model and says why
    assert targets.memory_target('h100', 9) == (
      None,
      '9 GPUs do not fill 2 hosts of 8: ask for a multiple of 8, or at most 8',
    )
  else:  # CI: one line saying what to install
    assert target is None and 'pip install "jax[cuda13]==' in why
  # TPU chips compile as one slice of that many chips, where libtpu is installed
  assert targets.memory_target('h100', 8, 'tpu_v5p') == ('tpu_v5p', '--compile_target=tpu_v5p')
  assert targets.memory_target('tpu_v5e', 12)[0] is None
  target, why = targets.memory_target('tpu_v5e', 8)
  if targets.libtpu_installed():
    assert (target, why) == ('tpu_v5e', 'tpu_v5e compiles as a v5e:2x4 slice')
    assert '12 tpu_v5e chips make no slice' in targets.memory_target('tpu_v5e', 12)[1]
  else:
    assert target is None and why.startswith('libtpu is not installed (pip install "jax[tpu]==')


# --- The GPU memory model: what the backward keeps (planning/residuals.py) ----------------------------------------


def test_residual_walk_keeps_what_fusion_cannot_recompute():
  """exp is recomputed inside the backward's fusion from tanh's output, which is kept (XLA's GPU fusion will not
  duplicate tanh); the scaled input a matmul read from memory is kept as written; inputs are never counted."""
  import jax.numpy as jnp

  def kept(w, x):
    def loss(w):
      h = x * 2.0  # read by the matmul: written
      return jnp.sum(jnp.exp(jnp.tanh(h @ w)))

    return jax.tree.leaves(jax.vjp(loss, w)[1])

  w, x = jax.ShapeDtypeStruct((8, 16), 'float32'), jax.ShapeDtypeStruct((4, 8), 'float32')
  closed = jax.make_jaxpr(kept)(w, x)
  made_by = {v: e.primitive.name for e in closed.jaxpr.eqns for v in e.outvars}
  fused, written = residuals._kept_values(closed)
  assert [(made_by[v], v.aval.shape) for v in fused] == [('tanh', (4, 16))]  # not the matmul's output behind it
  assert [(made_by[v], v.aval.shape) for v in written] == [('mul', (4, 8))]  # x * 2


def _llama_kept(remat, mesh_shape, batch=16, **model):
  config = _tiny_llama()
  config.model.update(dtype='bfloat16', remat=remat, vocab_size=512, num_layers=2, **model)
  config.batch_size = batch
  mesh = partitioning.make_mesh(dict(mesh_shape), jax.devices()[: 8 if any(s > 1 for _, s in mesh_shape) else 1])
  tr = training.build(config, mesh, lambda rngs: models.create(config.model, rngs))
  return residuals.estimate(tr, compiler_options=search_lib.FAST_CPU_COMPILE)


def test_residual_model_sees_remat_and_sharding():
  """What the CPU compile cannot show: remat policies keep less in that order, per device under FSDP an
  eighth, and the working set is the float32 logits' gradient in bf16 (16 x 64 x 512 x 2 bytes on one device);
  bf16 logits get theirs written over them."""
  one = (('data', 1), ('fsdp', 1), ('tensor', 1))
  est = {r: _llama_kept(r, one) for r in ('none', 'dots', 'full')}
  assert est['none'].fused > est['dots'].fused > est['full'].fused > 0
  assert est['none'].written > est['dots'].written > est['full'].written
  assert est['none'].largest == 16 * 64 * 512 * 2
  assert _llama_kept('dots', one, logits_dtype='bfloat16').largest < 16 * 64 * 512 * 2 / 4  # no logits-sized array
  fsdp = _llama_kept('dots', (('data', 1), ('fsdp', 8), ('tensor', 1)))
  assert fsdp.kept == pytest.approx(est['dots'].kept / 8, rel=0.05)
  assert fsdp.largest == est['dots'].largest / 8
  # the model's estimate: state + (fused + written) / 2 + largest, the range from fused to written
  gib = 2**30
  p = cost.Profile(
    1e12, 1e9, 30 * gib, 10 * gib, 20 * gib, {}, kept_fused=20 * gib, kept_written=40 * gib, kept_largest=8 * gib
  )
  pred = cost.predict(p, flops.chip('h100'), 8, temporaries_known=False, bytes_known=False)
  assert pred.memory_gib == 10 + 30 + 8 and pred.memory_range == (38, 58) and pred.fits
  assert not cost.predict(
    dataclasses.replace(p, kept_written=100 * gib), flops.chip('h100'), 8, temporaries_known=False
  ).fits  # 10 + 60 + 8 > 0.9 x 80


def test_plan_file_round_trips_through_train_py(searched, tmp_path):
  s, result = searched
  win = result.ranked[0]
  plan = search_lib.apply(s.config, win.candidate)
  base = llama.get_config('tiny')
  out = str(tmp_path / 'plan.py')
  plan_file.write(out, plan_file.render(LLAMA, 'tiny', base, plan, 'test plan'))
  fv = flags.FlagValues()  # the way train.py reads --config
  config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True)
  fv(['train.py', f'--config={out}'])
  loaded = fv.config
  assert loaded.to_dict() == plan.to_dict()
  import train

  assert train.train_and_evaluate(loaded, None, dry_run=True)['num_params'] > 0
  mesh = training.build(loaded, s._trainer(loaded, win.candidate).mesh, lambda r: models.create(loaded.model, r))
  ours = s._trainer(plan, win.candidate)
  assert dict(mesh.mesh.shape) == dict(win.candidate.mesh)
  assert mesh.specs == ours.specs
  # Over 2 hosts the same plan is written as a hybrid mesh: its leading axis across hosts (config.dcn_mesh),
  # which train.py builds with the same axis sizes and shardings.
  hybrid = search_lib.apply(s.config, win.candidate, hosts=2)
  lead, size = next((a, n) for a, n in win.candidate.mesh if n > 1)
  assert hybrid.dcn_mesh[lead] == 2 and hybrid.mesh[lead] == size // 2
  plan_file.write(out, plan_file.render(LLAMA, 'tiny', base, hybrid, 'test plan'), overwrite=True)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, '', flag_values=fv, lock_config=True)
  fv(['train.py', f'--config={out}'])
  assert fv.config.to_dict() == hybrid.to_dict()
  hybrid_mesh = partitioning.make_mesh(fv.config.mesh, jax.devices()[:8], fv.config.dcn_mesh)
  assert dict(hybrid_mesh.shape) == dict(win.candidate.mesh)


def test_accuracy_fit_recovers_a_known_ranking_and_overhead(tmp_path):
  """benchmarks/search_accuracy.py --fit on plans whose times come from a known 'cpu' chip plus a fixed
  overhead: the fitted constants rank them exactly and the overhead comes back."""
  import dataclasses
  import json
  import sys

  true = dataclasses.replace(
    flops.chip('cpu'), compute_eff=0.3, latency_us=400.0, dcn_latency_us=400.0, link_eff=0.5, step_overhead_us=20000.0
  )
  plans = []
  for i in range(8):
    key = cost.CollectiveKey('all-reduce' if i % 2 else 'all-gather', ('data',), 8, 1)
    profile = cost.Profile(2e8 * (1 + i % 3), 1e6, 1e9, 5e8, 5e8, {key: (float(4 + 3 * i), 1e6 * (8 - i))})
    plans.append(
      dict(
        plan=f'plan {i}',
        predicted_s=0.0,
        measured_s=cost.predict(profile, true, 8).step_s,
        times=[],
        profile=dict(
          flops=profile.flops,
          bytes_accessed=profile.bytes_accessed,
          memory=profile.memory,
          argument_bytes=profile.argument_bytes,
          temp_bytes=profile.temp_bytes,
          collectives=[[dataclasses.asdict(key), list(v)] for key, v in profile.collectives.items()],
        ),
      )
    )
  path = tmp_path / 'synthetic.json'
  path.write_text(json.dumps(dict(config='synthetic', devices=8, search_s=0.0, plans=plans)))
  out = children.run(
    [sys.executable, 'benchmarks/search_accuracy.py', '--fit', str(path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  fitted = out.stdout.split('fitted on')[1]
  assert 'Spearman 1.000' in fitted and '(+0.0%)' in fitted, out.stdout
  overhead = float(fitted.split('step overhead ')[1].split(' us')[0])
  assert 15000 < overhead < 25000, out.stdout


def test_a_plan_over_memory_is_tried_in_micro_batches_and_written_with_them(tmp_path):
  """Data parallel over 8 devices, 64 rows of 64 tokens: on a chip between its memory in 1 and in 2 micro-batches
  the search keeps the plan in 2 micro-batches (scored with its gradient all-reduce once per micro-batch), and the
  plan file sets config.grad_accum_steps; 4 is not tried once 2 fits."""
  config = _tiny_llama()
  config.batch_size = 64
  dp = candidates.Candidate(
    tuple((a, 8 if a == 'data' else 1) for a in ('data', 'fsdp', 'tensor')),
    'dp',
    candidates.rule_variants(llama.RULES)['dp'],
    'none',
  )
  cpu = flops.chip('cpu')
  s = search_lib.Search(config, lambda m, r: models.create(m, r), cpu, 8)
  one, two = s.run([dp, dataclasses.replace(dp, micro=2)]).ranked
  one, two = sorted((one, two), key=lambda p: p.candidate.micro)
  assert two.prediction.memory_gib < one.prediction.memory_gib  # temporaries fall with micro-batches
  reduce = lambda p: sum(r for k, (r, _) in p.profile.collectives.items() if k.op == 'all-reduce')
  assert reduce(two) > reduce(one)  # the loop's per-micro-batch gradient reduction is scored

  between = dataclasses.replace(cpu, memory_gib=(one.prediction.memory_gib + two.prediction.memory_gib) / 2 / 0.9)
  s = search_lib.Search(config, lambda m, r: models.create(m, r), between, 8)
  result = s.run([dp], micro_batches=[4, 2])
  assert [(p.candidate.micro, p.prediction.fits) for p in result.ranked] == [(2, True), (1, False)]
  assert result.pruned['over device memory (compiled)'] == 1
  plan = search_lib.apply(s.config, result.ranked[0].candidate)
  text = plan_file.render(LLAMA, 'tiny', llama.get_config('tiny'), plan, 'test plan')
  assert '  c.grad_accum_steps = 2\n' in text


def test_the_table_uses_units_that_fit_its_figures(searched):
  """Tiny plans print microseconds and KiB, not '0.0' ms, 'AR 0.0004G' or '0.0 GiB'."""
  _, result = searched
  text = report.table(result.ranked, flops.chip('cpu'))
  assert not re.search(r'\b0\.0+ ?(G|GiB|ms)\b|\b\d\.\d+e-\d', text), text
  assert re.search(r'\d (KiB|MiB)', text) and re.search(r'\d (us|ms|s)\b', text), text
  assert [report.seconds(x) for x in (2.5, 0.0123, 4e-5)] == ['2.5 s', '12.3 ms', '40 us']


def test_a_search_says_how_long_it_will_take_before_the_bulk(monkeypatch):
  config = _tiny_llama()
  rules = candidates.rule_variants(llama.RULES)
  s = search_lib.Search(config, lambda m, r: models.create(m, r), flops.chip('cpu'), 8)
  mesh = lambda **kw: tuple((a, kw.get(a, 1)) for a in ('data', 'fsdp', 'tensor'))
  said = []
  s.run(
    [
      candidates.Candidate(mesh(fsdp=8), 'fsdp', rules['fsdp'], 'none'),
      candidates.Candidate(mesh(data=8), 'dp', rules['dp'], 'none'),
    ],
    announce=said.append,
  )
  assert said[0] == '2 candidates: 2 programs at most to trace and compile (2 workers)', said
  assert re.fullmatch(
    r'the first took [\d.]+ s to trace, [\d.]+ s to compile: at most about \d+ s for all 2 \(pruned ones take less\)',
    said[1],
  ), said
