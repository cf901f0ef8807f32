"""Sampling parameters: what to generate, validated once on the host.

The numeric knobs (temperature, top_p, top_k) reach the jitted decode loop as traced per-row
values, so changing them between training steps never recompiles; only the draw `mode` (greedy,
full-vocabulary sampling, truncated sampling) selects between compiled variants, because it
decides whether the loop needs random numbers at all and whether it must search the top
candidates (`logits.select_tokens`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence


# A row's draw mode (`SamplingParams.mode`): argmax, a draw from the whole vocabulary, or a draw
# from the top-k / top-p candidates.
GREEDY, SAMPLE, TRUNCATE = 0, 1, 2


def _as_tuple(name: str, values: Sequence, kind: type) -> tuple:
  if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
    raise ValueError(f"{name}={values!r}; expected a list or tuple of {kind.__name__}")
  return tuple(values)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to continue a batch of prompts.

  Attributes:
    max_new_tokens: generate at most this many tokens per row (>= 1).
    temperature: 0 selects greedy (argmax) decoding; > 0 samples from softmax(logits / T).
    top_p: nucleus sampling; keep the smallest set of most likely tokens whose probability mass
      (after temperature and top-k) reaches top_p. 1 disables it. Must be in (0, 1].
    top_k: keep only the k most likely tokens; 0 disables it.
    stop_token_ids: a row finishes when it emits one of these (the token is kept in the output:
      the policy must learn to emit it). None means "the tokenizer's stop tokens" (none without a
      tokenizer); an empty tuple means no stop token, e.g. for fixed-length benchmarks.
    stop_strings: a row finishes at the first occurrence of one of these in its decoded text;
      checked on the host after decoding (see `Sampler.generate`).
  """

  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stop_token_ids: tuple[int, ...] | None = None
  stop_strings: tuple[str, ...] = ()

  def __post_init__(self):
    if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or (
        self.max_new_tokens < 1):
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r}; expected an integer >= 1")
    if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or (
        self.temperature < 0):
      raise ValueError(
          f"temperature={self.temperature!r}; expected a finite number >= 0 (0 = greedy)")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p!r}; expected a number in (0, 1] (1 = off)")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r}; expected an integer >= 0 (0 = off)")
    if self.stop_token_ids is not None:
      ids = _as_tuple("stop_token_ids", self.stop_token_ids, int)
      bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0]
      if bad:
        raise ValueError(f"stop_token_ids contains {bad!r}; expected non-negative integers")
      object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
    strings = _as_tuple("stop_strings", self.stop_strings, str)
    bad = [s for s in strings if not isinstance(s, str) or not s]
    if bad:
      raise ValueError(f"stop_strings contains {bad!r}; expected non-empty strings")
    object.__setattr__(self, "stop_strings", strings)
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def truncates(self) -> bool:
    """Whether top-k or top-p removes any token (sampling only; greedy ignores both)."""
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

  @property
  def mode(self) -> int:
    """GREEDY, SAMPLE or TRUNCATE: which draw `logits.select_tokens` makes for this row."""
    return GREEDY if self.greedy else TRUNCATE if self.truncates else SAMPLE

  @property
  def logprob_temperature(self) -> float:
    """The temperature of the policy distribution whose log-probs are returned (1 for greedy)."""
    return 1.0 if self.greedy else self.temperature

  def replace(self, **changes) -> "SamplingParams":
    return dataclasses.replace(self, **changes)
