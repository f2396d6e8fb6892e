"""A synthetic language with a known entropy rate: an order-2 Markov chain over a small alphabet.

Each context (previous two tokens) allows `branching` likely successors with Dirichlet-drawn
probabilities, mixed with `smoothing` of uniform mass so the chain is irreducible. Because the
true distribution is known, the best achievable next-token loss ("floor") is computed exactly,
and a trained model's eval loss can be compared to it.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from errors import ConfigError

ALPHABET = 'abcdefghijklmnopqrstuvwxyz0123456789'


@dataclasses.dataclass(frozen=True)
class MarkovLanguage:
  vocab_size: int = 16
  branching: int = 4
  smoothing: float = 0.03
  seed: int = 0

  def __post_init__(self):
    if not 2 <= self.vocab_size <= len(ALPHABET):
      raise ConfigError(f'config.dataset.vocab_size={self.vocab_size} must be in [2, {len(ALPHABET)}]')
    if not 1 <= self.branching <= self.vocab_size:
      raise ConfigError(f'config.dataset.branching={self.branching} must be in [1, vocab_size={self.vocab_size}]')

  @functools.cached_property
  def transitions(self) -> np.ndarray:
    """T[a, b, c] = P(next=c | prev2=a, prev1=b)."""
    V, rng = self.vocab_size, np.random.default_rng(self.seed)
    t = np.zeros((V, V, V))
    for a in range(V):
      for b in range(V):
        succ = rng.choice(V, size=self.branching, replace=False)
        t[a, b, succ] = rng.dirichlet(np.ones(self.branching))
    return (1 - self.smoothing) * t + self.smoothing / V

  @functools.cached_property
  def stationary_pairs(self) -> np.ndarray:
    """pi[a, b]: stationary probability of two consecutive tokens (a, b)."""
    V, t = self.vocab_size, self.transitions
    pi = np.full((V, V), 1.0 / V**2)
    for _ in range(10_000):
      new = np.einsum('ab,abc->bc', pi, t)
      if np.abs(new - pi).max() < 1e-15:
        break
      pi = new
    return new / new.sum()

  def entropies(self) -> dict[str, float]:
    """Entropy (nats) of the next token given 0, 1 and 2 previous tokens, under the stationary chain."""
    pi = self.stationary_pairs
    h = lambda p: -(p * np.log(np.where(p > 0, p, 1))).sum(-1)
    p1 = pi.sum(0)  # marginal of one token
    cond1 = pi / pi.sum(1, keepdims=True)  # P(b | a)
    return {
      'unigram': float(h(p1)),
      'bigram': float((p1 * h(cond1)).sum()),
      'order2': float((pi * h(self.transitions)).sum()),
    }

  def loss_floor(self, seq_len: int) -> float:
    """Best expected loss per target on windows of `seq_len` targets: the first target sees one token."""
    e = self.entropies()
    return (e['bigram'] + (seq_len - 1) * e['order2']) / seq_len

  def sample(self, num: int, length: int, seed: int) -> np.ndarray:
    """`num` sequences of `length` tokens (uint8), started from the stationary pair distribution."""
    V, rng = self.vocab_size, np.random.default_rng(seed)
    out = np.empty((num, length), np.uint8)
    first = rng.choice(V * V, size=num, p=self.stationary_pairs.ravel())
    out[:, 0], out[:, 1] = first // V, first % V
    cdf = np.cumsum(self.transitions, -1)
    cdf[..., -1] = 1.0
    for i in range(2, length):
      u = rng.random((num, 1))
      out[:, i] = (u > cdf[out[:, i - 2], out[:, i - 1]]).sum(-1)
    return out

  def nll(self, tokens: np.ndarray) -> float:
    """Mean negative log-likelihood (nats) of tokens[:, 2:] under the true chain."""
    t = tokens.astype(np.int64)
    p = self.transitions[t[:, :-2], t[:, 1:-1], t[:, 2:]]
    return float(-np.log(p).mean())

  def decode(self, tokens: np.ndarray) -> str:
    return ''.join(ALPHABET[int(i)] for i in tokens)


class MarkovText:
  """Offline text with labels: strings written by one of `num_classes` Markov languages (same
  alphabet, different transition tables), of lengths uniform in [min_len, max_len]. The label (which
  language wrote it) is learnable from the text; the varying lengths make padding masks matter.
  Random access, deterministic in (seed, split)."""

  def __init__(
    self,
    num: int,
    min_len: int,
    max_len: int,
    num_classes: int,
    seed: int,
    split: int,
    vocab_size: int = 16,
    branching: int = 4,
    smoothing: float = 0.03,
  ):
    if not 1 <= min_len <= max_len:
      raise ConfigError(f'text lengths must satisfy 1 <= min_len ({min_len}) <= max_len ({max_len})')
    langs = [MarkovLanguage(vocab_size, branching, smoothing, seed + c) for c in range(num_classes)]
    rng = np.random.default_rng((seed, split))
    self.labels = rng.integers(num_classes, size=num)
    self.lengths = rng.integers(min_len, max_len + 1, size=num)
    self.tokens = np.empty((num, max_len), np.uint8)
    for c, lang in enumerate(langs):
      rows = np.flatnonzero(self.labels == c)
      self.tokens[rows] = lang.sample(len(rows), max_len, seed=int(rng.integers(2**31)))

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, i: int) -> dict[str, object]:
    i = int(i)
    return {'text': ''.join(ALPHABET[t] for t in self.tokens[i, : self.lengths[i]]), 'label': int(self.labels[i])}
