"""A zoo language model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`), so any lm-eval task
runs on a trained run or an imported Hugging Face model, sharded as its config says (evaluate_lm.py).

It scores and generates as lm-eval's Hugging Face backend (`lm_eval.models.huggingface.HFLM`) does, so results
compare one for one: a text is encoded as the tokenizer begins one (what `tok(text)` adds: HFLM's default, and the
rule training follows, data/tokens.py; the byte tokenizer's <|bos|>), lm-eval's TemplateLM splits context and
continuation, an empty context is the BOS (else EOS) token, rolling windows are max_length tokens;
loglikelihoods are sums of float32 log-softmax over the continuation's tokens with the greedy flag, and
generations are greedy (or sampled when a task asks) up to max_gen_toks with the KV cache (generation/engine.py),
cut at the first stop sequence. Any tokenizer of data/tokens.py serves (TemplateLM needs only encode and decode):
the byte tokenizer, as a Hugging Face one. The scoring forward pass is one jitted program per (rows, length)
bucket, run under the config's rules.
"""

from __future__ import annotations

import collections
import difflib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as lm_utils
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import partitioning
from data import tokens
from errors import ConfigError
from generation import engine

DEFAULT_MAX_LENGTH = 2048  # as HFLM where the model names none
MAX_GEN_TOKS = 256  # HFLM's default


class ZooLM(TemplateLM):
  """`generator` (generation.load) and its tokenizer (data.tokens: byte or Hugging Face); `batch_size` rows per
  scoring or generation call."""

  def __init__(self, generator: engine.Generator, tokenizer: Any, *, batch_size: int = 8):
    super().__init__()
    if getattr(tokenizer, 'eos_id', None) is None:
      raise ConfigError(f'lm-eval needs a tokenizer with an end-of-text token; {tokenizer.name!r} has none')
    _check_batch_size(batch_size)
    self.gen, self.tok, self.batch_size = generator, tokenizer, batch_size
    self.max_length = generator.max_len or DEFAULT_MAX_LENGTH
    self._scorers: dict[tuple[int, int], Any] = {}

  # --- tokens, as HFLM encodes and decodes them ----------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw) -> list[int]:
    """HFLM's tok_encode: the tokenizer's own special tokens (tokens.prompt: as training begins a text) unless
    add_special_tokens=False or the string already starts with the BOS token's text."""
    if add_special_tokens is None:
      add_special_tokens = not lm_utils.has_bos_prefix(string, self.tok.decode([self.prefix_token_id], specials=True))
    ids = tokens.prompt(self.tok, string) if add_special_tokens else self.tok.encode(string).tolist()
    return ids[-left_truncate_len:] if left_truncate_len else ids

  # --- scoring ------------------------------------------------------------------------------------------
  def _scorer(self, rows: int, length: int):
    """A jitted (params, model_state, inputs, targets) -> (log-probability, greedy hit) of every target."""
    if (rows, length) not in self._scorers:
      gen = self.gen

      def score(params, model_state, inputs_BL, targets_BL):
        model = engine.inference(nnx.merge(gen.graphdef, params, model_state, copy=True))
        out = model(inputs_BL)
        logits_BLV = (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        return logp_BL, jnp.argmax(logits_BLV, axis=-1) == targets_BL

      def run(*args):
        if gen.rules is None:
          return score(*args)
        with partitioning.use_rules(gen.rules, gen.mesh):
          return score(*args)

      self._scorers[rows, length] = jax.jit(run)
    return self._scorers[rows, length]

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether every continuation token is the argmax) per request of
    (strings, context ids, continuation ids); the input is the last max_length + 1 tokens, as in HFLM."""
    out = []
    for start in range(0, len(requests), self.batch_size):
      chunk = requests[start : start + self.batch_size]
      seqs = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in chunk]
      conts = [len(cont) for _, _, cont in chunk]
      m = self.gen.row_multiple()
      rows = -(-len(chunk) // m) * m
      L = min(engine.bucket(max(len(s) - 1 for s in seqs), engine.MIN_PROMPT_BUCKET), self.max_length)
      inputs, targets = np.zeros((rows, L), np.int32), np.zeros((rows, L), np.int32)
      for b, s in enumerate(seqs):  # right-padded: causal attention keeps the padding out of every real position
        inputs[b, : len(s) - 1], targets[b, : len(s) - 1] = s[:-1], s[1:]
      logp, hit = jax.device_get(self._scorer(rows, L)(self.gen.params, self.gen.model_state, inputs, targets))
      for b, (s, n) in enumerate(zip(seqs, conts, strict=True)):
        end = len(s) - 1
        out.append((float(logp[b, end - n : end].sum()), bool(hit[b, end - n : end].all())))
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """A whole string's log-likelihood: disjoint windows of max_length tokens, each after one token of context."""
    totals = []
    for (string,) in [r.args for r in requests]:
      windows = [
        (None, *make_disjoint_window(w))
        for w in get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1,
        )
      ]  # fmt: skip
      totals.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
    return totals

  # --- generation ---------------------------------------------------------------------------------------
  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each context continued (greedy unless the task samples) up to max_gen_toks tokens or the end-of-text
    token, the text cut at the first of the task's stop sequences (`until`)."""
    results: list[str | None] = [None] * len(requests)
    groups = collections.defaultdict(list)  # one Sampling per distinct set of generation kwargs
    for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
      groups[repr(sorted(gen_kwargs.items()))].append((i, context, gen_kwargs))
    eos = self.tok.decode([self.eot_token_id], specials=True)
    for group in groups.values():
      kwargs = lm_utils.normalize_gen_kwargs(group[0][2], MAX_GEN_TOKS)
      until = lm_utils.handle_stop_sequences(kwargs.pop('until', None), eos=eos)
      new = kwargs.pop('max_gen_toks')
      temperature = float(kwargs.get('temperature', 0.0)) if kwargs.get('do_sample') else 0.0
      sampling = engine.Sampling(
        max_new_tokens=new, temperature=temperature, top_k=int(kwargs.get('top_k') or 0),
        top_p=float(kwargs.get('top_p') or 1.0), seed=int(kwargs.get('seed') or 0),
      )  # fmt: skip
      for start in range(0, len(group), self.batch_size):
        chunk = group[start : start + self.batch_size]
        ids = [self.tok_encode(c, left_truncate_len=self.max_length - new) for _, c, _ in chunk]
        for (i, _, _), g in zip(chunk, self.gen.generate(ids, sampling, self.eot_token_id), strict=True):
          text_out = self.tok.decode(g.ids)
          results[i] = lm_utils.postprocess_generated_text(text_out, until, None)
    return results


