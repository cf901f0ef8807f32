"""Stop strings: where a reply ends in its decoded text, for every engine the same way.

The device loops only know token ids (stop tokens); stop strings are searched on the host in the
decoded text. At the first occurrence, `text` is cut just before the stop string and
`tokens`/`logprobs` are cut after the token that completes it (that token may carry a few
characters beyond the stop string; they appear in the tokens, not in `text`). The cut depends only
on the tokens, so an engine that checks after every few decode steps (`continuous.py`) and the
static sampler that checks once at the end cut a reply at the same token.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

from marl_jax.sampling.engine import Completion, Tokenizer


def find(text: str, stop_strings: Sequence[str]) -> int:
  """Index of the earliest stop string in text, or -1."""
  hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
  return min(hits, default=-1)


def _shortest_prefix_with_stop(decode: Callable[[int], str], n: int,
                               stop_strings: Sequence[str]) -> int:
  """Fewest leading tokens (1..n) whose text contains a stop string; containment only grows with
  the prefix, so bisection needs about log2(n) decodes."""
  has_stop = lambda m: find(decode(m), stop_strings) >= 0
  return bisect.bisect_left(range(1, n + 1), True, key=has_stop) + 1


def completion(tokenizer: Tokenizer | None, tokens: np.ndarray, logprobs: np.ndarray,
               stopped: bool, prompt_length: int, stop_strings: Sequence[str], **ids
               ) -> Completion:
  """The Completion of a row that produced `tokens` (ended by a stop token when `stopped`, else
  by its budget or an earlier stop string); `ids`: the Completion's request id and policy
  version."""
  reason = "stop_token" if stopped else "length"
  if tokenizer is None:
    return Completion(tokens, logprobs, None, reason, prompt_length, **ids)
  body = tokens[:-1] if stopped else tokens  # the stop token is not part of the text
  decode = lambda n: tokenizer.decode(body[:n].tolist())
  text = decode(len(body))
  if stop_strings and find(text, stop_strings) >= 0:
    n = _shortest_prefix_with_stop(decode, len(body), stop_strings)
    text = decode(n)
    text = text[:find(text, stop_strings)]
    tokens, logprobs, reason = tokens[:n], logprobs[:n], "stop_string"
  return Completion(tokens, logprobs, text, reason, prompt_length, **ids)
