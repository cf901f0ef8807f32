"""Learned stopping (issue: learned orchestration, decision O5): the math 'learned_stop' workflow.

The coordinator's decisions are samples like any other: each lands in its own (problem, round,
coordinator) group and is credited with the episode it led to, team reward (alpha 1) minus
round_cost x rounds. Expected rewards and advantages are derived here from the decisions the
scripted team made (never from the env's reward code); with round_cost 0 a coordinator that stops
when the verifier approves gives exactly the fixed Dr. MAS loop's rewards.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from configs import orchestration_stop
from marl_jax.algos import batch as batch_lib
from marl_jax.algos.advantages import estimate
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema, stats
from marl_jax.training import config as config_lib
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Generation, Problem, RolloutConfig, rollout

CAP = 3


def _team(coordinator):
  """Solver wrong in round 1 and right from round 2; the verifier approves exactly the right
  answers; `coordinator(env) -> 'stop' | 'continue'`. Reads the state behind each prompt."""

  def generate(requests, policy_id, params):
    del policy_id, params
    out = []
    for r in requests:
      env = r.env
      if r.agent == "solver":
        answer = env.problem.answer if env.turn >= 1 else "-1"
        out.append(Generation(f"So the answer is \\boxed{{{answer}}}."))
      elif r.agent == "verifier":
        tag = "approve" if env.final_correct else "reject"
        out.append(Generation(f"Checked. <verify>{tag}</verify>"))
      else:
        out.append(Generation(f"Decision: #### {coordinator(env)}"))
    return out

  return generate


def _problems(workflow, n, **kwargs):
  return [Problem("math", dict(seed=s, workflow=workflow, max_turns=CAP, **kwargs), i)
          for i, s in enumerate(range(n))]


def _follow_verifier(env):
  return "stop" if "<verify>approve" in env.review else "continue"


def test_cost_zero_recovers_the_fixed_loop():
  """The fixed Dr. MAS loop (exit on approval; cap 3) against learned_stop with a coordinator
  that stops on approval: the same rounds, the same team and solver/verifier rewards; the
  orchestration channel is 0 at round_cost 0 and -cost x rounds otherwise."""
  spec = registry.workflow_spec("math", "drmas", max_turns=CAP)
  fixed = rollout(_problems("drmas", 3), spec, _team(None), None,
                  RolloutConfig(mode="independent", k=1))
  for cost in (0.0, 0.25):
    learned = rollout(_problems("learned_stop", 3, round_cost=cost),
                      registry.workflow_spec("math", "learned_stop", max_turns=CAP),
                      _team(_follow_verifier), None, RolloutConfig(mode="independent", k=1))
    for a, b in zip(fixed.episodes, learned.episodes):
      assert (a.solved, a.turns) == (b.solved, b.turns) == (True, 2)
      for channel in ("team", "agent:solver", "agent:verifier"):
        assert a.rewards[channel] == b.rewards[channel]
      assert b.rewards["orchestration"] == -cost * 2  # 2 solver rounds
      assert b.rewards["agent:coordinator"] == 0.0  # both decisions well formed
    rewards = defaultdict(list)
    for result in (fixed, learned):
      for s in result.samples:
        rewards[s.agent].append((s.reward, s.team_reward))
    assert rewards["solver"][:6] == rewards["solver"][6:]
    assert rewards["verifier"][:6] == rewards["verifier"][6:]
    assert rewards["coordinator"] == [(-cost * 2, 1.0)] * 6  # 2 decisions x 3 problems


@pytest.mark.parametrize("workflow, rounds", [("stop_by_verifier", 2), ("stop_at_cap", CAP)])
def test_fixed_exit_baselines_ignore_the_coordinator(workflow, rounds):
  """The learned_stop team with its exit fixed: whatever the coordinator replies (here: always
  stop, or no decision at all), the loop ends at the verifier's approval (round 2, as the 'drmas'
  loop) or at the cap; the coordinator is charged round_cost per round and never the format
  penalty, and its replies are recorded as `continue`."""
  cost = 0.1
  for reply in ("stop", "maybe"):
    result = rollout(_problems(workflow, 2, round_cost=cost),
                     registry.workflow_spec("math", workflow, max_turns=CAP),
                     _team(lambda env: reply), None, RolloutConfig(mode="independent", k=1))
    for episode in result.episodes:
      assert (episode.solved, episode.turns) == (True, rounds)
      assert episode.rewards["orchestration"] == pytest.approx(-cost * rounds)
      assert episode.rewards["agent:coordinator"] == 0.0
      decided = [e for e in episode.trace["events"] if e["type"] == "orchestrator_decision"
                 and "decision" in e]
      assert [e["decision"] for e in decided] == ["continue"] * (rounds - 1)


def test_decisions_get_nonzero_correctly_grouped_advantages():
  """2 problems x 4 independent trajectories, a coordinator deciding at random: each decision's
  advantage is the drmas estimator's over its (problem, round) group of coordinator decisions,
  with the reward derived here: solved (last solver answer is from round >= 2) - cost x rounds."""
  cost, k = 0.1, 4
  rng = random.Random(0)
  result = rollout(_problems("learned_stop", 2, round_cost=cost),
                   registry.workflow_spec("math", "learned_stop", max_turns=CAP),
                   _team(lambda env: rng.choice(["stop", "continue"])), None,
                   RolloutConfig(mode="independent", k=k))
  samples = result.samples
  rounds = defaultdict(int)
  for s in samples:
    rounds[s.traj_id] += s.agent == "solver"
  # The episode a decision led to, by hand: right iff the solver got a second round.
  want_r = np.array([float(rounds[s.traj_id] >= 2) - cost * rounds[s.traj_id]
                     if s.agent == "coordinator" else np.nan for s in samples])
  is_dec = np.array([s.agent == "coordinator" for s in samples])
  got_r = np.array([s.reward + s.team_reward for s in samples])  # alpha = 1
  np.testing.assert_allclose(got_r[is_dec], want_r[is_dec], rtol=0, atol=1e-12)

  c = orchestration_stop.get_config("cpu")
  cfg = config_lib.build(c).advantage
  spec = registry.workflow_spec("math", "learned_stop", max_turns=CAP)
  batch = batch_lib.make_batch(
      [s.reward for s in samples], problem_id=[s.problem_id for s in samples],
      turn=[s.turn for s in samples], agent_id=[s.agent_id for s in samples],
      team_rewards=[s.team_reward for s in samples])
  space = batch_lib.GroupSpace(num_problems=2, max_turns=CAP, num_agents=len(spec.agents))
  adv = np.asarray(estimate(batch, cfg, space).advantages)[:, 0]

  groups = defaultdict(list)
  for i, s in enumerate(samples):
    if s.agent == "coordinator":
      groups[(s.problem_id, s.turn)].append(i)
  assert {turn for _, turn in groups} == {0, 1}  # no decision in the capped last round
  nonzero = 0
  for members in groups.values():
    r = want_r[members]
    if len(r) == 1:  # Dr. MAS: a singleton group has mean 0 and std 1
      want = r
    else:
      want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[members], want, rtol=1e-5, atol=1e-6)
    nonzero += int(np.any(np.abs(want) > 0.1))
  assert nonzero >= 2  # the decisions carry a learning signal

  # Traces: one orchestrator_decision per decision, replay exact, stats counted by hand.
  for episode in result.episodes:
    schema.validate(episode.trace)
    assert replay_lib.replay(episode.trace, episode.content) == []
  summary = stats.summarize(e.trace for e in result.episodes)["decisions"]
  decided = [s for s in samples if s.agent == "coordinator"]
  stop = sum("#### stop" in s.generation.text for s in decided)
  assert (summary["decisions"], summary["stop"]) == (len(decided), stop)
  # The solver is wrong only in round 1, so every continue after round 1 is fixed in round 2.
  # A stop after round 1 is wrong; it is premature on a problem where a sibling continued after
  # round 1, unjudged where none did. Over-run: continued after round 2 (right).
  first_stops = [s for s in decided if s.turn == 0 and "#### stop" in s.generation.text]
  continued = {s.problem_id for s in decided
               if s.turn == 0 and "#### continue" in s.generation.text}
  assert summary["wrong_stops"] == len(first_stops)
  assert summary["premature_stops"] == sum(s.problem_id in continued for s in first_stops)
  assert summary["wrong_stops_unjudged"] == sum(s.problem_id not in continued for s in first_stops)
  assert summary["continues_from_wrong"] == summary["later_round_fixes"] == sum(
      s.turn == 0 and "#### continue" in s.generation.text for s in decided)
  assert summary["over_runs"] == sum("#### continue" in s.generation.text and s.turn == 1
                                     for s in decided)


def test_decision_rewards_need_independent_rollouts():
  with pytest.raises(ValueError, match=r"settles decision rewards .* use rollout mode "
                     r"'independent'$"):
    rollout(_problems("learned_stop", 1), registry.workflow_spec("math", "learned_stop"),
            _team(_follow_verifier), None, RolloutConfig(mode="tree", k=2))
  with pytest.raises(ValueError, match="round_cost / premature_penalty price the learned_stop"):
    registry.make_env("math", seed=0, workflow="drmas", round_cost=0.1)
