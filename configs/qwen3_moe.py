r"""Qwen3-MoE (128 experts, top-8, q/k norms): the MoE presets of configs/moe.py on Qwen3's attention.

  python train.py --config configs/qwen3_moe.py:tiny --workdir /tmp/qwen3_moe_tiny     # seconds on CPU
  python train.py --config configs/qwen3_moe.py:30b_a3b --workdir /tmp/q --dry_run    # per-device memory
  python train.py --config configs/qwen3_moe.py:ep,tiny --init_from /path/to/Qwen3-30B-A3B ...

Presets: dp, fsdp, ep, fsdp_ep (default), cp, pp, ep_tp (configs/moe.py). Sizes: 30b_a3b (Qwen3-30B-A3B), 235b_a22b
(Qwen3-235B-A22B), tiny. Published counts: docs/model_options.md (and tests/test_sparse_families.py).
"""

from configs import moe

RULES, MESHES = moe.RULES, moe.MESHES
_QWEN3_MOE = dict(
  vocab_size=151_936,
  head_dim=128,
  num_experts=128,
  top_k=8,
  rope_theta=1_000_000.0,
  norm_eps=1e-6,
  tie_embeddings=False,
  max_len=40_960,
  group_size=512,
)
SIZES = {
  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active
  '30b_a3b': dict(
    _QWEN3_MOE, embed_dim=2048, mlp_dim=6144, expert_mlp_dim=768, num_layers=48, num_heads=32, num_kv_heads=4
  ),
  # Qwen3-235B-A22B: 235B parameters, 22B active
  '235b_a22b': dict(
    _QWEN3_MOE, embed_dim=4096, mlp_dim=12_288, expert_mlp_dim=1536, num_layers=94, num_heads=64, num_kv_heads=4
  ),
  'tiny': dict(  # vocab_size unset: the data's (the Markov language's 16 symbols; a tokenizer's ids)
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=64,
    expert_mlp_dim=32,
    group_size=64,
    rope_theta=1_000_000.0,
    norm_eps=1e-6,
    max_len=64,
  ),
}


def get_config(arg: str | None = None):
  return moe.sparse_config('qwen3_moe', arg, RULES, SIZES, default_size='30b_a3b')
