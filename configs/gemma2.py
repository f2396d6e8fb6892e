r"""Gemma 2 (2B): Gemma with norms before and after each sublayer, local (window 4096) and global layers
alternating, query_pre_attn_scalar, and tanh soft caps on attention (50) and output (30) logits.

  python train.py --config configs/gemma2.py:tiny --workdir /tmp/gemma2_tiny          # seconds on CPU
  python train.py --config configs/gemma2.py --workdir /tmp/gemma2 --dry_run          # 2b: per-device memory
  python train.py --config configs/gemma2.py:fsdp,2b --workdir /tmp/gemma2 --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=google/gemma-2-2b               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 2b (Gemma-2-2B, default), tiny (2 layers, d=64, window 16 of 64 tokens, on the offline Markov language).
Combine with a comma: configs/gemma2.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['gemma2']


def get_config(arg: str | None = None):
  return decoders.config('gemma2', arg, RULES, MESHES, SIZES)
