r"""GRPO of Llama-3.2-1B-Instruct on your prompts and reward functions (RL with verifiable rewards).

  python train.py --config configs/llama_grpo.py --workdir /tmp/grpo \
      --config.dataset.train_files='prompts/train*.jsonl' --config.dataset.eval_files=prompts/eval.jsonl \
      --config.grpo.reward='my_rewards:correct,my_rewards:format*0.2'
  python train.py --config configs/llama_grpo.py:lora --workdir /tmp/grpo_lora   # adapters; reference = adapters off
  python train.py --config configs/llama_grpo.py:tiny --workdir /tmp/grpo_tiny   # offline: examples/arith

Each line of the files is a row with a "prompt" (a text, or a chat: a list of messages, rendered with the
generation prompt) and whatever the reward functions read. config.grpo.reward names functions
`module:function` (comma-separated, each `*weight` optional) called as function(prompt, completion, row) -> a
number. Every step samples config.grpo.group_size completions of config.batch_size / group_size prompts with the
KV-cache sampler on the training mesh, from the training parameters; each completion's advantage is its reward
normalised within its group; the loss is TRL's clipped policy ratio with a k3 KL term against the starting weights
(config.grpo.beta; with LoRA the base with its adapters off). docs/post_training.md says what each option does.

Presets: as configs/llama.py (dp, fsdp (default), tp, cp, fsdp_tp); add `lora` for adapters on the attention
projections. Sizes: real (init_from the hub model), tiny (a tiny Llama from scratch with the byte tokenizer on
examples/arith: sums, rewarded for digits and for the right answer).
"""

import ml_collections

from configs import llama_sft, schema
from configs.llama import SIZES  # noqa: F401  (the sizes of this config)
from configs.llama_lora import RULES  # noqa: F401  (the presets: llama's, with the ('lora_rank', None) rule)


def get_config(arg: str | None = None):
  lora = 'lora' in (arg or '')
  c = llama_sft.get_config(arg)
  c.task = 'grpo'
  tiny = c.size == 'tiny'
  c.dataset = llama_sft.post_training_files('prompts', tiny)
  c.grpo = ml_collections.ConfigDict(
    dict(
      reward='examples.arith.rewards:correct,examples.arith.rewards:digits*0.5' if tiny else '',
      max_new_tokens=4 if tiny else 512,
    )
  )
  if tiny:
    c.model.vocab_size = 260  # the byte tokenizer's ids
    c.batch_size, c.total_steps = 32, 60  # 4 prompts x 8 completions
    c.optim = ml_collections.ConfigDict(dict(lr=3e-3, warmup_steps=5))
    c.log_every, c.eval_every, c.checkpoint_every = 10, 30, 30
  else:
    c.batch_size = 64  # 8 prompts x 8 completions per step
    c.total_steps = 500
    c.optim.update(lr=1e-5 if lora else 1e-6, warmup_steps=20, weight_decay=0.0)
    c.checkpoint_every, c.eval_every, c.log_every = 50, 50, 5
  return schema.complete(c)
