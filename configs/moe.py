r"""MoE decoder (Mixtral-style, 8 experts, top-2): Llama blocks with a mixture of SwiGLU experts.

  python train.py --config configs/moe.py:tiny --workdir /tmp/moe_tiny             # seconds on CPU
  python train.py --config configs/moe.py --workdir /tmp/moe --dry_run              # per-device memory
  python train.py --config configs/moe.py:ep --workdir /tmp/moe                     # expert parallel, lm1b

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp       data parallel              mesh data=8; every expert on every device
  :fsdp     fully sharded              mesh fsdp=8; experts sharded on embed and gathered per layer
  :ep       expert parallel            mesh data=2, expert=4; each device holds 2 of the 8 experts,
            tokens go to their experts by all-to-all; batch on data x expert, dense layers replicated
  :fsdp_ep  FSDP + experts (default)   mesh fsdp=2, expert=4; as ep, and every weight is also sharded
            on embed (dense weights 8 ways over fsdp x expert, expert weights on fsdp)
  :cp       context parallel           mesh fsdp=2, context=4; as fsdp, each row split in 4 along the sequence
            (the routing groups of group_size tokens are split too: dispatch sums over the context axis)
  :pp       pipeline + experts + FSDP  mesh stage=2, fsdp=2, expert=2: the expert layers cut into 2 stages, ep and
            FSDP inside each; 16 micro-batches (4 at tiny size), GPipe (docs/pipelines.md)
  :ep_tp    experts + tensor           mesh expert=4, tensor=2; batch on expert, mlp/heads/vocab on tensor
Under expert parallelism, 'batch' and 'expert' share the mesh axis 'expert': the dense layers are
data parallel over it, the experts are split over it, and the dispatched tokens (expert, batch, ...)
fall back to the remaining batch axis.
Sizes: small (8 experts x top-2, 12 layers, d=1024: 0.93B total, 0.30B active parameters per token),
tiny (2 layers, d=64, 8 experts, on the offline Markov language). Combine: configs/moe.py:ep,tiny.
"""

from configs import common, schema

