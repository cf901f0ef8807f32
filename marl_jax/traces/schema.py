"""Orchestration-trace JSON Schema (docs/papers.md section 5) and a validator with clear errors.

A trace is one episode as a temporal interaction graph: typed events (who did what, when), typed
edges between them, reward channels and costs. The schema is the interchange contract with the
survey's artifact, so it is kept exactly as specified: a trace may carry nothing at top level beyond
the listed keys (raw content lives in a separate content store, see ``store.py``), while events may
carry extra keys (this project adds e.g. ``turn``, ``problem_id``, ``tokens``).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema

from marl_jax.errors import UserInputError

EVENT_TYPES = ("orchestrator_decision", "spawn", "despawn", "message", "tool_call", "tool_result",
               "return", "aggregate", "human_intervention", "safety_event")
EDGE_TYPES = ("temporal", "causal", "spawn", "message", "tool_dependency", "return", "aggregate",
              "safety_flow")
TOPOLOGIES = ("centralized", "planner_executor_critic", "debate", "swarm", "hierarchical",
              "harness", "mixed", "unknown")

_NON_EMPTY = {"type": "string", "minLength": 1}
_NUMBER_MAP = {"type": "object", "additionalProperties": {"type": "number"}}
_COUNT = {"type": "number", "minimum": 0}

TRACE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "LLM-MAS orchestration trace",
    "type": "object",
    "required": ["trace_id", "task_id", "events", "edges", "rewards", "costs"],
    "additionalProperties": False,
    "properties": {
        "trace_id": _NON_EMPTY,
        "task_id": _NON_EMPTY,
        "system": {"type": "string"},
        "topology": {"type": "string", "enum": list(TOPOLOGIES)},
        "events": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/event"}},
        "edges": {"type": "array", "items": {"$ref": "#/$defs/edge"}},
        "rewards": _NUMBER_MAP,  # channel -> value: team, agent:<name>, tool, orchestration, ...
        "costs": {
            "type": "object",
            "required": ["tokens", "wall_clock_s"],
            "additionalProperties": {"type": "number"},
            "properties": {"tokens": _COUNT, "wall_clock_s": _COUNT, "tool_calls": _COUNT,
                           "messages": _COUNT},
        },
        "metrics": _NUMBER_MAP,  # task_success, parallelism_efficiency, protocol_overhead, ...
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["id", "t", "type", "agent"],
            "additionalProperties": True,
            "properties": {
                "id": _NON_EMPTY,
                "t": {"type": "number", "minimum": 0},
                "type": {"type": "string", "enum": list(EVENT_TYPES)},
                "agent": _NON_EMPTY,
                "role": {"type": "string"},
                "from": {"type": "string"},
                "to": {"type": "string"},
                "tool": {"type": "string"},
                "content_ref": {"type": "string"},  # pointer or hash; raw content can be omitted
                "trusted": {"type": "boolean"},
            },
        },
        "edge": {
            "type": "object",
            "required": ["src", "dst", "type"],
            "additionalProperties": False,
            "properties": {"src": _NON_EMPTY, "dst": _NON_EMPTY,
                           "type": {"type": "string", "enum": list(EDGE_TYPES)}},
        },
    },
}

jsonschema.Draft202012Validator.check_schema(TRACE_SCHEMA)
_VALIDATOR = jsonschema.Draft202012Validator(TRACE_SCHEMA)


class TraceValidationError(UserInputError):
  """A trace that breaks the schema or references a missing event; ``path`` locates the problem."""

  def __init__(self, message: str, path: str):
    super().__init__(message)
    self.path = path


def validate(trace: Mapping[str, Any]) -> None:
  """Raises TraceValidationError naming the first problem and its JSON path; returns None if valid.

  Beyond the schema, event ids must be unique and every edge must join existing events, because
  replay and credit assignment walk the graph by id.
  """
  name = trace.get("trace_id", "?") if isinstance(trace, Mapping) else "?"
  errors = sorted(_VALIDATOR.iter_errors(trace), key=_document_order)
  if errors:
    first = errors[0]
    raise TraceValidationError(f"invalid trace {name!r}: at {first.json_path}: {first.message}",
                               first.json_path)
  for path in _non_finite(trace, "$"):  # JSON has no infinity; Python's json reads 1e999 as one
    raise TraceValidationError(f"invalid trace {name!r}: at {path}: non-finite number; expected a "
                               "finite number", path)
  seen: set[str] = set()
  for i, event in enumerate(trace["events"]):
    if event["id"] in seen:
      path = f"$.events[{i}].id"
      raise TraceValidationError(f"invalid trace {name!r}: at {path}: duplicate event id "
                                 f"{event['id']!r}", path)
    seen.add(event["id"])
  for i, edge in enumerate(trace["edges"]):
    for end in ("src", "dst"):
      if edge[end] not in seen:
        path = f"$.edges[{i}].{end}"
        raise TraceValidationError(f"invalid trace {name!r}: at {path}: edge refers to unknown "
                                   f"event id {edge[end]!r}", path)


def _non_finite(value: Any, path: str) -> Iterator[str]:
  """JSON paths of the infinite or NaN numbers in `value`, in document order."""
  if isinstance(value, float) and not math.isfinite(value):
    yield path
  elif isinstance(value, Mapping):
    for key, item in value.items():
      yield from _non_finite(item, f"{path}.{key}")
  elif isinstance(value, list):
    for i, item in enumerate(value):
      yield from _non_finite(item, f"{path}[{i}]")


def _document_order(error: jsonschema.ValidationError) -> tuple[list[tuple[int, int, str]], str]:
  """Sort key: array indices numerically, keys by name, so "first" is stable across runs."""
  return ([(0, p, "") if isinstance(p, int) else (1, 0, p) for p in error.absolute_path],
          error.message)
