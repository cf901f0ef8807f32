"""The reference engine: every pending request in one `Sampler.generate` call per sampling setting.

`step` hands all submitted requests to the static sampler at once, one call per distinct
SamplingParams in the order each first appears, and returns every completion: a lock-step wave.
The rollout then advances all episodes together, as before the engine existed. Each request
draws with its own key (`Sampler.generate` takes one key per row), so the tokens are those the
continuous engine produces for the same requests (`tests/sampling/test_engine.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig
from marl_jax.sampling import paged_runner
from marl_jax.sampling.engine import Completion, EngineRequest, Tokenizer
from marl_jax.sampling.sampler import Sampler


class StaticEngine:
  """`RolloutEngine` over one `Sampler` (its buckets, decode blocks and shared prompts)."""

  def __init__(self, config: ModelConfig, tokenizer: Tokenizer | None = None, *,
               top_candidates: int = 256):
    self.sampler = Sampler(config, tokenizer, top_candidates=top_candidates)
    self._params = self._adapters = None
    self._version = 0
    self._queue: list[EngineRequest] = []
    self._stats = dict.fromkeys(("requests", "calls", "prompt_tokens", "prefilled_tokens",
                                 "decode_tokens", "decode_row_steps", "peak_kv_bytes"), 0.0)
    self._token_bytes = paged_runner.bytes_per_token(config)

  def load(self, params: decoder.Params, adapters: decoder.LoraAdapters | None = None,
           version: int = 0) -> None:
    self._params, self._adapters, self._version = params, adapters, version

  def submit(self, requests: Sequence[EngineRequest]) -> None:
    if self._params is None:
      raise ValueError("the engine has no weights; call load(params) before submit")
    self._queue.extend(requests)

  @property
  def pending(self) -> int:
    return len(self._queue)

  def step(self) -> list[Completion]:
    queue, self._queue = self._queue, []
    groups: dict = {}  # sampling settings -> requests, first-seen order
    for r in queue:
      groups.setdefault(r.sampling, []).append(r)
    out = []
    for sampling, requests in groups.items():
      adapters = None
      if self._adapters is not None:
        adapters = self._adapters.replace(
            policy_ids=np.asarray([r.adapter for r in requests], np.int32))
      keys = jnp.stack([r.key for r in requests])
      completions = self.sampler.generate(self._params, [list(r.prompt) for r in requests],
                                          sampling, keys, adapters=adapters)
      out += [dataclasses.replace(c, request_id=r.request_id, policy_version=self._version)
              for c, r in zip(completions, requests)]
      call = self.sampler.last_call
      self._stats["calls"] += 1
      self._stats["prompt_tokens"] += sum(len(r.prompt) for r in requests)
      self._stats["prefilled_tokens"] += call["prefilled_tokens"]
      self._stats["decode_tokens"] += sum(len(c.tokens) for c in completions)
      self._stats["decode_row_steps"] += call["row_steps"]
      self._stats["peak_kv_bytes"] = max(self._stats["peak_kv_bytes"],
                                         call["cache_tokens"] * self._token_bytes)
    self._stats["requests"] += len(queue)
    return out

  def stats(self) -> dict[str, float]:
    """The continuous engine's counters where they apply: prompt tokens requested and
    prefilled (each distinct prompt of a call once), decode tokens and the row-steps computed
    for them, and the largest dense cache a call held (rows x padded widths)."""
    return dict(self._stats)

