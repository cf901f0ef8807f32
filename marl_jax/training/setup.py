"""From a checked config to the static things a run is built of: its problems, batch shape,
team (policy config, base params, tokenizers), learner config and sampling settings.

The trainer builds a run from these; `experiments/plan.py` plans paper scale with the same
functions on architectures alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from marl_jax.algos import batch as batch_lib
from marl_jax.algos.batch import BatchShape
from marl_jax.models import loading, precision
from marl_jax.models.config import ModelConfig
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.parallel import layouts, policies
from marl_jax.parallel.train_config import TrainConfig
from marl_jax.sampling.params import SamplingParams
from marl_jax.training import config as config_lib
from marl_jax.training import sft as sft_lib
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Problem
from marl_jax.workflows.spec import WorkflowSpec


def problems(c: ml_collections.ConfigDict, first_seed: int, count: int,
             ids: range | None = None, for_eval: bool = False) -> list[Problem]:
  """Problems `ids` (default: all) of `count` from consecutive seeds; problem i has seed
  `first_seed + i` and id i, so a process's slice keeps the global dense ids. Env kwargs that
  name a local dataset turn seed s into row `s % rows` (`registry.problem_kwargs`); evaluation's
  kwargs can name their own split (`config_lib.env_kwargs`)."""
  extra = config_lib.env_kwargs(c, for_eval)
  return [Problem(c.env.name, registry.problem_kwargs(c.env.name, c.env.workflow, c.env.max_turns,
                                                      first_seed + i, extra), i)
          for i in (range(count) if ids is None else ids)]


def batch_shape(c: ml_collections.ConfigDict, spec: WorkflowSpec, shards: int,
                procs: int = 1, sft: bool = False) -> BatchShape:
  """The static sizes of a step's batch on `procs` processes: each process's rows split into
  `shards` / `procs` pieces (its devices x micro-batches). `sft`: of a warm-start step."""
  mode, k, num = ((sft_lib.ROLLOUT_MODE, sft_lib.ROLLOUT_K, c.sft.problems_per_step) if sft
                  else (c.rollout.mode, c.rollout.k, c.rollout.problems_per_step))
  trajs, branching = batch_lib.id_layout(mode, k, spec.max_turns)
  return BatchShape(
      num_problems=num, trajs_per_problem=trajs, branching=branching,
      max_turns=spec.max_turns, num_agents=len(spec.agents), num_states=spec.num_states,
      multiple=shards // procs, min_rows=max(1, BatchShape.min_rows // procs))


def train_config(c: ml_collections.ConfigDict, built: config_lib.Built,
                 policy: policies.PolicyConfig, shape: BatchShape) -> TrainConfig:
  """The static configuration of the learner of config `c`."""
  return TrainConfig(
      policy=policy, advantage=built.advantage, loss=built.loss, space=shape.space,
      train=built.train, agent_policies=tuple(built.spec.policy_id(a) for a in built.spec.agents),
      temperature=config_lib.learner_temperatures(c, built.spec.agents),
      reference_policies=trained_policies(c, built))


def trained_policies(c: ml_collections.ConfigDict, built: config_lib.Built) -> tuple[int, ...]:
  """The ids of the policies that act for an agent RL trains (`config.train.agents`): the
  others get a frozen optimizer (`policy_config`), and their rows no update computes."""
  spec, trained = built.spec, config_lib.trained_agents(c, built.spec)
  return tuple(sorted({spec.policy_id(a) for a in trained}))


def team_names(c: ml_collections.ConfigDict, spec: WorkflowSpec
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the model of each model config, the policy names). A mapped team has one model per policy,
  `c.policy.models` in agent order (empty: `c.model` for each), and names each policy after its
  agents, so its params and batch dicts read as the roles; other teams have `c.model` and no
  names."""
  if not layouts.of(c.policy).per_policy_models:
    return (c.model,), ()
  num = spec.num_policies
  return (tuple(c.policy.models) or (c.model,) * num,
          tuple("+".join(a for a in spec.agents if spec.policy_id(a) == p) for p in range(num)))


