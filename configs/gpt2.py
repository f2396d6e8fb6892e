r"""GPT-2 (124M at real size): decoder-only LM, learned positions, tied embeddings.

  python train.py --config configs/gpt2.py:tiny --workdir /tmp/gpt2_tiny          # seconds on CPU
  python train.py --config configs/gpt2.py:fsdp --workdir /tmp/gpt2 --dry_run     # per-device memory
  python train.py --config configs/gpt2.py --workdir /tmp/gpt2                    # 124M on lm1b (bytes)

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp       data parallel            mesh data=8
  :fsdp     fully sharded (default)  mesh data=1, fsdp=8
  :tp       tensor parallel + data   mesh data=2, tensor=4
  :cp       context parallel         mesh fsdp=2, context=4 (each row split in 4 along the sequence)
  :pp       pipeline + FSDP          mesh stage=4, fsdp=2: the scanned layers cut into 4 stages, 16 micro-batches
            (8 at tiny size, which has 4 layers), GPipe; config.pipeline.repeats=2 for circular (docs/pipelines.md)
  :fsdp_tp  FSDP + tensor            mesh data=1, fsdp=4, tensor=2
Sizes: real (GPT-2 small, 124M: 12 layers, 12 heads, d=768), tiny (2 layers, d=64, on the offline
Markov language). Combine with a comma: configs/gpt2.py:tp,tiny.
"""

from configs import common, schema

# The transformer presets (configs/common.py), copied here to edit for this family, e.g. RULES['tp'] = [...].
RULES, MESHES = common.transformer_presets(context=True, pipeline=True)
SIZES = {
  # pad_vocab_to: 50257 rows padded to 50304 so 'vocab' divides any mesh axis up to 128 (padded logits masked).
  'real': dict(
    vocab_size=50257, pad_vocab_to=128, max_len=1024, num_layers=12, num_heads=12, embed_dim=768, mlp_dim=3072
  ),
  # vocab_size unset: the data's (the Markov language's 16 symbols; a tokenizer's ids: configs/schema.py)
  'tiny': dict(max_len=64, num_layers=2, num_heads=4, embed_dim=64, mlp_dim=256),
}


def get_config(arg: str | None = None):
  preset, size = common.parse_arg(arg, RULES, SIZES, default_preset='fsdp', default_size='real', file='gpt2.py')
  c = common.base(preset, size)
  c.task = 'lm'
  c.mesh = common.mesh(MESHES[preset])
  c.logical_axis_rules = RULES[preset]
  c.model = common.ConfigDict(
    dict(
      name='gpt2',
      **SIZES[size],
      norm_eps=1e-5,
      scan_layers=True,
    )
  )  # the speed and memory options (attention, remat, loss_chunks, ...): docs/model_options.md
  if size == 'real':
    c.model.update(common.REAL_SIZE_MODEL)  # bf16 compute, unrolled layers
    c.dataset = common.ConfigDict(dict(name='lm1b', eval_split='test', seq_len=1024, pack=True))  # byte tokenizer
    c.batch_size = 64
    c.total_steps = 100_000
    c.optim = common.ConfigDict(dict(lr=6e-4, warmup_steps=2000))  # AdamW, weight decay 0.1
    c.eval_every = 5000
  else:
    # The offline Markov language of configs/schema.py's defaults: 16 symbols, branching 4.
    c.dataset = common.ConfigDict(dict(name='markov', seq_len=64, num_eval=512))
    c.batch_size = 32
    c.total_steps = 400  # enough to come close to the language's entropy floor (docs/performance.md)
    c.optim = common.ConfigDict(dict(lr=1e-2))  # warmup: a tenth of the run (configs/schema.py)
    c.eval_every = 400
  return schema.complete(common.pipeline_preset(c))
