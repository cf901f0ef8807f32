"""Declarative turn order of a multi-agent workflow: who acts when, and on which policy.

Four kinds cover the papers' systems and learned orchestration:
  sequential  every turn, all agents act in `agents` order (AT-GRPO's tool -> plan; MARFT's
              profiled chain), until the environment is done or `max_turns` turns have passed;
  loop        sequential, plus an exit: after `exit_agent` acts, `exit_when(response)` ends the
              episode (Dr. MAS's solver -> verifier loop that stops on approval);
  router      every turn, `agents[0]` routes: `route(response)` names which of the other agents
              acts next (Dr. MAS search: verifier -> search agent or answer agent);
  spawn       every turn, `agents[0]` decides which workers to spawn: `spawn(response)` names
              a non-empty subset of the workers `agents[1:-1]` (how many and whom), which run,
              each on its own, then the aggregator `agents[-1]` (learned orchestration: when
              to spawn, whom to delegate to, how to aggregate).

The workflow decides order only; rewards, prompts and termination of the task live in the
environment, so one engine runs every workflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

KINDS = ("sequential", "loop", "router", "spawn")


@dataclasses.dataclass(frozen=True)
class WorkflowSpec:
  """Turn order plus the agent -> policy map. `policy_of` missing an agent means policy 0."""

  agents: tuple[str, ...]
  kind: str = "sequential"
  max_turns: int = 4
  tool_agents: frozenset[str] = frozenset()  # replies run as programs in the sandbox
  policy_of: Mapping[str, int] = dataclasses.field(default_factory=dict)
  exit_agent: str | None = None  # loop only
  exit_when: Callable[[str], bool] | None = None  # loop only
  route: Callable[[str], str] | None = None  # router only: router reply -> next agent
  spawn: Callable[[str], tuple[str, ...]] | None = None  # spawn only: reply -> workers to run
  topology: str = "planner_executor_critic"  # trace topology label (docs/papers.md section 5)
  num_states: int = 1  # the observations' `state` ids lie in [0, num_states) (envs/base.py)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown workflow kind {self.kind!r}; expected one of {KINDS}")
    if not self.agents or len(set(self.agents)) != len(self.agents):
      raise ValueError(f"agents must be distinct and non-empty; got {self.agents}")
    if self.max_turns < 1:
      raise ValueError(f"max_turns must be >= 1; got {self.max_turns}")
    if self.num_states < 1:
      raise ValueError(f"num_states must be >= 1; got {self.num_states}")
    unknown = (set(self.tool_agents) | set(self.policy_of)) - set(self.agents)
    if unknown:
      raise ValueError(f"tool_agents/policy_of name agents {sorted(unknown)} that are not in "
                       f"agents={self.agents}")
    if self.kind == "loop" and (self.exit_agent not in self.agents or self.exit_when is None):
      raise ValueError("a loop workflow needs exit_agent (one of the agents) and exit_when; got "
                       f"exit_agent={self.exit_agent!r}")
    if self.kind == "router" and (self.route is None or len(self.agents) < 2):
      raise ValueError("a router workflow needs route and at least one agent besides the router")
    if self.kind == "spawn" and (self.spawn is None or len(self.agents) < 3):
      raise ValueError("a spawn workflow needs spawn and agents (spawner, worker..., aggregator)")

  def agent_id(self, agent: str) -> int:
    return self.agents.index(agent)

  def policy_id(self, agent: str) -> int:
    return self.policy_of.get(agent, 0)

  @property
  def num_policies(self) -> int:
    return max([0, *self.policy_of.values()]) + 1


@dataclasses.dataclass(frozen=True)
class Cursor:
  """Where an episode stands in its workflow: the turn, who acts next (None = finished) and, in a
  spawn workflow, the spawned workers still to act after it."""

  turn: int = 0
  agent: str | None = None
  pending: tuple[str, ...] = ()


def first_cursor(spec: WorkflowSpec) -> Cursor:
  return Cursor(0, spec.agents[0])


def advance(spec: WorkflowSpec, cursor: Cursor, response: str, env_done: bool) -> Cursor:
  """The cursor after `cursor.agent` replied `response`; agent None once the episode is over."""
  if env_done:
    return Cursor(cursor.turn, None)
  agents = spec.agents
  if spec.kind == "router":
    if cursor.agent == agents[0]:
      chosen = spec.route(response)
      if chosen not in agents[1:]:
        raise ValueError(f"route() returned {chosen!r}; expected one of {agents[1:]}")
      return Cursor(cursor.turn, chosen)
    turn, nxt = cursor.turn + 1, agents[0]
  elif spec.kind == "spawn":
    workers = agents[1:-1]
    if cursor.agent == agents[0]:
      named = spec.spawn(response)
      chosen = tuple(w for w in workers if w in named)  # in worker order
      if not chosen or len(chosen) != len(named):  # none, a non-worker or a repeat
        raise ValueError(f"spawn() returned {named!r}; expected a non-empty subset of the "
                         f"workers {workers}")
      return Cursor(cursor.turn, chosen[0], chosen[1:])
    if cursor.pending:
      return Cursor(cursor.turn, cursor.pending[0], cursor.pending[1:])
    if cursor.agent != agents[-1]:
      return Cursor(cursor.turn, agents[-1])
    turn, nxt = cursor.turn + 1, agents[0]
  else:
    if spec.kind == "loop" and cursor.agent == spec.exit_agent and spec.exit_when(response):
      return Cursor(cursor.turn, None)
    i = agents.index(cursor.agent) + 1
    turn, nxt = (cursor.turn, agents[i]) if i < len(agents) else (cursor.turn + 1, agents[0])
  return Cursor(turn, nxt if turn < spec.max_turns else None)
