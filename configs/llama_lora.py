r"""Fine-tune a pretrained Llama (e.g. Llama-3.2-1B, Hugging Face weights) with LoRA adapters.

  python train.py --config configs/llama_lora.py --workdir /tmp/llama_lora --config.init_from=hf/llama-3.2-1b
  python train.py --config configs/llama_lora.py:tiny --workdir /tmp/llama_lora_tiny   # offline, from scratch

`init_from`: a Hugging Face LlamaForCausalLM directory (config.json + *.safetensors, single or
sharded with model.safetensors.index.json), downloaded once elsewhere. Its tokenizer tokenizes c4. Its
config.json gives the architecture and config.model.max_len; config.dataset.seq_len is that, at most 1024,
unless set.
Rank-16 adapters on the query and value projections train; the base weights are frozen (no
optimizer state). The adapters carry logical axes (input axes + 'lora_rank', 'lora_rank' + output
axes) and are sharded by the same rules. `--config.lora.export_merged=True` writes the weights with
the adapters folded in to <workdir>/export, a params-only checkpoint that `init_from` reads.
Presets: as configs/llama.py (dp, fsdp (default), tp, fsdp_tp), plus the ('lora_rank', None) rule.
"""

from ml_collections import config_dict

from configs import llama, schema
from configs.llama import MESHES, SIZES  # noqa: F401  (the presets and sizes of this config)

RULES = {name: [*rules, ('lora_rank', None)] for name, rules in llama.RULES.items()}


def get_config(arg: str | None = None):
  c = llama.get_config(arg)
  c.logical_axis_rules = RULES[c.preset]
  c.lora = config_dict.ConfigDict(dict(rank=16, alpha=32.0, targets=r'self_attn/(query|value)$'))
  if c.size == 'tiny':
    c.lora.rank = 4
    c.optim.update(lr=1e-2)
    return schema.complete(c)
  c.init_from = 'hf/llama-3.2-1b'
  c.dataset.tokenizer = schema.follows('init_from')  # init_from's, unless --config.dataset.tokenizer sets another
  # Unset (None): both follow the imported model (training/pretrained.py derive_lengths) unless given.
  c.dataset.seq_len = config_dict.placeholder(int)
  c.model.max_len = config_dict.placeholder(int)
  c.batch_size = 32
  c.total_steps = 2000
  c.optim.update(lr=2e-4, warmup_steps=100, weight_decay=0.0)
  c.checkpoint_every, c.eval_every = 500, 500
  return schema.complete(c)