def check_flags(limit: int | None, num_fewshot: int | None, batch_size: int, include_path: str | None) -> None:
  """evaluate_lm.py's numeric flags and --include_path, before anything is indexed or loaded: one ConfigError each."""
  if limit is not None and limit < 1:
    raise ConfigError(f'--limit={limit}: must be at least 1 (examples per task; leave it out for all of them)')
  if num_fewshot is not None and num_fewshot < 0:
    raise ConfigError(f"--num_fewshot={num_fewshot}: must be >= 0 (leave it out for each task's own)")
  _check_batch_size(batch_size, '--batch_size')
  if include_path is not None:
    if not os.path.exists(include_path):
      raise ConfigError(f'--include_path={include_path}: no such directory (a directory of task YAML files)')
    if not os.path.isdir(include_path):
      raise ConfigError(f'--include_path={include_path} is a file: give the directory of task YAML files')


def _check_batch_size(batch_size: int, flag: str = 'batch_size') -> None:
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ConfigError(f'{flag}={batch_size!r}: must be an integer >= 1 (rows per scoring or generation call)')


def task_manager(tasks: list[str], include_path: str | None) -> TaskManager:
  """lm-eval's task index, with every name of `tasks` (a task, group or tag; glob patterns as lm-eval matches
  them) checked to be in it: ConfigError naming the unknown ones and the nearest names. Indexing lm-eval's own
  thousands of task YAMLs takes ~10 s, so where every task named is one of --include_path's, that directory alone
  is indexed."""
  if include_path:
    local = TaskManager(include_path=include_path, include_defaults=False)
    if not _unknown(local, tasks):
      return local
  manager = TaskManager(include_path=include_path)
  if unknown := _unknown(manager, tasks):
    near = {t: difflib.get_close_matches(t, manager.all_tasks, n=3) for t in unknown}
    hints = '; '.join(f'{t!r}: did you mean {", ".join(map(repr, n))}?' for t, n in near.items() if n)
    where = f"lm-eval's tasks and {include_path}'s YAML files" if include_path else "lm-eval's tasks"
    raise ConfigError(
      f'--tasks: {", ".join(map(repr, unknown))} not among {where}'
      + (f' ({hints})' if hints else '')
      + ('' if include_path else '; a task of your own needs --include_path DIR (its YAML files)')
    )
  return manager


def _unknown(manager: TaskManager, tasks: list[str]) -> list[str]:
  return [t for t in tasks if not manager.match_tasks([t])]
