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
}
"""


def test_collective_stats_parses_counts_and_bytes():
  assert partitioning.collective_stats(HLO) == {
      'all-gather': (2, 16 * 16 * 4 + 32 * 16 * 4),  # an async start counts its result once
      'all-reduce': (1, 4 * 4 + 2 * 2 * 2),
      'reduce-scatter': (1, 2 * 4),
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
