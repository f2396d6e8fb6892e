"""Pieces shared by the config files (not a config itself: it has no get_config).

Every config file takes big_vision-style arguments after a colon: a parallelism preset and/or a
size, in any order, comma-separated:
  --config configs/gpt2.py              default preset, real size
  --config configs/gpt2.py:tp           tensor parallel, real size
  --config configs/gpt2.py:tiny         default preset, tiny size (trains in seconds on CPU)
  --config configs/gpt2.py:fsdp,tiny
The transformer presets' rules and meshes live here (TRANSFORMER_RULES, TRANSFORMER_MESHES); each config file
takes a copy as RULES / MESHES, where users edit them. docs/rules.md explains rules; docs/parallelism.md the presets.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import ml_collections

from errors import ConfigError


def parse_arg(
  arg: str | None, presets: Sequence[str], sizes: Sequence[str], *, default_preset: str, default_size: str, file: str
) -> tuple[str, str]:
  """'fsdp,tiny' -> ('fsdp', 'tiny'); unknown words, and two presets or two sizes, raise naming them."""
  given = {}  # 'preset' / 'size' -> the word that chose it
  for word in (w.strip() for w in (arg or '').split(',') if w.strip()):
    if word in presets:
      kind = 'preset'
    elif word in sizes:
      kind = 'size'
    else:
      raise ConfigError(f'{file}: unknown config argument {word!r}; presets: {sorted(presets)}, sizes: {sorted(sizes)}')
    if given.get(kind, word) != word:
      raise ConfigError(f'{file}: two {kind}s {given[kind]!r} and {word!r} in {arg!r}; give one preset and/or one size')
    given[kind] = word
  return given.get('preset', default_preset), given.get('size', default_size)


# The four parallelism presets of the transformer families (gpt2, llama, bert): logical-axis rules (first free
# match wins, later rules for a name are fallbacks, None replicates) and meshes over 8 devices. A config file
# takes a copy (`transformer_presets`) and may edit it, e.g. RULES['tp'] = [...], where users run it.
# What real sizes (run on accelerators) change in config.model: bf16 compute (params and optimizer state stay
# f32) and unrolled layers. Scanned layers compile one block instead of `num_layers` but cost step time on GPUs
# (docs/performance.md). Tiny sizes keep scanned layers: one block to compile is what the CPU tests want.
# Set --config.model.scan_layers=True to trade step time for compile time (e.g. very deep models).
REAL_SIZE_MODEL = dict(dtype='bfloat16', scan_layers=False)

# Decoding's KV cache (generation/engine.py) has its own names: rows like 'batch', kv heads like 'kv_heads' (with a
# fallback, as a cache of fewer kv heads than tensor devices cannot split them), its slots and head width whole.
# config.decode_rules replaces the whole list for generation where another layout suits decoding better.
TRANSFORMER_RULES = {
  'dp': [
    ('batch', 'data'),
    ('layers', None),
    ('length', None),
    ('embed', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('kv', None),
    ('vocab', None),
    ('norm', None),
    ('cache_batch', 'data'),
    ('cache_length', None),
    ('cache_heads', None),
    ('cache_kv', None),
  ],
  'fsdp': [
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('embed', None),  # params sharded on embed; activations fall back to None
    ('layers', None),
    ('length', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('kv', None),
    ('vocab', None),
    ('norm', None),
    ('cache_batch', ('data', 'fsdp')),
    ('cache_length', None),
    ('cache_heads', None),
    ('cache_kv', None),
  ],
  'tp': [
    ('batch', 'data'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('vocab', 'tensor'),
    ('layers', None),
    ('length', None),
    ('embed', None),
    ('kv', None),
    ('norm', None),
    ('cache_batch', 'data'),
    ('cache_length', None),
    ('cache_heads', 'tensor'),
    ('cache_heads', None),
    ('cache_kv', None),
  ],
  # Context (sequence) parallelism: every row split into `context` chunks along 'length' (activations, logits,
  # attention's q/k/v; attention all-gathers keys and values per shard, models/attention.py), batch over fsdp.
  # Parameters are sharded over fsdp x context (FSDP over all 8 devices), so the context axis does not hold
  # replicated weights. The one parameter with a 'length' axis, GPT-2's position table (max_len, embed), is
  # stored as P('context', 'fsdp') like any FSDP weight and gathered whole where it is used.
  'cp': [
    ('batch', ('data', 'fsdp')),
    ('length', 'context'),
    ('embed', ('fsdp', 'context')),
    ('embed', 'fsdp'),
    ('embed', None),
    ('layers', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('kv', None),
    ('vocab', None),
    ('norm', None),
    ('cache_batch', ('data', 'fsdp')),
    ('cache_length', None),
    ('cache_heads', None),
    ('cache_kv', None),
  ],
  # Pipeline parallelism (docs/pipelines.md): the scanned layer stack cut into 'stage' contiguous stages, the batch
  # in config.pipeline.microbatches micro-batches flowing through them; only activations cross 'stage', by
  # collective-permute. Outside the stack (embeddings, head, loss) 'stage' is one more batch axis. FSDP inside.
  'pp': [
    ('batch', ('data', 'fsdp', 'stage')),
    ('layers', 'stage'),
    ('embed', 'fsdp'),
    ('embed', None),
    ('length', None),
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
    ('kv', None),
    ('vocab', None),
    ('norm', None),
    ('cache_batch', ('data', 'fsdp', 'stage')),
    ('cache_length', None),
    ('cache_heads', None),
    ('cache_kv', None),
  ],
  'fsdp_tp': [
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('embed', None),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('vocab', 'tensor'),
    ('layers', None),
    ('length', None),
    ('kv', None),
    ('norm', None),
    ('cache_batch', ('data', 'fsdp')),
    ('cache_length', None),
    ('cache_heads', 'tensor'),
    ('cache_heads', None),
    ('cache_kv', None),
  ],
}
CACHE_NAMES = ('cache_batch', 'cache_length', 'cache_heads', 'cache_kv')  # models/layers.CACHE_AXES: decoders only
TRANSFORMER_MESHES = {
  'dp': dict(data=8, fsdp=1, tensor=1),
  'fsdp': dict(data=1, fsdp=8, tensor=1),
  'tp': dict(data=2, fsdp=1, tensor=4),
  'cp': dict(data=1, fsdp=2, context=4, tensor=1),
  'pp': dict(stage=4, data=1, fsdp=2, tensor=1),  # 'stage' outermost: across hosts where there are several
  'fsdp_tp': dict(data=1, fsdp=4, tensor=2),
}
CONTEXT_PRESETS = ('cp',)  # presets for decoder LMs only (transformer_presets(context=True))
PIPELINE_PRESETS = ('pp',)  # presets for scanned decoder LMs only (transformer_presets(pipeline=True))
PIPELINE_MICROBATCHES = {'real': 16, 'tiny': 8}  # config.pipeline.microbatches of the pp preset: bubble 3/19, 3/11


def transformer_presets(
  extra: Sequence[tuple] = (), drop: Sequence[str] = (), context: bool = False, pipeline: bool = False
) -> tuple[dict, dict]:
  """Copies of (TRANSFORMER_RULES, TRANSFORMER_MESHES) for one config file: `extra` rules appended to every
  preset (e.g. ('token_types', None)), rules for the logical names in `drop` left out; the context-parallel
  preset ('cp') only with `context` (decoder LMs), the pipeline preset ('pp') only with `pipeline`. The last
  preset stays fsdp_tp (tests/test_configs.py trains each file's last preset)."""
  keep = [
    k for k in TRANSFORMER_RULES if (context or k not in CONTEXT_PRESETS) and (pipeline or k not in PIPELINE_PRESETS)
  ]
  rules = {k: [r for r in TRANSFORMER_RULES[k] if r[0] not in drop] + list(extra) for k in keep}
  return rules, copy.deepcopy({k: TRANSFORMER_MESHES[k] for k in keep})


def pipeline_preset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The pp preset's model and pipeline settings (a no-op for other presets): scanned layers (the stacked
  dimension is what the stages cut), the micro-batches, and 4 layers at tiny size (one per stage)."""
  if c.preset in PIPELINE_PRESETS:
    c.model.scan_layers = True
    c.pipeline.microbatches = PIPELINE_MICROBATCHES.get(c.size, PIPELINE_MICROBATCHES['tiny'])
    if c.size == 'tiny':
      c.model.num_layers = 4
  return c


def mesh(sizes: Mapping[str, int]) -> ml_collections.ConfigDict:
  """Mesh axis name -> size, in device-layout order (outermost first). One size may be -1."""
  return ml_collections.ConfigDict(dict(sizes), sort_keys=False)


def dcn_mesh(mesh_cfg: Mapping[str, int]) -> ml_collections.ConfigDict:
  """config.dcn_mesh: the number of slices (hosts, TPU slices) along each axis of config.mesh, all 1 (one slice).
  E.g. --config.dcn_mesh.data=2 runs data parallelism across 2 slices over DCN, config.mesh inside each."""
  return ml_collections.ConfigDict({name: 1 for name in mesh_cfg}, sort_keys=False)


def base(preset: str, size: str) -> ml_collections.ConfigDict:
  """Fields every config has: seed, loop lengths, logging and the AdamW optimizer."""
  c = ml_collections.ConfigDict()
  c.preset, c.size = preset, size
  c.seed = 0
  c.total_steps = 1000
  c.log_every = 50
  c.eval_every = 500
  c.sample_len = 0
  # config.batch_size is the global batch of one optimizer step; grad_accum_steps > 1 runs it as that many
  # micro-batches in one jitted step (training/accumulate.py), the same update with less activation memory.
  # accum_gather_once: under FSDP gather the weights once per step, not once per micro-batch (more memory).
  c.grad_accum_steps = 1
  c.accum_gather_once = False
  c.decode_rules = []  # rules used instead of logical_axis_rules to generate (generation/); []: those
  # Causal load balancing under context parallelism (partitioning/context.py): rows in zigzag order, so every
  # context shard's queries see as many keys as any other's; a no-op where 'length' is not sharded.
  c.context_load_balance = preset in CONTEXT_PRESETS
  # Pipeline parallelism where a rule maps 'layers' to the 'stage' mesh axis (docs/pipelines.md): the batch is
  # split into `microbatches` (at least the stages); `repeats` > 1 runs the circular schedule.
  c.pipeline = ml_collections.ConfigDict(dict(microbatches=1, repeats=1))
  c.optim = ml_collections.ConfigDict(
    dict(
      name='adamw',
      lr=1e-3,
      warmup_steps=100,
      min_lr_ratio=0.1,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      grad_clip=1.0,
    )
  )
  return add_run_fields(c)


def add_run_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checkpointing and fine-tuning fields (docs/checkpoints.md, docs/finetuning.md)."""
  c.checkpoint_every = 1000  # steps between asynchronous checkpoints in <workdir>/checkpoints; 0 = never
  c.keep_checkpoints = 2  # the last K are kept; rerunning the same command resumes from the latest
  c.resume_fallback = True  # a damaged latest checkpoint: moved aside (kept) and the previous one resumed; False: error
  c.checkpoint_space = 'refuse'  # free space short of keep_checkpoints + 1 checkpoints at start: 'refuse' or 'warn'
  c.init_from = ''  # a checkpoint dir of this project (params only) or a Hugging Face model dir
  c.dont_load = ''  # regex over parameter paths left freshly initialised (e.g. a new head: '^classifier/')
  c.freeze = ''  # regex over parameter paths that get no updates and no optimizer state
  c.train_only = ''  # regex: freeze everything else (e.g. '^classifier/' trains only the head)
  c.lora = ml_collections.ConfigDict(
    dict(
      rank=0,  # > 0 adds LoRA adapters (and freezes all but them unless train_only says otherwise)
      alpha=16.0,
      targets=r'attn/(query|value)$',
      export_merged=False,
    )
  )
  # A non-finite loss or gradient never reaches the parameters (the update is skipped in the step). 'stop'
  # ends the run at once, naming the step and the first non-finite gradient's parameter, and writes no
  # checkpoint after it; 'skip' goes on and stops after max_nonfinite_skips bad steps in a row.
  c.on_nonfinite = 'stop'
  c.max_nonfinite_skips = 10
  c.profile_first_step = 0  # > 0: capture a jax.profiler trace of steps [first, first + profile_steps) into workdir
  c.profile_steps = 5
  return c


ConfigDict = ml_collections.ConfigDict
placeholder = ml_collections.config_dict.placeholder  # a typed None: `--config.dataset.data_dir=DIR` can set it
