"""Learned spawning and aggregation (issue: learned orchestration, O1/O4): the math 'spawn'
workflow. The dispatcher's `#### N` runs exactly N solvers, the aggregator sees their answers, and
the dispatcher's decision is credited with team reward - spawn_cost x N; expected values are
derived here from the scripted team's choices, not from the env's reward code."""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict

import numpy as np
import pytest

from configs import orchestration_spawn
from marl_jax.algos import batch as batch_lib
from marl_jax.algos.advantage_config import estimate
from marl_jax.envs.math import orchestration_spawn as spawn_env
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


def _dispatcher_groups(result, spec, preset: str, num_problems: int):
  """The config's estimator over the rollout's samples; per problem, the dispatcher's
  (sample, advantage) pairs."""
  cfg = config_lib.build(orchestration_spawn.get_config(preset)).advantage
  samples = result.samples
  batch = batch_lib.make_batch(
      [s.reward for s in samples], problem_id=[s.problem_id for s in samples],
      turn=[s.turn for s in samples], agent_id=[s.agent_id for s in samples],
      team_rewards=[s.team_reward for s in samples])
  space = batch_lib.GroupSpace(num_problems=num_problems, max_turns=1,
                               num_agents=len(spec.agents))
  adv = np.asarray(estimate(batch, cfg, space).advantages)[:, 0]
  return [[(s, adv[i]) for i, s in enumerate(samples)
           if s.agent == "dispatcher" and s.problem_id == p] for p in range(num_problems)]


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

  groups = _dispatcher_groups(result, spec, "cpu", num_problems=3)
  assert all(len(members) == k for members in groups)  # the problem's K decisions form one group
  nonzero = 0
  for members in groups:
    r = np.array([_solved(spawned[s.traj_id]) - cost * spawned[s.traj_id] for s, _ in members])
    adv = np.array([a for _, a in members])
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std(ddof=1) + 1e-6), rtol=1e-5,
                               atol=1e-6)
    nonzero += int(np.any(np.abs(adv) > 0.1))
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
  assert summary["by_spawned"] == {str(n): {"episodes": ns.count(n), "success": _solved(n)}
                                   for n in sorted(set(ns))}


def test_spawn_count_parsing_and_spec():
  assert spawn_env.spawn_count("I pick #### 3") == 3
  assert spawn_env.spawn_count("#### 2 then #### 4") == 4  # the last one
  assert spawn_env.spawn_count("#### 0") is None and spawn_env.spawn_count("#### 5") is None
  assert spawn_env.spawns("no number") == ("worker_1",)
  assert spawn_env.spawns("#### 3") == ("worker_1", "worker_2", "worker_3")
  env = registry.make_env("math", seed=0, workflow="spawn")
  result = env.step("dispatcher", "many")  # no N: one worker, the format penalty
  assert result.info["spawn"] == ["worker_1"] and result.rewards == {"dispatcher": -0.1}
  with pytest.raises(ValueError, match="'worker_2' was not spawned"):
    env.step("worker_2", "\\boxed{1}")
  for bad in [("w3",), ("w1", "w1"), ("agg",), ()]:
    spec = WorkflowSpec(("d", "w1", "w2", "agg"), kind="spawn", max_turns=1,
                        spawn=lambda r, bad=bad: bad)
    with pytest.raises(ValueError, match=rf"spawn\(\) returned {re.escape(repr(bad))}; "
                                         r"expected a non-empty subset of the workers"):
      advance(spec, Cursor(0, "d"), "x", False)
  spec = WorkflowSpec(("d", "w1", "w2", "agg"), kind="spawn", max_turns=1,
                      spawn=lambda r: ("w2", "w1"))
  assert advance(spec, Cursor(0, "d"), "x", False) == Cursor(0, "w1", ("w2",))  # worker order
  with pytest.raises(ValueError, match="a spawn workflow needs spawn"):
    WorkflowSpec(("d", "agg"), kind="spawn", spawn=lambda r: 1)
  with pytest.raises(ValueError, match="price the spawn and delegate workflows"):
    registry.make_env("math", seed=0, workflow="drmas", spawn_cost=0.2)
  with pytest.raises(ValueError, match="latency_cost.*must be >= 0"):
    registry.make_env("math", seed=0, workflow="delegate", latency_cost=-1.0)


