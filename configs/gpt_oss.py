r"""GPT-OSS (attention sinks, sliding-window and global layers alternating, biases, clamped SwiGLU experts).

  python train.py --config configs/gpt_oss.py:tiny --workdir /tmp/gpt_oss_tiny         # seconds on CPU
  python train.py --config configs/gpt_oss.py:20b --workdir /tmp/g --dry_run           # per-device memory

Presets: dp, fsdp, ep, fsdp_ep (default), cp, pp, ep_tp (configs/moe.py). Sizes: 20b (gpt-oss-20b), 120b
(gpt-oss-120b), tiny.
"""

from configs import moe

# the experts' gate|up pair axis ('glu', GPT-OSS's fused layout) is never split
RULES = {name: rules + [('glu', None)] for name, rules in moe.RULES.items()}
MESHES = moe.MESHES
_GPT_OSS = dict(
  vocab_size=201_088,
  embed_dim=2880,
  mlp_dim=2880,
  num_heads=64,
  num_kv_heads=8,
  head_dim=64,
  top_k=4,
  sliding_window=128,
  layer_pattern='LG',
  rope_theta=150_000.0,
  rope_scaling=(
    ('rope_type', 'yarn'),
    ('factor', 32.0),
    ('original_max_position_embeddings', 4096),
    ('beta_fast', 32.0),
    ('beta_slow', 1.0),
    ('truncate', False),
  ),
  norm_eps=1e-5,
  max_len=131_072,
  group_size=512,
)
SIZES = {
  '20b': dict(_GPT_OSS, num_layers=24, num_experts=32),  # gpt-oss-20b: 20.9B parameters, 3.6B active
  '120b': dict(_GPT_OSS, num_layers=36, num_experts=128),  # gpt-oss-120b: 116.8B parameters, 5.1B active
  'tiny': dict(  # vocab_size unset: the data's (the Markov language's 16 symbols; a tokenizer's ids)
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=32,
    sliding_window=16,
    layer_pattern='LG',
    norm_eps=1e-5,
    max_len=64,
    group_size=64,
  ),
}


def get_config(arg: str | None = None):
  return moe.sparse_config('gpt_oss', arg, RULES, SIZES, default_size='20b')
