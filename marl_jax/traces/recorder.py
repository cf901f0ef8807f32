"""Builds one episode's orchestration trace while a workflow runs it.

A workflow calls ``event`` for everything that happens (orchestrator decisions, spawns, messages,
tool calls and results, returns, aggregation), passing raw text as ``content``; the recorder assigns
ids and times, links each agent's consecutive events with temporal edges, adds the caller's causal
edges, stores the text by hash and counts costs. ``finish`` returns the schema-valid trace plus the
content it references, ready for ``TraceWriter.write``.

Task ids are ``"<task>/<instance>"``: the part before the first slash names the task, which is how
replay finds the function that recomputes the rewards.
"""
from __future__ import annotations

import copy
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from marl_jax.traces.schema import EDGE_TYPES, EVENT_TYPES, TOPOLOGIES, validate
from marl_jax.traces.store import content_ref

TEAM = "team"
TOOL = "tool"
ORCHESTRATION = "orchestration"
CLOCKS = ("wall", "logical")
_RESERVED = frozenset({"id", "t", "type", "agent", "role", "from", "to", "tool", "content_ref",
                       "trusted", "tokens"})


def agent_channel(agent: str) -> str:
  """Reward channel of one agent's local reward (AT-GRPO mixes it with the team channel)."""
  return f"agent:{agent}"


def task_name(task_id: str) -> str:
  return task_id.split("/", 1)[0]


