"""Replays an episode trace written by the rollout engine and recomputes its reward channels.

The engine stores every selected reply (and the sandbox output its program printed) by hash, plus
the env's keyword arguments in the first event. Re-stepping a fresh env with the stored texts, in
order, gives the rewards again with the same floating-point operations, so replay compares exactly.
Tool programs are not re-run: their recorded output is the input the env saw. The environment
registry (workflows/registry.py) registers this replayer for every environment it knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from marl_jax.traces.recorder import ORCHESTRATION, TEAM, agent_channel, task_name
from marl_jax.traces.replay import event_text
from marl_jax.workflows import registry


def recompute_rewards(trace: Mapping[str, Any], content: Mapping[str, str]) -> dict[str, float]:
  events = trace["events"]
  env = registry.make_env(task_name(trace["task_id"]), **events[0]["env_kwargs"])
  outputs = {e["reply"]: event_text(e, content) for e in events if e["type"] == "tool_result"}
  channels: dict[str, float] = {}
  for event in events:
    if event["type"] != "message":
      continue
    output = outputs.get(event["id"])
    kwargs = {} if output is None else {"tool_output": output}
    result = env.step(event["agent"], event_text(event, content), **kwargs)
    for name, value in result.rewards.items():
      channels[agent_channel(name)] = channels.get(agent_channel(name), 0.0) + value
  channels[TEAM] = 1.0 if env.solved else 0.0
  if hasattr(env, "final_rewards"):
    channels[ORCHESTRATION] = sum(env.final_rewards().values())
  return channels
