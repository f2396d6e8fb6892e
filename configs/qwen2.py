r"""Qwen2 / Qwen2.5 (0.5B, 7B): the Llama block with biases on the q, k and v projections.

  python train.py --config configs/qwen2.py:tiny --workdir /tmp/qwen2_tiny          # seconds on CPU
  python train.py --config configs/qwen2.py --workdir /tmp/qwen2 --dry_run          # 0.5b: per-device memory
  python train.py --config configs/qwen2.py:fsdp,7b --workdir /tmp/qwen2 --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=Qwen/Qwen2.5-0.5B               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 0.5b (Qwen2.5-0.5B, tied, default), 7b (Qwen2.5-7B), tiny (2 layers, d=64, on the offline Markov language).
Combine with a comma: configs/qwen2.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['qwen2']


def get_config(arg: str | None = None):
  return decoders.config('qwen2', arg, RULES, MESHES, SIZES)
