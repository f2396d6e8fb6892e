"""Mixture-of-experts decoder (Mixtral-style): Llama blocks (RMSNorm, rotary, grouped-query attention,
no biases) whose feed-forward is a mixture of SwiGLU experts with top-k routing and a load-balancing loss.

Parameters map onto Hugging Face's MixtralForCausalLM (hub checkpoints: model.layers.N.block_sparse_moe.{gate,
experts.J.{w1, w3, w2}}; transformers 5 in memory: model.layers.N.mlp.{gate, experts.gate_up_proj,
experts.down_proj}; both imported by `HF` at the end, and tested): embed_tokens, blocks.layers.N.{input_layernorm,
self_attn.{query, key, value, out}, post_attention_layernorm, moe.{router (gate), gate (w1), up (w3), down
(w2)}}, norm, lm_head (absent when tie_embeddings). Expert weights are stacked on a leading 'expert' axis:
gate/up (expert, embed, mlp), down (expert, mlp, embed).

Tokens move to the experts, never the expert weights to the tokens (GShard/Switch dispatch):
  1. the (B, L) tokens are cut into groups of S = group_size: x (G, S, D), G sharded like 'batch';
  2. the router picks k experts per token; an expert takes at most C = ceil(k * S * capacity_factor / E)
     of a group's tokens (C <= S);
  3. dispatch: a one-hot einsum, local to each group's devices, gives x (E, G, C, D); re-constraining it
     from (None, 'batch', ...) to ('expert', 'batch', ...) moves the tokens to their experts' devices:
     with 'batch' and 'expert' on one mesh axis (('batch', ('data', 'expert')), ('expert', 'expert')),
     an all-to-all over that axis (and its transpose in the backward pass);
  4. each device runs only its own experts: (E, G, C, D) x (E, D, F) with E sharded;
  5. combine: the router-weighted sum back to (G, S, D) (the inverse all-to-all).
Dropped tokens: if more than C of a group's assignments pick one expert, the later ones are dropped
(slots go to every token's first choice before any second choice, then in token order). A dropped
assignment contributes nothing; the token keeps its other experts and the residual connection.
aux['dropped_fraction'] reports the dropped share of assignments; capacity_factor >= E / k drops none.
Padding tokens are routed like any other and take capacity.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from errors import ConfigError
from models import decoder
from models import hf_import as hf
from models.layers import (
  MOE_DISPATCHED,
  MOE_GATE,
  MOE_RETURNED,
  MOE_UP,
  NORMAL_002,
  NOT_MODEL_FLOPS,
  Dense,
  active_scope,
  axes,
  dtypes,
  padded_vocab,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')
EXPERT_ACT = ('expert', 'batch', None, 'embed')  # dispatched tokens (E, G, C, D) on their experts' devices
GROUP_ACT = (None, 'batch', None, 'embed')  # the same, still on their groups' devices


def route(logits_GSE: jax.Array, k: int, capacity: int) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Top-k routing with per-group expert capacity.

  Returns dispatch_GSEC (1 where token s of group g fills slot c of expert e), combine_GSEC (the same
  entries holding the token's renormalised router weight) and unweighted statistics: the
  load-balancing loss E * sum_e(f_e * p_e) (f_e: share of the k-per-token assignments routed to e,
  before capacity; p_e: mean router probability of e; 1.0 when routing is uniform), the router z-loss
  mean(logsumexp(logits)^2), and the fraction of assignments dropped for lack of capacity.
  """
  G, S, E = logits_GSE.shape
  logits_GSE = logits_GSE.astype(jnp.float32)
  probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
  weights_GSK, experts_GSK = top_k(probs_GSE, k)
  weights_GSK = weights_GSK / weights_GSK.sum(-1, keepdims=True)  # Mixtral renormalises the k weights
  choice_GSKE = jax.nn.one_hot(experts_GSK, E, dtype=jnp.int32)
  # Slot of each assignment in its expert's buffer, counting all first choices of the group, then seconds...
  order_GKSE = choice_GSKE.transpose(0, 2, 1, 3)
  slots_GKSE = jnp.cumsum(order_GKSE.reshape(G, k * S, E), axis=1).reshape(G, k, S, E) - 1
  slot_GSK = (slots_GKSE.transpose(0, 2, 1, 3) * choice_GSKE).sum(-1)
  slot_GSKC = jax.nn.one_hot(slot_GSK, capacity)  # an index >= capacity gives a zero row: dropped
  choice_GSKE = choice_GSKE.astype(jnp.float32)
  dispatch_GSEC = jnp.einsum('gske,gskc->gsec', choice_GSKE, slot_GSKC)
  combine_GSEC = jnp.einsum('gsk,gske,gskc->gsec', weights_GSK, choice_GSKE, slot_GSKC)
  share_E = choice_GSKE.mean((0, 1)).sum(0) / k
  stats = {
    'load_balance_loss': E * jnp.sum(share_E * probs_GSE.mean((0, 1))),
    'router_z_loss': jnp.mean(jax.nn.logsumexp(logits_GSE, axis=-1) ** 2),
    'dropped_fraction': jnp.mean(slot_GSK >= capacity),
  }
  return dispatch_GSEC, combine_GSEC, stats


