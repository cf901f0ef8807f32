"""Workflow engine: turn order, tree sampling, reward attribution, batching, traces and replay."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import scripted
from marl_jax.envs import base as envs_base
from marl_jax.envs.games.base import evaluate_actions
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Generation, Problem, RolloutConfig, rollout
from marl_jax.workflows.spec import WorkflowSpec

GAME_MOVES = {"plan_path": ["U", "D", "L", "R"], "sokoban": ["U", "D", "L", "R"]}
SMALL = {"plan_path": {"height": 5, "width": 5}, "sokoban": {}, "sudoku": {}}


def _problems(task, seeds, mode="mas", **extra):
  return [Problem(task, dict(seed=s, mode=mode, **SMALL[task], **extra), i)
          for i, s in enumerate(seeds)]


@pytest.mark.parametrize("task", ["plan_path", "sokoban", "sudoku"])
@pytest.mark.parametrize("mode", ["tree", "independent"])
def test_oracle_solves_every_seed_through_the_two_agent_workflow(task, mode):
  problems = _problems(task, range(100))
  cfg = RolloutConfig(mode=mode, k=2 if mode == "tree" else 1, record_traces=False)
  result = rollout(problems, registry.workflow_spec(task, "mas"), scripted.oracle_generate, None, cfg)
  assert len(result.episodes) == 100
  assert all(e.solved for e in result.episodes)
  # Every problem's tree groups hold k samples with one shared prompt.
  groups = Counter((s.problem_id, s.turn, s.agent) for s in result.samples)
  assert set(groups.values()) == {cfg.k}


@pytest.mark.parametrize("task", ["plan_path", "sokoban"])
def test_random_policy_scores_low(task):
  problems = _problems(task, range(40))
  cfg = RolloutConfig(mode="independent", k=1, record_traces=False)
  spec = registry.workflow_spec(task, "single", max_turns=2)
  problems = _problems(task, range(40), mode="single", max_turns=2)
  oracle = rollout(problems, spec, scripted.oracle_generate, None, cfg)
  rand = rollout(problems, spec, scripted.make_random_generate(0, GAME_MOVES[task]), None, cfg)
  solved = sum(e.solved for e in rand.episodes)
  assert all(e.solved for e in oracle.episodes)
  assert solved <= 0.3 * len(problems)
  mean = lambda r: sum(s.reward for s in r.samples) / len(r.episodes)
  assert mean(rand) < 0.5 * mean(oracle)


class _Counter:
  """A bandit-like toy env: agents 'a' then 'b' say numbers; the env reward of a step is the
  number; b's step also pays 'a' the sum of both (a shared-state contribution)."""

  def __init__(self, max_turns=2, total=0.0, turn=0, last=None):
    self.agents, self.max_turns, self.total, self.turn, self.last = ("a", "b"), max_turns, total, turn, last

  done = property(lambda self: self.turn >= self.max_turns)
  solved = property(lambda self: self.total >= 10)

  def clone(self):
    return _Counter(self.max_turns, self.total, self.turn, self.last)

  def observe(self, agent):
    return envs_base.Observation(agent, self.turn, "count", f"total={self.total} last={self.last}")

  def step(self, agent, response):
    value = float(response)
    self.total += value
    rewards = {agent: value}
    if agent == "b":
      rewards["a"] = self.last + value
      self.turn += 1
    self.last = value
    return envs_base.StepResult(agent, None, rewards, self.done, {})


@pytest.fixture
def counter_env():
  registry.register("counter", envs_base.Task(_make_counter, {}, lambda v, t, seed: {}),
                    replace=True)


def _make_counter(**kwargs):
  return _Counter(**kwargs)


def test_tree_sampling_selects_the_best_branch_and_continues_from_its_clone(counter_env):
  calls = []

  def generate(requests, policy_id, params):
    calls.append((policy_id, len(requests)))
    # Branch j answers j+1; prompts of one group must be identical.
    assert len({str(r.messages) for r in requests}) == 1
    return [Generation(str(j + 1)) for j in range(len(requests))]

  spec = WorkflowSpec(agents=("a", "b"), max_turns=2, policy_of={"a": 0, "b": 1})
  result = rollout([Problem("counter", {"max_turns": 2}, 0)], spec, generate, None,
                   RolloutConfig(mode="tree", k=3, record_traces=False))
  # One generate call per policy per wave: a, b, a, b.
  assert calls == [(0, 3), (1, 3), (0, 3), (1, 3)]
  by_group = {}
  for s in result.samples:
    by_group.setdefault((s.turn, s.agent), []).append(s)
  # The best branch (3) is continued: the total after turn 0 is 3 + 3 = 6, after turn 1 is 12.
  assert [s.selected for s in by_group[(0, "a")]] == [False, False, True]
  assert result.episodes[0].solved
  # b's K samples all start from a's best clone (parent = a's selected sample).
  a_best = result.samples.index(by_group[(0, "a")][2])
  assert {s.parent for s in by_group[(0, "b")]} == {a_best}
  # a's samples: own value + the contribution of b's selected step (last=3, b=3 -> 6).
  assert [s.reward for s in by_group[(0, "a")]] == [1 + 6, 2 + 6, 3 + 6]
  assert [s.reward for s in by_group[(0, "b")]] == [1, 2, 3]


