"""Tree rollouts feeding the estimators: MAGRPO's joint-action tree (returns and sibling baselines
at every turn), AT-GRPO's per-branch team reward, the sa_grpo row, and the build refusals.

Expected numbers are derived here from docs/papers.md's rules (section 1: group = (problem, turn,
agent), final = alpha * global + local; section 3: R = r + gamma * mean(children), baseline =
sibling mean, gamma 0.9) and from the toy env's rules, never from the code under test.
"""

from __future__ import annotations

import ast
import math
from collections import defaultdict

import numpy as np
import pytest

import scripted
from configs import atgrpo_plan_path, magrpo_tldr
from marl_jax.algos import batch as batch_lib
from marl_jax.algos.advantage_config import AdvantageConfig, estimate
from marl_jax.envs import base as envs_base
from marl_jax.errors import UserInputError
from marl_jax.parallel import layouts
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema
from marl_jax.training import config as config_lib
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Generation, Problem, RolloutConfig, rollout
from marl_jax.workflows.spec import WorkflowSpec


class _Tally:
  """Agents 'a' then 'b' say numbers each turn. b's step pays both agents the turn's joint reward
  v = x_a + x_b + (total before the turn); the total then grows by x_a + x_b. Solved (and done)
  once the total reaches `goal`. The prompt shows every number said so far."""

  def __init__(self, max_turns=2, goal=1000.0, total=0.0, turn=0, history=()):
    self.agents, self.max_turns, self.goal = ("a", "b"), max_turns, goal
    self.total, self.turn, self.history = total, turn, tuple(history)

  solved = property(lambda self: self.total >= self.goal)
  done = property(lambda self: self.solved or self.turn >= self.max_turns)

  def clone(self):
    return _Tally(self.max_turns, self.goal, self.total, self.turn, self.history)

  def observe(self, agent):
    return envs_base.Observation(agent, self.turn, "tally", f"history={list(self.history)}")

  def step(self, agent, response):
    value = float(response)
    self.history += (value,)
    if agent == "a":
      return envs_base.StepResult(agent, None, {"a": 0.0}, False, {})
    x_a = self.history[-2]
    v = x_a + value + self.total
    self.total += x_a + value
    self.turn += 1
    return envs_base.StepResult(agent, None, {"a": v, "b": v}, self.done, {})


@pytest.fixture
def tally_env():
  registry.register("tally", envs_base.Task(lambda **kw: _Tally(**kw), {},
                                            lambda v, t, seed: {}), replace=True)


def _history(sample) -> list[float]:
  text = sample.messages[-1]["content"]
  return ast.literal_eval(text[text.index("history=") + len("history="):])


def _branch_generate(b_reply):
  """a answers 1, 2, ... across the copies of one prompt; b answers b_reply(x_a)."""

  def generate(requests, policy_id, params):
    out, seen = [], defaultdict(int)
    for r in requests:
      if r.agent == "a":
        j = seen[id(r.env)]
        seen[id(r.env)] += 1
        text = str(j + 1)
      else:
        text = str(b_reply(r.env.history[-1]))
      out.append(Generation(text, prompt_ids=(1,), token_ids=(2,), logprobs=(0.0,)))
    return out

  return generate


