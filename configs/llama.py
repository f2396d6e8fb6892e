r"""Llama (1.24B at real size, Llama-3.2-1B layout): RMSNorm, rotary, grouped-query attention, SwiGLU.

  python train.py --config configs/llama.py:tiny --workdir /tmp/llama_tiny          # seconds on CPU
  python train.py --config configs/llama.py:fsdp --workdir /tmp/llama --dry_run     # per-device memory
  python train.py --config configs/llama.py:cp --workdir /tmp/llama_32k --dry_run   # 32k tokens, context parallel
  python train.py --config configs/llama.py --workdir /tmp/llama \
      --config.dataset.tokenizer=/path/to/llama_tokenizer                           # 1.24B on packed C4

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp       data parallel            mesh data=8 (1.24B replicated: 13.8 GiB of params + Adam per device)
  :fsdp     fully sharded (default)  mesh data=1, fsdp=8
  :tp       tensor parallel + data   mesh data=2, tensor=4 (heads, kv_heads, mlp, vocab on 'tensor')
  :cp       context parallel         mesh fsdp=2, context=4: each row split in 4 along the sequence. At real
            size this is the long-context run: 2 rows of 32,768 tokens (Llama 3.2's rope scaling, as its
            config.json has it), 8,192 tokens of each row per device (benchmarks/context_memory.py); rows in
            zigzag order so every shard's causal attention does the same work (context_load_balance)
  :pp       pipeline + FSDP          mesh stage=4, fsdp=2: the scanned layers cut into 4 stages, 16 micro-batches
            (8 at tiny size, which has 4 layers), GPipe; config.pipeline.repeats=2 for circular (docs/pipelines.md)
  :fsdp_tp  FSDP + tensor            mesh data=1, fsdp=4, tensor=2
Sizes: real (vocab 128256, d=2048, 16 layers, 32 heads, 8 kv heads, mlp 8192, rope_theta 5e5, tied
embeddings), tiny (2 layers, d=64, 8 heads, 4 kv heads, on the offline Markov language).
Combine with a comma: configs/llama.py:tp,tiny.

The real size reads TFDS 'c4' packed into rows of 2048 tokens (segment ids and positions per
document); eval uses the first 10,000 validation documents. Set config.dataset.tokenizer to a local
directory holding the Llama 3 tokenizer, saved on a machine with access by
  AutoTokenizer.from_pretrained('meta-llama/Llama-3.2-1B').save_pretrained(DIR)
(TOKENIZER below is a placeholder: left as is, start-up fails with a message naming that field).
"""

from configs import common, schema

# The transformer presets (configs/common.py), copied here to edit for this family, e.g. RULES['tp'] = [...].
RULES, MESHES = common.transformer_presets(context=True, pipeline=True)
SIZES = {
  # Llama-3.2-1B: 1,235,814,400 parameters (HF config: hidden_size 2048, intermediate_size 8192,
  # num_key_value_heads 8, rms_norm_eps 1e-5, tie_word_embeddings True). head_dim = 2048 / 32 = 64.
  'real': dict(
    vocab_size=128256,
    embed_dim=2048,
    mlp_dim=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500_000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
    max_len=2048,
  ),
  # Llama-3-8B-sized, for the plan search's dry runs (docs/plan_search.md); untied, head_dim 128. This size takes
  # the tiny branch of get_config: set dtype, scan_layers, remat, batch and seq_len with --config.* flags.
  'llama3_8b': dict(
    vocab_size=128256,
    embed_dim=4096,
    mlp_dim=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500_000.0,
    norm_eps=1e-5,
    tie_embeddings=False,
    max_len=8192,
  ),
  'tiny': dict(  # vocab_size unset: the data's (the Markov language's 16 symbols; a tokenizer's ids)
    embed_dim=64,
    mlp_dim=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    rope_theta=10_000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
    max_len=64,
  ),
}
LONG_CONTEXT = 32768  # the cp preset's rows at real size
# Llama-3.2-1B's config.json rope_scaling (trained to 128k positions from 8k): what the long-context preset uses.
LLAMA32_ROPE_SCALING = (
  ('rope_type', 'llama3'),
  ('factor', 32.0),
  ('low_freq_factor', 1.0),
  ('high_freq_factor', 4.0),
  ('original_max_position_embeddings', 8192),
)
TOKENIZER = '/path/to/llama_tokenizer'  # placeholder: a local directory with a saved HF tokenizer


def get_config(arg: str | None = None):
  preset, size = common.parse_arg(arg, RULES, SIZES, default_preset='fsdp', default_size='real', file='llama.py')
  c = common.base(preset, size)
  c.task = 'lm'
  c.mesh = common.mesh(MESHES[preset])
  c.logical_axis_rules = RULES[preset]
  c.model = common.ConfigDict(
    dict(
      name='llama',
      **SIZES[size],
      scan_layers=True,
    )
  )  # the speed and memory options (attention, remat, loss_chunks, ...): docs/model_options.md
  if size == 'real':
    # bf16 compute, f32 params and optimizer state. remat='dots' keeps the weight matmuls' outputs: no matmul runs
    # twice, in less memory than 'none'. For less memory still: --config.model.remat=attention
    # --config.model.loss_chunks=8 (docs/model_options.md; figures in docs/performance.md).
    c.model.update(common.REAL_SIZE_MODEL, remat='dots')
    c.dataset = common.ConfigDict(
      dict(
        name='c4',
        eval_split='validation[:10000]',
        seq_len=2048,
        pack=True,
        tokenizer=TOKENIZER,
      )
    )
    c.batch_size = 64  # 131k tokens per step
    c.total_steps = 100_000
    c.optim = common.ConfigDict(dict(lr=3e-4, warmup_steps=2000))  # AdamW, weight decay 0.1
    c.eval_every = 5000
    if preset == 'cp':  # long context: rows of 32k tokens split over the context axis
      c.model.update(max_len=LONG_CONTEXT, rope_scaling=LLAMA32_ROPE_SCALING)  # (key, value) pairs, or None
      c.dataset.seq_len = LONG_CONTEXT
      c.batch_size = 2  # 65k tokens per step: one row per fsdp group
  else:
    # The offline Markov language of configs/schema.py's defaults: 16 symbols, branching 4.
    c.dataset = common.ConfigDict(dict(name='markov', seq_len=64, num_eval=512))
    c.batch_size = 16
    c.total_steps = 300
    c.optim = common.ConfigDict(dict(lr=3e-3))  # warmup: a tenth of the run (configs/schema.py)
    c.eval_every = 300
  return schema.complete(common.pipeline_preset(c))
