r"""Gemma (2B): (1 + w) RMSNorm, embeddings x sqrt(d), GeGLU (tanh), tied head, head_dim 256, one kv head.

  python train.py --config configs/gemma.py:tiny --workdir /tmp/gemma_tiny          # seconds on CPU
  python train.py --config configs/gemma.py --workdir /tmp/gemma --dry_run          # 2b: per-device memory
  python train.py --config configs/gemma.py:fsdp,2b --workdir /tmp/gemma --dry_run
  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.init_from=google/gemma-2b               # chat fine-tuning (SFT) of the checkpoint

Presets (configs/common.py's transformer presets; rules and meshes below stay editable):
  :dp  :fsdp (default)  :tp  :cp (context parallel)  :pp (pipeline; at tiny size one layer group per stage)
  :fsdp_tp
Sizes: 2b (Gemma-2B, default), tiny (2 layers, d=64, on the offline Markov language).
Combine with a comma: configs/gemma.py:tp,tiny. The block's options (models/decoder.py FAMILIES) are the family's;
the fields below are the checkpoints' (configs/decoders.py SIZES). --config.init_from=DIR or a hub id reads the
architecture from its config.json and the weights from its safetensors (docs/finetuning.md).
"""

from configs import decoders

RULES, MESHES = decoders.presets()
SIZES = decoders.SIZES['gemma']


def get_config(arg: str | None = None):
  return decoders.config('gemma', arg, RULES, MESHES, SIZES)