# Delegation (O2): the dispatcher names specialists. Scripted: 'concise' answers wrong, the others
# right; each specialist's reply has its own length; the aggregator gives the answer more solvers
# gave ('-1' on a tie).
LENGTHS = {"stepwise": 1500, "concise": 40, "checker": 900, "casework": 600}  # padding characters


def _reply(name: str, answer: str) -> str:
  return "x" * LENGTHS[name] + f" \\boxed{{{answer}}}"


def _delegating_team(choose):
  def generate(requests, policy_id, params):
    del policy_id, params
    out = []
    for r in requests:
      env = r.env
      if r.agent == "dispatcher":
        out.append(Generation("This needs: #### " + ", ".join(choose())))
      elif r.agent == "aggregator":
        votes = Counter(env.answers.values()).most_common()
        tie = len(votes) > 1 and votes[0][1] == votes[1][1]
        out.append(Generation(f"\\boxed{{{'-1' if tie else votes[0][0]}}}"))
      else:
        out.append(Generation(_reply(r.agent, "-1" if r.agent == "concise"
                                     else env.problem.answer)))
    return out

  return generate


def test_delegate_routes_to_the_named_specialists_and_prices_their_wall_clock():
  spawn_cost, latency_cost, bonus, k = 0.1, 0.2, 0.5, 4
  names = ("stepwise", "concise", "checker", "casework")  # the env's specialists, in order
  rng = random.Random(3)
  picks = iter([rng.sample(names, rng.randint(1, 4)) for _ in range(3 * k)])
  spec = registry.workflow_spec("math", "delegate")
  assert spec.agents == ("dispatcher", *names, "aggregator")
  problems = [Problem("math", dict(seed=s, workflow="delegate", spawn_cost=spawn_cost,
                                   latency_cost=latency_cost, aggregation_bonus=bonus), s)
              for s in range(3)]
  result = rollout(problems, spec, _delegating_team(lambda: next(picks)), None,
                   RolloutConfig(mode="independent", k=k))
  by_traj = defaultdict(list)
  for s in result.samples:
    by_traj[s.traj_id].append(s)
  chosen, expected = {}, {}
  for traj, samples in by_traj.items():
    named = samples[0].generation.text.rsplit("#### ", 1)[1].split(", ")
    team = [n for n in names if n in named]  # they act in the env's order, not the reply's
    chosen[traj] = team
    assert [s.agent for s in samples] == ["dispatcher", *team, "aggregator"]
    for s in samples[1:-1]:  # each specialist is prompted as itself
      assert s.messages[0]["content"] == spawn_env.SPECIALISTS[s.agent][1]
    right, wrong = sum(n != "concise" for n in team), int("concise" in team)
    solved = float(right > wrong)
    lengths = [len(s.generation.text) for s in samples[1:-1]]  # the scripted replies' lengths
    assert all(s.team_reward == solved for s in samples)
    decision = -spawn_cost * len(team) - latency_cost * max(lengths) / 1000
    assert samples[0].reward == pytest.approx(decision)
    assert samples[-1].reward == pytest.approx(bonus * solved)  # solved: a right answer kept
    expected[traj] = (solved + decision, sum(lengths) / max(lengths))
  assert len({len(t) for t in chosen.values()}) >= 3  # the scripted dispatcher varied its choice

  for members in _dispatcher_groups(result, spec, "delegate,cpu", num_problems=3):
    assert len(members) == k
    r = np.array([expected[s.traj_id][0] for s, _ in members])
    adv = np.array([a for _, a in members])
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std(ddof=1) + 1e-6), rtol=1e-5,
                               atol=1e-6)
    assert np.any(np.abs(adv) > 0.1)  # distinct picks, distinct costs

  for episode in result.episodes:
    trace = episode.trace
    schema.validate(trace)
    assert replay_lib.replay(trace, episode.content) == []
    team = chosen[episode.traj_id]
    assert sorted(e["to"] for e in trace["events"] if e["type"] == "spawn") == sorted(team)
    aggregate = next(e for e in trace["events"] if e["type"] == "aggregate")
    assert aggregate["speedup"] == pytest.approx(expected[episode.traj_id][1])
  summary = stats.summarize(e.trace for e in result.episodes)["decisions"]
  assert summary["spawned_to"] == dict(sorted(Counter(n for t in chosen.values()
                                                      for n in t).items()))
  assert summary["mean_speedup"] == pytest.approx(
      np.mean([expected[e.traj_id][1] for e in result.episodes]))
  everyone = sum(t == list(names) for t in chosen.values())
  assert summary.get(f"delegate {','.join(names)}", 0) == everyone