class TraceRecorder:
  """Accumulates the events, edges, rewards and costs of one episode.

  Args:
    task: task name (e.g. "plan_path"); replayers are registered under it.
    instance: which problem of the task (e.g. "seed=17"); with ``task`` forms the task_id.
    trace_id: unique id of this episode; a random one if not given.
    system: name of the producing system.
    topology: one of schema.TOPOLOGIES, if known.
    clock: "wall" (t = seconds since the recorder was made) or "logical" (t = event index), the
      latter for traces that must be byte-identical across runs.
  """

  def __init__(self, task: str, instance: str, *, trace_id: str | None = None,
               system: str = "marl_jax", topology: str | None = None, clock: str = "wall"):
    if "/" in task or not task:
      raise ValueError(f"task name {task!r} must be non-empty and contain no '/'")
    if topology is not None and topology not in TOPOLOGIES:
      raise ValueError(f"unknown topology {topology!r}; expected one of {list(TOPOLOGIES)}")
    if clock not in CLOCKS:
      raise ValueError(f"unknown clock {clock!r}; expected one of {list(CLOCKS)}")
    self._header: dict[str, Any] = {"trace_id": trace_id or uuid.uuid4().hex,
                                    "task_id": f"{task}/{instance}", "system": system}
    if topology is not None:
      self._header["topology"] = topology
    self._clock = clock
    self._start = time.monotonic()
    self._events: list[dict[str, Any]] = []
    self._edges: list[dict[str, str]] = []
    self._ids: set[str] = set()
    self._last_of_agent: dict[str, str] = {}
    self._rewards: dict[str, float] = {}
    self._metrics: dict[str, float] = {}
    self._content: dict[str, str] = {}
    self._extra_tokens = 0
    self._finished = False

  @property
  def trace_id(self) -> str:
    return self._header["trace_id"]

  def fork(self) -> TraceRecorder:
    """An open copy of this recording under a new trace id: each branch of a tree rollout is its
    own episode that shares the history recorded so far."""
    self._check_open()
    out = copy.deepcopy(self)
    out._header["trace_id"] = uuid.uuid4().hex
    return out

  def event(self, type: str, agent: str, *, content: str | None = None,
            after: Sequence[tuple[str, str]] = (), role: str | None = None,
            sender: str | None = None, receiver: str | None = None, tool: str | None = None,
            trusted: bool | None = None, tokens: int = 0, **extra: Any) -> str:
    """Records an event and returns its id.

    Args:
      type: one of schema.EVENT_TYPES.
      agent: who acts (for a tool_result, the tool).
      content: raw text (prompt, response, program, tool output); stored by hash.
      after: (event id, edge type) pairs: edges from earlier events to this one, e.g.
        ``[(call_id, "return")]`` on a tool result. Temporal edges are added automatically.
      role, sender, receiver, tool, trusted: the schema's optional fields (sender/receiver are
        written as "from"/"to").
      tokens: tokens this event cost (generated or consumed); summed into costs.tokens.
      **extra: further JSON values kept on the event (turn, problem_id, branch, ...).
    """
    self._check_open()
    if type not in EVENT_TYPES:
      raise ValueError(f"unknown event type {type!r}; expected one of {list(EVENT_TYPES)}")
    if not agent:
      raise ValueError("event agent must be a non-empty string")
    if tokens < 0:
      raise ValueError(f"tokens must be >= 0; got {tokens}")
    clash = _RESERVED.intersection(extra)
    if clash:
      raise ValueError(f"extra event keys {sorted(clash)} clash with schema fields; use the "
                       "named arguments")
    event_id = f"e{len(self._events)}"
    t = len(self._events) if self._clock == "logical" else time.monotonic() - self._start
    event: dict[str, Any] = {"id": event_id, "t": t, "type": type, "agent": agent}
    optional = {"role": role, "from": sender, "to": receiver, "tool": tool, "trusted": trusted}
    event.update({k: v for k, v in optional.items() if v is not None})
    if content is not None:
      ref = content_ref(content)
      self._content[ref] = content
      event["content_ref"] = ref
    if tokens:
      event["tokens"] = int(tokens)
    event.update(extra)
    for src, edge_type in after:  # checked before anything is stored, so a bad edge changes nothing
      self._check_edge(src, event_id, edge_type, dst_is_new=True)
    self._events.append(event)
    self._ids.add(event_id)
    previous = self._last_of_agent.get(agent)
    if previous is not None:
      self._edges.append({"src": previous, "dst": event_id, "type": "temporal"})
    self._last_of_agent[agent] = event_id
    for src, edge_type in after:
      self._edges.append({"src": src, "dst": event_id, "type": edge_type})
    return event_id

  def edge(self, src: str, dst: str, type: str) -> None:
    """Adds an edge between two recorded events (for links known only later, e.g. aggregation)."""
    self._check_open()
    self._check_edge(src, dst, type, dst_is_new=False)
    self._edges.append({"src": src, "dst": dst, "type": type})

  def set_reward(self, channel: str, value: float) -> None:
    """Sets a reward channel: TEAM, agent_channel(name), TOOL, ORCHESTRATION or any other name."""
    self._check_open()
    self._rewards[channel] = _finite(value, f"reward {channel!r}")

  def set_metric(self, name: str, value: float) -> None:
    self._check_open()
    self._metrics[name] = _finite(value, f"metric {name!r}")

  def add_tokens(self, tokens: int) -> None:
    """Counts tokens not tied to one event (e.g. a shared system prompt)."""
    self._check_open()
    if tokens < 0:
      raise ValueError(f"tokens must be >= 0; got {tokens}")
    self._extra_tokens += int(tokens)

  def finish(self) -> tuple[dict[str, Any], dict[str, str]]:
    """Closes the episode; returns (trace, content store entries), the trace already validated."""
    self._check_open()
    self._finished = True
    costs = {
        "tokens": self._extra_tokens + sum(e.get("tokens", 0) for e in self._events),
        "wall_clock_s": time.monotonic() - self._start,
        "tool_calls": sum(e["type"] == "tool_call" for e in self._events),
        "messages": sum(e["type"] == "message" for e in self._events),
    }
    trace = dict(self._header, events=self._events, edges=self._edges, rewards=self._rewards,
                 costs=costs)
    if self._metrics:
      trace["metrics"] = self._metrics
    validate(trace)
    return trace, dict(self._content)

  def _check_open(self) -> None:
    if self._finished:
      raise RuntimeError(f"trace {self.trace_id!r} is finished; start a new TraceRecorder")

  def _check_edge(self, src: str, dst: str, type: str, *, dst_is_new: bool) -> None:
    if type not in EDGE_TYPES:
      raise ValueError(f"unknown edge type {type!r}; expected one of {list(EDGE_TYPES)}")
    for end in (src,) if dst_is_new else (src, dst):
      if end not in self._ids:
        raise ValueError(f"edge {src!r} -> {dst!r} refers to unknown event {end!r}")


def _finite(value: float, what: str) -> float:
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{what} must be a finite number; got {value}")
  return value
