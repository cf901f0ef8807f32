"""The bridge from workflow prompts to the rollout engines: `LLMPolicy.serve(params)` is the
rollout's Responder (`workflows/rollout.py`).

The workflow engine hands over chat messages; this applies the model's chat template, picks the
acting policy's weights out of the team's params (shared model, a LoRA adapter over the frozen
base, one slice of stacked models, or one named model) and submits one engine request per
reply. Policies that share weights share one engine (LoRA adapters are per-request rows of its
batch); separate weights get one engine each (`Layout.engine_of`), so a mapped team has one
engine per base model.

Keys. Each request draws with `request_key(key, episode, turn, agent, sample)` (its
`Request.ids`) under the stream `reseed` set (the trainer: a key per step and rollout), so a
reply depends on nothing but its own prompt, settings and identity: not on the batch, the engine
or the order in which episodes advance, and a resumed run samples exactly what an uninterrupted
one would.

Per-agent sampling (`config.sampling.per_agent`): each request carries its agent's
SamplingParams; the static engine makes one sampler call per distinct setting, the continuous
engine mixes them in one batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax

from marl_jax.models.tokenizer import Tokenizer
from marl_jax.parallel import layouts
from marl_jax.parallel.policy_config import PolicyConfig
from marl_jax.sampling import registry
from marl_jax.sampling.engine import EngineOptions, EngineRequest, RolloutEngine, request_key
from marl_jax.sampling.params import SamplingParams
from marl_jax.workflows.rollout import Generation, Ticket


def prompt_ids(tokenizer: Tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
  """The token ids a policy is prompted with: `messages` through the model's chat template."""
  return tokenizer.encode(tokenizer.apply_chat_template(messages))


class LLMPolicy:
  """Samples replies for any policy of a team. `sampling`: every agent's settings, except the
  agents `per_agent` names. `engine` and `options`: `config.rollout.engine` and
  `config.engine`; `engines`: another LLMPolicy's `engines`, to share them."""

  def __init__(self, policy: PolicyConfig, tokenizers: Sequence[Any], sampling: SamplingParams,
               key: jax.Array, per_agent: Mapping[str, SamplingParams] | None = None, *,
               engine: str = "static", options: EngineOptions = EngineOptions(),
               engines: dict | None = None):
    if len(tokenizers) != len(policy.models):
      raise ValueError(f"{len(tokenizers)} tokenizers for the {len(policy.models)} model "
                       f"config(s) of a {policy.kind!r} policy; expected one per model")
    if engine not in registry.ENGINES:
      raise ValueError(f"rollout.engine={engine!r}; expected one of {sorted(registry.ENGINES)}")
    self.policy = policy
    self.tokenizers = list(tokenizers)  # one per model config (mapped teams), else one
    self.sampling = sampling
    self.per_agent = dict(per_agent or {})
    self.layout = layouts.of(policy)
    self.engine_name, self.options = engine, options
    # engine id -> (model index, engine, whether requests pick a LoRA adapter row); `engines`:
    # another LLMPolicy's (the trainer's evaluation shares the rollouts' engines and K/V pools:
    # requests carry their own settings and keys)
    self.engines: dict[int, tuple[int, RolloutEngine, bool]] = {} if engines is None else engines
    self.key, self.version = key, 0

  def reseed(self, key: jax.Array, version: int = 0) -> None:
    """Starts a new key stream (the trainer: one per step and rollout); `version`: the policy
    version the next `serve`'s replies are stamped with (the trainer's step)."""
    self.key, self.version = key, version

  def serve(self, params: Any) -> _Served:
    """Loads `params` = (trainable, frozen) into the engines; returns the rollout's Responder."""
    loaded = set()
    for policy_id in range(self.policy.num_policies):
      engine_id = self.layout.engine_of(self.policy, policy_id)
      if engine_id in loaded:
        continue
      loaded.add(engine_id)
      index, model_params, adapters = self.layout.acting_params(self.policy, *params,
                                                                policy_id, 1)
      if engine_id not in self.engines:
        self.engines[engine_id] = (index, registry.make_engine(
            self.engine_name, self.policy.models[index], self.tokenizers[index], self.options),
            adapters is not None)
      self.engines[engine_id][1].load(model_params, adapters, self.version)
    return _Served(self)

  def stats(self) -> dict[str, float]:
    """Every engine's counters, summed."""
    out: dict[str, float] = {}
    for _, engine, _ in self.engines.values():
      for name, value in engine.stats().items():
        out[name] = out.get(name, 0.0) + value
    return out


class _Served:
  """An LLMPolicy's engines as a Responder: requests in, replies out as each finishes."""

  def __init__(self, llm: LLMPolicy):
    self.llm = llm
    self.streams = llm.engine_name != "static"
    self._prompts: dict[Hashable, tuple[int, ...]] = {}

  @property
  def pending(self) -> int:
    return sum(engine.pending for _, engine, _ in self.llm.engines.values())

  def submit(self, tickets: Sequence[Ticket]) -> None:
    llm = self.llm
    batches: dict[int, list[EngineRequest]] = {}
    for ticket, request, policy_id in tickets:
      if not 0 <= policy_id < llm.policy.num_policies:
        raise ValueError(f"policy id {policy_id} has no params; the team has "
                         f"{llm.policy.num_policies} policies")
      engine_id = llm.layout.engine_of(llm.policy, policy_id)
      index, _, lora = llm.engines[engine_id]
      prompt = tuple(prompt_ids(llm.tokenizers[index], request.messages))
      self._prompts[ticket] = prompt
      batches.setdefault(engine_id, []).append(EngineRequest(
          ticket, prompt, llm.per_agent.get(request.agent, llm.sampling),
          request_key(llm.key, *request.ids), policy_id if lora else 0))
    for engine_id, requests in batches.items():
      llm.engines[engine_id][1].submit(requests)

  def collect(self) -> list[tuple[Hashable, Generation]]:
    out = []
    for _, engine, _ in self.llm.engines.values():
      if engine.pending:
        out += [(c.request_id, Generation(c.text, self._prompts.pop(c.request_id),
                                          tuple(int(t) for t in c.tokens),
                                          tuple(float(x) for x in c.logprobs), c.finish_reason,
                                          c.policy_version))
                for c in engine.step()]
    return out
