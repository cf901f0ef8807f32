"""The bridge from workflow prompts to the sampler: `generate(requests, policy_id, params)`.

The workflow engine hands over chat messages; this applies the model's chat template, picks the
acting policy's weights out of the team's params (shared model, a LoRA adapter over the frozen
base, one slice of stacked models, or one named model) and samples. Keys are derived from
(step, call) so a resumed run samples exactly what an uninterrupted one would.

Per-agent sampling (`config.sampling.per_agent`): a call's requests are split by their agent's
SamplingParams, one sampler call per distinct setting, in the order each first appears among the
requests; agents that share settings stay in one batch. Each sampler call takes the next key of
the stream, so with one setting for every agent the keys are exactly those of a single call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from marl_jax.models.tokenizer import Tokenizer
from marl_jax.parallel import layouts
from marl_jax.parallel.policies import PolicyConfig
from marl_jax.sampling.params import SamplingParams
from marl_jax.sampling.sampler import Sampler
from marl_jax.workflows.rollout import Generation, Request


def prompt_ids(tokenizer: Tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
  """The token ids a policy is prompted with: `messages` through the model's chat template."""
  return tokenizer.encode(tokenizer.apply_chat_template(messages))


class LLMPolicy:
  """Samples replies for any policy of a team. `params` = (trainable, frozen) of the trainer.
  `sampling`: every agent's settings, except the agents `per_agent` names."""

  def __init__(self, policy: PolicyConfig, tokenizers: Sequence[Any], sampling: SamplingParams,
               key: jax.Array, per_agent: Mapping[str, SamplingParams] | None = None):
    if len(tokenizers) != len(policy.models):
      raise ValueError(f"{len(tokenizers)} tokenizers for the {len(policy.models)} model "
                       f"config(s) of a {policy.kind!r} policy; expected one per model")
    self.policy = policy
    self.tokenizers = list(tokenizers)  # one per model config (mapped teams), else one
    self.samplers = [Sampler(m, t) for m, t in zip(policy.models, self.tokenizers)]
    self.sampling = sampling
    self.per_agent = dict(per_agent or {})
    self.layout = layouts.of(policy)
    self.key = key
    self._calls = 0

  def reseed(self, key: jax.Array) -> None:
    """Starts a new key stream (the trainer calls it with fold_in(run_key, step))."""
    self.key, self._calls = key, 0

  def generate(self, requests: Sequence[Request], policy_id: int, params: Any
               ) -> list[Generation]:
    if not 0 <= policy_id < self.policy.num_policies:
      raise ValueError(f"policy id {policy_id} has no params; the team has "
                       f"{self.policy.num_policies} policies")
    groups: dict[SamplingParams, list[int]] = {}  # settings -> request indices, first-seen order
    for i, r in enumerate(requests):
      groups.setdefault(self.per_agent.get(r.agent, self.sampling), []).append(i)
    out: list[Generation | None] = [None] * len(requests)
    for sampling, indices in groups.items():
      for i, gen in zip(indices, self._sample([requests[i] for i in indices], policy_id, params,
                                              sampling)):
        out[i] = gen
    return out

  def _sample(self, requests: Sequence[Request], policy_id: int, params: Any,
              sampling: SamplingParams) -> list[Generation]:
    """One sampler call at `sampling`, with the stream's next key."""
    index, model_params, adapters = self.layout.acting_params(self.policy, *params, policy_id,
                                                              len(requests))
    tokenizer, sampler = self.tokenizers[index], self.samplers[index]
    prompts = [prompt_ids(tokenizer, r.messages) for r in requests]
    key = jax.random.fold_in(self.key, self._calls)
    self._calls += 1
    completions = sampler.generate(model_params, prompts, sampling, key, adapters=adapters)
    return [Generation(c.text, tuple(p), tuple(int(t) for t in c.tokens),
                       tuple(float(x) for x in c.logprobs), c.finish_reason)
            for p, c in zip(prompts, completions)]
