"""Evaluation: independent rollouts on held-out problems, success metrics, traces on disk.

With k rollouts per problem: `accuracy` is avg@k (mean success over all k x problems) and
`pass@k` the fraction of problems solved at least once (with n = k samples the unbiased pass@k
estimator reduces to exactly this). In a multi-host run each process evaluates its own slice of
the problems and writes its own trace file; the metrics are reduced over processes as (sum,
count) pairs, so every process returns the values of the whole problem set.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from marl_jax.algos import batch as batch_lib
from marl_jax.parallel import multihost
from marl_jax.traces.store import TraceWriter
from marl_jax.workflows.rollout import (Generate, Problem, RolloutConfig, RolloutResult, Serving,
                                        rollout)
from marl_jax.workflows.spec import WorkflowSpec


def success_metrics(result: RolloutResult, num_problems: int, k: int,
                    agents: Sequence[str]) -> dict[str, float]:
  """avg@k, pass@k, mean turns, per-agent mean sample reward and mean response tokens over all
  processes' rollouts; `num_problems` and `result` are this process's (a collective: see
  `multihost.global_means`; `agents` names the per-agent entries every process reports)."""
  solved = defaultdict(lambda: [False] * k)
  for episode in result.episodes:
    solved[episode.problem_id][batch_lib.branch_of(episode.traj_id, k)] = episode.solved
  rewards = defaultdict(list)
  tokens = []
  for s in result.samples:
    rewards[s.agent].append(s.reward)
    tokens.append(len(s.generation.token_ids))
  total = multihost.sum_count
  parts = {"accuracy": (total([x for row in solved.values() for x in row])[0], num_problems * k),
           f"pass@{k}": (total([any(row) for row in solved.values()])[0], num_problems),
           "turns": total([e.turns for e in result.episodes]),
           "response_tokens": total(tokens)}
  parts.update({f"reward/{a}": total(rewards[a]) for a in agents})
  out = multihost.global_means(parts)
  out.setdefault("response_tokens", 0.0)
  return out


def evaluate(problems: Sequence[Problem], spec: WorkflowSpec, policy: Generate | Serving,
             params: Any, *, k: int, rollout_cfg: RolloutConfig, trace_path: str | os.PathLike | None = None
             ) -> dict[str, float]:
  """Rolls out k independent episodes per problem; writes their traces to `trace_path`.

  `problems`: this process's slice (all of them with one process); the metrics cover every
  process's problems.
  """
  cfg = RolloutConfig(mode="independent", k=k, tool_timeout_s=rollout_cfg.tool_timeout_s,
                      tool_memory_mb=rollout_cfg.tool_memory_mb,
                      record_traces=trace_path is not None)
  result = rollout(problems, spec, policy, params, cfg)
  if trace_path is not None:
    with TraceWriter(trace_path) as writer:
      for episode in result.episodes:
        writer.write(episode.trace, episode.content)
  return success_metrics(result, len(problems), k, spec.agents)
