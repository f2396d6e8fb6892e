r"""Gemma 3 (1B, 4B, 12B, 27B; text): Gemma 2's block with per-head q/k norms, five local layers (window
512 / 1024, rotary base 10k) to one global (base 1M, linear scaling x8 from 4B up), no soft caps.

  python train.py --config configs/gemma3.py:tiny --workdir /tmp/gemma3_tiny          # seconds on CPU
  python train.py --config configs/gemma3.py --workdir /tmp/gemma3 --dry_run          # 1b: per-device memory
  python train.py --config configs/gemma3.py:fsdp,4b --workdir /tmp/gemma3 --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=google/gemma-3-1b-pt               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 1b (Gemma-3-1B, default), 4b, 12b, 27b (their text towers), tiny (4 layers: local, local, global,
local; d=64, window 16 of 64 tokens, on the offline Markov language).
Combine with a comma: configs/gemma3.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['gemma3']


def get_config(arg: str | None = None):
  return decoders.config('gemma3', arg, RULES, MESHES, SIZES)
