"""Workflow specs of the math, code, writing and search tasks (who acts when, on which policy).

Each factory matches the env the same variant builds (`make_env("math", workflow=...)` etc.):
agent names, turn caps and the loop exit / router agree with the env's own termination. With
`per_role=True` every agent gets its own policy id in agent order (per-agent LoRA or full models,
MAGRPO's one model per agent, Dr. MAS's heterogeneous teams); otherwise all share policy 0.
"""

from __future__ import annotations

from marl_jax.envs.math import env as math_env
from marl_jax.envs.search import env as search_env
from marl_jax.workflows.spec import WorkflowSpec


def _policies(agents: tuple[str, ...], per_role: bool) -> dict[str, int]:
  return {agent: (i if per_role else 0) for i, agent in enumerate(agents)}


def math_workflow(variant: str = "atgrpo", *, max_turns: int | None = None,
                  roles: tuple[str, ...] = ("reasoner", "actor"),
                  per_role: bool = False) -> WorkflowSpec:
  """'atgrpo' tool -> reasoner (tool replies run in the sandbox), 'drmas' solver <-> verifier loop
  exiting on approval, 'marft' the profiled chain `roles`, 'single' one solver."""
  if variant == "atgrpo":
    agents = ("tool", "reasoner")
    return WorkflowSpec(agents, max_turns=max_turns or 4, tool_agents=frozenset({"tool"}),
                        policy_of=_policies(agents, per_role))
  if variant == "drmas":
    agents = ("solver", "verifier")
    return WorkflowSpec(agents, kind="loop", max_turns=max_turns or 2, exit_agent="verifier",
                        exit_when=math_env.approves, policy_of=_policies(agents, per_role))
  if variant == "marft":
    agents = tuple(roles)
    return WorkflowSpec(agents, max_turns=max_turns or 3, policy_of=_policies(agents, per_role))
  if variant == "single":
    return WorkflowSpec(("solver",), max_turns=1, topology="unknown")
  raise ValueError(f"unknown math workflow {variant!r}; expected one of {math_env.WORKFLOWS}")


def code_workflow(variant: str = "atgrpo", *, max_turns: int = 4,
                  per_role: bool = False) -> WorkflowSpec:
  """'atgrpo' coder -> tester, 'single' one coder, 'magrpo' aux and main in parallel (one turn).
  The code envs run their programs themselves, so no agent is a sandbox tool agent here."""
  if variant == "atgrpo":
    agents = ("coder", "tester")
    return WorkflowSpec(agents, max_turns=max_turns, policy_of=_policies(agents, per_role))
  if variant == "single":
    return WorkflowSpec(("coder",), max_turns=1, topology="unknown")
  if variant == "magrpo":
    agents = ("aux", "main")
    return WorkflowSpec(agents, max_turns=1, policy_of=_policies(agents, per_role),
                        topology="swarm")
  raise ValueError(f"unknown code workflow {variant!r}; expected atgrpo, single or magrpo")


def writing_workflow(*, per_role: bool = True) -> WorkflowSpec:
  """MAGRPO writing: agent1 and agent2 in parallel, one turn, one model per agent by default."""
  agents = ("agent1", "agent2")
  return WorkflowSpec(agents, max_turns=1, policy_of=_policies(agents, per_role),
                      topology="swarm")


def search_workflow(*, max_steps: int = 4, per_role: bool = False) -> WorkflowSpec:
  """Dr. MAS search: each step the verifier routes to the search or the answer agent."""
  agents = search_env.AGENTS
  return WorkflowSpec(agents, kind="router", max_turns=max_steps, route=search_env.route,
                      policy_of=_policies(agents, per_role), topology="centralized")
