r"""Qwen3 (0.6B, 8B, 32B): per-head q/k RMSNorm before the rotary embedding, head_dim apart from width / heads.

  python train.py --config configs/qwen3.py:tiny --workdir /tmp/qwen3_tiny          # seconds on CPU
  python train.py --config configs/qwen3.py --workdir /tmp/qwen3 --dry_run          # 0.6b: per-device memory
  python train.py --config configs/qwen3.py:fsdp,8b --workdir /tmp/qwen3 --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=Qwen/Qwen3-0.6B               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 0.6b (Qwen3-0.6B, tied, default), 8b, 32b, tiny (2 layers, d=64, head_dim 16, on the offline Markov language).
Combine with a comma: configs/qwen3.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['qwen3']


def get_config(arg: str | None = None):
  return decoders.config('qwen3', arg, RULES, MESHES, SIZES)
