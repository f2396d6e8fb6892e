r"""Mistral (7B, v0.1): the Llama block, every layer a sliding window of 4096 keys.

  python train.py --config configs/mistral.py:tiny --workdir /tmp/mistral_tiny          # seconds on CPU
  python train.py --config configs/mistral.py --workdir /tmp/mistral --dry_run          # 7b: per-device memory
  python train.py --config configs/mistral.py:fsdp,7b --workdir /tmp/mistral --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=mistralai/Mistral-7B-v0.1               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 7b (Mistral-7B-v0.1, default), tiny (2 layers, d=64, window 16 of 64 tokens, on the offline Markov language).
Combine with a comma: configs/mistral.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['mistral']


def get_config(arg: str | None = None):
  return decoders.config('mistral', arg, RULES, MESHES, SIZES)
