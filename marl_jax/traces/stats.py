"""Summary statistics over many traces: what a run's episodes looked like at a glance.

Answers the questions one asks of a trace file: how many episodes and of which tasks, how long they
were (events, simulated time), who acted and how, how often tools were called and messages sent,
what it cost, the mean of every reward channel and metric, and how learned orchestration decisions
went (`orchestrator_decision` events that carry a `decision`): counts per decision, stop rate,
stops on a wrong answer while rounds were left, premature stops, over-runs (continued although
the answer was already right), workers spawned per episode and to whom, aggregation quality (how
often the aggregate was right when some worker was) and the parallelism speedup (the workers'
total reply length over the longest, the aggregate events' mean). Decisions of a workflow with
states (`observed_state` on the event) are also counted per state, `by_state` {state: {decision:
n}}: e.g. how often a stopper stopped after a matching check (1) and after a mismatch (0).
Episodes that spawned workers and record `task_success` are grouped by how many, `by_spawned`
{n: {episodes, success}} (its mean): the accuracy side of the spawn count's trade-off.

Premature stop: stopped on a wrong answer while a later round would have fixed it. A stopped
episode never shows its own later rounds, so the counterfactual is read from its siblings: the
traces' other episodes of the same task that continued from a wrong answer after the same round.
A wrong stop is premature when one of them was right in a later round, not premature when they
all stayed wrong, and unjudged when no sibling continued from there.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

from marl_jax.traces.recorder import task_name


def summarize(traces: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
  """Aggregates validated traces into a JSON-serialisable summary.

  Rewards, costs and metrics are averaged over the episodes that have the channel (``count`` says
  how many), because agent-local channels exist only in episodes where that agent acted. (Over
  80 lines: one pass over the traces that fills every counter of the summary together.)
  """
  episodes = 0
  tasks: collections.Counter[str] = collections.Counter()
  topologies: collections.Counter[str] = collections.Counter()
  event_types: collections.Counter[str] = collections.Counter()
  edge_types: collections.Counter[str] = collections.Counter()
  agents: collections.Counter[str] = collections.Counter()
  lengths, durations = [], []
  rewards: dict[str, list[float]] = collections.defaultdict(list)
  costs: dict[str, list[float]] = collections.defaultdict(list)
  metrics: dict[str, list[float]] = collections.defaultdict(list)
  decisions: collections.Counter[str] = collections.Counter()
  by_state: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
  flags: collections.Counter[str] = collections.Counter()
  spawned_to: collections.Counter[str] = collections.Counter()
  by_spawned: dict[int, list[float]] = collections.defaultdict(list)  # n -> task_success values
  # (task_id, round) -> whether a continue from a wrong answer there was right later (any sibling)
  fixed_after: dict[tuple[str, Any], bool] = {}
  wrong_stops: list[tuple[str, Any]] = []
  for trace in traces:
    episodes += 1
    tasks[task_name(trace["task_id"])] += 1
    topologies[trace.get("topology", "unspecified")] += 1
    events = trace["events"]
    event_types.update(e["type"] for e in events)
    success = trace.get("metrics", {}).get("task_success")
    decided = [e for e in events if e["type"] == "orchestrator_decision" and "decision" in e]
    for i, e in enumerate(decided):
      decisions[e["decision"]] += 1
      if "observed_state" in e:
        by_state[e["observed_state"]][e["decision"]] += 1
      flags["over_run"] += e["decision"] == "continue" and bool(e.get("correct"))
      at = (trace["task_id"], e.get("round"))
      if e.get("correct"):
        continue
      if e["decision"] == "stop" and e.get("rounds_left", 0) > 0:
        wrong_stops.append(at)
      elif e["decision"] == "continue":
        later = any(d.get("correct") for d in decided[i + 1:]) or bool(success)
        fixed_after[at] = fixed_after.get(at, False) or later
        flags["continues_from_wrong"] += 1
        flags["later_round_fixes"] += later
    spawns = [e for e in events if e["type"] == "spawn"]
    flags["spawned"] += len(spawns)
    spawned_to.update(e.get("to", "unnamed") for e in spawns)
    if spawns and success is not None:
      by_spawned[len(spawns)].append(float(success))
    for e in events:
      if e["type"] == "aggregate" and "any_worker_correct" in e:
        flags["aggregates"] += 1
        flags["speedups"] += "speedup" in e
        flags["speedup_sum"] += e.get("speedup", 0.0)
        flags["any_right"] += bool(e["any_worker_correct"])
        flags["kept_right"] += bool(e["any_worker_correct"] and e.get("correct"))
    agents.update(e["agent"] for e in events)
    edge_types.update(e["type"] for e in trace["edges"])
    lengths.append(len(events))
    times = [e["t"] for e in events]
    durations.append(max(times) - min(times))
    for target, values in ((rewards, trace["rewards"]), (costs, trace["costs"]),
                           (metrics, trace.get("metrics", {}))):
      for name, value in values.items():
        target[name].append(value)
  flags["wrong_stops"] = len(wrong_stops)
  flags["premature"] = sum(fixed_after.get(at, False) for at in wrong_stops)
  flags["unjudged"] = sum(at not in fixed_after for at in wrong_stops)
  return {
      "episodes": episodes,
      "tasks": dict(sorted(tasks.items())),
      "topologies": dict(sorted(topologies.items())),
      "events": sum(lengths),
      "events_by_type": dict(sorted(event_types.items())),
      "edges_by_type": dict(sorted(edge_types.items())),
      "events_by_agent": dict(sorted(agents.items())),
      "mean_events_per_episode": _mean(lengths),
      "mean_episode_span_t": _mean(durations),
      "rewards": _channel_stats(rewards, total=False),
      "costs": _channel_stats(costs, total=True),
      "metrics": _channel_stats(metrics, total=False),
      "decisions": _decision_stats(decisions, flags, spawned_to, episodes, by_state,
                                   by_spawned),
  }


def format_summary(summary: Mapping[str, Any]) -> str:
  """Plain-text rendering of ``summarize``'s result for the command line."""
  lines = [f"episodes: {summary['episodes']}  events: {summary['events']}  "
           f"mean events/episode: {_fmt(summary['mean_events_per_episode'])}  "
           f"mean span t: {_fmt(summary['mean_episode_span_t'])}"]
  for key in ("tasks", "topologies", "events_by_type", "edges_by_type", "events_by_agent"):
    if summary[key]:
      lines.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in summary[key].items()))
  if summary["decisions"]:
    lines.append("decisions: " + ", ".join(f"{k}={_fmt(v)}" for k, v in
                                           summary["decisions"].items()))
  for key in ("rewards", "costs", "metrics"):
    for name, stats in summary[key].items():
      total = f" total={_fmt(stats['total'])}" if "total" in stats else ""
      lines.append(f"{key[:-1]} {name}: mean={_fmt(stats['mean'])} min={_fmt(stats['min'])} "
                   f"max={_fmt(stats['max'])} count={stats['count']}{total}")
  return "\n".join(lines)


