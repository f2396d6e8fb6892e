"""Llama: decoder-only LM with RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP: the decoder of
models/decoder.py with Llama's options (none: it is the base the other families differ from).

Parameters follow Hugging Face's LlamaForCausalLM, so weights are imported by renaming: embed_tokens,
blocks.layers.N.{input_layernorm, self_attn.{query, key, value, out} (q/k/v/o_proj), post_attention_layernorm,
mlp.{gate, up, down}_proj}, norm, lm_head (absent when tie_embeddings). HF's Linear weights are (out, in); ours are
(in, ...) with heads split out, e.g. q_proj (H*K, D) is query (D, H, K). Rotary embeddings use HF's rotate_half
convention, so no permutation is needed. `rope_scaling` (None, or Llama 3.1+'s frequency scaling: rope_type
'llama3', factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) is read from config.json.
"""

from __future__ import annotations

from typing import Any

from models import decoder

Llama = decoder.Decoder
Block = decoder.Block
HF = decoder.HF_FAMILIES['llama']  # models/hf_import.py: LlamaForCausalLM / LlamaModel
to_hf_config = HF.to_config


def num_params(cfg: Any) -> int:
  """Closed-form parameter count (checked against the built model in tests)."""
  return decoder.num_params(cfg)
