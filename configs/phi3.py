r"""Phi-3 (mini, 3.8B): the Llama block; its checkpoints fuse q|k|v and gate|up (split at import, fused again
on export) and ship longrope scaling for 128k contexts.

  python train.py --config configs/phi3.py:tiny --workdir /tmp/phi3_tiny          # seconds on CPU
  python train.py --config configs/phi3.py --workdir /tmp/phi3 --dry_run          # mini: per-device memory
  python train.py --config configs/phi3.py:fsdp,mini --workdir /tmp/phi3 --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=microsoft/Phi-3-mini-4k-instruct               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: mini (Phi-3-mini-4k, window 2047, default), tiny (2 layers, d=64, window 16 of 64, on the offline Markov
language).
Combine with a comma: configs/phi3.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['phi3']


def get_config(arg: str | None = None):
  return decoders.config('phi3', arg, RULES, MESHES, SIZES)