_REST = [
  ('layers', None),
  ('dense_layers', None),
  ('length', None),
  ('kv', None),
  ('norm', None),
  ('cache_length', None),
  ('cache_kv', None),
]
# The KV cache of generation (configs/common.py): rows like 'batch', kv heads like 'kv_heads'.
_CACHE = {
  'dp': [('cache_batch', 'data'), ('cache_heads', None)],
  'fsdp': [('cache_batch', ('data', 'fsdp')), ('cache_heads', None)],
  'ep': [('cache_batch', ('data', 'expert')), ('cache_batch', 'data'), ('cache_heads', None)],
  'fsdp_ep': [('cache_batch', ('fsdp', 'expert')), ('cache_batch', 'fsdp'), ('cache_heads', None)],
  'cp': [('cache_batch', ('data', 'fsdp')), ('cache_heads', None), ('cache_length', None), ('cache_kv', None)],
  'pp': [('cache_batch', ('fsdp', 'expert', 'stage')), ('cache_batch', 'fsdp'), ('cache_heads', None)],
  'ep_tp': [
    ('cache_batch', ('data', 'expert')),
    ('cache_batch', 'data'),
    ('cache_heads', 'tensor'),
    ('cache_heads', None),
  ],
}
RULES = {
  'dp': [
    ('batch', 'data'),
    ('expert', None),
    ('embed', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('vocab', None),
    *_REST,
  ],
  'fsdp': [
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('embed', None),  # params sharded on embed; activations fall back to None
    ('expert', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('vocab', None),
    *_REST,
  ],
  'ep': [
    ('batch', ('data', 'expert')),
    ('batch', 'data'),  # dispatched tokens: 'expert' is taken, fall back
    ('expert', 'expert'),
    ('expert', None),  # fallback: the router's (embed, expert) kernel under fsdp_ep
    ('embed', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('vocab', None),
    *_REST,
  ],
  'fsdp_ep': [
    ('batch', ('fsdp', 'expert')),
    ('batch', 'fsdp'),
    ('expert', 'expert'),
    ('expert', None),
    ('embed', ('fsdp', 'expert')),
    ('embed', 'fsdp'),
    ('embed', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('vocab', None),
    *_REST,
  ],
  'cp': [  # as fsdp, and each row split along the sequence over 'context' (configs/common.py: 'cp')
    ('batch', ('data', 'fsdp')),
    ('length', 'context'),
    ('embed', ('fsdp', 'context')),
    ('embed', 'fsdp'),
    ('embed', None),
    ('expert', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('vocab', None),
    ('layers', None),
    ('dense_layers', None),
    ('kv', None),
    ('norm', None),
  ],
  # Pipeline + experts + FSDP (docs/pipelines.md): the expert layers' stack cut into 'stage' stages, inside each the
  # ep and FSDP rules; the dense layers first (DeepSeek, Qwen3-MoE) run before the pipeline, replicated.
  'pp': [
    ('batch', ('fsdp', 'expert', 'stage')),
    ('batch', ('fsdp', 'stage')),  # dispatched tokens: 'expert' is taken
    ('layers', 'stage'),
    ('expert', 'expert'),
    ('expert', None),
    ('embed', 'fsdp'),
    ('embed', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('vocab', None),
    *[r for r in _REST if r[0] != 'layers'],
  ],
  'ep_tp': [
    ('batch', ('data', 'expert')),
    ('batch', 'data'),
    ('expert', 'expert'),
    ('expert', None),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('vocab', 'tensor'),
    ('embed', None),
    *_REST,
  ],
}
RULES = {name: rules + _CACHE[name] for name, rules in RULES.items()}
MESHES = {
  'dp': dict(data=8, fsdp=1, expert=1, tensor=1),
  'fsdp': dict(data=1, fsdp=8, expert=1, tensor=1),
  'ep': dict(data=2, fsdp=1, expert=4, tensor=1),
  'fsdp_ep': dict(data=1, fsdp=2, expert=4, tensor=1),
  'cp': dict(data=1, fsdp=2, context=4, expert=1, tensor=1),
  'pp': dict(stage=2, data=1, fsdp=2, expert=2, tensor=1),
  'ep_tp': dict(data=1, fsdp=1, expert=4, tensor=2),
}
_MOE = dict(num_experts=8, top_k=2, capacity_factor=1.25, aux_loss_weight=0.01, router_z_loss_weight=1e-3)
SIZES = {
  # vocab_size 32000 (Mixtral's): point dataset.tokenizer at a local Mistral tokenizer directory to use it all.
  'small': dict(
    vocab_size=32000,
    num_layers=12,
    embed_dim=1024,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    mlp_dim=2816,
    group_size=512,
  ),
  'tiny': dict(  # vocab_size unset: the data's (the Markov language's 16 symbols; a tokenizer's ids)
    num_layers=2,
    embed_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=64,
    group_size=64,
  ),
}


def get_config(arg: str | None = None):
  return sparse_config('moe', arg, RULES, SIZES, default_size='small', model=dict(rope_theta=1e6, norm_eps=1e-5))


def sparse_config(
  name: str, arg: str | None, rules: dict, sizes: dict, *, default_size: str, model: dict | None = None
):
  """Family `name`'s config (the MoE families: this file, configs/qwen3_moe.py, deepseek_v3.py, gpt_oss.py) for
  `arg`: the presets above (`rules`: a copy with the family's own logical names), bf16 and lm1b at real sizes (any
  size but 'tiny'), the offline Markov language at tiny size."""
  preset, size = common.parse_arg(
    arg, rules, sizes, default_preset='fsdp_ep', default_size=default_size, file=f'{name}.py'
  )
  c = common.base(preset, size)
  c.task = 'lm'
  c.mesh = common.mesh(MESHES[preset])
  c.logical_axis_rules = rules[preset]
  c.model = common.ConfigDict(
    {'name': name, **_MOE, **(model or {}), **sizes[size], 'scan_layers': True}
  )  # the speed and memory options (attention, remat, loss_chunks, ...): docs/model_options.md
  if size != 'tiny':
    c.model.update(common.REAL_SIZE_MODEL)  # bf16 compute, unrolled layers
    c.model.remat = 'full'  # without it the ep train step's temporaries are about 9x larger (docs/performance.md)
    c.dataset = common.ConfigDict(dict(name='lm1b', eval_split='test', seq_len=1024, pack=True))  # byte tokenizer
    c.batch_size = 64
    c.total_steps = 100_000
    c.optim = common.ConfigDict(dict(lr=3e-4, warmup_steps=2000))  # AdamW, weight decay 0.1
    c.eval_every = 5000
  else:
    # The offline Markov language of configs/schema.py's defaults: 16 symbols, branching 4.
    c.dataset = common.ConfigDict(dict(name='markov', seq_len=64, num_eval=512))
    c.batch_size = 16
    c.total_steps = 300
    c.optim = common.ConfigDict(dict(lr=3e-3))  # warmup: a tenth of the run (configs/schema.py)
    c.eval_every = 300
  if preset == 'pp':  # scanned layers (the stacked dimension is what the stages cut); 2 expert layers per stage
    c.model.scan_layers = True
    c.pipeline = common.ConfigDict(dict(microbatches=16 if size != 'tiny' else 4))  # 4 rows for fsdp x expert
    if size == 'tiny':
      c.model.num_layers = c.model.get('first_dense_layers', 0) + 2 * len(c.model.get('layer_pattern') or 'G')
  return schema.complete(c)