def test_magrpo_tree_gives_every_turn_the_return_minus_the_sibling_mean(tally_env):
  g, turns, gamma = 2, 2, 0.9
  spec = WorkflowSpec(agents=("a", "b"), max_turns=turns)
  result = rollout([Problem("tally", {"max_turns": turns}, 0)], spec,
                   _branch_generate(lambda x: int(x)), None,
                   RolloutConfig(mode="magrpo_tree", k=g, record_traces=False))
  # G + G^2 joint actions of two samples each; G^T leaves, each its own trajectory.
  assert len(result.samples) == 2 * (g + g * g)
  assert len(result.episodes) == g ** turns
  assert len({e.traj_id for e in result.episodes}) == g ** turns

  # The tree by hand: b echoes a, so r0 = 2 x0 and r1 = 2 x1 + 2 x0 (the total before turn 1).
  xs = [1.0, 2.0]
  r0 = {(x0,): 2 * x0 for x0 in xs}
  r1 = {(x0, x1): 2 * x1 + 2 * x0 for x0 in xs for x1 in xs}
  ret = dict(r1)
  for (x0,), r in r0.items():
    ret[(x0,)] = r + gamma * np.mean([r1[(x0, x1)] for x1 in xs])
  assert ret[(1.0,)] == pytest.approx(6.5) and ret[(2.0,)] == pytest.approx(10.3)
  expected = {}
  for path, value in ret.items():
    siblings = [v for p, v in ret.items() if len(p) == len(path) and p[:-1] == path[:-1]]
    expected[path] = value - np.mean(siblings)

  shape = batch_lib.BatchShape(num_problems=1, trajs_per_problem=g ** turns, branching=g,
                               max_turns=turns, num_agents=2)
  tb = batch_lib.build_rows(result.samples, shape, 0, 16, 32, 16)
  batch_lib.validate_batch(tb.samples, shape.space)
  out = estimate(tb.samples, AdvantageConfig("magrpo"), shape.space)
  got = np.asarray(out.advantages)[:, 0]
  for i, s in enumerate(result.samples):
    said = _history(s) + ([float(s.generation.text)] if s.agent == "a" else [])
    path = tuple(said[0::2])  # a's numbers, one per turn so far
    assert got[i] == pytest.approx(expected[path], abs=1e-5), (s.turn, s.agent, path)
  turn1 = [got[i] for i, s in enumerate(result.samples) if s.turn == 1]
  assert sorted(set(np.round(turn1, 5))) == [-1.0, 1.0]  # non-zero after turn 0
  # The same samples as one linear trajectory per leaf path would leave turn 1 without siblings:
  # every node of turn 1 sharing a parent proves the tree ids (G children per node).
  parents = np.asarray(tb.samples.parent_node)[:len(result.samples)]
  turn_of = np.asarray(tb.samples.turn)[:len(result.samples)]
  nodes = np.asarray(tb.samples.node_id)[:len(result.samples)]
  for parent in set(parents[turn_of == 1]):
    assert len(set(nodes[(turn_of == 1) & (parents == parent)])) == g


def test_magrpo_tree_observes_each_live_state_once_per_wave(tally_env, monkeypatch):
  observed = []
  honest = _Tally.observe
  monkeypatch.setattr(_Tally, "observe", lambda self, agent: observed.append(agent) or
                      honest(self, agent))
  g, turns = 2, 2
  result = rollout([Problem("tally", {"max_turns": turns}, 0)],
                   WorkflowSpec(agents=("a", "b"), max_turns=turns),
                   _branch_generate(lambda x: int(x)), None,
                   RolloutConfig(mode="magrpo_tree", k=g, record_traces=False))
  # waves: a of turn 0 (1 state), b of turn 0 (g branches), a of turn 1 (g), b of turn 1 (g*g)
  assert observed == ["a"] + ["b"] * g + ["a"] * g + ["b"] * g * g
  assert len(result.samples) == 2 * (g + g * g)


def test_magrpo_tree_counts_each_raising_step_once(tally_env, monkeypatch):
  honest = _Tally.step

  def step(self, agent, response):
    if agent == "b" and self.history[-1] == 2.0:  # b's step after a said 2 raises
      raise RuntimeError("boom")
    return honest(self, agent, response)

  monkeypatch.setattr(_Tally, "step", step)
  g, turns = 2, 2
  result = rollout([Problem("tally", {"max_turns": turns}, 0)],
                   WorkflowSpec(agents=("a", "b"), max_turns=turns),
                   _branch_generate(lambda x: int(x)), None,
                   RolloutConfig(mode="magrpo_tree", k=g, record_traces=False))
  # turn 0: the branch where a said 2 raises and ends; the other forks into g branches at turn 1,
  # of which the one where a said 2 raises again.
  assert result.safety_events == 2
  assert len(result.episodes) == 1 + g


