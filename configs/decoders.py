"""The decoder families' config files (configs/qwen2.py, qwen3.py, mistral.py, gemma.py, gemma2.py, gemma3.py,
phi3.py, olmo2.py) are thin tables over this module (not a config itself: it has no get_config): the published
sizes of each family (SIZES, config.json's architecture as the hub ships it), their tiny sizes, and `config`, which
builds one config as configs/llama.py does: the transformer presets (dp, fsdp, tp, cp, pp, fsdp_tp), bf16 compute
and packed C4 at real sizes, the offline Markov language at tiny size. What the families' blocks do differently is
declared in models/decoder.py (FAMILIES), not here: a config sets only the per-checkpoint fields.
"""

from __future__ import annotations

import ml_collections

from configs import common, schema

# Rotary bases and the like that several sizes of a family share.
_QWEN = dict(rope_theta=1_000_000.0, norm_eps=1e-6)
_GEMMA3 = dict(
  vocab_size=262_208,
  head_dim=256,
  query_pre_attn_scalar=256.0,
  rope_theta=1_000_000.0,
  local_rope_theta=10_000.0,
  sliding_window=1024,
  layer_pattern='LLLLLG',
  rope_scaling=(('rope_type', 'linear'), ('factor', 8.0)),
  norm_eps=1e-6,
  tie_embeddings=True,
  max_len=131_072,
)
# The tiny sizes: 2-4 layers of width 64 on the offline Markov language (16 symbols); local layers (where a family
# has them) with a window of 16 of the 64 tokens, so the windows cut. vocab_size unset: the data's (the Markov
# language's symbols; a tokenizer's ids), so your own file trains from the command line (docs/your_data.md).
_TINY = dict(
  embed_dim=64,
  mlp_dim=128,
  num_layers=2,
  num_heads=8,
  num_kv_heads=4,
  head_dim=8,
  norm_eps=1e-6,
  max_len=64,
)


def _shape(vocab_size, embed_dim, mlp_dim, num_layers, num_heads, num_kv_heads, head_dim) -> dict:
  """The seven numbers every config.json has, in one row of the table below."""
  return dict(
    vocab_size=vocab_size,
    embed_dim=embed_dim,
    mlp_dim=mlp_dim,
    num_layers=num_layers,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
  )


