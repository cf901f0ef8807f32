"""Learned stopping (issue: learned orchestration, decision O5): the math 'learned_stop' workflow
and 'learned_stop_checked', where a checker's program (run in the sandbox) reviews each answer.

The coordinator's decisions are samples like any other: each lands in its own (problem, round,
coordinator) group and is credited with the episode it led to, team reward (alpha 1) minus
round_cost x rounds. Expected rewards and advantages are derived here from the decisions the
scripted team made (never from the env's reward code); with round_cost 0 a coordinator that stops
when the verifier approves (the checker's output matches) gives exactly the fixed loop's rewards.
"""

from __future__ import annotations

import dataclasses
import fractions
import itertools
import random
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from configs import orchestration_stop
from marl_jax.algos import batch as batch_lib
from marl_jax.algos.advantage_config import estimate
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema, stats
from marl_jax.envs.math.orchestration_stop import CheckedStopMathEnv, decision
from marl_jax.training import config as config_lib
from marl_jax.training import setup
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Generation, Problem, RolloutConfig, rollout

CAP = 3


def _second_round_right(env):
  return env.turn >= 1


def _team(coordinator, checker_code=None, right=_second_round_right):
  """Solver right when `right(env)` (default: wrong in round 1 and right from round 2); the
  verifier approves exactly the right answers; the checker's program prints the true answer (or
  `checker_code`); `coordinator(env) -> 'stop' | 'continue'`. Reads the state behind each
  prompt."""

  def generate(requests, policy_id, params):
    del policy_id, params
    out = []
    for r in requests:
      env = r.env
      if r.agent == "solver":
        answer = env.problem.answer if right(env) else "-1"
        out.append(Generation(f"So the answer is \\boxed{{{answer}}}."))
      elif r.agent == "verifier":
        tag = "approve" if env.final_correct else "reject"
        out.append(Generation(f"Checked. <verify>{tag}</verify>"))
      elif r.agent == "checker":
        code = checker_code or f"print({env.problem.answer})"
        out.append(Generation(f"```python\n{code}\n```"))
      else:
        out.append(Generation(f"Decision: #### {coordinator(env)}"))
    return out

  return generate


def _problems(workflow, n, **kwargs):
  return [Problem("math", dict(seed=s, workflow=workflow, max_turns=CAP, **kwargs), i)
          for i, s in enumerate(range(n))]


def _z(r):
  """A group's advantages as at_grpo scores them: z-scores with the unbiased std (eps 1e-6);
  a singleton has nothing to compare with and gets 0."""
  return np.zeros(1) if len(r) == 1 else (r - r.mean()) / (r.std(ddof=1) + 1e-6)


def _follow_verifier(env):
  return "stop" if "<verify>approve" in env.review else "continue"


def _follow_check(env):
  return "stop" if env.review.endswith(" matches it.") else "continue"


def _rollout(workflow, coordinator, n=3, k=1, checker_code=None, right=_second_round_right,
             **kwargs):
  return rollout(_problems(workflow, n, **kwargs),
                 registry.workflow_spec("math", workflow, max_turns=CAP),
                 _team(coordinator, checker_code, right), None,
                 RolloutConfig(mode="independent", k=k))


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


def test_cost_zero_recovers_the_fixed_checked_loop():
  """The program-checked loop: stop_by_check (stop when the answer matches the program's output)
  against learned_stop_checked with a coordinator that follows the check: at round_cost 0 the
  same rounds and the same rewards on every channel, the orchestration channel 0 included."""
  fixed = _rollout("stop_by_check", lambda env: "maybe")
  for cost in (0.0, 0.25):
    learned = _rollout("learned_stop_checked", _follow_check, round_cost=cost)
    for a, b in zip(fixed.episodes, learned.episodes):
      assert (a.solved, a.turns) == (b.solved, b.turns) == (True, 2)
      for channel in ("team", "agent:solver", "agent:checker", "agent:coordinator"):
        assert a.rewards[channel] == b.rewards[channel]
      assert a.rewards["orchestration"] == 0.0
      assert b.rewards["orchestration"] == -cost * 2
    if cost == 0.0:
      assert ([(s.agent, s.reward, s.team_reward) for s in fixed.samples]
              == [(s.agent, s.reward, s.team_reward) for s in learned.samples])


