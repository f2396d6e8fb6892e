r"""DeepSeek-V3 (multi-head latent attention; 256 routed experts top-8 with sigmoid scores, a score-correction
bias and group limits, one shared expert; three dense layers first) and DeepSeek-V2-Lite's layout.

  python train.py --config configs/deepseek_v3.py:tiny --workdir /tmp/dsv3_tiny        # seconds on CPU
  python train.py --config configs/deepseek_v3.py:671b --workdir /tmp/d --dry_run      # per-device memory

Presets: dp, fsdp, ep, fsdp_ep (default), cp, pp, ep_tp (configs/moe.py), each with rules for the latent dims
('q_lora', 'kv_lora': sharded as the preset shards 'embed'; map them to 'tensor' to split the latent projections).
Sizes: 671b (DeepSeek-V3/R1), v2_lite (DeepSeek-V2-Lite, 16B: softmax routing, two shared experts, full-rank q), tiny.
"""

from configs import moe


def _latent(rules: list) -> list:
  """The latent dims go where the preset puts 'embed' (FSDP's axes, else whole): q_b_proj and kv_b_proj have no
  embed dim, so FSDP would otherwise keep them whole on every device (in the 671b layout 3 x 13 GiB of parameters
  and AdamW state per device)."""
  return [(latent, target) for latent in ('q_lora', 'kv_lora') for name, target in rules if name == 'embed']


RULES = {name: rules + _latent(rules) for name, rules in moe.RULES.items()}
MESHES = moe.MESHES
_YARN = (
  ('rope_type', 'yarn'),
  ('factor', 40.0),
  ('original_max_position_embeddings', 4096),
  ('beta_fast', 32.0),
  ('beta_slow', 1.0),
)
SIZES = {
  # DeepSeek-V3: 671B parameters (the hub's 685B adds the 14B multi-token-prediction layer), 37B active
  '671b': dict(
    vocab_size=129_280,
    embed_dim=7168,
    mlp_dim=18_432,
    expert_mlp_dim=2048,
    num_layers=61,
    first_dense_layers=3,
    num_heads=128,
    num_experts=256,
    top_k=8,
    shared_experts=1,
    router_score='sigmoid',
    score_correction_bias=True,
    routed_scale=2.5,
    router_groups=8,
    router_group_topk=4,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=10_000.0,
    rope_scaling=_YARN + (('mscale', 1.0), ('mscale_all_dim', 1.0)),
    norm_eps=1e-6,
    max_len=163_840,
    group_size=512,
  ),
  # DeepSeek-V2-Lite: 15.7B parameters, 2.4B active
  'v2_lite': dict(
    vocab_size=102_400,
    embed_dim=2048,
    mlp_dim=10_944,
    expert_mlp_dim=1408,
    num_layers=27,
    first_dense_layers=1,
    num_heads=16,
    num_experts=64,
    top_k=6,
    shared_experts=2,
    norm_topk=False,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=10_000.0,
    rope_scaling=_YARN + (('mscale', 0.707), ('mscale_all_dim', 0.707)),
    norm_eps=1e-6,
    max_len=163_840,
    group_size=512,
  ),
  'tiny': dict(  # vocab_size unset: the data's (the Markov language's 16 symbols; a tokenizer's ids)
    embed_dim=64,
    mlp_dim=64,
    expert_mlp_dim=32,
    num_layers=3,
    first_dense_layers=1,
    num_heads=4,
    num_experts=8,
    top_k=2,
    shared_experts=1,
    router_score='sigmoid',
    score_correction_bias=True,
    routed_scale=2.5,
    router_groups=4,
    router_group_topk=2,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    norm_eps=1e-6,
    max_len=64,
    group_size=64,
  ),
}


def get_config(arg: str | None = None):
  return moe.sparse_config('deepseek_v3', arg, RULES, SIZES, default_size='671b')
