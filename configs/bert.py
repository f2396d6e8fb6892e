r"""BERT (bert-base at real size, 109M): bidirectional post-LN encoder; masked-LM or classifier head.

  python train.py --config configs/bert.py:tiny --workdir /tmp/bert_tiny                # MLM, seconds on CPU
  python train.py --config configs/bert.py:tiny,classify --workdir /tmp/bert_cls        # text classification
  python train.py --config configs/bert.py:tp --workdir /tmp/bert --dry_run             # per-device memory
  python train.py --config configs/bert.py --workdir /tmp/bert \
      --config.dataset.tokenizer=/path/to/bert_tokenizer                                # MLM on lm1b

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp       data parallel            mesh data=8
  :fsdp     fully sharded (default)  mesh data=1, fsdp=8
  :tp       tensor parallel + data   mesh data=2, tensor=4 (heads, mlp, vocab on 'tensor')
  :fsdp_tp  FSDP + tensor            mesh data=1, fsdp=4, tensor=2
Sizes: base (vocab 30522 padded to 30592 rows, 12 layers, 12 heads, d=768, mlp 3072, 512 positions,
2 token types), tiny (2 layers, d=64, byte tokenizer, on the offline 'markov_text' strings).
Tasks: mlm (default: head 'mlm', task 'mlm') or classify (head 'classify', task 'text_classification':
pooled [CLS] -> num_classes). Combine words with commas: configs/bert.py:tp,tiny,classify.

Real data: MLM reads TFDS 'lm1b' (rows of 128 tokens, 15% masked); classify reads TFDS 'glue/sst2'
(text_key 'sentence', 2 classes). Both need a BERT WordPiece tokenizer in a local directory, saved on
a machine with access by
  AutoTokenizer.from_pretrained('bert-base-uncased').save_pretrained(DIR)
and passed as --config.dataset.tokenizer=DIR (TOKENIZER below is a placeholder: left as is, start-up
fails with a message naming that field). Fine-tuning pretrained weights needs the planned HF import.
"""

from configs import common, schema
from errors import ConfigError

# The transformer presets (configs/common.py) plus BERT's token-type rows, copied here to edit for this family.
RULES, MESHES = common.transformer_presets(extra=[('token_types', None)], drop=common.CACHE_NAMES)  # no decoding
SIZES = {
  # pad_vocab_to: 30522 = 2 x 3 x 5087 rows padded to 30592 so 'vocab' divides tensor=4 (padded logits masked).
  'base': dict(
    vocab_size=30522,
    pad_vocab_to=128,
    max_len=512,
    num_layers=12,
    num_heads=12,
    embed_dim=768,
    mlp_dim=3072,
  ),
  'tiny': dict(
    vocab_size=260, max_len=64, num_layers=2, num_heads=4, embed_dim=64, mlp_dim=256
  ),  # 260 = the byte tokenizer's ids
}
TASKS = {'mlm': ('mlm', 'mlm'), 'classify': ('text_classification', 'classify')}  # word -> (task, head)
TOKENIZER = '/path/to/bert_tokenizer'  # placeholder: a local directory with a saved HF tokenizer


def get_config(arg: str | None = None):
  words = [w.strip() for w in (arg or '').split(',') if w.strip()]
  tasks = sorted({w for w in words if w in TASKS})
  if len(tasks) > 1:
    raise ConfigError(f'bert.py: two tasks {tasks[0]!r} and {tasks[1]!r} in {arg!r}; give one task')
  word = tasks[0] if tasks else 'mlm'
  rest = ','.join(w for w in words if w not in TASKS)
  try:
    preset, size = common.parse_arg(rest, RULES, SIZES, default_preset='fsdp', default_size='base', file='bert.py')
  except ConfigError as e:
    raise ConfigError(f'{e}, tasks: {sorted(TASKS)}') from None
  task, head = TASKS[word]
  c = common.base(preset, size)
  c.task = task
  c.mesh = common.mesh(MESHES[preset])
  c.logical_axis_rules = RULES[preset] + ([('classes', None)] if head == 'classify' else [])
  c.model = common.ConfigDict(
    dict(
      name='bert',
      **SIZES[size],
      head=head,
      norm_eps=1e-12,
      scan_layers=True,
    )
  )
  if size == 'base':
    c.model.update(common.REAL_SIZE_MODEL)  # bf16 compute, unrolled layers
    c.optim = common.ConfigDict(dict(b2=0.999, eps=1e-6, weight_decay=0.01))
    if task == 'mlm':  # BERT's pre-training recipe (phase 1: 128-token rows)
      c.dataset = common.ConfigDict(
        dict(
          name='lm1b',
          eval_split='test[:10000]',
          seq_len=128,
          tokenizer=TOKENIZER,
        )
      )  # 15% of the tokens masked
      c.batch_size, c.total_steps, c.eval_every = 256, 1_000_000, 10_000
      c.optim.update(lr=1e-4, warmup_steps=10_000)
    else:  # SST-2 fine-tuning: 3 epochs of 67,349 sentences
      c.dataset = common.ConfigDict(
        dict(
          name='glue/sst2',
          eval_split='validation',
          seq_len=128,
          tokenizer=TOKENIZER,
          text_key='sentence',
          num_classes=2,
        )
      )
      c.batch_size, c.total_steps, c.eval_every = 32, 6300, 1000
      c.optim.update(lr=2e-5, warmup_steps=630)
  else:
    # Strings of the offline Markov language of configs/schema.py's defaults, read by the byte tokenizer.
    c.dataset = common.ConfigDict(dict(name='markov_text', seq_len=32, num_eval=512))
    c.batch_size = 16
    c.total_steps = 300
    c.optim = common.ConfigDict(dict(lr=3e-3, warmup_steps=30))
    c.eval_every = 300
    if task == 'text_classification':  # which of 2 languages wrote a string: longer strings, gentler lr
      c.dataset.update(num_classes=2, seq_len=64)
      c.total_steps = c.eval_every = 600
      c.optim.lr = 1e-3  # at 3e-3 (3 classes, 32 tokens) the post-LN encoder stayed at chance for 300 steps
  if head == 'classify':
    c.model.num_classes = c.dataset.num_classes
  return schema.complete(c)