def test_checker_review_and_format_penalty():
  """The coordinator reads the program's output and whether the answer matches it, the outcome
  again as its prompt's last line (and as its observed state); a program that prints nothing is
  a format error of the checker (-0.1 each round), and stop_by_check then runs to the cap, since
  nothing matches."""
  env = registry.make_env("math", seed=0, workflow="learned_stop_checked")
  answer = env.problem.answer
  env.step("solver", "\\boxed{-1}")
  env.step("checker", f"```python\nprint({answer})\n```", tool_output=f"{answer}\n")
  assert env.observe("coordinator").user.endswith(
      f"```python\nprint({answer})\n```\nThe program printed: {answer}. The proposed answer -1 "
      "does not match it.\nRounds left after this one: 2.\nCheck result: mismatch.")
  assert env.observe("coordinator").state == 0
  matched = registry.make_env("math", seed=0, workflow="learned_stop_checked")
  matched.step("solver", f"\\boxed{{{answer}}}")
  matched.step("checker", f"```python\nprint({answer})\n```", tool_output=f"{answer}\n")
  shown = matched.observe("coordinator")
  assert shown.user.endswith("matches it.\nRounds left after this one: 2.\nCheck result: match.")
  assert shown.state == 1
  silent = _rollout("stop_by_check", _follow_check, n=1, checker_code="x = 1")
  episode, = silent.episodes
  assert episode.turns == CAP and episode.solved
  assert episode.rewards["agent:checker"] == pytest.approx(-0.1 * (CAP - 1))
  with pytest.raises(ValueError, match="the checker's step needs its program's stdout"):
    registry.make_env("math", seed=0, workflow="learned_stop_checked").step("checker", "x")


@pytest.mark.parametrize("level", ["one_step", "multi_step"])
def test_checker_demonstration_prints_the_answer(level):
  """The warm-start's checker program, run by Python here, prints the problem's answer exactly
  (fractions included); the coordinator's demonstrated reply copies the check result line, and
  its decision is the same whether the answer is right or wrong; its round-1 and round-2
  decisions take all four combinations (no decision fixes the other)."""
  decisions = set()
  for seed in range(30):
    wrong = registry.make_env("math", seed=seed, level=level, workflow="learned_stop_checked")
    answer = wrong.problem.answer
    code = wrong.demonstration("checker").removeprefix("```python\n").removesuffix("\n```")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True).stdout.strip()
    assert fractions.Fraction(out) == fractions.Fraction(answer), (seed, code)
    right = wrong.clone()
    for env, proposed in ((wrong, "-1"), (right, answer)):
      env.step("solver", f"\\boxed{{{proposed}}}")
      env.step("checker", right.demonstration("checker"), tool_output=out)
    assert (wrong.match, right.match) == (False, True)
    shown = right.demonstration("coordinator")
    assert shown.startswith("Check result: match.\n#### ")
    assert wrong.demonstration("coordinator") == shown.replace("match", "mismatch", 1)
    right.step("coordinator", "#### continue")
    right.step("solver", f"\\boxed{{{answer}}}")
    right.step("checker", right.demonstration("checker"), tool_output=out)
    decisions.add((decision(shown), decision(right.demonstration("coordinator"))))
  assert decisions == set(itertools.product(["stop", "continue"], repeat=2))


@pytest.mark.parametrize("workflow, decisions", [
    ("stop_by_verifier", ["continue"]),  # the verifier's approval in round 2 ends the loop
    ("stop_at_cap", ["continue", "continue"]),
    ("stop_by_check", ["continue", "stop"]),  # round 2's answer matches the program's output
    ("stop_at_cap_checked", ["continue", "continue"])])
def test_fixed_exit_baselines_ignore_the_coordinator(workflow, decisions):
  """The learned_stop teams with their exit fixed: whatever the coordinator replies (here: always
  stop, or no decision at all), the loop ends at the verifier's approval or the program check's
  match (round 2) or at the cap; the coordinator is charged round_cost per round and never the
  format penalty, and its replies are recorded as the fixed rule's decisions."""
  cost = 0.1
  rounds = 2 if decisions[-1] == "stop" or len(decisions) == 1 else CAP
  for reply in ("stop", "maybe"):
    result = _rollout(workflow, lambda env: reply, n=2, round_cost=cost)
    for episode in result.episodes:
      assert (episode.solved, episode.turns) == (True, rounds)
      assert episode.rewards["orchestration"] == pytest.approx(-cost * rounds)
      assert episode.rewards["agent:coordinator"] == 0.0
      decided = [e for e in episode.trace["events"] if e["type"] == "orchestrator_decision"
                 and "decision" in e]
      assert [e["decision"] for e in decided] == decisions


