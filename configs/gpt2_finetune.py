r"""Fine-tune pretrained GPT-2 (Hugging Face weights) on a text dataset.

  python train.py --config configs/gpt2_finetune.py --workdir /tmp/gpt2_ft --config.init_from=hf/gpt2
  python train.py --config configs/gpt2_finetune.py:tiny --workdir /tmp/gpt2_ft_tiny   # offline, from scratch

`init_from` is a Hugging Face model directory (config.json + *.safetensors), e.g. from
`hf download openai-community/gpt2 --local-dir hf/gpt2`, or a hub id (`openai-community/gpt2`, resolved
through the huggingface_hub cache, downloaded there the first time); its tokenizer files
tokenize the dataset (so token ids match the pretrained embedding). The architecture comes from its
config.json, and so does the training length: config.dataset.seq_len is the model's max_len (at most 1024)
unless set. Everything is loaded; the optimizer starts fresh. Rerunning the same command resumes.
Presets and rules: as configs/gpt2.py (dp, fsdp (default), tp, fsdp_tp).
"""

from ml_collections import config_dict

from configs import gpt2, schema
from configs.gpt2 import MESHES, RULES, SIZES  # noqa: F401  (the presets and sizes of this config)

HF_DIR = 'hf/gpt2'


def get_config(arg: str | None = None):
  c = gpt2.get_config(arg)
  if c.size == 'tiny':
    return c  # offline: trains from scratch on the Markov language (tests, trying things)
  c.init_from = HF_DIR
  c.model.pad_vocab_to = 1  # GPT-2's 50257 rows; vocab stays replicated in these presets' rules
  c.logical_axis_rules = [r if r[0] != 'vocab' else ('vocab', None) for r in c.logical_axis_rules]
  # The tokenizer follows init_from (--config.init_from=DIR moves it) unless --config.dataset.tokenizer sets
  # another; the length is unset (None), so it follows the model (training/pretrained.py derive_lengths) unless
  # --config.dataset.seq_len sets it.
  c.dataset.update(name='lm1b', pack=True)
  c.dataset.tokenizer = schema.follows('init_from')
  c.dataset.seq_len = config_dict.placeholder(int)
  c.batch_size = 32
  c.total_steps = 5000
  c.optim.update(lr=1e-4, warmup_steps=200, weight_decay=0.01)
  c.checkpoint_every, c.eval_every = 500, 1000
  return schema.complete(c)
