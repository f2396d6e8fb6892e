"""Pieces shared by the config files (not a config itself: it has no get_config). A config file sets only what it
changes: every field's default is configs/schema.py's, filled in by schema.complete.

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
    c.pipeline = ml_collections.ConfigDict(
      dict(microbatches=PIPELINE_MICROBATCHES.get(c.size, PIPELINE_MICROBATCHES['tiny']))
    )
    if c.size == 'tiny':
      c.model.num_layers = 4
  return c


def mesh(sizes: Mapping[str, int]) -> ml_collections.ConfigDict:
  """Mesh axis name -> size, in device-layout order (outermost first). One size may be -1."""
  return ml_collections.ConfigDict(dict(sizes), sort_keys=False)


def base(preset: str, size: str) -> ml_collections.ConfigDict:
  """A config's start: the preset and size get_config(arg) chose, and causal load balancing for the
  context-parallel presets. Every other field a config does not set gets its default from configs/schema.py
  FIELDS (schema.complete, which each get_config returns through)."""
  c = ml_collections.ConfigDict()
  c.preset, c.size = preset, size
  if preset in CONTEXT_PRESETS:
    c.context_load_balance = True  # rows in zigzag order over the context shards (partitioning/context.py)
  return c


ConfigDict = ml_collections.ConfigDict