def test_delegation_parsing():
  assert spawn_env.delegated("I need #### checker, stepwise") == ("stepwise", "checker")
  assert spawn_env.delegated("#### casework and Concise") == ("concise", "casework")
  assert spawn_env.delegated("#### stepwise, wizard") is None  # an unknown name
  assert spawn_env.delegated("#### ") is None and spawn_env.delegated("stepwise") is None
  assert spawn_env.delegates("nothing") == ("stepwise",)
  env = registry.make_env("math", seed=0, workflow="delegate")
  result = env.step("dispatcher", "all of them")  # no names: 'stepwise', the format penalty
  assert result.info["spawn"] == ["stepwise"] and result.rewards == {"dispatcher": -0.1}


def test_costs_of_zero_leave_the_task_reward_alone():
  """The same delegations priced and unpriced: with spawn_cost, latency_cost and
  aggregation_bonus all 0 every call's reward is the fixed team's (the team reward: solved, and
  no local term for well-formed replies) and the orchestration channel is 0; pricing changes the
  dispatcher's and aggregator's local rewards only, by the amounts derived here."""
  names = ("stepwise", "concise", "checker", "casework")
  rng = random.Random(5)
  picks = [rng.sample(names, rng.randint(1, 4)) for _ in range(2 * 3)]
  spec = registry.workflow_spec("math", "delegate")

  def run(**costs):
    problems = [Problem("math", dict(seed=s, workflow="delegate", **costs), s) for s in range(2)]
    it = iter(picks)
    return rollout(problems, spec, _delegating_team(lambda: next(it)), None,
                   RolloutConfig(mode="independent", k=3))

  free = run(spawn_cost=0.0, latency_cost=0.0, aggregation_bonus=0.0)
  priced = run(spawn_cost=0.1, latency_cost=0.2, aggregation_bonus=0.5)
  assert len({len(p) for p in picks}) >= 2
  for a, b in zip(free.episodes, priced.episodes):
    assert a.rewards["orchestration"] == 0.0
    assert b.rewards["team"] == a.rewards["team"]
  for a, b in zip(free.samples, priced.samples, strict=True):
    assert (a.agent, a.traj_id, a.generation.text) == (b.agent, b.traj_id, b.generation.text)
    assert a.reward == 0.0 and a.team_reward == b.team_reward
    if a.agent == "dispatcher":
      team = [s for s in free.samples if s.traj_id == a.traj_id][1:-1]
      longest = max(len(s.generation.text) for s in team)
      assert b.reward == pytest.approx(-0.1 * len(team) - 0.2 * longest / 1000)
    elif a.agent == "aggregator":
      assert b.reward == pytest.approx(0.5 * a.team_reward)  # right answers kept when solved
    else:
      assert b.reward == 0.0


def test_plurality_counts_equivalent_answers_together_and_keeps_the_first_on_a_tie():
  assert spawn_env.plurality(["3", "0.5", "1/2", None, "3"]) == "3"  # 2 against 2: "3" came first
  assert spawn_env.plurality(["3", "0.5", "1/2"]) == "0.5"  # "1/2" votes with "0.5"
  assert spawn_env.plurality([None, "7"]) == "7"
  assert spawn_env.plurality([None, None]) is None


@pytest.mark.parametrize("workflow", ["spawn_vote", "delegate_vote"])
def test_vote_workflows_answer_with_the_workers_plurality(workflow):
  """The same team as the learned-aggregator workflow (so the same checkpoint loads), with an
  aggregator that always answers wrong and gives no `\\boxed{}`: the vote ignores it, so an
  episode is solved exactly when the workers' plurality is right (derived here: worker answers in
  order, one wrong answer first), the aggregator is not penalised, and the learned workflow
  on the same replies solves nothing."""
  base = workflow.removesuffix("_vote")
  assert registry.workflow_spec("math", workflow).agents == registry.workflow_spec(
      "math", base).agents
  rng = random.Random(2)
  names = list(spawn_env.SPECIALISTS)
  picks = [rng.randint(1, 4) for _ in range(6)]  # 3 problems x K = 2, the same in both runs
  choices = iter(())

  def generate(requests, policy_id, params):
    del policy_id, params
    out = []
    for r in requests:
      if r.agent == "dispatcher":
        n = next(choices)
        out.append(Generation("#### " + (str(n) if base == "spawn" else ", ".join(names[:n]))))
      elif r.agent == "aggregator":
        out.append(Generation("I would say -5."))
      else:
        first = r.agent in ("worker_1", names[0])
        out.append(Generation(f"\\boxed{{{'-1' if first else r.env.problem.answer}}}"))
    return out

  results = {}
  for name in (workflow, base):
    choices = iter(picks)
    problems = [Problem("math", dict(seed=s, workflow=name), s) for s in range(3)]
    results[name] = rollout(problems, registry.workflow_spec("math", name), generate, None,
                            RolloutConfig(mode="independent", k=2))
  voted = results[workflow]
  ns = []
  for episode in voted.episodes:
    n = sum(e["type"] == "spawn" for e in episode.trace["events"])
    ns.append(n)
    # one wrong answer, then n - 1 right ones: the right answer wins from n = 3 (a 1-1 tie goes
    # to the wrong one, given first)
    assert episode.solved == (n >= 3)
    assert episode.rewards["agent:aggregator"] == 0.0  # its reply is not read
  assert {n >= 3 for n in ns} == {True, False}
  assert not any(e.solved for e in results[base].episodes)  # the aggregator's "-5" is unboxed