def top_k(x_GSE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """jax.lax.top_k over the last axis (ties: lower index first) as k argmax passes: the partitioner
  keeps these sharded over G, while it gathers a top_k's operand onto every device."""
  values, indices = [], []
  for _ in range(k):
    i_GS = jnp.argmax(x_GSE, axis=-1)
    values.append(jnp.take_along_axis(x_GSE, i_GS[..., None], axis=-1)[..., 0])
    indices.append(i_GS)
    x_GSE = jnp.where(jnp.arange(x_GSE.shape[-1]) == i_GS[..., None], -jnp.inf, x_GSE)
  return jnp.stack(values, -1), jnp.stack(indices, -1)


def capacity(cfg: Any, group_size: int) -> int:
  """Slots per expert and group: ceil(k * S * capacity_factor / E), at most S."""
  return min(group_size, math.ceil(cfg.top_k * group_size * cfg.capacity_factor / cfg.num_experts))


class MoEMLP(nnx.Module):
  """Top-k mixture of SwiGLU experts. x (B, L, D) -> (y (B, L, D), aux); aux['aux_loss'] is weighted."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    E, D, F, k = cfg.num_experts, cfg.embed_dim, cfg.mlp_dim, cfg.top_k
    if not 1 <= k <= E:
      raise ConfigError(f'config.model.top_k={k} must be in [1, num_experts={E}]')
    if cfg.capacity_factor <= 0:
      raise ConfigError(f'config.model.capacity_factor={cfg.capacity_factor} must be > 0')
    if cfg.group_size < 1:
      raise ConfigError(f'config.model.group_size={cfg.group_size} must be >= 1')
    kw = dtypes(cfg)
    # The router runs in float32 (as Mixtral's softmax does): routing decisions are not bf16 noise.
    self.router = Dense(
      'gsd,de->gse', (D, E), ('embed', 'expert'), dtype=jnp.float32, param_dtype=kw['param_dtype'], rngs=rngs
    )
    expert = lambda shape, names: nnx.Param(NORMAL_002(rngs.params(), shape, kw['param_dtype']), **axes(*names))
    self.gate = expert((E, D, F), ('expert', 'embed', 'mlp'))
    self.up = expert((E, D, F), ('expert', 'embed', 'mlp'))
    self.down = expert((E, F, D), ('expert', 'mlp', 'embed'))
    self.cfg, self.dtype = cfg, kw['dtype']

  def __call__(self, x_BLD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    B, L, D = x_BLD.shape
    S = min(self.cfg.group_size, L)
    if L % S:
      raise ConfigError(f'config.model.group_size={self.cfg.group_size} must divide the sequence length {L}')
    x_GSD = shard_logical(x_BLD.reshape(B * L // S, S, D), ACT)
    logits_GSE = shard_logical(self.router(x_GSD), ('batch', 'length', None))
    C, E, k = capacity(self.cfg, S), self.cfg.num_experts, self.cfg.top_k
    with jax.named_scope(NOT_MODEL_FLOPS):
      dispatch_GSEC, combine_GSEC, stats = route(logits_GSE, k, C)
    dt = self.dtype
    # Each einsum runs where its tokens are (G sharded); the constraint from GROUP_ACT to EXPERT_ACT
    # (and back) is the all-to-all, in the forward and (as its transpose) in the backward pass.
    with jax.named_scope(NOT_MODEL_FLOPS):
      x_EGCD = shard_logical(jnp.einsum('gsec,gsd->egcd', dispatch_GSEC.astype(dt), x_GSD), GROUP_ACT)
    x_EGCD = checkpoint_name(shard_logical(x_EGCD, EXPERT_ACT), MOE_DISPATCHED)  # remat 'dots' keeps the names
    gate_EDF, up_EDF, down_EFD = (w[...].astype(dt) for w in (self.gate, self.up, self.down))
    with jax.named_scope(active_scope(k * S, E * C)):  # model FLOPs: the top-k assignments, not every slot
      h_EGCF = jax.nn.silu(checkpoint_name(jnp.einsum('egcd,edf->egcf', x_EGCD, gate_EDF), MOE_GATE)) * checkpoint_name(
        jnp.einsum('egcd,edf->egcf', x_EGCD, up_EDF), MOE_UP
      )
      h_EGCF = shard_logical(h_EGCF, ('expert', 'batch', None, 'mlp'))
      y_EGCD = shard_logical(jnp.einsum('egcf,efd->egcd', h_EGCF, down_EFD), EXPERT_ACT)
    y_EGCD = checkpoint_name(shard_logical(y_EGCD, GROUP_ACT), MOE_RETURNED)
    with jax.named_scope(NOT_MODEL_FLOPS):
      y_GSD = shard_logical(jnp.einsum('gsec,egcd->gsd', combine_GSEC.astype(dt), y_EGCD), ACT)
    aux_loss = (
      self.cfg.aux_loss_weight * stats['load_balance_loss'] + self.cfg.router_z_loss_weight * stats['router_z_loss']
    )
    return y_GSD.reshape(B, L, D), {'aux_loss': aux_loss, **stats}


class Block(decoder.Block):
  """A decoder block (models/decoder.py, Llama's options) whose feed-forward is the mixture of experts; returns
  (x, aux)."""

  def init_mlp(self, cfg: ml_collections.ConfigDict, opts: decoder.Options, rngs: nnx.Rngs) -> None:
    self.moe = MoEMLP(cfg, rngs=rngs)

  def feed_forward(self, x_BLD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return self.moe(x_BLD)


class MoE(decoder.Decoder):
  """tokens (B, L) int32 -> (logits (B, L, V) float32, aux). aux['aux_loss'] is the weighted sum over
  layers (the lm task adds it to the loss); the other aux entries are unweighted means over layers.
  `hidden_states` (-> (x, aux)) and `head` are the two halves of `__call__` (the chunked LM loss runs the
  head per chunk)."""

  block = Block

  def __call__(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    x_BLD, aux = self.hidden_states(tokens_BL, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL)
    return self.head(x_BLD), aux

  def hidden_states(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The last block's output after the final RMSNorm, (B, L, D), and aux (the class docstring)."""
    x_BLD, totals = self.blocks(self.embed(tokens_BL), positions_BL, segment_ids_BL)
    aux = {k: v if k == 'aux_loss' else v / self.num_layers for k, v in totals.items()}
    return self.norm(x_BLD), aux


def _counts(cfg: Any) -> tuple[int, int, int]:
  """(parameters outside the experts, parameters of one expert, expert layers)."""
  D, F, N, H, E = cfg.embed_dim, cfg.mlp_dim, cfg.num_layers, cfg.num_heads, cfg.num_experts
  G = cfg.num_kv_heads or H  # None: as many as the heads
  K = cfg.head_dim or D // H
  V = padded_vocab(cfg)
  block = 2 * D + 2 * D * H * K + 2 * D * G * K + D * E  # 2 RMSNorms, q+o, k+v, router
  heads = 1 if cfg.tie_embeddings else 2
  return heads * V * D + N * block + D, 3 * D * F, N


def num_params(cfg: Any) -> int:
  """Closed-form total parameter count (checked against the built model in tests)."""
  dense, expert, N = _counts(cfg)
  return dense + N * cfg.num_experts * expert


def num_active_params(cfg: Any) -> int:
  """Parameters one token uses: everything but the experts it is not routed to (k of E per layer)."""
  dense, expert, N = _counts(cfg)
  return dense + N * cfg.top_k * expert


# --- Hugging Face import (models/hf_import.py): MixtralForCausalLM / MixtralModel ---------------------
#
# capacity_factor has no config.json counterpart: Mixtral is dropless (every token reaches its top_k
# experts), and the zoo is dropless when capacity_factor >= num_experts / top_k (then C = S: every expert
# has a slot for every token of a group). The importer sets capacity_factor = num_experts / top_k, so an
# imported model computes what the checkpoint's does; a value from the config or command line is
# replaced, like every architecture field, and logged with them. The price: each expert runs over all S
# slots of a group (E / top_k times the FLOPs of the experts a token uses; Mixtral-8x7B: 4x), as the
# zoo's dispatch has no dropless kernel. group_size has no counterpart either and is kept (any value is
# dropless here). Training settings are not read: router_aux_loss_coef (the zoo's aux_loss_weight x num_layers /
# top_k, see to_hf_config), output_router_logits, dropout.


def _hf_config(c: dict) -> dict:
  """config.json (model_type 'mixtral') -> config.model's architecture fields (the inverse of to_hf_config)."""
  for field, want, why in (
    ('hidden_act', 'silu', "the zoo's MoE experts are SwiGLU (silu)"),
    ('sliding_window', None, "the zoo's MoE attends to the whole sequence"),
    ('router_jitter_noise', 0.0, "the zoo's router adds no noise to the router logits"),
  ):
    if (c.get(field) or want) != want:
      raise decoder.unsupported(field, c[field], why)
  H = c['num_attention_heads']
  theta, scaling = decoder.hf_rope(c)
  E, k = c['num_local_experts'], c['num_experts_per_tok']
  return dict(
    vocab_size=c['vocab_size'],
    embed_dim=c['hidden_size'],
    mlp_dim=c['intermediate_size'],
    num_layers=c['num_hidden_layers'],
    num_heads=H,
    num_kv_heads=c.get('num_key_value_heads') or H,
    head_dim=c.get('head_dim') or c['hidden_size'] // H,
    num_experts=E,
    top_k=k,
    capacity_factor=E / k,
    rope_theta=theta,
    rope_scaling=scaling,
    norm_eps=c.get('rms_norm_eps', 1e-5),
    tie_embeddings=bool(c.get('tie_word_embeddings', False)),
  )


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same MixtralForCausalLM: the real vocabulary (not the padded rows),
  no dropout or router jitter, and the loss weights as router_aux_loss_coef (Mixtral's) and
  router_z_loss_coef (not a Mixtral field: transformers keeps it as an attribute; the torch peer reads it).
  Mixtral's load-balancing loss is over the tokens of every layer at once and counts each of a token's top_k
  assignments, where the zoo's sums the layers' losses of assignment shares: the same penalty is
  router_aux_loss_coef = aux_loss_weight x num_layers / top_k (exactly so where the layers route alike)."""
  H = cfg.num_heads
  out = dict(
    model_type='mixtral',
    architectures=['MixtralForCausalLM'],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=H,
    num_key_value_heads=cfg.num_kv_heads or H,
    head_dim=cfg.head_dim or cfg.embed_dim // H,
    num_local_experts=cfg.num_experts,
    num_experts_per_tok=cfg.top_k,
    hidden_act='silu',
    rms_norm_eps=cfg.norm_eps,
    rope_parameters=decoder.hf_rope_parameters(cfg.rope_theta, cfg.rope_scaling),
    tie_word_embeddings=cfg.tie_embeddings,
    sliding_window=None,
    attention_dropout=0.0,
    router_jitter_noise=0.0,
    router_aux_loss_coef=cfg.aux_loss_weight * cfg.num_layers / cfg.top_k,
    router_z_loss_coef=cfg.router_z_loss_weight,
  )
  return dict(out, max_position_embeddings=cfg.max_len) if cfg.get('max_len') else out  # a length set by hand


def _hf_params() -> list[hf.Param]:
  """The decoder's attention, norm and vocabulary rows (padded to pad_vocab_to), and the experts in either
  file layout. The hub's (what MixtralForCausalLM.save_pretrained writes): block_sparse_moe.gate (E, D) and
  per expert w1 (gate), w3 (up): (F, D), w2 (down): (D, F), stacked onto the 'expert' axis ('{e}').
  transformers 5's in-memory one (save_pretrained(save_original_format=False)): mlp.gate (E, D),
  mlp.experts.gate_up_proj (E, 2F, D) holding gate | up, mlp.experts.down_proj (E, D, F)."""
  b, h = 'blocks/layers/{i}/moe', 'layers.{i}'
  lin = [hf.T((1, 0))]
  half = lambda part: lambda cfg: [hf.Slice(1, part * cfg.mlp_dim, (part + 1) * cfg.mlp_dim), hf.T((0, 2, 1))]
  return decoder.hf_params('moe', mlp=False) + [
    # the hub's layout
    hf.Param(f'{b}/router/layer/kernel', f'{h}.block_sparse_moe.gate.weight', lin),
    hf.Param(f'{b}/gate', f'{h}.block_sparse_moe.experts.{{e}}.w1.weight', lin),
    hf.Param(f'{b}/up', f'{h}.block_sparse_moe.experts.{{e}}.w3.weight', lin),
    hf.Param(f'{b}/down', f'{h}.block_sparse_moe.experts.{{e}}.w2.weight', lin),
    # transformers 5's fused experts
    hf.Param(f'{b}/router/layer/kernel', f'{h}.mlp.gate.weight', lin),
    hf.Param(f'{b}/gate', f'{h}.mlp.experts.gate_up_proj', half(0)),
    hf.Param(f'{b}/up', f'{h}.mlp.experts.gate_up_proj', half(1)),
    hf.Param(f'{b}/down', f'{h}.mlp.experts.down_proj', [hf.T((0, 2, 1))]),
  ]


# Keys are 'model.'-prefixed in MixtralForCausalLM files, bare in MixtralModel ones; lm_head.weight is never
# prefixed. As for Llama: rotary inv_freq buffers are ignored; a tied model accepts a file's lm_head.weight only
# as a copy of the embedding.
HF = hf.Family(
  model_types=('mixtral',),
  config=_hf_config,
  params=_hf_params(),
  prefixes=('model.', ''),
  ignore=(r'rotary_emb\.inv_freq$',),
  tied=(('lm_head.weight', 'embed_tokens.weight'),),
  to_config=to_hf_config,
  unprefixed=(r'^lm_head\.',),
)
