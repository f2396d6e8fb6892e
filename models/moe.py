"""The mixture-of-experts block with declared routing, and the sparse decoders on it: Mixtral ('moe'), Qwen3-MoE
('qwen3_moe'), DeepSeek-V2/V3 ('deepseek_v3', with multi-head latent attention: models/mla.py) and GPT-OSS
('gpt_oss', with attention sinks and sliding windows). A family's blocks are models/decoder.py's with its
options (FAMILIES); its feed-forward is the experts.

Routing (`Routing`, from config.model), in float32:
  scores = softmax(logits) ('softmax': Mixtral, Qwen3-MoE, GPT-OSS) or sigmoid(logits) ('sigmoid': DeepSeek-V3);
  choice = scores + correction bias (score_correction_bias: DeepSeek-V3's e_score_correction_bias, which picks
           the experts but never weights them);
  groups: with router_groups > 1 the experts are in that many groups, each scored by the sum of its two best
          choices; a token chooses among the router_group_topk best groups only;
  the top_k experts by choice, weighted by their scores, renormalised to sum to 1 (norm_topk), times
  routed_scale (DeepSeek-V3's routed_scaling_factor). GPT-OSS's softmax over the top-k logits is the
  renormalised softmax of all of them, so it is 'softmax' with norm_topk.
Beside the routed experts: `shared_experts` (a SwiGLU of shared_experts x expert_mlp_dim every token goes
through, unweighted: DeepSeek); dense layers first (`first_dense_layers`: DeepSeek's first_k_dense_replace,
Qwen's mlp_only_layers when they lead the stack), a stack of their own ('dense_blocks'); per family, router and
expert biases and GPT-OSS's clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate <= limit,
|up| <= limit).

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

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from errors import ConfigError
from models import decoder, mla
from models import hf_import as hf
from models.layers import (
  MOE_DISPATCHED,
  MOE_GATE,
  MOE_RETURNED,
  MOE_UP,
  NORMAL_002,
  NOT_MODEL_FLOPS,
  Dense,
  GatedMLP,
  active_scope,
  axes,
  dtypes,
  eager_rounding,
  padded_vocab,
  silu,
)
from partitioning import shard_logical

ACT = ('batch', 'length', 'embed')
EXPERT_ACT = ('expert', 'batch', None, 'embed')  # dispatched tokens (E, G, C, D) on their experts' devices
GROUP_ACT = (None, 'batch', None, 'embed')  # the same, still on their groups' devices


@dataclasses.dataclass(frozen=True)
class Routing:
  """How router logits become each token's experts and weights (the module docstring); static."""

  score: str = 'softmax'  # 'softmax' | 'sigmoid'
  normalise: bool = True  # the top-k weights renormalised to sum to 1
  scale: float = 1.0  # then times this
  groups: int = 1  # experts in this many groups; a token picks among `group_topk` of them
  group_topk: int = 1

  @classmethod
  def of(cls, cfg: Any) -> Routing:
    return cls(cfg.router_score, cfg.norm_topk, cfg.routed_scale, cfg.router_groups, cfg.router_group_topk)


MIXTRAL = Routing()