@pytest.mark.parametrize("workflow, preset", [("learned_stop", "cpu"),
                                              ("learned_stop_checked", "program,cpu")])
def test_decisions_get_nonzero_correctly_grouped_advantages(workflow, preset):
  """2 problems x 4 independent trajectories, a coordinator deciding at random: each decision's
  advantage is the preset's estimator over its group of coordinator decisions, with the reward
  derived here: solved (last solver answer is from round >= 2) - cost x rounds. The verifier
  loop: drmas over (problem, round), a singleton keeping its reward; the program-checked loop:
  at_grpo over (round, whether the answer matched the check), pooled over the problems, a
  singleton getting 0 (configs/orchestration_stop.py). The checker prints the true answer, so
  the answer matches exactly from round 2 on."""
  cost, k = 0.1, 4
  rng = random.Random(0)
  c = orchestration_stop.get_config(preset)
  assert c.env.workflow == workflow
  result = _rollout(workflow, lambda env: rng.choice(["stop", "continue"]), n=2, k=k,
                    round_cost=cost)
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

  cfg = config_lib.build(c).advantage
  checked = workflow == "learned_stop_checked"
  assert (cfg.estimator, cfg.group_by) == (("at_grpo", "turn_agent_state") if checked
                                           else ("drmas", "problem_turn_agent"))
  spec = registry.workflow_spec("math", workflow, max_turns=CAP)
  batch = batch_lib.make_batch(
      [s.reward for s in samples], problem_id=[s.problem_id for s in samples],
      turn=[s.turn for s in samples], agent_id=[s.agent_id for s in samples],
      team_rewards=[s.team_reward for s in samples], state=[s.state for s in samples])
  space = batch_lib.GroupSpace(num_problems=2, max_turns=CAP, num_agents=len(spec.agents),
                               num_states=spec.num_states)
  adv = np.asarray(estimate(batch, cfg, space).advantages)[:, 0]

  groups = defaultdict(list)
  for i, s in enumerate(samples):
    if s.agent == "coordinator":
      groups[(s.turn, s.turn >= 1) if checked else (s.turn, s.problem_id)].append(i)
  assert {key[0] for key in groups} == {0, 1}  # no decision in the capped last round
  nonzero = 0
  for members in groups.values():
    r = want_r[members]
    # Dr. MAS: a singleton group has mean 0 and std 1, so it keeps its reward
    want = r if len(r) == 1 and not checked else _z(r)
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
  assert ("by_state" in summary) == checked  # only a workflow with states records them