def _decision_stats(decisions: collections.Counter[str], flags: collections.Counter[str],
                    spawned_to: collections.Counter[str], episodes: int,
                    by_state: Mapping[int, collections.Counter[str]],
                    by_spawned: Mapping[int, list[float]]) -> dict[str, Any]:
  """Counts and rates of learned orchestration decisions; empty when the traces hold none."""
  total = sum(decisions.values())
  if not total:
    return {}
  out: dict[str, Any] = {"decisions": total, **dict(sorted(decisions.items()))}
  stops, continues = decisions["stop"], decisions["continue"]
  if stops or continues:
    out.update(stop_rate=stops / (stops + continues), wrong_stops=flags["wrong_stops"],
               premature_stops=flags["premature"],
               premature_rate=flags["premature"] / stops if stops else None,
               wrong_stops_unjudged=flags["unjudged"],
               continues_from_wrong=flags["continues_from_wrong"],
               later_round_fixes=flags["later_round_fixes"],
               over_runs=flags["over_run"],
               over_run_rate=flags["over_run"] / continues if continues else None)
  if by_state:  # JSON keys are strings
    out["by_state"] = {str(k): dict(sorted(v.items())) for k, v in sorted(by_state.items())}
  if flags["spawned"]:
    out["spawned_per_episode"] = flags["spawned"] / episodes
    out["spawned_to"] = dict(sorted(spawned_to.items()))
    if by_spawned:
      out["by_spawned"] = {str(n): {"episodes": len(v), "success": _mean(v)}
                           for n, v in sorted(by_spawned.items())}
  if flags["aggregates"]:
    out.update(aggregates=flags["aggregates"], any_worker_right=flags["any_right"],
               kept_right_rate=(flags["kept_right"] / flags["any_right"]
                                if flags["any_right"] else None))
  if flags["speedups"]:
    out["mean_speedup"] = flags["speedup_sum"] / flags["speedups"]
  return out


def _channel_stats(values: Mapping[str, list[float]], *, total: bool) -> dict[str, dict[str, Any]]:
  out = {}
  for name in sorted(values):
    series = values[name]
    stats: dict[str, Any] = {"mean": _mean(series), "min": min(series), "max": max(series),
                             "count": len(series)}
    if total:
      stats["total"] = sum(series)
    out[name] = stats
  return out


def _mean(values: list[float]) -> float | None:
  return sum(values) / len(values) if values else None


def _fmt(value: float | Mapping[str, float] | None) -> str:
  if isinstance(value, Mapping):
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
  return "n/a" if value is None else f"{value:.4g}"