def test_magrpo_tree_traces_validate_and_replay():
  problems = [Problem("plan_path", dict(seed=s, mode="mas", height=5, width=5), i)
              for i, s in enumerate(range(3))]
  rand = scripted.make_random_generate(2, ["U", "D", "L", "R"], length=3)
  result = rollout(problems, registry.workflow_spec("plan_path", "mas", max_turns=2), rand, None,
                   RolloutConfig(mode="magrpo_tree", k=2))
  assert len({e.trace["trace_id"] for e in result.episodes}) == len(result.episodes)
  assert len({e.traj_id for e in result.episodes}) == len(result.episodes) >= 3 * 2
  for episode in result.episodes:
    schema.validate(episode.trace)
    assert replay_lib.replay(episode.trace, episode.content) == []


def _tree_generate():
  """Every copy of a prompt answers 1, 2, 3, ... in order (a and b alike)."""

  def generate(requests, policy_id, params):
    out, seen = [], defaultdict(int)
    for r in requests:
      seen[id(r.env)] += 1
      out.append(Generation(str(seen[id(r.env)])))
    return out

  return generate


def test_atgrpo_tree_team_term_is_each_branchs_own_state(tally_env):
  """K = 3 branches; a says 1 (the first of its tied candidates continues), b's candidates say
  1, 2, 3: totals 2, 3, 4 with goal 4, so only b's third branch reaches a solved state."""
  spec = WorkflowSpec(agents=("a", "b"), max_turns=1)
  result = rollout([Problem("tally", {"max_turns": 1, "goal": 4.0}, 0)], spec,
                   _tree_generate(), None,
                   RolloutConfig(mode="tree", k=3, record_traces=False))
  b = [s for s in result.samples if s.agent == "b"]
  assert [s.reward for s in b] == [2.0, 3.0, 4.0]  # v = x_a + x_b + 0
  team_b = np.array([0.0, 0.0, 1.0])  # by hand: solved iff 1 + x_b >= 4
  assert [s.team_reward for s in b] == list(team_b)
  assert [s.team_reward for s in result.samples if s.agent == "a"] == [0.0] * 3  # a: total 0

  fields = dict(problem_id=[s.problem_id for s in result.samples],
                turn=[s.turn for s in result.samples],
                agent_id=[s.agent_id for s in result.samples],
                team_rewards=[s.team_reward for s in result.samples])
  samples = batch_lib.make_batch([s.reward for s in result.samples], **fields)
  space = batch_lib.GroupSpace(num_problems=1, max_turns=1, num_agents=2)

  def advantages(alpha):
    cfg = AdvantageConfig("at_grpo", alpha=alpha)
    return np.asarray(estimate(samples, cfg, space).advantages)[:, 0]

  is_b = np.array([s.agent == "b" for s in result.samples])
  for alpha in (0.0, 1.0):
    r = np.array([2.0, 3.0, 4.0]) + alpha * team_b
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # AT-GRPO configs: unbiased std
    np.testing.assert_allclose(advantages(alpha)[is_b], want, rtol=1e-5)
  assert not np.allclose(advantages(0.0)[is_b], advantages(1.0)[is_b])
  np.testing.assert_allclose(advantages(0.0)[~is_b], advantages(1.0)[~is_b])