def test_state_matched_groups_compare_decisions_after_the_same_review():
  """A solver right or wrong at random in every round, so trajectories of one problem reach a
  round with and without a matching check: each coordinator sample's state is, derived here,
  whether the last answer equals the true answer (the checker prints it); through the trainer's
  rows, at_grpo over (problem, round, state) gives each decision its advantage among the
  decisions after the same review, a singleton 0; and those differ from (problem, round)
  groups' wherever a round mixed both reviews."""
  cost, k, n = 0.1, 4, 3
  rng = random.Random(3)
  result = _rollout("learned_stop_checked", lambda env: rng.choice(["stop", "continue"]), n=n,
                    k=k, right=lambda env: rng.random() < 0.5, round_cost=cost)
  samples = result.samples
  last, rounds, want_state, want_r = {}, defaultdict(int), [], []
  for s in samples:  # a trajectory's samples come in acting order
    if s.agent == "solver":
      last[s.traj_id] = "-1" not in s.generation.text
      rounds[s.traj_id] += 1
    want_state.append(int(last[s.traj_id]) if s.agent == "coordinator" else 0)
  for s in samples:
    t = s.traj_id
    want_r.append(float(last[t]) - cost * rounds[t] if s.agent == "coordinator" else np.nan)
  assert [s.state for s in samples] == want_state
  want_r = np.array(want_r)
  # The traces record each decision's state; stats counts the decisions per state.
  by_state = defaultdict(lambda: defaultdict(int))
  for i, s in enumerate(samples):
    if s.agent == "coordinator":
      by_state[str(want_state[i])]["stop" if "#### stop" in s.generation.text else "continue"] += 1
  assert len(by_state) == 2
  summary = stats.summarize(e.trace for e in result.episodes)["decisions"]
  assert summary["by_state"] == {k: dict(v) for k, v in by_state.items()}

  c = orchestration_stop.get_config("program,cpu")
  c.rollout.k, c.rollout.problems_per_step = k, n
  c.algo.group_by = "problem_turn_agent_state"  # the preset pools them over problems
  built = config_lib.build(c)
  shape = setup.batch_shape(c, built.spec, shards=1)
  assert shape.space.num_states == 2
  rows = batch_lib.round_rows(len(samples))
  batch = batch_lib.build_rows(samples, shape, pad_id=0, rows=rows, width=32, resp_width=16)
  np.testing.assert_array_equal(batch.samples.state[:len(samples)], want_state)
  # Scripted replies have no tokens; one each, so no sample is dropped as empty.
  rows_batch = batch.samples.replace(token_mask=np.ones_like(batch.samples.token_mask))
  out = estimate(rows_batch, built.advantage, shape.space)
  adv = np.asarray(out.advantages)[:len(samples), 0]

  by_state, by_round = defaultdict(list), defaultdict(list)
  for i, s in enumerate(samples):
    if s.agent == "coordinator":
      by_state[(s.problem_id, s.turn, want_state[i])].append(i)
      by_round[(s.problem_id, s.turn)].append(i)
  mixed = [key for key, members in by_round.items()
           if len({want_state[i] for i in members}) == 2]
  assert mixed  # some round saw both reviews, so the state split matters
  for members in by_state.values():
    np.testing.assert_allclose(adv[members], _z(want_r[members]), rtol=1e-5, atol=1e-6)
  round_adv = {}
  for members in by_round.values():
    round_adv.update(zip(members, _z(want_r[members])))
  assert any(abs(adv[i] - round_adv[i]) > 0.1 for key in mixed for i in by_round[key])
  assert np.any(np.abs(adv[np.isfinite(want_r)]) > 0.1)


def test_observed_state_outside_the_workflows_states_is_refused(monkeypatch):
  """An env whose observation names a state the workflow does not declare fails the rollout with
  the env, agent and value named, instead of training on a group id past its range."""
  real = CheckedStopMathEnv.observe
  monkeypatch.setattr(CheckedStopMathEnv, "observe",
                      lambda self, agent: dataclasses.replace(real(self, agent), state=2))
  with pytest.raises(ValueError, match=r"CheckedStopMathEnv.observe\('solver'\) gave state 2; "
                     r"expected an int in \[0, 2\)"):
    _rollout("learned_stop_checked", _follow_check, n=1)


@pytest.mark.parametrize("group_by", ["problem_turn_agent_state", "turn_agent_state"])
def test_state_matched_groups_need_a_workflow_with_states(group_by):
  c = orchestration_stop.get_config("cpu")
  c.algo.estimator, c.algo.group_by = "at_grpo", group_by
  with pytest.raises(ValueError, match="workflow 'learned_stop' declares none"):
    config_lib.build(c)


def test_pooled_state_groups_refuse_dynamic_sampling():
  """DAPO refills keep whole problems by their own groups; pooled groups have none."""
  c = orchestration_stop.get_config("full,program,cpu")
  c.algo.group_by, c.algo.filter, c.rollout.max_refills = "turn_agent_state", "zero_variance", 2
  with pytest.raises(ValueError, match=r"group_by='turn_agent_state' pools the step's problems"):
    config_lib.build(c)
  c.rollout.max_refills = 0  # the device filter alone drops constant pooled groups
  assert config_lib.build(c).advantage.group_by == "turn_agent_state"


def test_decision_rewards_need_independent_rollouts():
  with pytest.raises(ValueError, match=r"^rollout.mode='tree': 'math' credits decisions .* "
                     r"expected rollout.mode='independent'$"):
    rollout(_problems("learned_stop", 1), registry.workflow_spec("math", "learned_stop"),
            _team(_follow_verifier), None, RolloutConfig(mode="tree", k=2))
  with pytest.raises(ValueError, match="round_cost / premature_penalty price the learned_stop"):
    registry.make_env("math", seed=0, workflow="drmas", round_cost=0.1)
