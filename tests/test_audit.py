"""The compiled-step audit: collectives parsed from HLO, and what each preset's rules imply."""

import partitioning
import training
from tests.conftest import build_trainer, tiny_config

HLO = """
ENTRY %main {
  %p = f32[8,16]{1,0} parameter(0)
  %all-gather.1 = f32[16,16]{1,0} all-gather(%p), channel_id=1, dimensions={0}
  %all-reduce.2 = (f32[4]{0}, bf16[2,2]{1,0}) all-reduce(%a, %b), channel_id=2, to_apply=%add
  %ags = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%p), channel_id=3, dimensions={0}
  %agd = f32[32,16]{1,0} all-gather-done(%ags)
  ROOT %rs = f32[2]{0} reduce-scatter(%x), channel_id=4, dimensions={0}
  %rss = ((f32[256,256]{1,0}, bf16[64]{0}), (f32[32,256]{1,0}, bf16[8]{0})) reduce-scatter-start(%g, %h), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %ars = (f32[1000]{0}, f32[3]{0}) all-reduce-start(%a, %b), channel_id=6, replica_groups=[1,8]<=[8], to_apply=%add
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%c), channel_id=7, source_target_pairs={{0,1},{1,0}}
}
"""


def test_collective_stats_parses_counts_and_bytes():
  """Async starts count their results once: a combined start (several collectives in one, as XLA's GPU
  combiners make them: reduce-scatter-start's shape is (operands, results)) counts every result."""
  assert partitioning.collective_stats(HLO) == {
    'all-gather': (2, 16 * 16 * 4 + 32 * 16 * 4),
    'all-reduce': (2, 4 * 4 + 2 * 2 * 2 + 1003 * 4),
    'reduce-scatter': (2, 2 * 4 + 32 * 256 * 4 + 8 * 2),
    'collective-permute': (1, 4 * 4),
  }


def _stats(preset):
  cfg = tiny_config(preset)
  trainer = build_trainer(cfg)
  compiled = training.compile_step(trainer, training.jit_train_step(trainer))
  return partitioning.collective_stats(compiled.as_text()), partitioning.audit(compiled)


def test_data_parallel_gathers_no_parameters_and_fsdp_does():
  dp, line = _stats('dp')
  assert 'all-gather' not in dp and dp['all-reduce'][0] > 0  # replicated params; gradients all-reduced
  assert line.startswith('arguments ') and 'collectives: all-reduce x' in line
  fsdp, _ = _stats('fsdp')
  assert fsdp['all-gather'][0] > 0  # parameters sharded on 'embed' are gathered for use


def test_replica_groups_in_every_hlo_form_and_what_crosses_dcn():
  """Explicit, iota and mesh-form replica groups (jax 0.10's XLA prints the last) and permute pairs become groups
  of partition ids; with the slice of each, only the collectives whose groups span slices count as DCN."""
  groups = partitioning.replica_groups
  assert groups('{{0,4},{1,5}}', 8) == [[0, 4], [1, 5]] and groups('{}', 4) == [[0, 1, 2, 3]]
  assert groups('[2,4]<=[8]', 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert groups('[2,4]<=[4,2]T(1,0)', 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  mesh_form = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {%s}"
  assert groups(mesh_form % "'axis_0'", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert groups(mesh_form % "'axis_2'", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  hlo = (
    '  %a = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add\n'
    '  %b = f32[4]{0} all-reduce(%p), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add\n'
    '  %c = f32[2]{0} collective-permute(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}\n'
    '  %d = f32[16]{0} collective-permute(%p), channel_id=4, source_target_pairs={{1,2},{3,0}}\n'
  )
  slice_of = [0, 0, 1, 1]  # devices 0-1 and 2-3 are two slices
  assert partitioning.collective_stats(hlo, slice_of) == {'all-reduce': (1, 16), 'collective-permute': (1, 64)}
  assert partitioning.collective_stats(hlo)['all-reduce'] == (2, 48)
