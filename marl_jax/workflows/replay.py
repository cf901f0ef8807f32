"""Replays an episode trace written by the rollout engine and recomputes its reward channels.

The engine stores every selected reply (and the sandbox output its program printed) by hash, plus
the env's keyword arguments in the first event. Re-stepping a fresh env with the stored texts, in
order, gives the rewards again with the same floating-point operations, so replay compares exactly.
Tool programs are not re-run: their recorded output is the input the env saw. The environment
registry (workflows/registry.py) registers this replayer for every environment it knows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from marl_jax.envs.base import Environment, Observation, RewardsDecisions, StepResult
from marl_jax.traces.recorder import ORCHESTRATION, TEAM, agent_channel, task_name
from marl_jax.traces.replay import event_text
from marl_jax.workflows import registry


@dataclasses.dataclass(frozen=True)
class ReplayedStep:
  """One recorded reply re-stepped: what its agent was shown, what it said and what it got."""

  event: Mapping[str, Any]  # the trace's `message` event (turn, tokens, candidates, ...)
  observation: Observation  # the prompt the env gives the agent in that state
  reply: str
  tool_output: str | None  # what the reply's program printed, for a tool agent
  result: StepResult  # rewards and the env's parse of the reply (`info`)


def replay_steps(trace: Mapping[str, Any], content: Mapping[str, str]
                 ) -> tuple[Environment, list[ReplayedStep]]:
  """(the env after the episode, its steps): a fresh env of the trace's task and kwargs re-stepped
  with the stored replies in order, each agent observed before its step as the rollout engine
  does. Raises ValueError on a step the env refuses."""
  events = trace["events"]
  env = registry.make_env(task_name(trace["task_id"]), **events[0]["env_kwargs"])
  outputs = {e["reply"]: event_text(e, content) for e in events if e["type"] == "tool_result"}
  steps = []
  for event in events:
    if event["type"] != "message":
      continue
    reply, output = event_text(event, content), outputs.get(event["id"])
    observation = env.observe(event["agent"])
    kwargs = {} if output is None else {"tool_output": output}
    steps.append(ReplayedStep(event, observation, reply, output,
                              env.step(event["agent"], reply, **kwargs)))
  return env, steps


def recompute_rewards(trace: Mapping[str, Any], content: Mapping[str, str]) -> dict[str, float]:
  env, steps = replay_steps(trace, content)
  channels: dict[str, float] = {}
  for step in steps:
    for name, value in step.result.rewards.items():
      channels[agent_channel(name)] = channels.get(agent_channel(name), 0.0) + value
  channels[TEAM] = 1.0 if env.solved else 0.0
  if isinstance(env, RewardsDecisions):
    channels[ORCHESTRATION] = sum(env.final_rewards().values())
  return channels
