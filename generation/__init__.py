"""Decoding a language model without training machinery: no optimizer, no train step (generate.py, evaluate_lm.py,
and the end-of-run sample train.py asks for).

Modules: engine (Sampling, CacheLayout, Generator: a KV cache placed by the rules, one jitted while-loop program
per shape), loading (the decode-only build, weights from a run's checkpoint, a params-only checkpoint or a Hugging
Face directory, the tokenizer, and the entry points' command line: from_flags, read_prompts), lm_eval_model
(ZooLM, lm-eval's model adapter; imports lm_eval, so it is not imported here).
"""

from generation.engine import CacheLayout, Generated, Generator, Sampling, cache_layout, sample
from generation.loading import (
  build,
  decode_config,
  encode,
  from_flags,
  load,
  read_prompts,
  tokenizer,
  with_family_config,
)

__all__ = [
  'CacheLayout',
  'Generated',
  'Generator',
  'Sampling',
  'build',
  'cache_layout',
  'decode_config',
  'encode',
  'from_flags',
  'load',
  'read_prompts',
  'sample',
  'tokenizer',
  'with_family_config',
]
