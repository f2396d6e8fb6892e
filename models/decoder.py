"""One decoder for the dense language-model families: Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 1/2/3, Phi-3, OLMo-2.

A family is a set of declared options on one block (`Options`, the `FAMILIES` table), not a copy of it:

  family   q/k/v bias  q/k norm  norms       Gemma's (1 + w), x sqrt(D), GeGLU   per-checkpoint fields they read
  llama                                                                        rope scaling (llama3)
  qwen2    yes                                                                 sliding window (rarely used)
  qwen3                head                                                    head_dim, sliding window
  mistral                                                                      sliding window on every layer
  gemma                          pre         yes                               head_dim
  gemma2                         pre + post  yes                               query scale, soft caps, 'LG' windows
  gemma3               head      pre + post  yes                               'LLLLLG' windows, local rope base
  phi3                                                                         longrope; fused q|k|v and gate|up
  olmo2                whole     post                                          q/k norm over all heads

What differs per checkpoint is config.model: sizes, head_dim, rope_theta / rope_scaling, `sliding_window` and
`layer_pattern` (a string of 'L' local and 'G' global layers, cycled over the stack: 'G' dense attention
everywhere, 'L' Mistral, 'LG' Gemma 2, 'LLLLLG' Gemma 3), `local_rope_theta` (the local layers' rotary base,
Gemma 3), `query_pre_attn_scalar` (scores scaled by its -1/2 power instead of head_dim's), `attn_softcap` and
`final_softcap` (Gemma 2's tanh caps of attention and output logits), `tie_embeddings`, `pad_vocab_to`.

Parameters follow Hugging Face's names (embed_tokens, blocks/layers/N/{input_layernorm, self_attn/{query, key,
value, out, q_norm, k_norm}, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm,
mlp/{gate, up, down}}, norm, lm_head), so a family's Hugging Face table (`HF_FAMILIES`, at the end) is renames and
reshapes; Llama's paths are what models/llama.py always had. The norms are named by their place as each family's
checkpoints name them: a 'pre' block's input_layernorm and post_attention_layernorm are before attention and before
the MLP (Llama's naming); 'pre_post' (Gemma 2/3) adds post_attention_layernorm after attention and
pre/post_feedforward_layernorm around the MLP; 'post' (OLMo-2) has post_attention_layernorm and
post_feedforward_layernorm after each sublayer only.

Shape suffixes: B batch, L length, D embed, V vocab, T new tokens (decoding).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from errors import ConfigError, HFExportError
from models import attention, mla
from models import hf_import as hf
from models.layers import (
  Attention,
  Dense,
  Embed,
  GatedMLP,
  RMSNorm,
  Stack,
  dtypes,
  gelu_tanh,
  logits_dtype,
  loss_chunks,
  mask_padded_vocab,
  padded_vocab,
  rope_scaling_params,
  silu,
  stack_options,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')
NORMS = ('pre', 'pre_post', 'post')
ACTIVATIONS = {'silu': silu, 'gelu_tanh': gelu_tanh}


@dataclasses.dataclass(frozen=True)
class Options:
  """What a family's block does differently from Llama's (the module docstring's table)."""

  qkv_bias: bool = False  # biases on the q, k and v projections (not the output): Qwen2
  qk_norm: str = ''  # RMSNorm of q and k before the rotary embedding: 'head' (per head), 'whole' (whole projection)
  norms: str = 'pre'  # where the block's RMSNorms sit: NORMS
  norm_plus_one: bool = False  # RMSNorm scales x by (1 + w), w stored (Gemma)
  embed_scale: bool = False  # token embeddings times sqrt(embed_dim) (Gemma)
  activation: str = 'silu'  # the gated MLP's: SwiGLU 'silu' or GeGLU 'gelu_tanh' (Gemma)
  # The sparse families (models/moe.py's block, models/mla.py):
  attention: str = 'mha'  # 'mha' (grouped-query) or 'mla' (multi-head latent attention: DeepSeek-V2/V3)
  out_bias: bool = False  # a bias on the attention's output projection too (GPT-OSS)
  sinks: bool = False  # a learned per-head logit in every softmax's denominator (GPT-OSS)
  router_bias: bool = False  # the router's linear layer has a bias (GPT-OSS)
  expert_bias: bool = False  # the experts' projections have biases (GPT-OSS)
  expert_activation: str = 'silu'  # 'silu' (SwiGLU) or 'clamped' (GPT-OSS: clamped gate and up, (up + 1) * glu)
  fused_gate_up: bool = False  # the experts' gate and up stored as one (expert, embed, mlp, 2) tensor (GPT-OSS)


FAMILIES = {  # config.model.name -> its block's options
  'llama': Options(),
  'qwen2': Options(qkv_bias=True),
  'qwen3': Options(qk_norm='head'),
  'mistral': Options(),
  'gemma': Options(norm_plus_one=True, embed_scale=True, activation='gelu_tanh'),
  'gemma2': Options(norms='pre_post', norm_plus_one=True, embed_scale=True, activation='gelu_tanh'),
  'gemma3': Options(qk_norm='head', norms='pre_post', norm_plus_one=True, embed_scale=True, activation='gelu_tanh'),
  'phi3': Options(),
  'olmo2': Options(qk_norm='whole', norms='post'),
  'moe': Options(),  # Mixtral's attention half (models/moe.py swaps the MLP for its experts)
  'qwen3_moe': Options(qk_norm='head'),
  'deepseek_v3': Options(attention='mla'),
  'gpt_oss': Options(
    qkv_bias=True,
    out_bias=True,
    sinks=True,
    router_bias=True,
    expert_bias=True,
    expert_activation='clamped',
    fused_gate_up=True,
  ),
}


def pattern(cfg: Any) -> str:
  """config.model.layer_pattern at its shortest cycle ('LGLG' -> 'LG', 'LL' -> 'L', 'LLGLL' -> 'LLG': a cycle
  need not fill the string), checked: local layers need a sliding_window. One place in it per block the stack
  compiles (layers.Stack's `period`)."""
  p = cfg.layer_pattern
  if not p or set(p) - {'L', 'G'}:
    raise ConfigError(
      f"config.model.layer_pattern={p!r}: a string of 'L' (local: sliding-window attention) and 'G' (global) layers, "
      "cycled over the stack, e.g. 'G', 'LG', 'LLLLLG'"
    )
  if 'L' in p and cfg.sliding_window is None:
    raise ConfigError(
      f'config.model.layer_pattern={p!r} has local layers, but config.model.sliding_window is None: set the window'
    )
  return next(p[:n] for n in range(1, len(p) + 1) if all(p[i] == p[i % n] for i in range(len(p))))


def layer_windows(cfg: Any) -> list[int | None]:
  """Each layer's sliding window (None: global), in order."""
  p = pattern(cfg)
  return [cfg.sliding_window if p[i % len(p)] == 'L' else None for i in range(cfg.num_layers)]


class Block(nnx.Module):
  """A decoder block: x + attention(norm(x)) then x + mlp(norm(x)), norms where the family puts them. Called with
  `layer` (its place in the layer pattern: local or global attention) when the stack has a pattern."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    opts = FAMILIES[cfg.name]
    if opts.norms not in NORMS:
      raise ConfigError(f'{cfg.name}: norms={opts.norms!r} is not one of {NORMS}')
    kw = dict(**dtypes(cfg), rngs=rngs)
    D = cfg.embed_dim
    norm = lambda: RMSNorm(D, eps=cfg.norm_eps, plus_one=opts.norm_plus_one, **kw)
    if opts.norms in ('pre', 'pre_post'):
      self.input_layernorm = norm()
    self.post_attention_layernorm = norm()  # 'pre': the MLP's input norm (Llama's name)
    if opts.norms == 'pre_post':
      self.pre_feedforward_layernorm = norm()
    if opts.norms in ('pre_post', 'post'):
      self.post_feedforward_layernorm = norm()
    scalar = cfg.query_pre_attn_scalar
    if opts.attention == 'mla':
      self.self_attn = mla.MLA(cfg, **kw)
    else:
      self.self_attn = Attention(
        D,
        cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        use_bias=opts.qkv_bias,
        out_bias=opts.out_bias,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        qk_norm=opts.qk_norm,
        norm_eps=cfg.norm_eps,
        norm_plus_one=opts.norm_plus_one,
        logits=attention.Logits(scale=None if scalar is None else scalar**-0.5, softcap=cfg.attn_softcap),
        sinks=opts.sinks,
        impl=cfg.attention,
        **kw,
      )
    self.init_mlp(cfg, opts, rngs)
    # Each place of the layer pattern: its window and rotary (theta, scaling); local layers take local_rope_theta
    # without scaling where it is set (Gemma 3's linear scaling stretches its global layers only).
    local_rotary = None if cfg.local_rope_theta is None else (cfg.local_rope_theta, None)
    self.places = tuple((cfg.sliding_window, local_rotary) if kind == 'L' else (None, None) for kind in pattern(cfg))
    self.norms = opts.norms

  def init_mlp(self, cfg: ml_collections.ConfigDict, opts: Options, rngs: nnx.Rngs) -> None:
    """The feed-forward half (models/moe.py's block puts its experts here)."""
    self.mlp = GatedMLP(cfg.embed_dim, cfg.mlp_dim, activation=ACTIVATIONS[opts.activation], **dtypes(cfg), rngs=rngs)

  def feed_forward(self, x_BLD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """(the MLP's output, per-layer losses or None)."""
    return self.mlp(x_BLD), None

  def __call__(
    self,
    x_BLD: jax.Array,
    positions_BL: jax.Array | None,
    segment_ids_BL: jax.Array | None,
    *,
    layer: int = 0,
    cache: Any = None,
    decoding: Any = None,
  ) -> jax.Array | tuple[jax.Array, Any]:
    """x (B, L, D) -> x; (x, aux) for a block with per-layer losses (MoE); decoding with a KV cache
    (Stack.decode): (x, the cache written)."""
    window, rotary = self.places[layer]
    h_BLD = self.input_layernorm(x_BLD) if self.norms != 'post' else x_BLD
    h_BLD = self.self_attn(
      h_BLD,
      causal=True,
      positions_BL=positions_BL,
      segment_ids_BL=segment_ids_BL,
      window=window,
      rotary=rotary,
      cache=cache,
      decoding=decoding,
    )
    if cache is not None:
      h_BLD, cache = h_BLD
    if self.norms != 'pre':
      h_BLD = self.post_attention_layernorm(h_BLD)
    x_BLD = shard_logical(x_BLD + h_BLD, ACT)
    if self.norms == 'pre':
      h_BLD = self.post_attention_layernorm(x_BLD)
    elif self.norms == 'pre_post':
      h_BLD = self.pre_feedforward_layernorm(x_BLD)
    else:
      h_BLD = x_BLD
    y_BLD, aux = self.feed_forward(h_BLD)
    if self.norms != 'pre':
      y_BLD = self.post_feedforward_layernorm(y_BLD)
    x_BLD = shard_logical(x_BLD + y_BLD, ACT)
    if cache is not None:
      return x_BLD, cache
    return x_BLD if aux is None else (x_BLD, aux)


class Decoder(nnx.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32 (the family's options from FAMILIES[cfg.name]). Packed rows:
  pass positions and segment_ids (rotary angles come from the positions, so each document starts at position 0).
  `hidden_states` and `head` are the two halves of `__call__` (the chunked LM loss runs the head per chunk);
  `decode` runs new tokens against a KV cache (generation/engine.py)."""

  block = Block

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    opts = FAMILIES[cfg.name]
    kw = dtypes(cfg)
    D, V = cfg.embed_dim, cfg.vocab_size
    self.embed_tokens = Embed(V, D, pad_to=cfg.pad_vocab_to, logits_dtype=logits_dtype(cfg), **kw, rngs=rngs)
    self.make_stacks(cfg, rngs)
    self.norm = RMSNorm(D, eps=cfg.norm_eps, plus_one=opts.norm_plus_one, **kw, rngs=rngs)
    self.tied = cfg.tie_embeddings
    if not self.tied:
      rows = self.embed_tokens.embed.embedding.shape[0]
      self.lm_head = Dense(
        'bld,dv->blv', (D, rows), ('embed', 'vocab'), preferred_element_type=logits_dtype(cfg), **kw, rngs=rngs
      )
    self.embed_scale = math.sqrt(D) if opts.embed_scale else None
    self.final_softcap, self.vocab_size, self.num_layers = cfg.final_softcap, V, cfg.num_layers
    self.dtype = kw['dtype']
    self.loss_chunks = loss_chunks(cfg)

  def make_stacks(self, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs, dense_first: int = 0) -> None:
    """The blocks: num_layers of `self.block` in the family's pattern. `dense_first` (a mixture of experts' dense
    layers first, models/moe.py): that many plain blocks before them, a stack of their own on the 'dense_layers'
    axis ('dense_blocks'), which a pipeline does not cut."""
    if dense_first:
      self.dense_blocks = Stack(
        lambda r: Block(cfg, rngs=r), dense_first, **stack_options(cfg), axis='dense_layers', rngs=rngs
      )
    self.blocks = Stack(
      lambda r: self.block(cfg, rngs=r),
      cfg.num_layers - dense_first,
      **stack_options(cfg),
      period=len(pattern(cfg)),
      rngs=rngs,
    )

  def stacks(self, x_BLD: jax.Array, *args: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x through the dense layers first (if any) and the blocks: (x, the blocks' aux summed over layers)."""
    if hasattr(self, 'dense_blocks'):
      x_BLD, _ = self.dense_blocks(x_BLD, *args)
    return self.blocks(x_BLD, *args)

  def __call__(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> jax.Array:
    return self.head(self.hidden_states(tokens_BL, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL))

  def embed(self, tokens_BL: jax.Array) -> jax.Array:
    """Token embeddings (B, L, D), times sqrt(D) in the compute dtype where the family scales them (Gemma)."""
    x_BLD = self.embed_tokens(tokens_BL)
    if self.embed_scale is not None:
      x_BLD = x_BLD * jnp.asarray(self.embed_scale, self.dtype)
    return shard_logical(x_BLD, ACT)

  def hidden_states(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> jax.Array:
    """The last block's output after the final RMSNorm, (B, L, D)."""
    x_BLD, _ = self.stacks(self.embed(tokens_BL), positions_BL, segment_ids_BL)
    return self.norm(x_BLD)

  def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache: Any, decoding: Any) -> tuple[jax.Array, Any]:
    """The last token's logits (B, V) and the KV cache with tokens_BT written into it (generation/engine.py); with
    dense layers first, `cache` is (theirs, the blocks')."""
    x_BTD = self.embed(tokens_BT)
    if hasattr(self, 'dense_blocks'):
      dense, cache = cache
      x_BTD, dense = self.dense_blocks.decode(x_BTD, dense, decoding, positions_BT, None)
    x_BTD, cache = self.blocks.decode(x_BTD, cache, decoding, positions_BT, None)
    if hasattr(self, 'dense_blocks'):
      cache = (dense, cache)
    return self.head(self.norm(x_BTD[:, -1:]))[:, 0], cache

  def head(self, x_BLD: jax.Array) -> jax.Array:
    """Hidden states (B, L, D) -> logits (B, L, V): the tied embedding or lm_head, soft-capped where the family
    caps them (Gemma 2: final_softcap * tanh(logits / final_softcap)), padded rows masked after."""
    if self.tied:
      logits_BLV = self.embed_tokens.attend(x_BLD, softcap=self.final_softcap)
    else:
      logits_BLV = self.lm_head(x_BLD)
      if self.final_softcap is not None:
        logits_BLV = self.final_softcap * jnp.tanh(logits_BLV / self.final_softcap)
      logits_BLV = mask_padded_vocab(logits_BLV, self.vocab_size)
    return shard_logical(logits_BLV, ('batch', 'length', 'vocab'))


def num_params(cfg: Any) -> int:
  """Closed-form parameter count of a decoder family's config (checked against the built model and the published
  counts in tests)."""
  opts = FAMILIES[cfg.name]
  D, F, N, H = cfg.embed_dim, cfg.mlp_dim, cfg.num_layers, cfg.num_heads
  G = cfg.num_kv_heads or H  # None: as many as the heads
  K = cfg.head_dim or D // H
  V = padded_vocab(cfg)
  norms = {'pre': 2, 'pre_post': 4, 'post': 2}[opts.norms] * D
  bias = (H + 2 * G) * K if opts.qkv_bias else 0
  qk_norm = {'': 0, 'head': 2 * K, 'whole': (H + G) * K}[opts.qk_norm]
  block = norms + 2 * D * H * K + 2 * D * G * K + bias + qk_norm + 3 * D * F
  head = 0 if cfg.tie_embeddings else D * V
  return V * D + N * block + D + head


# --- Hugging Face in and out (models/hf_import.py, models/hf_export.py) -----------------------------------------
#
# Each family's checkpoints: which config.json model_type and class, its activation field and values, where its
# config.json says which layers are local, whether q|k|v and gate|up are fused, and the fields of config.model its
# config.json can carry beyond the common ones (an export of another value is refused by name).


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """How one family's Hugging Face checkpoints are laid out (config.json and tensor names)."""

  model_types: tuple[str, ...]
  architecture: str
  activation: tuple[str, str | tuple[str, ...]] = ('hidden_act', 'silu')  # config.json field, values (first written)
  # Which layers are local, in config.json: '' none (refused), 'all' (one sliding_window for every layer: Mistral,
  # Phi-3), 'types' (layer_types, else the family's default pattern: Gemma 2, Gemma 3), 'qwen' (layer_types, else
  # use_sliding_window with max_window_layers).
  windows: str = ''
  default_pattern: str = 'G'  # Gemma 2 'LG'; Gemma 3 'LLLLLG' (its config.json's sliding_window_pattern)
  fused: bool = False  # Phi-3: qkv_proj = [q | k | v], gate_up_proj = [gate | up]
  carries: tuple[str, ...] = ()  # config.model fields beyond the common ones its config.json holds
  bias_field: str | None = 'attention_bias'  # config.json's switch for biases on every projection (refused)
  # Vision-language checkpoints of the family (Gemma 3 from 4B up): their model_type, and the defaults of the
  # language model's text_config, which the hub's files leave out (transformers fills them in the same way).
  multimodal: str | None = None
  text_defaults: tuple[tuple[str, Any], ...] = ()


CHECKPOINTS = {
  'llama': Checkpoint(('llama',), 'LlamaForCausalLM'),
  'qwen2': Checkpoint(('qwen2',), 'Qwen2ForCausalLM', windows='qwen', bias_field=None),
  'qwen3': Checkpoint(('qwen3',), 'Qwen3ForCausalLM', windows='qwen'),
  'mistral': Checkpoint(('mistral',), 'MistralForCausalLM', windows='all', bias_field=None),
  'gemma': Checkpoint(('gemma',), 'GemmaForCausalLM', activation=('hidden_act', ('gelu_pytorch_tanh', 'gelu'))),
  'gemma2': Checkpoint(
    ('gemma2',),
    'Gemma2ForCausalLM',
    activation=('hidden_activation', ('gelu_pytorch_tanh',)),
    windows='types',
    default_pattern='LG',
    carries=('query_pre_attn_scalar', 'attn_softcap', 'final_softcap'),
  ),
  'gemma3': Checkpoint(
    ('gemma3_text', 'gemma3'),
    'Gemma3ForCausalLM',
    activation=('hidden_activation', ('gelu_pytorch_tanh',)),
    windows='types',
    default_pattern='LLLLLG',
    carries=('query_pre_attn_scalar', 'attn_softcap', 'final_softcap', 'local_rope_theta'),
    multimodal='gemma3',
    text_defaults=(  # transformers' Gemma3TextConfig
      ('vocab_size', 262_208),
      ('hidden_size', 2304),
      ('intermediate_size', 9216),
      ('num_hidden_layers', 26),
      ('num_attention_heads', 8),
      ('num_key_value_heads', 4),
      ('head_dim', 256),
      ('max_position_embeddings', 131_072),
      ('rms_norm_eps', 1e-6),
      ('query_pre_attn_scalar', 256),
      ('sliding_window', 4096),
      ('tie_word_embeddings', True),
    ),
  ),
  'phi3': Checkpoint(('phi3',), 'Phi3ForCausalLM', windows='all', fused=True, bias_field=None),
  'olmo2': Checkpoint(('olmo2',), 'Olmo2ForCausalLM'),
}


def unsupported(field: str, value: Any, why: str) -> hf.HFImportError:
  """The HFImportError for a config.json setting the zoo does not implement: the field, its value and why."""
  return hf.HFImportError(f'config.json {field}={value!r}: {why}')


_ROPE_OTHER_KEYS = ('rope_theta', 'rope_type', 'type', 'partial_rotary_factor')


def hf_rope(c: dict, params: dict | None = None, field: str | None = None) -> tuple[float, tuple | None]:
  """(rope_theta, rope_scaling) from config.json: transformers 5.x writes `rope_parameters` {rope_type, rope_theta,
  ...}; older files have top-level `rope_theta` and `rope_scaling` {type|rope_type, ...}. `params`: one layer type's
  entry of a per-type `rope_parameters` (Gemma 3). A missing original_max_position_embeddings comes from the
  top level (Phi-3) or max_position_embeddings; yarn's and longrope's factor, when absent, is
  max_position_embeddings / original_max_position_embeddings, as transformers takes it."""
  if params is None:
    params = dict(c.get('rope_parameters') or c.get('rope_scaling') or {})
    field = 'rope_parameters' if c.get('rope_parameters') else 'rope_scaling'
  if params and not all(isinstance(v, (int, float, str, list, type(None))) for v in params.values()):
    raise unsupported(field, params, 'per-layer-type rope parameters are not supported for this family')
  theta = float(params.get('rope_theta') or c.get('rope_theta') or 10_000.0)
  kind = params.get('rope_type', params.get('type', 'default'))
  fraction = params.get('partial_rotary_factor', c.get('partial_rotary_factor'))
  if float(fraction or 1.0) != 1.0:
    raise unsupported('partial_rotary_factor', fraction, 'the zoo rotates the whole head_dim')
  if kind == 'default':
    return theta, None
  if kind not in ('llama3', 'linear', 'yarn', 'longrope'):
    raise unsupported(
      f'{field}.rope_type', kind, "the zoo implements 'default', 'linear', 'llama3', 'yarn', 'longrope'"
    )
  scaling = {k: v for k, v in params.items() if k not in _ROPE_OTHER_KEYS}
  if kind != 'linear':
    scaling.setdefault(
      'original_max_position_embeddings', c.get('original_max_position_embeddings') or c.get('max_position_embeddings')
    )
  if kind in ('yarn', 'longrope') and scaling.get('factor') is None:
    scaling['factor'] = c['max_position_embeddings'] / scaling['original_max_position_embeddings']
  try:
    return theta, rope_scaling_params({**scaling, 'rope_type': kind})
  except ConfigError as e:
    raise hf.HFImportError(f'config.json {field}: {e}') from None


def hf_rope_parameters(theta: float, scaling: Any) -> dict:
  """A rotary (theta, scaling) as transformers 5's `rope_parameters` (the inverse of hf_rope)."""
  scaling = rope_scaling_params(scaling)
  if scaling is None:
    return dict(rope_type='default', rope_theta=float(theta))
  out = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}
  if 'original_max_position_embeddings' in out:
    out['original_max_position_embeddings'] = int(out['original_max_position_embeddings'])
  return dict(out, rope_theta=float(theta))


# Gemma3TextConfig's own defaults (global, local rotary bases): a config.json written without them means these.
GEMMA3_HF_THETAS = (1_000_000.0, 10_000.0)


def _rope_fields(c: dict, layout: Checkpoint) -> dict:
  """rope_theta, rope_scaling (and Gemma 3's local_rope_theta) from config.json."""
  params = c.get('rope_parameters') or {}
  if 'local_rope_theta' not in layout.carries:
    theta, scaling = hf_rope(c)
    return dict(rope_theta=theta, rope_scaling=scaling)
  if isinstance(params.get('full_attention'), dict):  # transformers 5: one entry per layer type
    theta, scaling = hf_rope(c, params['full_attention'], 'rope_parameters.full_attention')
    local, local_scaling = hf_rope(c, params.get('sliding_attention') or {}, 'rope_parameters.sliding_attention')
    if local_scaling is not None:
      raise unsupported('rope_parameters.sliding_attention', params['sliding_attention'], 'local layers are unscaled')
  else:  # older files: rope_theta, rope_scaling (global layers) and rope_local_base_freq
    theta, scaling = hf_rope(dict(c, rope_theta=c.get('rope_theta') or GEMMA3_HF_THETAS[0]))
    local = float(c.get('rope_local_base_freq') or GEMMA3_HF_THETAS[1])
  return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local)


def hf_windows(c: dict, layout: Checkpoint) -> dict:
  """sliding_window and layer_pattern from config.json (its layer_types where it has them)."""
  N = c['num_hidden_layers']
  W = c.get('sliding_window')
  if layout.windows == 'qwen' and not c.get('use_sliding_window'):
    W = None
  types = c.get('layer_types')
  if types and layout.windows in ('types', 'qwen'):
    if set(types) - {'sliding_attention', 'full_attention'}:
      raise unsupported('layer_types', types, "the zoo's layers are 'sliding_attention' or 'full_attention'")
    p = ''.join('L' if t == 'sliding_attention' else 'G' for t in types)
  elif layout.windows == 'qwen':
    p = ''.join('L' if W is not None and i >= c.get('max_window_layers', N) else 'G' for i in range(N))
  elif layout.windows == 'all':
    p = 'L' if W is not None else 'G'
  elif layout.windows == 'types':
    n = c.get('sliding_window_pattern') or c.get('_sliding_window_pattern') or len(layout.default_pattern)
    p = ''.join('G' if (i + 1) % n == 0 else 'L' for i in range(N))
  else:
    if W is not None:
      raise unsupported('sliding_window', W, f'the {layout.model_types[0]} family attends to the whole sequence')
    p = 'G'
  if 'L' not in p:
    return dict(sliding_window=None, layer_pattern='G')
  if W is None:
    raise unsupported('sliding_window', W, f'layer_types has sliding layers ({p}) but no window')
  shortest = pattern(ml_collections.ConfigDict(dict(layer_pattern=p, sliding_window=W)))
  return dict(sliding_window=int(W), layer_pattern=shortest)


def _checked(c: dict, name: str, layout: Checkpoint) -> None:
  """Refuses (HFImportError naming the field) the settings a family's config.json may hold that the zoo does not
  implement."""
  field, values = layout.activation
  values = (values,) if isinstance(values, str) else values
  if c.get(field, values[0]) not in values:
    raise unsupported(field, c[field], f"the zoo's {name} MLP is {values[0]}")
  if layout.bias_field and c.get(layout.bias_field):
    raise unsupported(layout.bias_field, True, f"the zoo's {name} projections have no biases (but Qwen2's q, k, v)")
  for key, want, why in (
    ('mlp_bias', False, f"the zoo's {name} MLP has no biases"),
    ('use_bidirectional_attention', False, 'the zoo decodes causally'),
    ('attention_chunk_size', None, 'chunked attention is not implemented'),
  ):
    if c.get(key) not in (None, want):
      raise unsupported(key, c[key], why)


def text_config(name: str, c: dict) -> dict:
  """A config.json as family `name`'s language model's: a vision-language checkpoint's text_config, with the
  defaults its file leaves out (Checkpoint.text_defaults); any other unchanged."""
  layout = CHECKPOINTS[name]
  if layout.multimodal is None or c.get('model_type') != layout.multimodal:
    return c
  text = {**dict(layout.text_defaults), **c.get('text_config', {})}
  # the vision-language model ties its head as its own config says (transformers' default: tied)
  return dict(text, model_type=layout.model_types[0], tie_word_embeddings=c.get('tie_word_embeddings', True))


def hf_config(name: str, c: dict) -> dict:
  """config.json -> config.model's architecture fields for family `name` (the inverse of to_hf_config): every
  architectural field is adopted (the head is part of the architecture: untied configs get their own lm_head).
  A vision-language checkpoint (Gemma 3's) gives its language model's (`text_config`)."""
  layout = CHECKPOINTS[name]
  c = text_config(name, c)
  _checked(c, name, layout)
  H = c['num_attention_heads']
  out = dict(
    vocab_size=c['vocab_size'],
    embed_dim=c['hidden_size'],
    mlp_dim=c['intermediate_size'],
    num_layers=c['num_hidden_layers'],
    num_heads=H,
    num_kv_heads=c.get('num_key_value_heads') or H,
    head_dim=c.get('head_dim') or c['hidden_size'] // H,
    norm_eps=c.get('rms_norm_eps', 1e-6),
    tie_embeddings=bool(c.get('tie_word_embeddings', False)),
    max_len=c.get('max_position_embeddings', 2048),
    **_rope_fields(c, layout),
    **hf_windows(c, layout),
  )
  if 'query_pre_attn_scalar' in layout.carries:
    out.update(
      query_pre_attn_scalar=float(c.get('query_pre_attn_scalar') or out['head_dim']),
      attn_softcap=c.get('attn_logit_softcapping'),
      final_softcap=c.get('final_logit_softcapping'),
    )
  return out


COMMON = ('vocab_size', 'embed_dim', 'mlp_dim', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim', 'norm_eps')
_DEFAULTS = dict(
  sliding_window=None, layer_pattern='G', query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None
)  # what a family whose config.json cannot say otherwise must have


def to_hf_config(name: str, cfg: Any) -> dict:
  """config.model -> config.json of the same <Family>ForCausalLM (the inverse of hf_config); an architecture the
  family's config.json cannot express (a sliding window on Llama, a soft cap on Qwen) is an HFExportError naming
  the field. Without a max_len, transformers' default length."""
  layout = CHECKPOINTS[name]
  windows = layer_windows(cfg)
  for field, default in _DEFAULTS.items():
    carried = field in layout.carries or (field in ('sliding_window', 'layer_pattern') and layout.windows)
    if not carried and cfg[field] != default:
      raise HFExportError(
        f'config.model.{field}={cfg[field]!r}: a {layout.architecture} config.json cannot express it (the '
        f'{name} family has {field}={default!r}); export a family that has it, or train without it'
      )
  if 'local_rope_theta' not in layout.carries and cfg.local_rope_theta is not None:
    raise HFExportError(f'config.model.local_rope_theta={cfg.local_rope_theta!r}: {name} has one rotary base')
  H = cfg.num_heads
  field, values = layout.activation
  out = dict(
    model_type=layout.model_types[0],
    architectures=[layout.architecture],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=H,
    num_key_value_heads=cfg.num_kv_heads or H,
    head_dim=cfg.head_dim or cfg.embed_dim // H,
    rms_norm_eps=cfg.norm_eps,
    tie_word_embeddings=cfg.tie_embeddings,
    attention_dropout=0.0,
    # the tokenizer's business (a class default such as Phi-3's pad 32000 may not exist); a run started from a
    # Hugging Face directory keeps that config.json's ids (hf_export.config_json)
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    **{field: values if isinstance(values, str) else values[0]},
  )
  if layout.bias_field:
    out[layout.bias_field] = False
  if name == 'llama':
    out['mlp_bias'] = False
  if 'local_rope_theta' in layout.carries:
    local = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
    out['rope_parameters'] = dict(
      full_attention=hf_rope_parameters(cfg.rope_theta, cfg.rope_scaling),
      sliding_attention=hf_rope_parameters(local, None),
    )
  else:
    out['rope_parameters'] = hf_rope_parameters(cfg.rope_theta, cfg.rope_scaling)
  types = ['sliding_attention' if w else 'full_attention' for w in windows]
  if layout.windows == 'all':
    if len(set(types)) > 1:
      raise HFExportError(
        f'config.model.layer_pattern={cfg.layer_pattern!r}: a {layout.architecture} config.json has one '
        'sliding_window for every layer'
      )
    out['sliding_window'] = cfg.sliding_window if windows[0] else None
  elif layout.windows:
    out.update(sliding_window=cfg.sliding_window, layer_types=types)
    if layout.windows == 'qwen':
      leading = next((i for i, t in enumerate(types) if t == 'sliding_attention'), len(types))
      out.update(use_sliding_window='sliding_attention' in types, max_window_layers=leading)
  if 'query_pre_attn_scalar' in layout.carries:
    K = cfg.head_dim or cfg.embed_dim // H
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else K
    out.update(
      query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,  # transformers wants an int
      attn_logit_softcapping=cfg.attn_softcap,
      final_logit_softcapping=cfg.final_softcap,
    )
  if name == 'phi3':  # its attention factor and long/short switch read these at the top level too
    s = dict(rope_scaling_params(cfg.rope_scaling) or ())
    if 'original_max_position_embeddings' in s:
      out['original_max_position_embeddings'] = int(s['original_max_position_embeddings'])
    out.update(resid_pdrop=0.0, embd_pdrop=0.0)
  return dict(out, max_position_embeddings=cfg.max_len) if cfg.max_len else out


def hf_params(name: str, mlp: bool = True) -> list[hf.Param]:
  """Family `name`'s rows (models/hf_import.py): HF Linear weights are (out, in), so each is transposed, then the
  heads split out; Phi-3's fused q|k|v and gate|up are sliced first (so the export writes them fused again).
  mlp=False: all but the MLP rows (models/moe.py adds its experts)."""
  opts = FAMILIES[name]
  fused = name in CHECKPOINTS and CHECKPOINTS[name].fused

  def dims(cfg):  # D, H, G, K
    H = cfg.num_heads
    return cfg.embed_dim, H, cfg.num_kv_heads or H, cfg.head_dim or cfg.embed_dim // H

  def proj(part: str, bias: bool = False):  # q, k or v: (rows, D) -> (D, n, K); a bias (rows,) -> (n, K)
    def ops(cfg):
      D, H, G, K = dims(cfg)
      n = H if part == 'q' else G
      cut = []
      if fused:
        start = {'q': 0, 'k': H * K, 'v': (H + G) * K}[part]
        cut = [hf.Slice(0, start, start + n * K)]
      if bias:
        return cut + [hf.R((n, K), (n * K,))]
      return cut + [hf.T((1, 0)), hf.R((D, n, K), (D, n * K))]

    return ops

  def out(cfg):
    D, H, _, K = dims(cfg)
    return [hf.T((1, 0)), hf.R((H, K, D), (H * K, D))]

  b, h = 'blocks/layers/{i}', 'layers.{i}'
  qkv = (lambda p: f'{h}.self_attn.qkv_proj.weight') if fused else (lambda p: f'{h}.self_attn.{p}_proj.weight')
  rows = [
    hf.Param('embed_tokens/embed/embedding', 'embed_tokens.weight', lambda cfg: [hf.Pad(0, *_vocab_rows(cfg))]),
    hf.Param('norm/scale', 'norm.weight'),
    hf.Param(  # untied only
      'lm_head/layer/kernel', 'lm_head.weight', lambda cfg: [hf.T((1, 0)), hf.Pad(1, *_vocab_rows(cfg))]
    ),
    hf.Param(f'{b}/self_attn/query/layer/kernel', qkv('q'), proj('q')),
    hf.Param(f'{b}/self_attn/key/layer/kernel', qkv('k'), proj('k')),
    hf.Param(f'{b}/self_attn/value/layer/kernel', qkv('v'), proj('v')),
    hf.Param(f'{b}/self_attn/out/layer/kernel', f'{h}.self_attn.o_proj.weight', out),
  ]
  rows += [
    hf.Param(f'{b}/{norm}/scale', f'{h}.{norm}.weight')
    for norm in (
      'input_layernorm',
      'post_attention_layernorm',
      'pre_feedforward_layernorm',
      'post_feedforward_layernorm',
    )
  ]  # a block has the ones its family places (rows naming a path the model lacks are skipped)
  if opts.qkv_bias:
    rows += [
      hf.Param(f'{b}/self_attn/{ours}/layer/bias', f'{h}.self_attn.{p}_proj.bias', proj(p, bias=True))
      for ours, p in (('query', 'q'), ('key', 'k'), ('value', 'v'))
    ]
  if opts.qk_norm == 'head':
    rows += [hf.Param(f'{b}/self_attn/{n}/scale', f'{h}.self_attn.{n}.weight') for n in ('q_norm', 'k_norm')]
  elif opts.qk_norm == 'whole':
    rows += [
      hf.Param(
        f'{b}/self_attn/{n}/scale',
        f'{h}.self_attn.{n}.weight',
        lambda cfg, n=n: [hf.R((dims(cfg)[1 if n == 'q_norm' else 2], dims(cfg)[3]), (-1,))],
      )
      for n in ('q_norm', 'k_norm')
    ]
  if mlp and fused:  # gate_up_proj (2F, D) = [gate | up]
    half = lambda part: lambda cfg: [hf.Slice(0, part * cfg.mlp_dim, (part + 1) * cfg.mlp_dim), hf.T((1, 0))]
    rows += [
      hf.Param(f'{b}/mlp/gate/layer/kernel', f'{h}.mlp.gate_up_proj.weight', half(0)),
      hf.Param(f'{b}/mlp/up/layer/kernel', f'{h}.mlp.gate_up_proj.weight', half(1)),
      hf.Param(f'{b}/mlp/down/layer/kernel', f'{h}.mlp.down_proj.weight', [hf.T((1, 0))]),
    ]
  elif mlp:
    rows += [
      hf.Param(f'{b}/mlp/{n}/layer/kernel', f'{h}.mlp.{n}_proj.weight', [hf.T((1, 0))]) for n in ('gate', 'up', 'down')
    ]
  return rows


def _vocab_rows(cfg: Any) -> tuple[int, int]:
  """(the zoo's vocabulary rows, the checkpoint's): config.model.vocab_size padded to pad_vocab_to."""
  return padded_vocab(cfg), cfg.vocab_size


def fits_positions(ours: int, theirs: int) -> str | None:
  """max_len: rotary positions have no table, so a shorter (or equal) length works with any checkpoint."""
  if 0 < ours <= theirs:
    return None
  return (
    f'longer than the {theirs} positions the checkpoint was trained for; '
    'extend the context with rope_scaling, or leave config.model.max_len unset (it follows config.json)'
  )


def _family(name: str) -> hf.Family:
  """Family `name`'s Hugging Face mapping. Keys are 'model.'-prefixed in <Family>ForCausalLM files, bare in
  <Family>Model ones; lm_head.weight is never prefixed. Ignored: rotary inv_freq buffers (older files). A tied
  model (tie_embeddings follows config.json; an untied one always reads lm_head.weight) accepts a file's
  lm_head.weight only as a copy of the embedding. A vision-language checkpoint's language model is read from under
  'language_model.model.' (the hub's files) or 'model.language_model.' (transformers 5's), its vision tower and
  projector ignored; the export writes the language model alone (<Family>ForCausalLM)."""
  layout = CHECKPOINTS[name]
  multimodal = layout.multimodal is not None
  return hf.Family(
    model_types=layout.model_types,
    config=lambda c: hf_config(name, c),
    params=hf_params(name),
    prefixes=('model.', '', *(('language_model.model.', 'model.language_model.') if multimodal else ())),
    keep={'max_len': fits_positions},
    base_keeps=('max_position_embeddings',),
    ignore=(
      r'rotary_emb\.inv_freq$',
      *(
        (r'^(model\.)?(vision_tower|multi_modal_projector)\.', r'^language_model\.lm_head\.weight$')
        if multimodal
        else ()
      ),
    ),
    tied=(('lm_head.weight', 'embed_tokens.weight'),),
    to_config=lambda cfg: to_hf_config(name, cfg),
    unprefixed=(r'^lm_head\.',),
    own_config=(lambda c: text_config(name, c)) if multimodal else None,
  )


HF_FAMILIES: dict[str, hf.Family] = {name: _family(name) for name in CHECKPOINTS}
ENTRY: dict[str, Callable[..., nnx.Module]] = {name: Decoder for name in CHECKPOINTS}  # models.MODELS' entries