def test_sa_grpo_row_is_tree_sampling_with_turn_agent_groups_and_the_filter():
  c = atgrpo_plan_path.get_config("sa_grpo,cpu")
  built = config_lib.build(c)
  assert (c.rollout.mode, built.advantage.estimator, built.advantage.filter) == (
      "tree", "at_grpo", "lowest_mean")
  spec = registry.workflow_spec(c.env.name, c.env.workflow, c.env.max_turns,
                                layouts.of(c.policy).per_role)
  problems = [Problem(c.env.name, registry.problem_kwargs(c.env.name, c.env.workflow,
                                                          c.env.max_turns, seed, {}), i)
              for i, seed in enumerate(range(4))]
  rand = scripted.make_random_generate(3, ["U", "D", "L", "R"], length=3)
  result = rollout(problems, spec, rand, None,
                   RolloutConfig(mode=c.rollout.mode, k=c.rollout.k, record_traces=False))
  groups = defaultdict(list)
  for i, s in enumerate(result.samples):
    groups[(s.problem_id, s.turn, s.agent_id)].append(i)
  assert {len(v) for v in groups.values()} == {c.rollout.k}
  for members in groups.values():  # one shared prompt per group
    assert len({str(result.samples[i].messages) for i in members}) == 1
  rewards = np.array([s.reward for s in result.samples])
  samples = batch_lib.make_batch(
      rewards, problem_id=[s.problem_id for s in result.samples],
      turn=[s.turn for s in result.samples], agent_id=[s.agent_id for s in result.samples],
      policy_id=[s.policy_id for s in result.samples])
  space = batch_lib.GroupSpace(num_problems=len(problems), max_turns=spec.max_turns,
                               num_agents=len(spec.agents))
  out = estimate(samples, built.advantage, space)
  assert float(out.metrics["groups"]) == len(groups)
  # By hand: floor(0.5 x groups) groups are dropped, none with a higher mean than a kept one.
  mask = np.asarray(out.sample_mask)
  kept = {key for key, members in groups.items() if mask[members].all()}
  assert all(mask[members].all() or not mask[members].any() for members in groups.values())
  assert len(groups) - len(kept) == math.floor(0.5 * len(groups))
  mean = {key: rewards[members].mean() for key, members in groups.items()}
  assert min(mean[k] for k in kept) >= max(mean[k] for k in groups if k not in kept) - 1e-6
  for key, members in groups.items():
    r = rewards[members]
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if key in kept else 0.0 * r
    np.testing.assert_allclose(np.asarray(out.advantages)[members, 0], want, atol=1e-5)


def _edit(c, **edits):
  for dotted, value in edits.items():
    group, name = dotted.split("__")
    c[group][name] = value
  return c


def _magrpo_game(**edits):
  c = atgrpo_plan_path.get_config("mas_shared,cpu")
  c.algo.estimator, c.algo.filter, c.algo.std_ddof = "magrpo", "none", None
  return _edit(c, **edits)


@pytest.mark.parametrize("config, message", [
    (_magrpo_game(rollout__mode="tree"),
     "config.rollout.mode='tree' continues one joint action per turn, so every 'magrpo' node"),
    (_magrpo_game(rollout__mode="independent", env__max_turns=2),
     "config.rollout.mode='independent' with 2 turns gives every 'magrpo' node after turn 0 no "
     "sibling"),
    (_magrpo_game(rollout__mode="magrpo_tree", rollout__k=1, env__max_turns=2),
     "config.rollout.k=1 gives every 'magrpo' node no sibling"),
    (_magrpo_game(rollout__mode="magrpo_tree", rollout__k=8, env__max_turns=4),
     "config.rollout: rollout mode 'magrpo_tree' with k=8 over max_turns=4 grows "
     r"k\*\*max_turns=4096 leaves per problem; expected at most 256"),
    (_edit(atgrpo_plan_path.get_config("mas_shared,cpu"), rollout__k=1),
     "config.rollout.k=1 puts one sample in every \\(problem, turn, agent\\) group of estimator "
     "'at_grpo'"),
])
def test_build_refuses_rollouts_that_only_give_zero_advantages(config, message):
  with pytest.raises(UserInputError, match=message) as info:
    config_lib.build(config)
  assert "\n" not in str(info.value)


def test_build_accepts_the_magrpo_tree_and_one_turn_magrpo():
  config_lib.build(_magrpo_game(rollout__mode="magrpo_tree", rollout__k=4, env__max_turns=2))
  config_lib.build(_magrpo_game(rollout__mode="magrpo_tree", rollout__k=2, env__max_turns=4,
                                algo__baseline="none"))
  config_lib.build(magrpo_tldr.get_config("cpu"))  # one turn, independent: G siblings at the root
