r"""Preference tuning (DPO; ipo, hinge, simpo, orpo) of Llama-3.2-1B-Instruct on your own pairs of answers.

  python train.py --config configs/llama_dpo.py --workdir /tmp/dpo \
      --config.dataset.train_files='pairs/train*.jsonl' --config.dataset.eval_files=pairs/eval.jsonl
  python train.py --config configs/llama_dpo.py:lora --workdir /tmp/dpo_lora     # adapters; reference = adapters off
  python train.py --config configs/llama_dpo.py:tiny --workdir /tmp/dpo_tiny     # offline: examples/arith's pairs

Each line of the files is {"prompt": "...", "chosen": "...", "rejected": "..."} (texts), or TRL's conversational
form {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}, rendered by the tokenizer's chat
template; the loss is on the answers' tokens only. --config.dpo.loss picks sigmoid (DPO), ipo, hinge, or the
reference-free simpo (--config.dpo.gamma) and orpo; --config.dpo.beta (0.1) sets how far from the reference the
policy may move. The reference is the starting weights: with LoRA the base model with its adapters off (no second
copy in memory), otherwise a frozen copy kept in the train state (docs/post_training.md).

Presets: as configs/llama.py (dp, fsdp (default), tp, cp, fsdp_tp); add the word `lora` for adapters on the
attention projections (e.g. configs/llama_dpo.py:fsdp,lora). Sizes: real (init_from the hub model), tiny (a tiny
Llama from scratch with the byte tokenizer, on examples/arith: sums preferred to wrong sums).
"""

import ml_collections

from configs import llama_sft, schema
from configs.llama import SIZES  # noqa: F401  (the sizes of this config)
from configs.llama_lora import RULES  # noqa: F401  (the presets: llama's, with the ('lora_rank', None) rule)


def get_config(arg: str | None = None):
  lora = 'lora' in (arg or '')
  c = llama_sft.get_config(arg)
  c.task = 'dpo'
  tiny = c.size == 'tiny'
  c.dataset = llama_sft.post_training_files('pairs', tiny)
  if tiny:
    c.model.vocab_size = 260  # the byte tokenizer's ids
    c.batch_size, c.total_steps = 16, 120
    c.optim = ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=5))
    c.log_every, c.eval_every, c.checkpoint_every = 10, 40, 40
  else:
    c.batch_size = 32  # pairs per step: 64 rows
    c.total_steps = 500
    c.optim.update(lr=5e-5 if lora else 5e-7, warmup_steps=50, weight_decay=0.0)
    c.checkpoint_every, c.eval_every, c.log_every = 100, 100, 10
  return schema.complete(c)
