r"""OLMo 2 (7B): norms after each sublayer (none before), q/k RMSNorm over every head's projection at once.

  python train.py --config configs/olmo2.py:tiny --workdir /tmp/olmo2_tiny          # seconds on CPU
  python train.py --config configs/olmo2.py --workdir /tmp/olmo2 --dry_run          # 7b: per-device memory
  python train.py --config configs/olmo2.py:fsdp,7b --workdir /tmp/olmo2 --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=allenai/OLMo-2-1124-7B               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 7b (OLMo-2-1124-7B, default), tiny (2 layers, d=64, on the offline Markov language).
Combine with a comma: configs/olmo2.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['olmo2']


def get_config(arg: str | None = None):
  return decoders.config('olmo2', arg, RULES, MESHES, SIZES)
