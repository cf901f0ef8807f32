"""DAPO dynamic sampling on the host: keep the step's first `count` problems that carry a learning
signal, out of several rollouts of fresh problems.

With `algo.filter="zero_variance"` the estimator drops every group whose rewards are all equal, so
a step whose problems are all solved (or all failed) trains on few or no samples. DAPO (and verl's
`filter_groups`) rolls out more prompts until the batch holds enough groups with non-zero reward
variance. Here the unit kept is a problem (its samples must stay together: every id of the batch
is a problem's), and a problem qualifies when at least one of its estimator groups (`group_by`:
the problem, (problem, agent) or (problem, turn, agent)) holds two samples with different mixed
rewards `alpha * team_reward + reward` (the device filter's rule: a singleton group is constant).
The trainer rolls out `count` fresh problems per try (`Run._rollout`); `select` keeps the first
`count` qualifying problems in seed order and renumbers them 0..count-1 so the batch's ids stay
dense.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import ml_collections

from marl_jax.algos import batch as batch_lib
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.workflows.rollout import RolloutResult, Sample


def enabled(c: ml_collections.ConfigDict, advantage: AdvantageConfig) -> bool:
  """Whether a run refills its rollouts: `algo.filter="zero_variance"` with
  `rollout.max_refills` > 0."""
  return advantage.filter == "zero_variance" and c.rollout.max_refills > 0


def qualifying_problems(samples: Sequence[Sample], group_by: str, alpha: float) -> list[int]:
  """Sorted ids of the problems with at least one group of non-zero reward variance."""
  rewards = defaultdict(set)
  for s in samples:
    rewards[batch_lib.group_key(s, group_by)].add(batch_lib.mix(s.reward, s.team_reward, alpha))
  return sorted({key[0] for key, values in rewards.items() if len(values) > 1})


def select(results: Sequence[RolloutResult], qualifying: Sequence[Sequence[int]], count: int,
           trajs_per_problem: int) -> tuple[list[Sample], dict[str, float]]:
  """The samples of the first `count` qualifying problems over `results` (tries in seed order,
  each numbering its problems from 0), renumbered 0..kept-1, and the refill metrics.
  `qualifying[t]`: `qualifying_problems` of `results[t]` (the trainer computes it once per try).

  Fewer than `count` qualify (the try cap was hit): all qualifying ones are kept; none: the first
  try's problems are kept as they are (the device filter then drops every group; the metrics
  say so)."""
  found = [(t, p) for t, ids in enumerate(qualifying) for p in ids]
  kept = found[:count] or [(0, p) for p in sorted({s.problem_id for s in results[0].samples})]
  new_id = {key: i for i, key in enumerate(kept)}
  out: list[Sample] = []
  for t, r in enumerate(results):
    index = {}  # position in this try's samples -> position in `out` (tree-mode parents)
    for i, s in enumerate(r.samples):
      pid = new_id.get((t, s.problem_id))
      if pid is None:
        continue
      branch = s.traj_id - batch_lib.traj_id(s.problem_id, 0, trajs_per_problem)
      index[i] = len(out)
      out.append(dataclasses.replace(
          s, problem_id=pid, traj_id=batch_lib.traj_id(pid, branch, trajs_per_problem),
          parent=index.get(s.parent, -1)))
  metrics = {"rollout/tries": float(len(results)),
             "rollout/problems_rolled": float(sum(len({s.problem_id for s in r.samples})
                                                  for r in results)),
             "rollout/qualifying_found": float(len(found)),
             "rollout/problems_kept": float(len(kept)),
             "rollout/refill_cap_hit": float(len(found) < count)}
  return out, metrics