@pytest.mark.parametrize("workflow", ["spawn_vote", "spawn_checked"])
def test_fixed_pick_workflows_refuse_an_aggregation_bonus(workflow):
  pick = workflow.removeprefix("spawn_").removesuffix("ed")
  with pytest.raises(ValueError, match=r"aggregation_bonus=0.5 rewards the aggregator's choice; "
                     f"with the fixed pick '{pick}'"):
    registry.make_env("math", seed=0, workflow=workflow, level="equation",
                      aggregation_bonus=0.5)


def test_checked_pick_needs_problems_with_a_check():
  """Generated problems default to the equation level; another level has no check."""
  assert registry.make_env("math", seed=0, workflow="spawn_checked").problem.check
  with pytest.raises(ValueError, match="has no check to verify answers with"):
    registry.make_env("math", seed=0, workflow="spawn_checked", level="one_step")
  with pytest.raises(ValueError, match="has no check to verify answers with"):
    registry.make_env("math", workflow="spawn_checked",
                      problem={"question": "1 + 1?", "answer": "2"})


def test_checked_pick_answers_with_the_first_worker_that_passes_the_check():
  """spawn_checked on equation problems: worker_1 answers wrong, the others right, and the
  aggregator's reply is unread. The first passing answer wins, so an episode is solved exactly
  when 2 or more solvers were spawned (derived here); the plurality vote on the same replies
  needs 3 (a 1-1 tie goes to the wrong answer, given first); with every worker wrong the pick
  falls back to their plurality."""
  rng = random.Random(5)
  picks = [rng.randint(1, 4) for _ in range(8)]  # 4 problems x K = 2
  choices, wrong = iter(()), ()

  def generate(requests, policy_id, params):
    del policy_id, params
    out = []
    for r in requests:
      if r.agent == "dispatcher":
        out.append(Generation(f"#### {next(choices)}"))
      elif r.agent == "aggregator":
        out.append(Generation("\\boxed{-5}"))
      else:
        bad = r.agent in wrong
        out.append(Generation(f"\\boxed{{{'-1' if bad else r.env.problem.answer}}}"))
    return out

  solved = {}
  for name, wrong in (("spawn_checked", ("worker_1",)), ("spawn_vote", ("worker_1",)),
                      ("spawn_checked", tuple(f"worker_{i}" for i in range(1, 5)))):
    choices = iter(picks)
    problems = [Problem("math", dict(seed=s, workflow=name, level="equation"), s)
                for s in range(4)]
    result = rollout(problems, registry.workflow_spec("math", name), generate, None,
                     RolloutConfig(mode="independent", k=2))
    spawned = [sum(e["type"] == "spawn" for e in ep.trace["events"]) for ep in result.episodes]
    assert sorted(spawned) == sorted(picks)
    solved[name, len(wrong)] = [(n, ep.solved) for n, ep in zip(spawned, result.episodes)]
    assert all(ep.rewards["agent:aggregator"] == 0.0 for ep in result.episodes)
  assert all(ok == (n >= 2) for n, ok in solved["spawn_checked", 1])
  assert all(ok == (n >= 3) for n, ok in solved["spawn_vote", 1])
  assert {n for n, _ in solved["spawn_checked", 1]} >= {1, 2}  # both outcomes occur
  assert not any(ok for _, ok in solved["spawn_checked", 4])