# Each real size: _shape(vocab, width, MLP width, layers, heads, KV heads, head dim), then its other fields.
SIZES = {
  'qwen2': {
    # Qwen2.5-0.5B: 494,032,768 parameters (tied); Qwen2.5-7B: 7,615,616,512 (untied)
    '0.5b': dict(_shape(151_936, 896, 4864, 24, 14, 2, 64), tie_embeddings=True, max_len=32_768, **_QWEN),
    '7b': dict(_shape(152_064, 3584, 18_944, 28, 28, 4, 128), tie_embeddings=False, max_len=32_768, **_QWEN),
    'tiny': dict(_TINY, tie_embeddings=True),
  },
  'qwen3': {
    # Qwen3-0.6B: 596,049,920 (tied); Qwen3-8B: 8,190,735,360; Qwen3-32B: 32,762,123,264 (untied)
    '0.6b': dict(_shape(151_936, 1024, 3072, 28, 16, 8, 128), tie_embeddings=True, max_len=40_960, **_QWEN),
    '8b': dict(_shape(151_936, 4096, 12_288, 36, 32, 8, 128), tie_embeddings=False, max_len=40_960, **_QWEN),
    '32b': dict(_shape(151_936, 5120, 25_600, 64, 64, 8, 128), tie_embeddings=False, max_len=40_960, **_QWEN),
    'tiny': dict(_TINY, head_dim=16, tie_embeddings=False),  # head_dim apart from width / heads, as Qwen3's
  },
  'mistral': {
    # Mistral-7B-v0.1: 7,241,732,096 (sliding window 4096 on every layer)
    '7b': dict(
      _shape(32_000, 4096, 14_336, 32, 32, 8, 128),
      sliding_window=4096,
      layer_pattern='L',
      rope_theta=10_000.0,
      norm_eps=1e-5,
      max_len=32_768,
    ),
    'tiny': dict(_TINY, sliding_window=16, layer_pattern='L'),
  },
  'gemma': {
    # Gemma-2B: 2,506,172,416 (multi-query attention, head_dim 256)
    '2b': dict(
      _shape(256_000, 2048, 16_384, 18, 8, 1, 256),
      rope_theta=10_000.0,
      norm_eps=1e-6,
      tie_embeddings=True,
      max_len=8192,
    ),
    'tiny': dict(_TINY, tie_embeddings=True),
  },
  'gemma2': {
    # Gemma-2-2B: 2,614,341,888 (local and global layers alternate; soft caps 50 and 30)
    '2b': dict(
      _shape(256_000, 2304, 9216, 26, 8, 4, 256),
      query_pre_attn_scalar=256.0,
      sliding_window=4096,
      layer_pattern='LG',
      attn_softcap=50.0,
      final_softcap=30.0,
      rope_theta=10_000.0,
      norm_eps=1e-6,
      tie_embeddings=True,
      max_len=8192,
    ),
    'tiny': dict(
      _TINY,
      sliding_window=16,
      layer_pattern='LG',
      query_pre_attn_scalar=16.0,
      attn_softcap=50.0,
      final_softcap=30.0,
      tie_embeddings=True,
    ),
  },
  'gemma3': {
    # Gemma 3 (text; 4B and up ship beside a vision tower, which is not counted): 1B 999,885,952;
    # 4B 3,880,263,168; 12B 11,766,034,176; 27B 27,009,346,304. Five local layers to one global.
    '1b': dict(
      _GEMMA3,
      vocab_size=262_144,
      embed_dim=1152,
      mlp_dim=6912,
      num_layers=26,
      num_heads=4,
      num_kv_heads=1,
      sliding_window=512,
      rope_scaling=None,
      max_len=32_768,
    ),
    '4b': dict(_GEMMA3, embed_dim=2560, mlp_dim=10_240, num_layers=34, num_heads=8, num_kv_heads=4),
    '12b': dict(_GEMMA3, embed_dim=3840, mlp_dim=15_360, num_layers=48, num_heads=16, num_kv_heads=8),
    '27b': dict(
      _GEMMA3,
      embed_dim=5376,
      mlp_dim=21_504,
      num_layers=62,
      num_heads=32,
      num_kv_heads=16,
      head_dim=128,
      query_pre_attn_scalar=168.0,
    ),
    # three layers per pattern at tiny size (two local, one global); 4 layers: one group and one left over
    'tiny': dict(
      _TINY,
      num_layers=4,
      sliding_window=16,
      layer_pattern='LLG',
      query_pre_attn_scalar=8.0,
      local_rope_theta=10_000.0,
      rope_theta=1_000_000.0,
      tie_embeddings=True,
    ),
  },
  'phi3': {
    # Phi-3-mini-4k: 3,821,079,552 (its config.json's sliding window of 2047 on every layer)
    'mini': dict(
      _shape(32_064, 3072, 8192, 32, 32, 32, 96),
      sliding_window=2047,
      layer_pattern='L',
      rope_theta=10_000.0,
      norm_eps=1e-5,
      max_len=4096,
    ),
    'tiny': dict(_TINY, sliding_window=16, layer_pattern='L'),
  },
  'olmo2': {
    # OLMo-2-1124-7B: 7,298,617,344 (norms after each sublayer, q/k norm over every head)
    '7b': dict(_shape(100_352, 4096, 11_008, 32, 32, 32, 128), rope_theta=500_000.0, norm_eps=1e-6, max_len=4096),
    'tiny': dict(_TINY),
  },
}
# Each family's default size: the smallest real one (what `--dry_run` and the config matrix check by default).
DEFAULT_SIZE = {name: next(iter(sizes)) for name, sizes in SIZES.items()}
TOKENIZER = '/path/to/{}_tokenizer'  # placeholder: a local directory with the family's saved HF tokenizer


def presets() -> tuple[dict, dict]:
  """Copies of the transformer presets (configs/common.py), for one family's file to edit."""
  return common.transformer_presets(context=True, pipeline=True)


def config(name: str, arg: str | None, rules: dict, meshes: dict, sizes: dict) -> ml_collections.ConfigDict:
  """Family `name`'s config for `arg` (a preset and/or a size, as configs/common.parse_arg reads them)."""
  preset, size = common.parse_arg(
    arg, rules, sizes, default_preset='fsdp', default_size=DEFAULT_SIZE[name], file=f'{name}.py'
  )
  c = common.base(preset, size)
  c.task = 'lm'
  c.mesh = common.mesh(meshes[preset])
  c.logical_axis_rules = rules[preset]
  c.model = ml_collections.ConfigDict(dict(name=name, **sizes[size], scan_layers=True))
  if size == 'tiny':
    c.dataset = ml_collections.ConfigDict(dict(name='markov', seq_len=64, num_eval=512))
    c.batch_size = 16
    c.total_steps = 300
    c.optim = ml_collections.ConfigDict(dict(lr=3e-3))  # warmup: a tenth of the run (schema's default)
    c.eval_every = 300
  else:
    # bf16 compute, f32 params and optimizer state; remat='dots' as configs/llama.py (docs/model_options.md).
    c.model.update(common.REAL_SIZE_MODEL, remat='dots')
    c.dataset = ml_collections.ConfigDict(
      dict(name='c4', eval_split='validation[:10000]', seq_len=2048, pack=True, tokenizer=TOKENIZER.format(name))
    )
    c.batch_size = 64
    c.total_steps = 100_000
    c.optim = ml_collections.ConfigDict(dict(lr=3e-4, warmup_steps=2000))
    c.eval_every = 5000
  c = common.pipeline_preset(c)
  if preset in common.PIPELINE_PRESETS and size == 'tiny' and 'layer_pattern' in c.model:
    c.model.num_layers *= len(c.model.layer_pattern)  # the stages hold whole groups of the layer pattern
  return schema.complete(c)