def policy_config(c: ml_collections.ConfigDict, built: config_lib.Built,
                  models: Sequence[ModelConfig]) -> policies.PolicyConfig:
  """The team's PolicyConfig over the architectures of `team_names(...)[0]`. A policy that acts
  for none of the agents RL trains (`config.train.agents`) gets a frozen optimizer: its
  gradient is zero anyway, and so it also skips AdamW's decoupled weight decay and holds no
  moments; the warm-start (`sft.train_config`) still trains every policy."""
  spec, trained = built.spec, trained_policies(c, built)
  frozen = dataclasses.replace(built.optim, frozen=True)
  optim = tuple(built.optim if p in trained else frozen for p in range(spec.num_policies))
  return policies.PolicyConfig(
      kind=c.policy.kind, models=tuple(models), num_policies=spec.num_policies,
      names=team_names(c, spec)[1], lora=built.lora, optim=optim,
      critic=built.critic, critic_optim=built.critic_optim)


def load_team(c: ml_collections.ConfigDict, built: config_lib.Built
              ) -> tuple[policies.PolicyConfig, Any, list[Tokenizer]]:
  """The team's PolicyConfig, base params and one tokenizer per model config (`team_names`).

  A model named twice is read once and copied: the train step donates its state, and two
  policies must never share one buffer.
  """
  names, policy_names = team_names(c, built.spec)
  loaded: dict[str, loading.LoadedModel] = {}
  params = []
  for name in names:
    if name in loaded:
      params.append(jax.tree.map(np.array, loaded[name].params))
    else:
      loaded[name] = loading.load_model(name, c.param_dtype,
                                        precision.compute_dtype(c.compute_dtype))
      params.append(loaded[name].params)
  models = [loaded[name] for name in names]
  policy = policy_config(c, built, [m.config for m in models])
  base = dict(zip(policy_names, params)) if policy_names else params[0]
  return policy, base, [m.tokenizer for m in models]


def sampling_params(c: ml_collections.ConfigDict, temperature: float, top_p: float
                    ) -> SamplingParams:
  """config.sampling's budget, stop strings and top-k at `temperature` and `top_p` (the global
  settings of a rollout or evaluation)."""
  return SamplingParams(max_new_tokens=c.sampling.max_new_tokens, temperature=temperature,
                        top_p=top_p, top_k=c.sampling.top_k,
                        stop_strings=tuple(c.sampling.stop))


def agent_sampling_params(c: ml_collections.ConfigDict, agents: Sequence[str],
                          for_eval: bool = False) -> dict[str, SamplingParams]:
  """Each agent's SamplingParams: its `sampling.per_agent` overrides over config.sampling
  (`config.agent_sampling`). Evaluation (`for_eval`) samples every agent at config.eval's
  temperature and top_p (None: sampling.top_p) but keeps each agent's max_new_tokens and stop
  strings (its reply format and budget), as the config's `sampling` comment says."""
  out = {}
  for a in agents:
    if for_eval:
      temperature = c.eval.temperature
      top_p = c.sampling.top_p if c.eval.top_p is None else c.eval.top_p
    else:
      temperature = config_lib.agent_sampling(c, a, "temperature")
      top_p = config_lib.agent_sampling(c, a, "top_p")
    out[a] = SamplingParams(
        max_new_tokens=config_lib.agent_sampling(c, a, "max_new_tokens"),
        temperature=temperature, top_p=top_p, top_k=c.sampling.top_k,
        stop_strings=tuple(config_lib.agent_sampling(c, a, "stop")))
  return out


def largest_budget(c: ml_collections.ConfigDict) -> int:
  """The most new tokens any agent of the run may sample: config.sampling.max_new_tokens or a
  larger `sampling.per_agent` budget (set only for the run's agents, `config_checks.sampling`)."""
  return max([c.sampling.max_new_tokens] + [s.max_new_tokens for s in
                                            c.sampling.per_agent.values()
                                            if s.max_new_tokens is not None])