def test_independent_rollouts_keep_their_own_trajectories(counter_env):
  def generate(requests, policy_id, params):
    return [Generation(str(1 + (r.env.total > 0))) for r in requests]

  spec = WorkflowSpec(agents=("a", "b"), max_turns=2)
  result = rollout([Problem("counter", {}, 0), Problem("counter", {}, 1)], spec, generate, None,
                   RolloutConfig(mode="independent", k=2, record_traces=False))
  assert len(result.episodes) == 4 and len(result.samples) == 16
  assert sorted({s.traj_id for s in result.samples}) == [0, 1, 2, 3]
  turn0_a = [s for s in result.samples if s.turn == 0 and s.agent == "a"]
  assert [s.reward for s in turn0_a] == [1 + 3] * 4  # own 1, then b says 2: 1 + 2


def test_loop_exit_and_router_order(counter_env):
  seen = []

  def generate(requests, policy_id, params):
    seen.extend(r.agent for r in requests)
    return [Generation("0" if r.agent != "a" else "1") for r in requests]

  loop = WorkflowSpec(agents=("a", "b"), kind="loop", max_turns=2, exit_agent="a",
                      exit_when=lambda text: text == "1")
  rollout([Problem("counter", {"max_turns": 5}, 0)], loop, generate, None,
          RolloutConfig(k=1, record_traces=False))
  assert seen == ["a"]
  seen.clear()
  router = WorkflowSpec(agents=("a", "b"), kind="router", max_turns=3, route=lambda text: "b")
  rollout([Problem("counter", {"max_turns": 5}, 0)], router, generate, None,
          RolloutConfig(k=1, record_traces=False))
  assert seen == ["a", "b"] * 3


def test_bad_workflow_specs_fail_clearly():
  with pytest.raises(ValueError, match="unknown workflow kind 'star'"):
    WorkflowSpec(agents=("a",), kind="star")
  with pytest.raises(ValueError, match="not in agents"):
    WorkflowSpec(agents=("a",), policy_of={"b": 1})
  with pytest.raises(ValueError, match="unknown rollout mode 'beam'"):
    RolloutConfig(mode="beam")


@pytest.mark.parametrize("mode", ["tree", "independent"])
def test_traces_validate_and_replay_exactly(mode, tmp_path):
  problems = _problems("plan_path", range(4))
  rand = scripted.make_random_generate(1, GAME_MOVES["plan_path"], length=4)
  result = rollout(problems, registry.workflow_spec("plan_path", "mas", max_turns=2), rand, None,
                   RolloutConfig(mode=mode, k=2))
  assert len(result.episodes) == (4 if mode == "tree" else 8)
  for episode in result.episodes:
    schema.validate(episode.trace)
    assert replay_lib.replay(episode.trace, episode.content) == []
    assert episode.trace["rewards"]["team"] == float(episode.solved)
  # Tampering with a recorded reward is caught.
  trace = dict(result.episodes[0].trace)
  trace["rewards"] = dict(trace["rewards"], **{"agent:plan": trace["rewards"]["agent:plan"] + 1})
  assert [m.what for m in replay_lib.replay(trace, result.episodes[0].content)] == ["agent:plan"]


def test_tool_and_plan_rewards_follow_the_paper_bookkeeping():
  problems = _problems("plan_path", [3])
  result = rollout(problems, registry.workflow_spec("plan_path", "mas"), scripted.oracle_generate, None,
                   RolloutConfig(mode="independent", k=1, record_traces=False))
  tool, plan = result.samples
  env = problems[0].make()
  moves = env.game.oracle()
  r_own, _ = evaluate_actions(env.game, moves)
  r_shared = env.game.clone().step(moves).reward
  assert tool.reward == pytest.approx(r_own + r_shared)
  assert plan.reward == pytest.approx(2 * r_shared)
  assert dataclasses.asdict(tool)["team_reward"] == 1.0
