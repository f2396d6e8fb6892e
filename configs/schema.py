"""Every config field's type, allowed values and default, each declared once, and the check of a config against
them before anything is built (train.py, export.py and search.py call `check`).

FIELDS gives each field its type, range and default (none for the fields every config sets); FAMILIES says which
config.model fields each model family needs and reads. `complete` fills in what a config does not set, so config
files set only what they change and the code reads `config.x`, with no default of its own. Where a field's choices
belong to another module (the model families, tasks, optimizers, attention kernels, ...), that module registers
them when it is imported (`register`): configs/ never imports training/ or models/, and `check(config,
owned=False)` checks everything else before JAX is imported. A bad value is one ConfigError naming the field, the
value and what is allowed; so is a field no entry describes (a config file that adds a field adds it here:
tests/test_bad_input.py goes over every field of every config file). Deeper checks that need the whole config
(rules against the mesh, heads dividing the width, a dataset's fields) stay where they are, still before compiling.
`warnings` are the settings that are valid but would silently do something else than written (train.py prints
them). The command line is configs/cli.py's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from errors import ConfigError

INF = float('inf')
RULE = '(logical name, mesh axis | tuple of mesh axes | None) pair'  # one of config.logical_axis_rules
REQUIRED = object()  # Field.default of a field every config sets: it has no default


@dataclasses.dataclass(frozen=True)
class Field:
  """A field's type (int, float, bool, str, 'regex', 'ints', 'mesh', 'dcn', 'rules', 'rope', 'remat', 'info',
  'mixture'), range and default."""

  kind: Any
  lo: float = -INF
  hi: float = INF
  lo_open: bool = False  # lo itself is not allowed
  hi_open: bool = False
  values: tuple[Any, ...] | None = None  # the allowed values, where the schema itself knows them
  owner: str | None = None  # the module that registers the allowed values (`register`), where it does not
  optional: bool = False  # None is allowed
  # What `complete` fills in where a config does not set the field (a function of the config: derived from its
  # other fields when filled); REQUIRED: none, the config must set it.
  default: Any = REQUIRED
  # A default that is a function of other fields and follows them (a `Derived` value): a --config.* override of
  # those fields moves it too, until the field itself is set.
  follows: bool = False
  # The config.task values (dataset fields) or optimizers (optim fields) whose configs have the field; None: all.
  # config.model's fields are the family's (FAMILIES).
  only: tuple[str, ...] | None = None
  path: str = ''  # its key in FIELDS (set below)

  @property
  def required(self) -> bool:
    """Every config sets it: no default, in every config (config.model's other fields: FAMILIES' needs)."""
    section = self.path.partition('.')[0]
    return self.default is REQUIRED and self.only is None and (section != 'model' or self.path == 'model.name')

  @property
  def owned(self) -> bool:
    """Whether what it allows comes from another module (`register`, `register_kind`): checked once that module
    is imported (`check(config, owned=True)`), never before."""
    return self.owner is not None or self.kind in KIND_OWNERS

  def choices(self) -> list[Any] | None:
    """The allowed values (None: any of the kind's): the owner's must have been registered, the owner imported."""
    if self.owner is None:
      return None if self.values is None else list(self.values)
    assert self.path in _CHOICES, (
      f'config.{self.path} is checked, but {self.owner}, which registers its choices (configs.schema.register), '
      'was never imported: import it before configs.schema.check'
    )
    return list(_CHOICES[self.path])

  def allowed(self) -> str:
    if self.owner is not None and self.path not in _CHOICES:  # a description only (missing_field before imports)
      text = f'one of the values {self.owner} registers'
    elif self.choices() is not None:
      text = f'one of {self.choices()}'
      if self.kind == 'remat':  # layers.remat_policy still maps older configs' booleans
        text += ' (or, in a config file, True/False for full/none)'
    elif self.kind in (int, float):
      name = 'an integer' if self.kind is int else 'a finite number'
      bounds = [f'{">" if self.lo_open else ">="} {self.lo:g}'] if self.lo > -INF else []
      bounds += [f'{"<" if self.hi_open else "<="} {self.hi:g}'] if self.hi < INF else []
      text = f'{name} {" and ".join(bounds)}'.strip()
    else:
      text = {
        bool: 'True or False',
        str: 'a string',
        'regex': 'a regular expression (or empty)',
        'ints': 'a non-empty tuple of integers >= 1',
        'mesh': 'a dict of mesh axis name -> size >= 1 (one may be -1)',
        'dcn': 'a dict of mesh axis name -> number of slices >= 1',
        'rules': f'a list of {RULE}s',
        'rope': "None or a rotary scaling: (name, value) pairs of rope_type ('linear', 'llama3', 'yarn' or "
        "'longrope') and its fields (models/layers.ROPE_SCALINGS), e.g. rope_type='llama3', factor, "
        'low_freq_factor, high_freq_factor, original_max_position_embeddings',
        'info': 'a string',
        'mixture': 'a non-empty list of (file glob, weight > 0) pairs',
      }[self.kind]
    return text + (' (or None)' if self.optional else '')

  def problem(self, value: Any) -> bool:
    """Whether `value` is not allowed (an owned field's owner must have registered: `owned`)."""
    if value is None:
      return not self.optional
    kind = self.kind
    if kind is bool:
      return not isinstance(value, bool)
    if kind in (int, float):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return True
      return (
        not math.isfinite(value)
        or value < self.lo
        or value > self.hi
        or (self.lo_open and value == self.lo)
        or (self.hi_open and value == self.hi)
      )
    if kind in (str, 'info', 'remat'):
      if kind == 'remat' and isinstance(value, bool):  # older configs: True/False mean full/none
        return False
      if self.owner is not None and value == self.default:  # allowed: its owner said so when it registered
        return False
      return not isinstance(value, str) or (self.choices() is not None and value not in self.choices())
    if kind == 'regex':
      if not isinstance(value, str):
        return True
      try:
        re.compile(value)
      except re.error:
        return True
      return False
    if kind == 'ints':
      return (
        not isinstance(value, (tuple, list))
        or not value
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
      )
    if kind == 'mesh':
      return (
        not hasattr(value, 'items')
        or not value
        or any(
          not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or not (v >= 1 or v == -1)
          for k, v in value.items()
        )
        or list(value.values()).count(-1) > 1
      )
    if kind == 'dcn':
      return not hasattr(value, 'items') or any(
        not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 1 for k, v in value.items()
      )
    if kind == 'rules':
      return not isinstance(value, (tuple, list)) or any(_kind_problem('rules', r) for r in value)
    if kind == 'mixture':
      return (
        not isinstance(value, (tuple, list))
        or not value
        or any(
          not isinstance(p, (tuple, list))
          or len(p) != 2
          or not isinstance(p[0], str)
          or isinstance(p[1], bool)
          or not isinstance(p[1], (int, float))
          or not (math.isfinite(p[1]) and p[1] > 0)
          for p in value
        )
      )
    if kind == 'rope':
      return bool(_kind_problem('rope', value))
    raise AssertionError(kind)

  def bad_values(self) -> list[Any]:
    """Values this field refuses (for tests): one of the wrong type, and one out of range where a range exists."""
    wrong_type = {
      bool: 'yes',
      int: 'four',
      float: 'small',
      str: 3,
      'info': 3,
      'remat': 3,
      'regex': '(unclosed',
      'ints': 'abc',
      'mesh': {'data': 0},
      'dcn': {'data': -1},
      'rules': [('batch',)],
      'rope': dict(rope_type='yarn'),
      'mixture': [('a.jsonl', 0)],
    }[self.kind]
    out = [wrong_type]
    if self.values is not None or self.owner is not None:
      out.append('no_such_choice')
    if self.kind in (int, float) and self.lo > -INF:
      out.append(self.kind(self.lo) if self.lo_open else self.kind(self.lo - 1))
    if self.kind in (int, float) and self.hi < INF:
      out.append(self.kind(self.hi) if self.hi_open else self.kind(self.hi + 1))
    if self.kind is float:
      out += [float('nan'), float('inf')]
    if self.kind == 'ints':
      out.append((0,))
    return out

  def message(self, path: str, value: Any) -> str:
    """The one-line error for a value `problem` refuses: a bad rule of a list of rules is named by its index."""
    if self.kind == 'rules' and isinstance(value, (tuple, list)):
      i, why = next((i, why) for i, r in enumerate(value) if (why := _kind_problem('rules', r)))
      return f'config.{path}[{i}]={value[i]!r}: must be a {RULE} ({why})'
    shown = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    return f'config.{path}={shown!r}: must be {self.allowed()}'


class Derived(ml_collections.FieldReference):
  """A field's value derived from other fields of its config (`rule(config)`), recomputed by `complete` until the
  field is set: a config file or a --config.* override writing it makes the value its own, and writes nothing else.
  (A shared ml_collections field reference would write both ways: setting the tokenizer would move init_from.)"""

  def __init__(self, rule: Callable[[ml_collections.ConfigDict], Any], kind: type, source: str):
    super().__init__(None, field_type=kind)
    self.rule, self.source, self.given = rule, source, False

  def set(self, value: Any, type_safe: bool = True) -> None:
    self.given = True
    super().set(value, type_safe)

  def derive(self, config: ml_collections.ConfigDict) -> bool:
    """Recomputes the value unless it was set; whether it changed."""
    if self.given:
      return False
    value = self.rule(config)
    changed = value != self.get()
    ml_collections.FieldReference.set(self, value)  # not `set`: a derived value is not given
    return changed


def follows(path: str, kind: type = str) -> Derived:
  """For a config file: a field that takes the value of the field at `path` until it is set itself, e.g.
  `tokenizer=schema.follows('init_from')` (the pretrained model's tokenizer, unless --config.dataset.tokenizer)."""

  def rule(config: ml_collections.ConfigDict) -> Any:
    node = config
    for key in path.split('.'):
      node = _get(node, key) if isinstance(node, ml_collections.ConfigDict) else None
    return node

  return Derived(rule, kind, f'config.{path}')


def derived_from(config: ml_collections.ConfigDict, path: str) -> str | None:
  """What the field at `path` follows ('config.init_from', ...) while it is derived and not set, else None: for
  messages about its value ('config.dataset.tokenizer=... (it follows config.init_from)')."""
  section, _, key = path.rpartition('.')
  node = _get(config, section) if section else config
  ref = _stored(node, key) if isinstance(node, ml_collections.ConfigDict) else None
  return ref.source if isinstance(ref, Derived) and not ref.given else None


def _get(node: Mapping[str, Any], key: str) -> Any:
  # ConfigDict.get, less its cost on a missing key: ml_collections builds a did-you-mean message (difflib over
  # the node's keys) for the KeyError that get() then drops. complete() and check() ask for many missing keys.
  return node.get(key) if '.' in key or key in node else None  # (get reads a dotted path; `in` does not)


def _stored(node: ml_collections.ConfigDict, key: str) -> Any:
  # What a ConfigDict holds for `key` before references are resolved (a Derived value, or a plain one);
  # ml_collections has no public reader of it that leaves the field as it is (get_ref makes it a reference).
  return node._fields.get(key)


def _derived(config: ml_collections.ConfigDict) -> list[Derived]:
  out = []
  for key in config:
    stored = _stored(config, key)
    if isinstance(stored, Derived):
      out.append(stored)
    elif isinstance(config[key], ml_collections.ConfigDict) and key not in OPAQUE:
      out += _derived(config[key])
  return out


def derive(config: ml_collections.ConfigDict) -> None:
  """Recomputes every derived field of `config` that was not set (`Derived`), after other fields changed (the
  command line's overrides; init_from resolved to a directory)."""
  refs = _derived(config)
  for _ in range(len(refs) + 1):  # a derived field may read another: until nothing changes
    if not any([r.derive(config) for r in refs]):
      return


# --- What owners register ----------------------------------------------------------------------------------------
# The modules that own a field's choices (models.MODELS, training.tasks.TASKS, ...) give them to the schema when they
# are imported, so configs/ never imports training/ or models/: the schema checks the rest first, in about a second,
# and the owned fields once train.py has imported their owners (check(config, owned=True)), before anything is built.
KIND_OWNERS = {
  'rules': 'models.layers',  # the shape of one logical-axis rule: partitioning/rules.py's, which AxisRules parses
  'rope': 'models.layers',  # rotary scalings (layers.rope_scaling_params)
}
_CHOICES: dict[str, tuple[Any, ...]] = {}  # field path -> its owner's values
_KIND_PROBLEMS: dict[str, Callable[[Any], str]] = {}  # kind -> what is wrong with a value ('' if nothing)


def register(path: str, values: Sequence[Any]) -> None:
  """The allowed values of the field at `path`, in the order its messages list them; called by the module that
  owns them when it is imported. The model families and their tasks the schema names itself (FAMILIES: the check
  before the owners are imported needs them): models and training.tasks register theirs to be compared."""
  field = FIELDS[path]
  if field.owner is None:
    assert field.values is not None and set(values) == set(field.values), (
      f'config.{path}: configs/schema.py FAMILIES names {sorted(field.values)}, its owner {sorted(values)}'
    )
    return
  assert field.default in (REQUIRED, None, *values), f'config.{path}: its default {field.default!r} is not {values}'
  named = {o for f in FIELDS.values() if f.path.startswith(path.partition('.')[0] + '.') for o in (f.only or ())}
  assert path != 'optim.name' or named <= set(values), f'configs/schema.py names optimizers {sorted(named)}'
  _CHOICES[path] = tuple(values)


def register_kind(kind: str, problem: Callable[[Any], str]) -> None:
  """`problem(value)`: what is wrong with one value of `kind` ('' if nothing); called by the kind's owner."""
  assert kind in KIND_OWNERS, kind
  _KIND_PROBLEMS[kind] = problem


def _kind_problem(kind: str, value: Any) -> str:
  assert kind in _KIND_PROBLEMS, (
    f'a {kind!r} field is checked, but {KIND_OWNERS[kind]}, which registers the check '
    '(configs.schema.register_kind), was never imported: import it before configs.schema.check'
  )
  return _KIND_PROBLEMS[kind](value)


# --- The fields --------------------------------------------------------------------------------------------------


def _data_vocabulary(config: ml_collections.ConfigDict) -> int | None:
  """config.model.vocab_size's default for the language models that leave it unset (the tiny sizes): the data's
  vocabulary. A Markov language's symbols (config.dataset.vocab_size); for text, None: the tokenizer's ids, which
  the run sets when it starts (data.vocabulary), as configs/ never loads a tokenizer."""
  dataset = _get(config, 'dataset')
  if isinstance(dataset, ml_collections.ConfigDict) and _get(dataset, 'name') == 'markov':
    return _get(dataset, 'vocab_size')
  return None


def _prompt_key(config: ml_collections.ConfigDict) -> str | None:
  """config.dataset.prompt_key's default: 'prompt' for the post-training tasks' rows; None (plain text) otherwise."""
  return 'prompt' if _get(config, 'task') in POST else None


def _warmup(config: ml_collections.ConfigDict) -> int:
  """config.optim.warmup_steps's default: 100 steps, or a tenth of a shorter run (config.total_steps)."""
  total = _get(config, 'total_steps')
  return min(100, total // 10) if isinstance(total, int) and not isinstance(total, bool) else 100


def _one_slice_per_axis(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict | None:
  """config.dcn_mesh's default: one slice (host, TPU slice) along every axis of config.mesh."""
  mesh = _get(config, 'mesh')
  return ml_collections.ConfigDict({a: 1 for a in mesh}, sort_keys=False) if hasattr(mesh, 'keys') else None


def _int(lo: float, default: Any = REQUIRED, **kw: Any) -> Field:
  return Field(int, lo=lo, default=default, **kw)


def _float(lo: float, default: Any = REQUIRED, **kw: Any) -> Field:
  return Field(float, lo=lo, default=default, **kw)


@dataclasses.dataclass(frozen=True)
class Family:
  """What a model family (config.model.name) reads: the tasks it trains on, the config.model fields a config of it
  must set (in the order its error lists them) and those filled with their defaults where unset."""

  tasks: tuple[str, ...]
  needs: tuple[str, ...]
  reads: tuple[str, ...] = ()


EVERY_FAMILY = ('dtype', 'param_dtype')
_STACK = ('scan_layers', 'remat')  # models/layers.Stack
_LM = ('attention', *_STACK, 'logits_dtype', 'loss_chunks')
_SIZES = ('num_layers', 'num_heads', 'embed_dim', 'mlp_dim', 'norm_eps')  # and vocab_size (the LMs: the data's)
# models/decoder.py's per-checkpoint fields (its families' options are declared there, not here)
_ROTARY = ('num_kv_heads', 'head_dim', 'rope_theta', 'rope_scaling', 'tie_embeddings', 'pad_vocab_to')
_DECODER = (
  *_ROTARY,
  'sliding_window',
  'layer_pattern',
  'local_rope_theta',
  'query_pre_attn_scalar',
  'attn_softcap',
  'final_softcap',
)
_CAUSAL = ('lm', 'dpo', 'grpo')  # the causal language models' tasks: next tokens, preference pairs, rewards
_MOE = ('num_experts', 'top_k', 'capacity_factor', 'group_size', 'aux_loss_weight')
# models/moe.py's declared routing and expert options (per checkpoint; what a family does differently is declared
# in models/decoder.py FAMILIES)
_ROUTING = (
  'router_z_loss_weight',
  'expert_mlp_dim',
  'first_dense_layers',
  'shared_experts',
  'router_score',
  'norm_topk',
  'routed_scale',
  'router_groups',
  'router_group_topk',
  'score_correction_bias',
)
_MLA = ('q_lora_rank', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim', 'rope_interleave')
# The dense decoder families (models/decoder.py FAMILIES): one block, declared options. max_len: their rotary
# positions have no table (None: config.json's, or none).
DECODERS = ('llama', 'qwen2', 'qwen3', 'mistral', 'gemma', 'gemma2', 'gemma3', 'phi3', 'olmo2')
FAMILIES = {
  # max_len: learned position tables need it; vocab_size: the LMs' may be left to the data (data.vocabulary)
  'gpt2': Family(_CAUSAL, ('max_len', *_SIZES), ('vocab_size', 'pad_vocab_to', *_LM)),
  **{name: Family(_CAUSAL, _SIZES, ('vocab_size', 'max_len', *_DECODER, *_LM)) for name in DECODERS},
  'moe': Family(_CAUSAL, (*_SIZES, *_MOE), ('vocab_size', *_DECODER, *_ROUTING, *_LM)),
  # the sparse families on the MoE block (models/moe.py): Qwen3-MoE, DeepSeek-V3 (latent attention), GPT-OSS
  'qwen3_moe': Family(_CAUSAL, (*_SIZES, *_MOE), ('vocab_size', 'max_len', *_DECODER, *_ROUTING, *_LM)),
  'deepseek_v3': Family(
    _CAUSAL, (*_SIZES, *_MOE, *_MLA[1:5]), ('vocab_size', 'max_len', *_DECODER, *_ROUTING, *_MLA, *_LM)
  ),
  'gpt_oss': Family(_CAUSAL, (*_SIZES, *_MOE), ('vocab_size', 'max_len', *_DECODER, *_ROUTING, 'swiglu_limit', *_LM)),
  'bert': Family(
    ('mlm', 'text_classification'),
    ('max_len', 'vocab_size', *_SIZES),
    ('pad_vocab_to', 'type_vocab_size', 'head', 'attention', *_STACK),
  ),
  'vit': Family(
    ('classification',),
    (
      'image_size',
      'patch_size',
      'channels',
      'embed_dim',
      'num_layers',
      'num_heads',
      'mlp_dim',
      'norm_eps',
      'num_classes',
    ),
    ('attention', *_STACK),
  ),
  'resnet': Family(
    ('classification',),
    ('channels', 'width', 'block', 'stage_sizes', 'bn_eps', 'bn_momentum', 'num_classes'),
    ('bn_fast_variance', 'bn_fused', 'stride_in_1x1', *_STACK),
  ),
  'cnn': Family(('classification',), ('image_size', 'channels', 'features', 'mlp_dim', 'num_classes')),
  'mlp': Family(('classification',), ('image_size', 'channels', 'hidden_dims', 'num_classes')),
}
DTYPES = ('float32', 'bfloat16', 'float16')
TEXT = ('lm', 'mlm', 'text_classification')  # the tasks of text datasets (data/registry.py)
# The tasks your own files serve (data/files.py): every language-model config takes them from the command line.
FILES = ('lm', 'mlm')
POST = ('dpo', 'grpo')  # post-training (training/preference.py, training/rl.py): rows of your own files
OWN_FILES = (*FILES, *POST)
TOKENS = (*TEXT, *POST)  # the tasks whose rows a tokenizer makes, to a length
LABELS = ('classification', 'text_classification')
IMAGES = ('classification',)

FIELDS: dict[str, Field] = {
  # the run
  'task': Field(str, values=tuple(sorted({t for f in FAMILIES.values() for t in f.tasks}))),  # training/tasks.py
  'seed': _int(0, 0),
  'batch_size': _int(1),
  # config.batch_size is the global batch of one optimizer step; grad_accum_steps > 1 runs it as that many
  # micro-batches in one jitted step (training/accumulate.py), the same update with less activation memory.
  # accum_gather_once: under FSDP gather the weights once per step, not once per micro-batch (more memory).
  'grad_accum_steps': _int(1, 1),
  'accum_gather_once': Field(bool, default=False),
  'total_steps': _int(1),
  'log_every': _int(1, 50),
  'eval_every': _int(1, 500),
  'sample_len': _int(0, 0),  # tokens of a sample from the language printed at the end (offline LM datasets)
  'checkpoint_every': _int(0, 1000),  # steps between asynchronous checkpoints in <workdir>/checkpoints; 0 = never
  'keep_checkpoints': _int(1, 2),  # the last K are kept; rerunning the same command resumes from the latest
  'resume_fallback': Field(bool, default=True),  # a damaged latest checkpoint: moved aside, the previous resumed
  'checkpoint_space': Field(str, values=('refuse', 'warn'), default='refuse'),  # too little free space at start
  # Seconds a save may take before the run stops naming what blocks it; 0: from the state's size and the slowest
  # write rate measured in the run (checkpointing/deadlines.py).
  'checkpoint_timeout': _float(0, 0.0),
  # A non-finite loss or gradient never reaches the parameters (the update is skipped in the step). 'stop' ends the
  # run at once, naming the step and the first non-finite gradient's parameter, and writes no checkpoint after it;
  # 'skip' goes on and stops after max_nonfinite_skips bad steps in a row.
  'on_nonfinite': Field(str, values=('stop', 'skip'), default='stop'),
  'max_nonfinite_skips': _int(0, 10),
  'profile_first_step': _int(0, 0),  # > 0: a jax.profiler trace of steps [first, first + profile_steps) in workdir
  'profile_steps': _int(1, 5),
  'preset': Field('info', default=''),  # set by get_config(arg): the parallelism preset the file built
  'size': Field('info', default=''),  # and the size
  'mesh': Field('mesh'),  # mesh axis name -> size, outermost first; one size may be -1
  # Slices over DCN per mesh axis (hosts); e.g. --config.dcn_mesh.data=2 runs data parallelism across 2 slices
  # over DCN, config.mesh inside each.
  'dcn_mesh': Field('dcn', default=_one_slice_per_axis),
  'logical_axis_rules': Field('rules'),
  'decode_rules': Field('rules', default=[]),  # generation's rules in place of logical_axis_rules; []: the same
  # A decode step's weight matmuls on one CPU device: 'auto' runs models/kernels' matvec kernel where it builds and
  # applies (XLA's dot elsewhere), 'xla' always XLA's dot.
  'decode_matmul': Field(str, values=('auto', 'xla'), default='auto'),
  # Causal load balancing under context parallelism (partitioning/context.py): rows in zigzag order, so every
  # context shard's queries see as many keys as any other's; a no-op where 'length' is not sharded.
  'context_load_balance': Field(bool, default=False),
  # Pipeline parallelism where a rule maps 'layers' to the 'stage' mesh axis (docs/pipelines.md): the batch is
  # split into `microbatches` (at least the stages); `repeats` > 1 runs the circular schedule.
  'pipeline.microbatches': _int(1, 1),
  'pipeline.repeats': _int(1, 1),  # 1: GPipe; > 1: circular, each device holding that many non-adjacent stages
  # starting from pretrained weights, what trains (docs/finetuning.md)
  'init_from': Field(str, default=''),  # a checkpoint dir of this project (params only) or a Hugging Face model dir
  'dont_load': Field('regex', default=''),  # parameter paths left freshly initialised (a new head: '^classifier/')
  'freeze': Field('regex', default=''),  # parameter paths that get no updates and no optimizer state
  'train_only': Field('regex', default=''),  # freeze everything else (e.g. '^classifier/' trains only the head)
  'lora.rank': _int(0, 0),  # > 0 adds LoRA adapters (and freezes all but them unless train_only says otherwise)
  'lora.alpha': _float(0, 16.0, lo_open=True),
  'lora.targets': Field('regex', default=r'attn/(query|value)$'),
  'lora.export_merged': Field(bool, default=False),
  # optimizer: linear warmup, cosine decay to lr * min_lr_ratio, gradients clipped to grad_clip (0: not)
  'optim.name': Field(str, owner='training.optim', default='adamw'),
  'optim.lr': _float(0),
  'optim.warmup_steps': _int(0, _warmup, follows=True),
  'optim.min_lr_ratio': Field(float, lo=0, hi=1, default=0.1),
  'optim.grad_clip': _float(0, 1.0),
  'optim.weight_decay': _float(0, 0.1, only=('adamw',)),  # not on vectors (norms, biases)
  'optim.b1': Field(float, lo=0, hi=1, hi_open=True, default=0.9, only=('adamw',)),
  'optim.b2': Field(float, lo=0, hi=1, hi_open=True, default=0.95, only=('adamw',)),
  'optim.eps': _float(0, 1e-8, lo_open=True, only=('adamw',)),
  'optim.momentum': Field(float, lo=0, hi=1, hi_open=True, default=0.9, only=('sgd',)),
  # model: every family's fields; FAMILIES says which a family reads. The speed and memory options
  # (docs/model_options.md) default to what the model computes without them.
  'model.name': Field(str, values=tuple(sorted(FAMILIES))),  # models.MODELS
  'model.dtype': Field(str, values=DTYPES, default='float32'),  # compute
  'model.param_dtype': Field(str, values=DTYPES, default='float32'),
  'model.logits_dtype': Field(str, values=DTYPES, default='float32'),
  'model.loss_chunks': _int(0, 0),  # the LM loss in that many chunks along the length; 0 or 1: off
  'model.attention': Field(str, owner='models.attention', default='auto'),
  'model.remat': Field('remat', owner='models.layers', default='none'),  # True/False: full/none (older configs)
  'model.scan_layers': Field(bool, default=False),  # the blocks stacked and scanned: one to compile
  # None: the tokenizer's ids, set when the run starts (the language models' tiny sizes leave it to the data)
  'model.vocab_size': _int(1, _data_vocabulary, optional=True, follows=True),
  'model.pad_vocab_to': _int(1, 1),  # vocabulary rows rounded up to a multiple of this (padded logits masked)
  'model.max_len': _int(1, None, optional=True),  # positions; None: no table of its own (the imported model's)
  'model.num_layers': _int(1),
  'model.num_heads': _int(1),
  'model.num_kv_heads': _int(1, None, optional=True),  # None: as many as num_heads
  'model.head_dim': _int(1, None, optional=True),  # None: embed_dim // num_heads
  'model.embed_dim': _int(1),
  'model.mlp_dim': _int(1),
  'model.norm_eps': _float(0, lo_open=True),
  'model.tie_embeddings': Field(bool, default=False),  # the output head is the token embedding
  'model.rope_theta': _float(0, 10_000.0, lo_open=True),
  'model.rope_scaling': Field('rope', optional=True, default=None),
  # the decoder families' (models/decoder.py): local layers' window and the pattern of local ('L') and global ('G')
  # layers cycled over the stack; the local layers' rotary base (None: rope_theta, scaled alike); scores scaled by
  # query_pre_attn_scalar**-0.5 (None: head_dim's); tanh soft caps of attention and output logits (None: none)
  'model.sliding_window': _int(1, None, optional=True),
  'model.layer_pattern': Field(str, default='G'),
  'model.local_rope_theta': _float(0, None, lo_open=True, optional=True),
  'model.query_pre_attn_scalar': _float(0, None, lo_open=True, optional=True),
  'model.attn_softcap': _float(0, None, lo_open=True, optional=True),
  'model.final_softcap': _float(0, None, lo_open=True, optional=True),
  'model.num_experts': _int(1),
  'model.top_k': _int(1),
  'model.capacity_factor': _float(0, lo_open=True),
  'model.group_size': _int(1),
  'model.aux_loss_weight': _float(0),
  'model.router_z_loss_weight': _float(0, 0.0),
  'model.expert_mlp_dim': _int(1, None, optional=True),  # an expert's hidden width; None: mlp_dim
  'model.first_dense_layers': _int(0, 0),  # the first layers have a dense MLP (of mlp_dim), not experts
  'model.shared_experts': _int(0, 0),  # experts every token goes through, beside its routed ones
  'model.router_score': Field(str, values=('softmax', 'sigmoid'), default='softmax'),
  'model.norm_topk': Field(bool, default=True),  # the top-k weights renormalised to sum to 1
  'model.routed_scale': _float(0, 1.0, lo_open=True),  # the routed experts' weights times this
  'model.router_groups': _int(1, 1),  # experts in groups; a token picks among router_group_topk groups only
  'model.router_group_topk': _int(1, 1),
  'model.score_correction_bias': Field(bool, default=False),  # a per-expert bias added for choosing, not weighting
  'model.swiglu_limit': _float(0, 7.0, lo_open=True),  # GPT-OSS's clamp of the expert gate and up projections
  # multi-head latent attention (DeepSeek-V2/V3): q and kv through low-rank latents
  'model.q_lora_rank': _int(1, None, optional=True),  # None: a full-rank q projection (V2-Lite)
  'model.kv_lora_rank': _int(1),
  'model.qk_nope_head_dim': _int(1),
  'model.qk_rope_head_dim': _int(2),
  'model.v_head_dim': _int(1),
  'model.rope_interleave': Field(bool, default=True),  # the rotary dims in (x0, x1) pairs, as DeepSeek's weights
  'model.type_vocab_size': _int(1, 2),
  'model.head': Field(str, owner='models.bert', default='mlm'),
  'model.num_classes': _int(1),
  'model.image_size': _int(1),
  'model.patch_size': _int(1),
  'model.channels': _int(1),
  'model.features': Field('ints'),
  'model.hidden_dims': Field('ints'),
  'model.width': _int(1),
  'model.block': Field(str, owner='models.resnet'),
  'model.stage_sizes': Field('ints'),
  'model.bn_eps': _float(0, lo_open=True),
  'model.bn_momentum': Field(float, lo=0, hi=1, hi_open=True),
  'model.bn_fast_variance': Field(bool, default=False),  # one-pass variance E[x^2] - mean^2 (in float32)
  'model.bn_fused': Field(bool, default=False),
  'model.stride_in_1x1': Field(bool, default=False),  # a bottleneck strides on its 3x3 conv (v1.5); True: 1x1 (v1)
  # data (data/registry.py): the fields the datasets of config.task read. None, where allowed: the dataset's own
  # (TFDS_DEFAULTS and the offline datasets' sizes).
  'dataset.name': Field(str),
  'dataset.seq_len': _int(1, None, optional=True, only=TOKENS),  # None: the model's max_len (fine-tune configs)
  'dataset.data_dir': Field(str, optional=True, default=None),  # where TFDS datasets are prepared
  'dataset.train_split': Field(str, default='train'),
  'dataset.eval_split': Field(str, optional=True, default=None),
  'dataset.num_threads': _int(1, 1),
  # train batches made in this many worker processes (images decoded, text packed; 0: in this process's threads)
  'dataset.num_workers': _int(0, 0, only=(*IMAGES, *TEXT)),
  'dataset.prefetch': _int(0, 4),
  # the offline datasets (deterministic from their seed): 'markov', 'markov_text' languages, 'synthetic_images'
  'dataset.seed': _int(0, 0),
  'dataset.num_train': _int(1, 8192),
  'dataset.num_eval': _int(1, 1000),
  'dataset.vocab_size': _int(1, 16, only=TEXT),
  'dataset.branching': _int(1, 4, only=TEXT),
  'dataset.smoothing': Field(float, lo=0, hi=1, default=0.03, only=TEXT),
  'dataset.min_text_len': _int(1, None, optional=True, only=TEXT),  # None: a quarter of max_text_len
  'dataset.max_text_len': _int(1, None, optional=True, only=TEXT),  # None: what a row of seq_len holds
  'dataset.num_classes': _int(1, None, optional=True, only=LABELS),
  'dataset.image_size': _int(1, None, optional=True, only=IMAGES),
  'dataset.channels': _int(1, None, optional=True, only=IMAGES),
  'dataset.noise': _float(0, 1.0, only=IMAGES),
  'dataset.max_shift': _int(0, 2, only=IMAGES),
  'dataset.augment': Field(str, owner='data.vision', optional=True, default=None, only=IMAGES),
  # text
  'dataset.tokenizer': Field(str, default='byte', only=TOKENS),  # 'byte' or a Hugging Face tokenizer directory
  'dataset.text_key': Field(str, default='text'),  # the text feature of TFDS datasets and files
  'dataset.pack': Field(bool, default=False, only=TEXT),  # documents packed into rows (task lm only)
  # lm: documents tokenized once into a cache of ids (data/token_cache.py); False: tokenized as they are read
  'dataset.token_cache': Field(bool, default=True, only=('lm',)),
  'dataset.mlm_probability': Field(float, lo=0, hi=1, lo_open=True, hi_open=True, default=0.15, only=('mlm',)),
  # your own files (data/files.py, docs/your_data.md): name 'json', 'parquet', 'text' or 'hf'
  'dataset.train_files': Field(str, default='', only=OWN_FILES),  # globs, comma-separated ('hf': a split, '': train)
  'dataset.eval_files': Field(str, default='', only=OWN_FILES),
  'dataset.mixture': Field('mixture', optional=True, default=None, only=OWN_FILES),  # (glob, weight) pairs instead
  'dataset.path': Field(str, default='', only=OWN_FILES),  # 'hf': a hub id or a save_to_disk directory
  'dataset.cache_dir': Field(str, optional=True, default=None, only=OWN_FILES),  # the Arrow cache; None: HF's
  'dataset.sample_by': Field(str, owner='data.files', default='line', only=OWN_FILES),  # 'text' files' rows
  # with completion_key: the loss on it; the prompt of a preference pair or of a GRPO row
  'dataset.prompt_key': Field(str, optional=True, default=_prompt_key, only=OWN_FILES),
  'dataset.completion_key': Field(str, optional=True, default=None, only=FILES),
  'dataset.messages_key': Field(str, optional=True, default=None, only=FILES),  # chats: the loss on the answers
  'dataset.no_assistant': Field(str, owner='data.files', default='skip', only=FILES),  # a chat with no answer
  # preference pairs (task dpo, data/preference.py): the two answers to prompt_key's prompt, texts or chats
  'dataset.chosen_key': Field(str, default='chosen', only=('dpo',)),
  'dataset.rejected_key': Field(str, default='rejected', only=('dpo',)),
  # preference tuning (docs/post_training.md, training/preference.py)
  'dpo.loss': Field(str, owner='training.preference', default='sigmoid', only=('dpo',)),
  'dpo.beta': _float(0, 0.1, lo_open=True, only=('dpo',)),  # how far from the reference the policy may move
  'dpo.gamma': _float(0, 0.5, only=('dpo',)),  # simpo's target margin (TRL's simpo_gamma)
  # the reference's log-probs computed in one pass before training and stored beside the data (no reference in the step)
  'dpo.precompute_reference': Field(bool, default=False, only=('dpo',)),
  # GRPO (docs/post_training.md, training/rl.py): 'module:function' rewards, comma-separated, each '*weight' optional
  'grpo.reward': Field(str, default='', only=('grpo',)),
  'grpo.group_size': _int(2, 8, only=('grpo',)),  # completions sampled per prompt; config.batch_size counts them
  'grpo.max_new_tokens': _int(1, 32, only=('grpo',)),  # a completion's longest; prompts get seq_len - this
  'grpo.temperature': _float(0, 1.0, lo_open=True, only=('grpo',)),
  'grpo.beta': _float(0, 0.04, only=('grpo',)),  # the KL (k3) term's weight against the reference; 0: none
  'grpo.epsilon': _float(0, 0.2, lo_open=True, only=('grpo',)),  # the policy ratio is clipped to 1 +- epsilon
  'grpo.iterations': _int(1, 1, only=('grpo',)),  # updates per batch of samples (TRL's num_iterations)
  'grpo.scale_rewards': Field(str, values=('group', 'batch', 'none'), default='group', only=('grpo',)),
  'grpo.loss_aggregation': Field(str, values=('dapo', 'grpo'), default='dapo', only=('grpo',)),
}
FIELDS = {path: dataclasses.replace(field, path=path) for path, field in FIELDS.items()}


OPAQUE = (
  'mesh',
  'dcn_mesh',
  'model.rope_scaling',
)  # dict-valued fields checked as a whole (keys: axis names, rope settings)


def leaves(config: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """Dotted field path -> value, for every field (dict-valued fields in OPAQUE count as one)."""
  out = {}
  for key, value in config.items():
    path = f'{prefix}{key}'
    if isinstance(value, (Mapping, ml_collections.ConfigDict)) and path not in OPAQUE:
      out.update(leaves(value, path + '.'))
    else:
      out[path] = value
  return out


def complete(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Fills every field `config` does not set with the field's default (FIELDS): the run's fields, optim.*
  (those of its optimizer), lora.* and pipeline.*, config.model's of its family (FAMILIES) and config.dataset's
  of its task. Sections model and dataset are filled where the config has them; what has no default stays
  unset (`check` names it). Idempotent; returns `config`. It runs wherever a config comes from: each config
  file's get_config returns through it, cli.parse_flags runs it on what a --config file returns before the
  --config.* overrides (which so reach every field), `check` on a config changed in code, and
  export.load_run_config on a run's saved config (an older run gets today's defaults)."""
  if not isinstance(config, ml_collections.ConfigDict):
    return config
  with config.unlocked():  # a config ml_collections loaded is locked (no new fields); its defaults come all the same
    for path, field in FIELDS.items():
      section, _, key = path.rpartition('.')
      node = config if not section else _get(config, section)
      if node is None and (section in ('optim', 'lora', 'pipeline') or (section in POST and _has(config, field))):
        node = config[section] = ml_collections.ConfigDict()
      if not isinstance(node, ml_collections.ConfigDict) or key in node or not _has(config, field):
        continue
      if field.follows:  # derived below, and again whenever the fields it reads change, until it is set
        node[key] = Derived(field.default, _PYTHON_TYPE.get(field.kind, field.kind), f'the default of config.{path}')
        continue
      value = field.default(config) if callable(field.default) else field.default
      if value is not None:
        node[key] = list(value) if isinstance(value, list) else value
      elif field.optional:  # a typed None, so that --config.<field>=... can set it
        node[key] = ml_collections.config_dict.placeholder(_PYTHON_TYPE[field.kind])
  derive(config)
  return config


_PYTHON_TYPE = {int: int, float: float, str: str, 'rope': tuple, 'mixture': tuple}


def _has(config: ml_collections.ConfigDict, field: Field) -> bool:
  """Whether a config of this family, optimizer and task has `field` (with a default to fill)."""
  if field.default is REQUIRED:
    return False
  section = field.path.partition('.')[0]
  if section == 'model':
    name = _get(config.model, 'name')
    family = FAMILIES.get(name) if isinstance(name, str) else None
    key = field.path[len('model.') :]
    return key in EVERY_FAMILY or (family is not None and key in family.reads)
  if field.only is None:
    return True
  if section == 'optim':
    return _get(config.optim, 'name') in field.only
  return _get(config, 'task') in field.only


def check(config: ml_collections.ConfigDict, *, owned: bool = True) -> None:
  """Completes `config` (`complete`), then raises one ConfigError for the first field that is missing, unknown or
  holds a value it does not allow, a mesh whose axes would not keep the order written, or a model family that does
  not train on config.task or lacks a field it needs. With owned=False the fields whose choices their owners
  register are left for a later check(config) (train.py checks the rest before JAX and the owners are imported);
  with owned=True (the default) those owners must have been imported."""
  complete(config)
  if missing := missing_field(config):
    raise ConfigError(missing)
  for path, value in leaves(config).items():
    field = FIELDS.get(path)
    if field is None:
      raise ConfigError(
        f'config.{path} is not a field shardzoo knows; a new field is described in '
        'configs/schema.py FIELDS (its type and allowed values)'
      )
    if (owned or not field.owned) and field.problem(value):
      raise ConfigError(field.message(path, value))
  for name in MESHES:
    if _reordered(_get(config, name)):
      value = config[name]
      raise ConfigError(
        f'config.{name}={dict(_written(value))!r} is a ConfigDict that sorts its keys: its axes would be laid out '
        f'as {list(value)}, not in the order written; build it with common.mesh(...) '
        '(ml_collections.ConfigDict(..., sort_keys=False))'
      )
  if problem := _family_problem(config.model, config.task):
    raise ConfigError(problem)


def _family_problem(model: ml_collections.ConfigDict, task: str) -> str:
  """A config switched to another family or task by an override (--config.model.name=vit on a GPT-2 config): what
  the family needs, named before anything is built."""
  name = model.name
  family = FAMILIES.get(name) if isinstance(name, str) else None
  if family is None:  # not a family at all: FIELDS['model.name'] says so once its owner registered
    return ''
  missing = [f'config.model.{f}' for f in family.needs if f not in model]
  problems = [] if task in family.tasks else [f'trains on config.task={" or ".join(map(repr, family.tasks))} only']
  if missing:
    problems.append(f'needs {", ".join(missing)}, which this config does not set')
  if not problems:
    return ''
  return (
    f'config.model.name={name!r} with config.task={task!r}: {name} {"; it also ".join(problems)} '
    f'(start from a config file of the {name} family)'
  )


def missing_field(config: Any) -> str:
  """'config.<path> is missing: ...' for the first field every config sets (Field.required) that `config` lacks."""
  have = leaves(config)
  for path, field in FIELDS.items():
    if field.required and path not in have:
      return f'config.{path} is missing: every config sets it ({field.allowed()})'
  return ''


MESHES = ('mesh', 'dcn_mesh')  # device-layout order: outermost axis first


def _written(value: ml_collections.ConfigDict) -> dict[str, Any]:
  # A ConfigDict keeps its fields in the order they were set and sorts them only when iterated (sort_keys=True,
  # the default); ml_collections has no public reader of that order.
  return dict(value._fields)


def _reordered(value: Any) -> bool:
  """Whether `value` is a key-sorting ConfigDict whose axes were written in another order."""
  return isinstance(value, ml_collections.ConfigDict) and value._sort_keys and list(_written(value)) != list(value)


def keep_written_order(config: ml_collections.ConfigDict) -> None:
  """config.mesh and config.dcn_mesh in the order written, where a plain ConfigDict (in a config file, or from
  --config.mesh="{...}") would sort the axes and so change the device layout."""
  for name in MESHES:
    if _reordered(_get(config, name)):
      config[name] = ml_collections.ConfigDict(_written(config[name]), sort_keys=False)


def _pipelined(config: ml_collections.ConfigDict) -> bool | None:
  """Whether a rule maps 'layers' to the 'stage' mesh axis (the first 'layers' rule, as partitioning reads it);
  None where the rules are not a list of pairs (their own check names them)."""
  try:
    axes = next((r[1] for r in config.logical_axis_rules if r[0] == 'layers'), None)
  except (TypeError, IndexError):
    return None
  return 'stage' in (axes if isinstance(axes, (tuple, list)) else (axes,))


def warnings(config: ml_collections.ConfigDict) -> list[str]:
  """Settings that are valid but would not do what they say (train.py prints each as a warning line)."""
  out = []
  warmup, total = config.optim.warmup_steps, config.total_steps
  if warmup > max(total - 1, 0):
    out.append(
      f'config.optim.warmup_steps={warmup} with config.total_steps={total}: the warmup is cut to '
      f'{max(total - 1, 0)} steps (the learning rate peaks at the last step)'
    )
  if config.accum_gather_once and config.grad_accum_steps == 1:
    out.append(
      'config.accum_gather_once=True has no effect with config.grad_accum_steps=1: it gathers the weights once for '
      'all micro-batches of a step, and there is one'
    )
  if _pipelined(config) is False and (config.pipeline.microbatches > 1 or config.pipeline.repeats > 1):
    out.append(
      f'config.pipeline.microbatches={config.pipeline.microbatches}, repeats={config.pipeline.repeats} have no '
      "effect: no rule maps 'layers' to the 'stage' mesh axis, so nothing is pipelined (docs/pipelines.md)"
    )
  if config.dont_load and not config.init_from:
    out.append(
      f'config.dont_load={config.dont_load!r} has no effect without config.init_from: nothing is loaded, '
      'every parameter starts fresh'
    )
  return out
