"""Replay: recompute a trace's rewards from its stored content and report every disagreement.

Each task registers a *replayer*, a pure function ``(trace, content) -> {channel: reward}`` that
re-derives the rewards from the recorded texts alone (parse the actions from the stored responses,
re-run the environment from the instance in the task_id, ...). Replay then checks that all
referenced content is present and unaltered (its SHA-256 still matches the ref) and compares the
recomputed channels with the recorded ones, exactly by default: JSON round-trips Python floats bit
for bit, so any difference means the rewards or the content were changed, or the reward code
drifted.

Replayers live in the `REPLAYERS` registry (marl_jax/registry.py), under the task name:
``REPLAYERS.register("plan_path", recompute_plan_path)``, or a lazy ``"module:function"`` string
that is imported when a trace of that task is first replayed (the environment registry,
workflows/registry.py, registers every environment's replayer that way).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from marl_jax.registry import Registry
from marl_jax.traces.recorder import task_name
from marl_jax.traces.store import content_ref, is_content_ref

Replayer = Callable[[Mapping[str, Any], Mapping[str, str]], Mapping[str, float]]

REPLAYERS: Registry[Replayer] = Registry("replayer")  # task name -> replayer


@dataclasses.dataclass(frozen=True)
class Mismatch:
  """One disagreement between a trace and its replay."""
  trace_id: str
  what: str  # reward channel, content ref, or "replayer"
  recorded: float | None
  recomputed: float | None
  detail: str

  def __str__(self) -> str:
    return f"trace {self.trace_id!r}: {self.what}: {self.detail}"


def event_text(event: Mapping[str, Any], content: Mapping[str, str]) -> str | None:
  """The stored text of an event, or None if it has none; for use inside replayers."""
  ref = event.get("content_ref")
  return None if ref is None else content.get(ref)


def replay(trace: Mapping[str, Any], content: Mapping[str, str], *,
           atol: float = 0.0) -> list[Mismatch]:
  """Recomputes the rewards of ``trace``; returns the mismatches (empty when everything agrees).

  Raises ValueError only when no replayer is registered for the trace's task (a set-up error, not a
  property of the trace); a replayer that raises is reported as a mismatch.
  """
  task = task_name(trace["task_id"])
  replayer = REPLAYERS.get(task)
  trace_id = trace["trace_id"]
  mismatches = []
  for event in trace["events"]:
    ref = event.get("content_ref")
    if ref is None or not is_content_ref(ref):
      continue
    if ref not in content:
      mismatches.append(Mismatch(trace_id, ref, None, None,
                                 f"content of event {event['id']!r} is missing from the store"))
    elif content_ref(content[ref]) != ref:
      mismatches.append(Mismatch(trace_id, ref, None, None,
                                 f"content of event {event['id']!r} was altered (hash differs)"))
  try:
    recomputed = {k: float(v) for k, v in replayer(trace, content).items()}
  except Exception as e:  # a replayer failing on a broken trace is a finding, not a crash
    return mismatches + [Mismatch(trace_id, "replayer", None, None,
                                  f"replayer for {task!r} raised {type(e).__name__}: {e}")]
  recorded = trace["rewards"]
  for channel in sorted(set(recorded) | set(recomputed)):
    old, new = recorded.get(channel), recomputed.get(channel)
    if old is None:
      mismatches.append(Mismatch(trace_id, channel, None, new, f"recomputed {new!r} but the trace "
                                 "has no such reward"))
    elif new is None:
      mismatches.append(Mismatch(trace_id, channel, old, None, f"recorded {old!r} but the replayer "
                                 "does not produce this channel"))
    elif abs(old - new) > atol:
      mismatches.append(Mismatch(trace_id, channel, old, new,
                                 f"recorded {old!r}, recomputed {new!r}"))
  return mismatches
