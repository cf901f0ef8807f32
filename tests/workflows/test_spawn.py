"""Learned spawning and aggregation (issue: learned orchestration, O1/O4): the math 'spawn'
workflow. The dispatcher's `#### N` runs exactly N solvers, the aggregator sees their answers, and
the dispatcher's decision is credited with team reward - spawn_cost x N; expected values are
derived here from the scripted team's choices, not from the env's reward code."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from configs import orchestration_spawn
from marl_jax.algos import batch as batch_lib
from marl_jax.algos.advantages import estimate
from marl_jax.envs.math import env as math_env
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema, stats
from marl_jax.training import config as config_lib
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Generation, Problem, RolloutConfig, rollout
from marl_jax.workflows.spec import Cursor, WorkflowSpec, advance


def _team(choose):
  """Dispatcher: `#### choose()`; worker_1 answers wrong, the others right; the aggregator takes
  the most common answer (the first on a tie)."""

  def generate(requests, policy_id, params):
    del policy_id, params
    out = []
    for r in requests:
      env = r.env
      if r.agent == "dispatcher":
        out.append(Generation(f"Hard enough. #### {choose()}"))
      elif r.agent == "aggregator":
        votes = Counter(a for a in env.answers.values())
        out.append(Generation(f"Majority: \\boxed{{{votes.most_common(1)[0][0]}}}"))
      else:
        answer = "-1" if r.agent == "worker_1" else env.problem.answer
        out.append(Generation(f"\\boxed{{{answer}}}"))
    return out

  return generate


def _solved(n: int) -> float:
  """By hand: one wrong answer (worker_1) and n - 1 right ones; the majority (first on a tie)
  is right from n = 3."""
  return float(n >= 3)


def test_spawn_order_rewards_advantages_and_traces():
  cost, k = 0.1, 4
  rng = random.Random(1)
  spec = registry.workflow_spec("math", "spawn")
  problems = [Problem("math", dict(seed=s, workflow="spawn", spawn_cost=cost), s)
              for s in range(3)]
  result = rollout(problems, spec, _team(lambda: rng.randint(1, 4)), None,
                   RolloutConfig(mode="independent", k=k))
  by_traj = defaultdict(list)
  for s in result.samples:
    by_traj[s.traj_id].append(s)
  spawned = {}
  for traj, samples in by_traj.items():
    n = int(samples[0].generation.text.rsplit("#### ", 1)[1])
    spawned[traj] = n
    assert [s.agent for s in samples] == (["dispatcher"] + [f"worker_{i}" for i in
                                                            range(1, n + 1)] + ["aggregator"])
    assert all(s.team_reward == _solved(n) for s in samples)
    assert samples[0].reward == pytest.approx(-cost * n)
    # The aggregator's prompt shows exactly the spawned workers' answers.
    assert samples[-1].messages[1]["content"].count("Solver ") == n
  assert len(set(spawned.values())) >= 3  # the scripted dispatcher varied its choice

  cfg = config_lib.build(orchestration_spawn.get_config("cpu")).advantage
  samples = result.samples
  batch = batch_lib.make_batch(
      [s.reward for s in samples], problem_id=[s.problem_id for s in samples],
      turn=[s.turn for s in samples], agent_id=[s.agent_id for s in samples],
      team_rewards=[s.team_reward for s in samples])
  space = batch_lib.GroupSpace(num_problems=3, max_turns=1, num_agents=len(spec.agents))
  adv = np.asarray(estimate(batch, cfg, space).advantages)[:, 0]
  nonzero = 0
  for p in range(3):
    members = [i for i, s in enumerate(samples) if s.agent == "dispatcher" and s.problem_id == p]
    assert len(members) == k  # the problem's K decisions form one group
    r = np.array([_solved(spawned[samples[i].traj_id]) - cost * spawned[samples[i].traj_id]
                  for i in members])
    np.testing.assert_allclose(adv[members], (r - r.mean()) / (r.std(ddof=1) + 1e-6),
                               rtol=1e-5, atol=1e-6)
    nonzero += int(np.any(np.abs(adv[members]) > 0.1))
  assert nonzero >= 1

  for episode in result.episodes:
    trace = episode.trace
    schema.validate(trace)
    assert replay_lib.replay(trace, episode.content) == []
    n = spawned[episode.traj_id]
    types = Counter(e["type"] for e in trace["events"])
    assert (types["spawn"], types["despawn"], types["aggregate"]) == (n, n, 1)
    aggregate = next(e["id"] for e in trace["events"] if e["type"] == "aggregate")
    assert sum(e["type"] == "aggregate" and e["dst"] == aggregate for e in trace["edges"]) == n
    assert trace["rewards"]["orchestration"] == pytest.approx(-cost * n)
  summary = stats.summarize(e.trace for e in result.episodes)["decisions"]
  ns = [spawned[e.traj_id] for e in result.episodes]
  assert summary["spawned_per_episode"] == pytest.approx(sum(ns) / len(ns))
  assert summary["any_worker_right"] == sum(n >= 2 for n in ns)
  assert summary["kept_right_rate"] == pytest.approx(sum(n >= 3 for n in ns) /
                                                     sum(n >= 2 for n in ns))


def test_spawn_count_parsing_and_spec():
  assert math_env.spawn_count("I pick #### 3") == 3
  assert math_env.spawn_count("#### 2 then #### 4") == 4  # the last one
  assert math_env.spawn_count("#### 0") is None and math_env.spawn_count("#### 5") is None
  assert math_env.spawns("no number") == 1
  env = registry.make_env("math", seed=0, workflow="spawn")
  result = env.step("dispatcher", "many")  # no N: one worker, the format penalty
  assert result.info["spawn"] == ["worker_1"] and result.rewards == {"dispatcher": -0.1}
  with pytest.raises(ValueError, match="'worker_2' was not spawned"):
    env.step("worker_2", "\\boxed{1}")
  spec = WorkflowSpec(("d", "w1", "w2", "agg"), kind="spawn", max_turns=1, spawn=lambda r: 3)
  with pytest.raises(ValueError, match=r"spawn\(\) returned 3; expected 1..2 workers"):
    advance(spec, Cursor(0, "d"), "x", False)
  with pytest.raises(ValueError, match="a spawn workflow needs spawn"):
    WorkflowSpec(("d", "agg"), kind="spawn", spawn=lambda r: 1)
  with pytest.raises(ValueError, match="spawn_cost prices the spawn workflow"):
    registry.make_env("math", seed=0, workflow="drmas", spawn_cost=0.2)
