r"""Chat fine-tuning (SFT) of Llama-3.2-1B-Instruct on your own JSON Lines chats, the loss on the answers only.

  python train.py --config configs/llama_sft.py --workdir /tmp/sft \
      --config.dataset.train_files='chats/train*.jsonl' --config.dataset.eval_files=chats/eval.jsonl
  python train.py --config configs/llama_sft.py:lora --workdir /tmp/sft_lora      # LoRA adapters, base frozen
  python train.py --config configs/llama_sft.py:tiny --workdir /tmp/sft_tiny      # offline, from scratch

Each line of the files is {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}.
The chats are rendered by the tokenizer's own chat template (init_from's, token for token as transformers'
apply_chat_template) and only the assistant turns are trained on; chats without an assistant turn are left out
and counted (--config.dataset.no_assistant=error refuses them). Whole chats are packed into rows of 2048 tokens
(segment ids: no attention across chats, positions restart); a longer chat is truncated, and counted in the log.
Prompt/completion files instead: --config.dataset.messages_key= --config.dataset.prompt_key=prompt
--config.dataset.completion_key=completion. docs/your_data.md walks from a hub id and a JSONL file to a
fine-tuned model, generate.py and an export that transformers loads.

`init_from`: a hub id (resolved through the Hugging Face cache; downloaded there the first time) or a Llama
model directory; the architecture comes from its config.json, the tokenizer (and its chat template) from its
files. Presets: as configs/llama.py (dp, fsdp (default), tp, cp, fsdp_tp); add the word `lora` for rank-16
adapters on the attention projections (e.g. configs/llama_sft.py:fsdp,lora). Sizes: real, tiny (the offline
Markov language, as configs/llama.py:tiny).
"""

import ml_collections

from configs import llama, schema
from configs.llama import SIZES  # noqa: F401  (the sizes of this config)
from configs.llama_lora import RULES  # the presets: llama's, with the ('lora_rank', None) rule

HUB_ID = 'meta-llama/Llama-3.2-1B-Instruct'
LORA_TARGETS = r'self_attn/(query|key|value|out)$'


def get_config(arg: str | None = None):
  words = [w.strip() for w in (arg or '').split(',') if w.strip()]
  lora = 'lora' in words
  c = llama.get_config(','.join(w for w in words if w != 'lora'))
  c.logical_axis_rules = RULES[c.preset]
  if lora:
    c.lora = ml_collections.ConfigDict(dict(rank=4 if c.size == 'tiny' else 16, alpha=32.0, targets=LORA_TARGETS))
  if c.size == 'tiny':
    return schema.complete(c)  # offline: trains from scratch on the Markov language (tests, trying things)
  c.init_from = HUB_ID
  c.dataset = ml_collections.ConfigDict(
    dict(
      name='json',
      train_files='chats/train*.jsonl',
      eval_files='chats/eval.jsonl',
      messages_key='messages',  # prompt/completion files: set prompt_key, completion_key and messages_key= (empty)
      tokenizer=schema.follows('init_from'),  # init_from's, unless --config.dataset.tokenizer sets another
      seq_len=c.model.max_len,  # 2048 (cp: 32768)
      pack=True,
    )
  )
  c.batch_size = 16  # 32k tokens per step
  c.total_steps = 1000
  c.optim.update(lr=2e-4 if lora else 2e-5, warmup_steps=50, weight_decay=0.0)
  c.checkpoint_every, c.eval_every, c.log_every = 200, 200, 10
  return schema.complete(c)


def post_training_files(kind: str, tiny: bool) -> ml_collections.ConfigDict:
  """The dataset of a post-training config (DPO pairs, GRPO prompts): `kind`_train*.jsonl / `kind`/eval.jsonl
  with init_from's tokenizer, or the tiny size's offline examples/arith files with the byte tokenizer."""
  return ml_collections.ConfigDict(
    dict(
      name='json',
      train_files=f'examples/arith/{kind}_train.jsonl' if tiny else f'{kind}/train*.jsonl',
      eval_files=f'examples/arith/{kind}_eval.jsonl' if tiny else f'{kind}/eval.jsonl',
      tokenizer='byte' if tiny else schema.follows('init_from'),
      seq_len=16 if tiny else 1024,  # prompt + answer per row
    )
  )