def route(
  logits_GSE: jax.Array, k: int, capacity: int, routing: Routing = MIXTRAL, bias_E: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Top-k routing (`routing`; `bias_E`: the score-correction bias, for choosing only) with per-group expert
  capacity.

  Returns dispatch_GSEC (1 where token s of group g fills slot c of expert e), combine_GSEC (the same
  entries holding the token's router weight) and unweighted statistics: the load-balancing loss
  E * sum_e(f_e * p_e) (f_e: share of the k-per-token assignments routed to e, before capacity; p_e: mean
  router probability of e, sigmoid scores normalised per token; 1.0 when routing is uniform), the router
  z-loss mean(logsumexp(logits)^2), and the fraction of assignments dropped for lack of capacity.
  """
  G, S, E = logits_GSE.shape
  logits_GSE = logits_GSE.astype(jnp.float32)
  sigmoid = routing.score == 'sigmoid'
  scores_GSE = jax.nn.sigmoid(logits_GSE) if sigmoid else jax.nn.softmax(logits_GSE, axis=-1)
  choice_GSE = scores_GSE if bias_E is None else scores_GSE + bias_E.astype(jnp.float32)
  if routing.groups > 1:  # each group scored by its two best choices; the others' experts cannot be chosen
    n = routing.groups
    best_GSn = top_k(choice_GSE.reshape(G, S, n, E // n), 2)[0].sum(-1)
    kept_GSn = jax.nn.one_hot(top_k(best_GSn, routing.group_topk)[1], n).sum(-2) > 0
    choice_GSE = jnp.where(jnp.repeat(kept_GSn, E // n, axis=-1), choice_GSE, -jnp.inf)
  _, experts_GSK = top_k(choice_GSE, k)
  weights_GSK = jnp.take_along_axis(scores_GSE, experts_GSK, axis=-1)
  if routing.normalise:  # Mixtral renormalises the k weights (DeepSeek-V3 guards the sigmoids' sum)
    weights_GSK = weights_GSK / (weights_GSK.sum(-1, keepdims=True) + (1e-20 if sigmoid else 0.0))
  if routing.scale != 1.0:
    weights_GSK = weights_GSK * routing.scale
  probs_GSE = scores_GSE / scores_GSE.sum(-1, keepdims=True) if sigmoid else scores_GSE
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


SWIGLU_ALPHA = 1.702  # GPT-OSS's clamped SwiGLU: gate * sigmoid(alpha * gate)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
  """GPT-OSS's experts' activation, (clip(up) + 1) * g * sigmoid(alpha g) with g = min(gate, limit), in
  transformers' order of torch operations, each rounded to gate's dtype (layers.eager_rounding)."""
  wide, r = eager_rounding(gate.dtype)
  g = jnp.minimum(gate, limit).astype(wide)
  u = jnp.clip(up, -limit, limit).astype(wide)
  glu = r(g * r(jax.nn.sigmoid(r(g * SWIGLU_ALPHA))))
  return (r(u + 1) * glu).astype(gate.dtype)


def expert_dim(cfg: Any) -> int:
  """An expert's hidden width: expert_mlp_dim, or mlp_dim where the family has one width (Mixtral)."""
  return cfg.mlp_dim if cfg.expert_mlp_dim is None else cfg.expert_mlp_dim


class ScoreBias(nnx.Variable):
  """The router's score-correction bias (DeepSeek-V3's e_score_correction_bias): model state, not a parameter;
  auxiliary-loss-free balancing moves it between steps, not the optimizer."""


class MoEMLP(nnx.Module):
  """Top-k mixture of SwiGLU experts. x (B, L, D) -> (y (B, L, D), aux); aux['aux_loss'] is weighted."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    E, D, F, k = cfg.num_experts, cfg.embed_dim, expert_dim(cfg), cfg.top_k
    if not 1 <= k <= E:
      raise ConfigError(f'config.model.top_k={k} must be in [1, num_experts={E}]')
    if cfg.capacity_factor <= 0:
      raise ConfigError(f'config.model.capacity_factor={cfg.capacity_factor} must be > 0')
    if cfg.group_size < 1:
      raise ConfigError(f'config.model.group_size={cfg.group_size} must be >= 1')
    routing = Routing.of(cfg)
    if (
      E % routing.groups
      or not 1 <= routing.group_topk <= routing.groups
      or k > E // routing.groups * routing.group_topk
    ):
      raise ConfigError(
        f'config.model.router_groups={routing.groups}, router_group_topk={routing.group_topk}: the groups must '
        f'divide num_experts={E}, and the groups kept must hold top_k={k} experts'
      )
    opts = decoder.FAMILIES[cfg.name]
    kw = dtypes(cfg)
    # The router runs in float32 (as Mixtral's softmax does): routing decisions are not bf16 noise.
    self.router = Dense(
      'gsd,de->gse',
      (D, E),
      ('embed', 'expert'),
      bias_axes=('expert',) if opts.router_bias else None,
      dtype=jnp.float32,
      param_dtype=kw['param_dtype'],
      rngs=rngs,
    )
    if cfg.score_correction_bias:  # model state, as DeepSeek's buffer: it chooses, never weights, so no gradient
      self.correction_bias = ScoreBias(jnp.zeros((E,), jnp.float32), **axes('expert'))
    expert = lambda shape, names, init=NORMAL_002: nnx.Param(
      init(rngs.params(), shape, kw['param_dtype']), **axes(*names)
    )
    if opts.fused_gate_up:  # GPT-OSS's layout: gate and up interleaved on the last axis, kept as one tensor
      self.gate_up = expert((E, D, F, 2), ('expert', 'embed', 'mlp', 'glu'))
    else:
      self.gate = expert((E, D, F), ('expert', 'embed', 'mlp'))
      self.up = expert((E, D, F), ('expert', 'embed', 'mlp'))
    self.down = expert((E, F, D), ('expert', 'mlp', 'embed'))
    if opts.expert_bias:
      zeros = nnx.initializers.zeros
      if opts.fused_gate_up:
        self.gate_up_bias = expert((E, F, 2), ('expert', 'mlp', 'glu'), zeros)
      self.down_bias = expert((E, D), ('expert', 'embed'), zeros)
    if cfg.shared_experts:
      self.shared_experts = GatedMLP(D, cfg.shared_experts * F, **kw, rngs=rngs)
    self.cfg, self.dtype, self.routing = cfg, kw['dtype'], routing
    self.activation, self.limit = (
      opts.expert_activation,
      cfg.swiglu_limit if opts.expert_activation == 'clamped' else None,
    )

  def _hidden(self, x_EGCD: jax.Array) -> jax.Array:
    """The experts' gated hidden activations (E, G, C, F), each from its own weights."""
    dt = self.dtype
    if hasattr(self, 'gate_up'):
      w_EDF2 = self.gate_up[...].astype(dt)
      gate_EDF, up_EDF = w_EDF2[..., 0], w_EDF2[..., 1]
    else:
      gate_EDF, up_EDF = self.gate[...].astype(dt), self.up[...].astype(dt)
    g_EGCF = checkpoint_name(jnp.einsum('egcd,edf->egcf', x_EGCD, gate_EDF), MOE_GATE)
    u_EGCF = checkpoint_name(jnp.einsum('egcd,edf->egcf', x_EGCD, up_EDF), MOE_UP)
    if hasattr(self, 'gate_up_bias'):
      b_EF2 = self.gate_up_bias[...].astype(dt)
      g_EGCF, u_EGCF = g_EGCF + b_EF2[:, None, None, :, 0], u_EGCF + b_EF2[:, None, None, :, 1]
    if self.activation == 'clamped':  # GPT-OSS
      return clamped_swiglu(g_EGCF, u_EGCF, self.limit)
    return silu(g_EGCF) * u_EGCF

  def __call__(self, x_BLD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    B, L, D = x_BLD.shape
    S = min(self.cfg.group_size, L)
    if L % S:
      raise ConfigError(f'config.model.group_size={self.cfg.group_size} must divide the sequence length {L}')
    x_GSD = shard_logical(x_BLD.reshape(B * L // S, S, D), ACT)
    logits_GSE = shard_logical(self.router(x_GSD), ('batch', 'length', None))
    C, E, k = capacity(self.cfg, S), self.cfg.num_experts, self.cfg.top_k
    bias_E = self.correction_bias[...] if hasattr(self, 'correction_bias') else None
    with jax.named_scope(NOT_MODEL_FLOPS):
      dispatch_GSEC, combine_GSEC, stats = route(logits_GSE, k, C, self.routing, bias_E)
    dt = self.dtype
    # Each einsum runs where its tokens are (G sharded); the constraint from GROUP_ACT to EXPERT_ACT
    # (and back) is the all-to-all, in the forward and (as its transpose) in the backward pass.
    with jax.named_scope(NOT_MODEL_FLOPS):
      x_EGCD = shard_logical(jnp.einsum('gsec,gsd->egcd', dispatch_GSEC.astype(dt), x_GSD), GROUP_ACT)
    x_EGCD = checkpoint_name(shard_logical(x_EGCD, EXPERT_ACT), MOE_DISPATCHED)  # remat 'dots' keeps the names
    with jax.named_scope(active_scope(k * S, E * C)):  # model FLOPs: the top-k assignments, not every slot
      h_EGCF = shard_logical(self._hidden(x_EGCD), ('expert', 'batch', None, 'mlp'))
      y_EGCD = jnp.einsum('egcf,efd->egcd', h_EGCF, self.down[...].astype(dt))
      if hasattr(self, 'down_bias'):
        y_EGCD = y_EGCD + self.down_bias[...].astype(dt)[:, None, None, :]
      y_EGCD = shard_logical(y_EGCD, EXPERT_ACT)
    y_EGCD = checkpoint_name(shard_logical(y_EGCD, GROUP_ACT), MOE_RETURNED)
    with jax.named_scope(NOT_MODEL_FLOPS):
      y_GSD = shard_logical(jnp.einsum('gsec,egcd->gsd', combine_GSEC.astype(dt), y_EGCD), ACT)
    y_BLD = y_GSD.reshape(B, L, D)
    if hasattr(self, 'shared_experts'):  # every token, unweighted
      y_BLD = y_BLD + self.shared_experts(x_BLD)
    aux_loss = (
      self.cfg.aux_loss_weight * stats['load_balance_loss'] + self.cfg.router_z_loss_weight * stats['router_z_loss']
    )
    return y_BLD, {'aux_loss': aux_loss, **stats}


class Block(decoder.Block):
  """A decoder block (models/decoder.py, its family's options) whose feed-forward is the mixture of experts;
  returns (x, aux)."""

  def init_mlp(self, cfg: ml_collections.ConfigDict, opts: decoder.Options, rngs: nnx.Rngs) -> None:
    self.moe = MoEMLP(cfg, rngs=rngs)

  def feed_forward(self, x_BLD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return self.moe(x_BLD)


class MoE(decoder.Decoder):
  """tokens (B, L) int32 -> (logits (B, L, V) float32, aux). aux['aux_loss'] is the weighted sum over
  layers (the lm task adds it to the loss); the other aux entries are unweighted means over the expert layers.
  `hidden_states` (-> (x, aux)) and `head` are the two halves of `__call__` (the chunked LM loss runs the
  head per chunk). With first_dense_layers, those layers are a stack of their own ('dense_blocks', dense MLPs of
  mlp_dim, stacked on 'dense_layers') before the experts' ('blocks'); a pipeline cuts only the experts' stack."""

  block = Block

  def make_stacks(self, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs) -> None:
    first = cfg.first_dense_layers
    if not 0 <= first < cfg.num_layers:
      raise ConfigError(f'config.model.first_dense_layers={first}: fewer than num_layers={cfg.num_layers}')
    period = len(decoder.pattern(cfg))
    if first and period > 1:
      raise ConfigError(
        f'config.model.first_dense_layers={first} with layer_pattern={cfg.layer_pattern!r}: dense layers first '
        'and a pattern of local and global layers are not implemented together'
      )
    super().make_stacks(cfg, rngs, dense_first=first)
    self.expert_layers = cfg.num_layers - first

  def __call__(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    x_BLD, aux = self.hidden_states(tokens_BL, positions_BL=positions_BL, segment_ids_BL=segment_ids_BL)
    return self.head(x_BLD), aux

  def hidden_states(
    self, tokens_BL: jax.Array, *, positions_BL: jax.Array | None = None, segment_ids_BL: jax.Array | None = None
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The last block's output after the final RMSNorm, (B, L, D), and aux (the class docstring)."""
    x_BLD, totals = self.stacks(self.embed(tokens_BL), positions_BL, segment_ids_BL)
    aux = {k: v if k == 'aux_loss' else v / self.expert_layers for k, v in totals.items()}
    return self.norm(x_BLD), aux


def attention_params(cfg: Any) -> int:
  """One block's attention parameters (its q/k norms, biases and sinks; latent attention's)."""
  opts = decoder.FAMILIES[cfg.name]
  if opts.attention == 'mla':
    return mla.num_params(cfg)
  D, H = cfg.embed_dim, cfg.num_heads
  G = cfg.num_kv_heads or H  # None: as many as the heads
  K = cfg.head_dim or D // H
  n = 2 * D * H * K + 2 * D * G * K
  n += (H + 2 * G) * K if opts.qkv_bias else 0
  n += D if opts.out_bias else 0
  n += 2 * K if opts.qk_norm == 'head' else 0
  return n + (H if opts.sinks else 0)


def _counts(cfg: Any) -> tuple[int, int, int]:
  """(parameters outside the routed experts, parameters of one routed expert, expert layers)."""
  opts = decoder.FAMILIES[cfg.name]
  D, N, E, first = cfg.embed_dim, cfg.num_layers, cfg.num_experts, cfg.first_dense_layers
  F = expert_dim(cfg)
  V = padded_vocab(cfg)
  router = D * E + (E if opts.router_bias else 0)  # the score-correction bias is model state
  block = 2 * D + attention_params(cfg) + router + 3 * D * cfg.shared_experts * F  # 2 RMSNorms
  dense = first * (2 * D + attention_params(cfg) + 3 * D * cfg.mlp_dim)
  heads = 1 if cfg.tie_embeddings else 2
  expert = 3 * D * F + (2 * F + D if opts.expert_bias else 0)
  return heads * V * D + (N - first) * block + dense + D, expert, N - first


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
  out = _common(c, c['num_local_experts'], eps=1e-5)  # MixtralConfig's default eps
  del out['max_len']  # Mixtral's rotary positions have no table: its config.model has no max_len
  return out


def to_hf_config(cfg: Any) -> dict:
  """config.model -> config.json of the same MixtralForCausalLM: the real vocabulary (not the padded rows),
  no dropout or router jitter, and the loss weights as router_aux_loss_coef (Mixtral's) and
  router_z_loss_coef (not a Mixtral field: transformers keeps it as an attribute).
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


# --- Hugging Face: Qwen3-MoE, DeepSeek-V3, GPT-OSS ------------------------------------------------------------
#
# As for Mixtral, the importer makes the model dropless (capacity_factor = num_experts / top_k) and leaves
# group_size; training settings (router_aux_loss_coef, output_router_logits, dropout) are not read.


def _common(c: dict, E: int, eps: float = 1e-6) -> dict:
  """config.json's fields every MoE family has -> config.model's (`eps`: the family's default rms_norm_eps)."""
  H = c['num_attention_heads']
  theta, scaling = decoder.hf_rope(c)
  k = c['num_experts_per_tok']
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
    norm_eps=c.get('rms_norm_eps', eps),
    tie_embeddings=bool(c.get('tie_word_embeddings', False)),
    max_len=c.get('max_position_embeddings', 2048),
  )


def _refuse(c: dict, *checks: tuple[str, Any, str]) -> None:
  for field, want, why in checks:
    if c.get(field, want) != want:
      raise decoder.unsupported(field, c[field], why)


def _leading(layers: Any, N: int, field: str) -> int:
  """How many layers lead the stack as `layers` (a list of indices) names them: they must be the first ones."""
  layers = sorted(layers or [])
  if layers != list(range(len(layers))) or len(layers) >= N:
    raise decoder.unsupported(field, layers, 'the zoo places dense layers first only (0, 1, ... k - 1)')
  return len(layers)


def _qwen3_moe_config(c: dict) -> dict:
  _refuse(
    c,
    ('hidden_act', 'silu', "the zoo's experts are SwiGLU (silu)"),
    ('attention_bias', False, "the zoo's qwen3_moe projections have no biases"),
    ('use_sliding_window', False, "the zoo's qwen3_moe attends to the whole sequence"),
    ('decoder_sparse_step', 1, 'every layer after the dense ones has experts in the zoo'),
  )
  out = _common(c, c.get('num_experts') or c['num_local_experts'])
  return dict(
    out,
    expert_mlp_dim=c['moe_intermediate_size'],
    norm_topk=bool(c.get('norm_topk_prob', False)),
    first_dense_layers=_leading(c.get('mlp_only_layers'), out['num_layers'], 'mlp_only_layers'),
  )


def _deepseek_config(c: dict) -> dict:
  _refuse(
    c,
    ('hidden_act', 'silu', "the zoo's experts are SwiGLU (silu)"),
    ('attention_bias', False, "the zoo's latent attention has no biases"),
    ('scoring_func', 'sigmoid', 'DeepSeek-V3 routes with sigmoid scores'),
    ('topk_method', 'noaux_tc', 'DeepSeek-V3 chooses with the score-correction bias (noaux_tc)'),
  )
  out = _common(c, c['n_routed_experts'])
  return dict(
    out,
    num_kv_heads=out['num_heads'],
    head_dim=None,
    expert_mlp_dim=c['moe_intermediate_size'],
    first_dense_layers=c.get('first_k_dense_replace', 0),
    shared_experts=c.get('n_shared_experts') or 0,
    router_score='sigmoid',
    score_correction_bias=True,
    norm_topk=bool(c.get('norm_topk_prob', True)),
    routed_scale=float(c.get('routed_scaling_factor', 1.0)),
    router_groups=c.get('n_group') or 1,
    router_group_topk=c.get('topk_group') or 1,
    q_lora_rank=c.get('q_lora_rank'),
    kv_lora_rank=c['kv_lora_rank'],
    qk_nope_head_dim=c['qk_nope_head_dim'],
    qk_rope_head_dim=c['qk_rope_head_dim'],
    v_head_dim=c['v_head_dim'],
    rope_interleave=bool(c.get('rope_interleave', True)),
  )


GPT_OSS_LAYOUT = decoder.Checkpoint(('gpt_oss',), 'GptOssForCausalLM', windows='types', default_pattern='LG')


def _deepseek_skip(c: dict) -> tuple[str, str] | None:
  """DeepSeek-V3's multi-token-prediction layers, model.layers.{num_hidden_layers} on: not imported."""
  n, N = c.get('num_nextn_predict_layers') or 0, c['num_hidden_layers']
  if not n:
    return None
  return (
    rf'^(model\.)?layers\.({"|".join(str(N + k) for k in range(n))})\.',
    f'model.layers.{N}{f"-{N + n - 1}" if n > 1 else ""} is the multi-token-prediction module '
    f'(num_nextn_predict_layers={n}), which predicts a further token for that training objective and speculative '
    'decoding; the causal LM does not run it (transformers skips it too), so it is left out',
  )


def _gpt_oss_config(c: dict) -> dict:
  _refuse(
    c,
    ('hidden_act', 'silu', "the zoo's experts are GPT-OSS's clamped SwiGLU"),
    ('attention_bias', True, "the zoo's gpt_oss projections have biases"),
    ('swiglu_alpha', SWIGLU_ALPHA, f'the clamped SwiGLU is gate * sigmoid({SWIGLU_ALPHA} gate)'),
  )
  return dict(
    _common(c, c['num_local_experts']),
    swiglu_limit=float(c.get('swiglu_limit', 7.0)),
    **decoder.hf_windows(c, GPT_OSS_LAYOUT),
  )


def _to_common(cfg: Any, model_type: str, architecture: str) -> dict:
  H = cfg.num_heads
  out = dict(
    model_type=model_type,
    architectures=[architecture],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.embed_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=H,
    num_key_value_heads=cfg.num_kv_heads or H,
    head_dim=cfg.head_dim or cfg.embed_dim // H,
    num_experts_per_tok=cfg.top_k,
    hidden_act='silu',
    rms_norm_eps=cfg.norm_eps,
    rope_parameters=decoder.hf_rope_parameters(cfg.rope_theta, cfg.rope_scaling),
    tie_word_embeddings=cfg.tie_embeddings,
    attention_dropout=0.0,
    router_aux_loss_coef=cfg.aux_loss_weight * cfg.num_layers / cfg.top_k,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  return dict(out, max_position_embeddings=cfg.max_len) if cfg.max_len else out


def _to_qwen3_moe(cfg: Any) -> dict:
  return dict(
    _to_common(cfg, 'qwen3_moe', 'Qwen3MoeForCausalLM'),
    num_experts=cfg.num_experts,
    moe_intermediate_size=expert_dim(cfg),
    norm_topk_prob=cfg.norm_topk,
    decoder_sparse_step=1,
    mlp_only_layers=list(range(cfg.first_dense_layers)),
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=None,
  )


def _to_deepseek(cfg: Any) -> dict:
  out = _to_common(cfg, 'deepseek_v3', 'DeepseekV3ForCausalLM')
  return dict(
    out,
    head_dim=cfg.qk_rope_head_dim,
    num_key_value_heads=cfg.num_heads,
    n_routed_experts=cfg.num_experts,
    moe_intermediate_size=expert_dim(cfg),
    n_shared_experts=cfg.shared_experts,
    first_k_dense_replace=cfg.first_dense_layers,
    norm_topk_prob=cfg.norm_topk,
    routed_scaling_factor=cfg.routed_scale,
    n_group=cfg.router_groups,
    topk_group=cfg.router_group_topk,
    q_lora_rank=cfg.q_lora_rank,
    kv_lora_rank=cfg.kv_lora_rank,
    qk_nope_head_dim=cfg.qk_nope_head_dim,
    qk_rope_head_dim=cfg.qk_rope_head_dim,
    v_head_dim=cfg.v_head_dim,
    rope_interleave=cfg.rope_interleave,
    attention_bias=False,
    num_nextn_predict_layers=0,
  )


def _to_gpt_oss(cfg: Any) -> dict:
  windows = decoder.layer_windows(cfg)
  return dict(
    _to_common(cfg, 'gpt_oss', 'GptOssForCausalLM'),
    num_local_experts=cfg.num_experts,
    swiglu_limit=cfg.swiglu_limit,
    swiglu_alpha=SWIGLU_ALPHA,
    attention_bias=True,
    sliding_window=cfg.sliding_window,
    layer_types=['sliding_attention' if w else 'full_attention' for w in windows],
  )


_LIN = [hf.T((1, 0))]


def _mla_rows() -> list[hf.Param]:
  """DeepSeek's latent attention (models/mla.py): kv_a_proj_with_mqa (R + P, D) is the latent's and the rotary
  key's projections side by side."""
  b, h = 'blocks/layers/{i}/self_attn', 'layers.{i}.self_attn'

  def heads(rows_in: str, k: str):  # (H * k, in) -> (in, H, k)
    def ops(cfg):
      n = {'K': cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, 'KV': cfg.qk_nope_head_dim + cfg.v_head_dim}[k]
      d = {'Q': cfg.q_lora_rank, 'D': cfg.embed_dim, 'R': cfg.kv_lora_rank}[rows_in]
      return [hf.T((1, 0)), hf.R((d, cfg.num_heads, n), (d, cfg.num_heads * n))]

    return ops

  def kv_a(part: int):
    return lambda cfg: [
      hf.Slice(
        0, *((0, cfg.kv_lora_rank) if part == 0 else (cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
      ),
      hf.T((1, 0)),
    ]

  def out(cfg):
    H, V, D = cfg.num_heads, cfg.v_head_dim, cfg.embed_dim
    return [hf.T((1, 0)), hf.R((H, V, D), (H * V, D))]

  return [
    hf.Param(f'{b}/q_a_proj/layer/kernel', f'{h}.q_a_proj.weight', _LIN),
    hf.Param(f'{b}/q_a_layernorm/scale', f'{h}.q_a_layernorm.weight'),
    hf.Param(f'{b}/q_b_proj/layer/kernel', f'{h}.q_b_proj.weight', heads('Q', 'K')),
    hf.Param(f'{b}/q_proj/layer/kernel', f'{h}.q_proj.weight', heads('D', 'K')),
    hf.Param(f'{b}/kv_a_proj/layer/kernel', f'{h}.kv_a_proj_with_mqa.weight', kv_a(0)),
    hf.Param(f'{b}/k_rope_proj/layer/kernel', f'{h}.kv_a_proj_with_mqa.weight', kv_a(1)),
    hf.Param(f'{b}/kv_a_layernorm/scale', f'{h}.kv_a_layernorm.weight'),
    hf.Param(f'{b}/kv_b_proj/layer/kernel', f'{h}.kv_b_proj.weight', heads('R', 'KV')),
    hf.Param(f'{b}/o_proj/layer/kernel', f'{h}.o_proj.weight', out),
  ]


def _expert_rows(name: str) -> list[hf.Param]:
  """The MoE layers' rows: Qwen3-MoE and DeepSeek-V3 in the hub's per-expert layout ({e}) and transformers 5's
  fused one; DeepSeek's shared experts and score-correction bias; GPT-OSS's router and expert biases, its
  gate|up interleaved on the last axis (gate at even, up at odd columns) of an in x out tensor."""
  b, h = 'blocks/layers/{i}/moe', 'layers.{i}.mlp'
  if name == 'gpt_oss':
    gate_up = lambda cfg: [
      hf.R((cfg.num_experts, cfg.embed_dim, expert_dim(cfg), 2), (cfg.num_experts, cfg.embed_dim, 2 * expert_dim(cfg)))
    ]
    bias = lambda cfg: [hf.R((cfg.num_experts, expert_dim(cfg), 2), (cfg.num_experts, 2 * expert_dim(cfg)))]
    return [
      hf.Param(f'{b}/router/layer/kernel', f'{h}.router.weight', _LIN),
      hf.Param(f'{b}/router/layer/bias', f'{h}.router.bias'),
      hf.Param(f'{b}/gate_up', f'{h}.experts.gate_up_proj', gate_up),
      hf.Param(f'{b}/gate_up_bias', f'{h}.experts.gate_up_proj_bias', bias),
      hf.Param(f'{b}/down', f'{h}.experts.down_proj'),
      hf.Param(f'{b}/down_bias', f'{h}.experts.down_proj_bias'),
    ]
  half = lambda part: (
    lambda cfg: [
      hf.Slice(1, part * expert_dim(cfg), (part + 1) * expert_dim(cfg)),
      hf.T((0, 2, 1)),
    ]
  )
  return [
    hf.Param(f'{b}/router/layer/kernel', f'{h}.gate.weight', _LIN),
    hf.Param(f'{b}/correction_bias', f'{h}.gate.e_score_correction_bias', state=True),
    *(hf.Param(f'{b}/{n}', f'{h}.experts.{{e}}.{n}_proj.weight', _LIN) for n in ('gate', 'up', 'down')),
    hf.Param(f'{b}/gate', f'{h}.experts.gate_up_proj', half(0)),
    hf.Param(f'{b}/up', f'{h}.experts.gate_up_proj', half(1)),
    hf.Param(f'{b}/down', f'{h}.experts.down_proj', [hf.T((0, 2, 1))]),
    *(
      hf.Param(f'{b}/shared_experts/{n}/layer/kernel', f'{h}.shared_experts.{n}_proj.weight', _LIN)
      for n in ('gate', 'up', 'down')
    ),
  ]


def _sparse_rows(name: str) -> Any:
  """Family `name`'s table for a config: the attention and norm rows (models/decoder.py's, or latent
  attention's) for both stacks, the dense layers' MLPs (layers 0..first-1, 'dense_blocks'), and the expert layers'
  rows from HF layer `first_dense_layers` on."""
  common = decoder.hf_params(name, mlp=False)
  if decoder.FAMILIES[name].attention == 'mla':
    common += _mla_rows()
  if decoder.FAMILIES[name].out_bias:
    common.append(hf.Param('blocks/layers/{i}/self_attn/out/layer/bias', 'layers.{i}.self_attn.o_proj.bias'))
  if decoder.FAMILIES[name].sinks:
    common.append(hf.Param('blocks/layers/{i}/self_attn/sinks', 'layers.{i}.self_attn.sinks'))
  experts = _expert_rows(name)
  dense_mlp = [
    hf.Param(f'blocks/layers/{{i}}/mlp/{n}/layer/kernel', f'layers.{{i}}.mlp.{n}_proj.weight', _LIN)
    for n in ('gate', 'up', 'down')
  ]

  def rows(cfg: Any) -> list[hf.Param]:
    first = cfg.first_dense_layers
    layered = [r for r in common if r.zoo.startswith('blocks/')]
    out = [r for r in common if not r.zoo.startswith('blocks/')]
    out += [dataclasses.replace(r, first_layer=first) for r in layered + experts]
    if first:
      out += [dataclasses.replace(r, zoo='dense_' + r.zoo) for r in layered + dense_mlp]
    return out

  return rows


def _sparse_family(name: str, model_types: tuple[str, ...], config: Any, to_config: Any, skip: Any = None) -> hf.Family:
  """Keys 'model.'-prefixed in <Family>ForCausalLM files, bare in <Family>Model ones; lm_head never prefixed. The
  rotary inv_freq buffers of older files are ignored; a tied model accepts a file's lm_head.weight only as a copy
  of the embedding; max_len may be shorter than config.json's (rotary positions have no table)."""
  return hf.Family(
    model_types=model_types,
    config=config,
    params=_sparse_rows(name),
    prefixes=('model.', ''),
    keep={'max_len': decoder.fits_positions},
    base_keeps=('max_position_embeddings',),
    ignore=(r'rotary_emb\.inv_freq$',),
    tied=(('lm_head.weight', 'embed_tokens.weight'),),
    to_config=to_config,
    unprefixed=(r'^lm_head\.',),
    skip=skip,
  )


SPARSE_HF = {
  'qwen3_moe': _sparse_family('qwen3_moe', ('qwen3_moe',), _qwen3_moe_config, _to_qwen3_moe),
  'deepseek_v3': _sparse_family('deepseek_v3', ('deepseek_v3',), _deepseek_config, _to_deepseek, _deepseek_skip),
  'gpt_oss': _sparse_family('gpt_oss', ('gpt_oss',), _gpt_oss_config, _to_gpt_oss),
}
