"""The rollout engine contract: what the rollout submits, what it receives, and the engine options.

    engine = registry.make_engine(options, config, tokenizer)   # sampling/registry.py
    engine.load(params, adapters, version=step)
    engine.submit([EngineRequest(request_id, prompt_ids, sampling, key, adapter), ...])
    while engine.pending:
      for completion in engine.step():   # whatever finished during this step
        ...

Requests are one LLM call each: for a team, (episode, agent, turn, sample). Each carries its own
token ids, sampling settings, LoRA adapter row and PRNG key (`request_key`), so its tokens depend
on nothing else: not on which requests share its batch, in which order they were admitted, or
which engine ran it. Engines differ only in how they schedule the work:

  static      (`static.py`) the reference: every submitted request in one `Sampler.generate`
              call per sampling setting, returned all at once (a lock-step wave).
  continuous  (`continuous.py`) a fixed number of slots over a paged K/V pool: a request that
              finishes frees its slot at once and a waiting one is admitted (its prompt prefilled
              in chunks, reusing cached prompt pages) while the others keep decoding; several
              decode steps per device call; completions stream out between calls.

A new engine implements `RolloutEngine` and adds one line to `registry.ENGINES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from marl_jax.models import decoder
from marl_jax.sampling.paged_attention import IMPLEMENTATIONS
from marl_jax.sampling.params import SamplingParams


class Tokenizer(Protocol):
  pad_id: int
  stop_token_ids: Sequence[int]

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class EngineRequest:
  """One LLM call: continue `prompt` with `sampling`, drawing step s with fold_in(key, s)."""

  request_id: Hashable
  prompt: tuple[int, ...]  # token ids (the chat template already applied)
  sampling: SamplingParams
  key: jax.Array  # typed PRNG key of this request (`request_key`)
  adapter: int = 0  # LoRA adapter row of the engine's adapters (0 without adapters)


@dataclasses.dataclass(frozen=True)
class Completion:
  tokens: np.ndarray  # [n] int32 generated tokens (stop token included when one ended the row)
  logprobs: np.ndarray  # [n] f32 log_softmax(logits / T) at each token, full vocabulary
  text: str | None  # decoded completion (None without a tokenizer)
  finish_reason: str  # "stop_token" | "stop_string" | "length"
  prompt_length: int  # real (unpadded) prompt tokens
  request_id: Hashable = None  # the EngineRequest's (None from `Sampler.generate`)
  policy_version: int = 0  # the `load` version whose weights produced the tokens


class RolloutEngine(Protocol):
  """What the rollout talks to (see the module docstring)."""

  def load(self, params: decoder.Params, adapters: decoder.LoraAdapters | None = None,
           version: int = 0) -> None:
    """Weights for the requests that follow (cached prompt pages of older weights are
    dropped); `adapters`' params and scale serve each request's `adapter` row."""

  def submit(self, requests: Sequence[EngineRequest]) -> None:
    """Queues requests; invalid ones (too long, unknown adapter, ...) raise ValueError here."""

  def step(self) -> list[Completion]:
    """Advances the submitted work and returns the requests that finished (possibly none)."""

  @property
  def pending(self) -> int:
    """Requests submitted and not yet returned by `step`."""

  def stats(self) -> dict[str, float]:
    """Counters since construction: prompt tokens requested vs prefilled, decode-slot
    occupancy, peak K/V bytes, compiled programs, ..."""


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """`config.engine`: the continuous engine's sizes (`continuous.py` says what each buys).

  Attributes:
    slots: requests decoded at once (decode rows; each call packs the live ones into the
      smallest `shapes.fine_bucket` size that holds them).
    page_size: tokens per K/V page.
    pool_tokens: K/V pool size in tokens (pages = pool_tokens / page_size, plus a scratch page).
    pool_gib: when > 0, the pool's size in GiB of K/V instead of `pool_tokens`.
    decode_steps: decode steps per device call (K): finished requests leave, and waiting ones
      enter, between calls.
    prefill_chunk: prompt tokens one prefill call computes at most, as rows x width: a
      16 * 4^k-token chunk of each of up to prefill_chunk / (16 * 4^k) requests (longer prompts
      are prefilled in chunks); a power of two >= 16.
    prefill_tokens: prompt tokens prefilled per step (between two decode calls) while some
      request is decoding; with none decoding, prefill runs until every admitted prompt is in.
    prefix_cache: reuse cached pages of page-aligned prompt blocks seen before (same tokens from
      the start, same adapter, same weights).
    attention: paged decode attention (`paged_attention.IMPLEMENTATIONS`).
    top_candidates: tokens searched by top-k / top-p (`logits.truncated_candidates`).
  """

  slots: int = 64
  page_size: int = 16
  pool_tokens: int = 32768
  pool_gib: float = 0.0
  decode_steps: int = 8
  prefill_chunk: int = 256
  prefill_tokens: int = 2048
  prefix_cache: bool = True
  attention: str = "auto"
  top_candidates: int = 256

  def __post_init__(self):
    for name in ("slots", "page_size", "pool_tokens", "decode_steps", "prefill_chunk",
                 "prefill_tokens", "top_candidates"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an integer >= 1")
    if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
      raise ValueError(f"prefill_chunk={self.prefill_chunk!r}; expected a power of two >= 16")
    if not isinstance(self.pool_gib, (int, float)) or not self.pool_gib >= 0:
      raise ValueError(f"pool_gib={self.pool_gib!r}; expected a number >= 0 (0 = size the pool "
                       "by pool_tokens)")
    if self.attention not in IMPLEMENTATIONS:
      raise ValueError(f"attention={self.attention!r}; expected one of {IMPLEMENTATIONS}")
    if not isinstance(self.prefix_cache, bool):
      raise ValueError(f"prefix_cache={self.prefix_cache!r}; expected True or False")


def request_key(key: jax.Array, *ids: int) -> jax.Array:
  """The key of the request identified by `ids` (e.g. episode, turn, agent, sample) under `key`
  (a run's sampling stream): fold_in over the ids in order."""
  for i in ids:
    key = jax.random.fold_in(key, i)
  return key


def run_all(engine: RolloutEngine, requests: Sequence[EngineRequest]) -> list[Completion]:
  """Every request's Completion, in request order (submit all, step until none is pending)."""
  engine.submit(requests)
  done: dict[Any, Completion] = {}
  while engine.pending:
    done.update((c.request_id, c) for c in engine.step())
  return [done[r.request_id] for r in requests]
