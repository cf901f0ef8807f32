"""Paper-code fidelity of the estimators: Dr. MAS's vanilla GRPO baseline (`traj_grpo`), AT-GRPO's
per-policy lowest-mean filter and the std conventions. Expected numbers are derived here from
docs/papers.md (sections 1, 2) and the papers' public code (PettingLLMs, DrMAS/verl), never from our
own output."""
from __future__ import annotations

import collections
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from marl_jax.algos.advantage_config import AdvantageConfig, AdvantageOutput, estimate
from marl_jax.algos.batch import GroupSpace, make_batch
from host import cpu_devices

TOL = dict(rtol=1e-5, atol=1e-5)


def run_both(batch, cfg: AdvantageConfig, space: GroupSpace) -> list[AdvantageOutput]:
  """The estimator on one device and inside shard_map over 8 devices (sample axis split)."""
  single = jax.jit(lambda b: estimate(b, cfg, space))(batch)
  mesh = Mesh(np.array(cpu_devices(8)), ("data",))
  specs = AdvantageOutput(advantages=P("data"), returns=None, sample_mask=P("data"), metrics=P())
  sharded = jax.jit(jax.shard_map(lambda b: estimate(b, cfg, space, "data"), mesh=mesh,
                                  in_specs=(P("data"),), out_specs=specs))(batch)
  return [single, sharded]


# ----------------------------------------------------------------------------- Dr. MAS vanilla GRPO


def test_traj_grpo_scores_calls_with_their_trajectory_mean():
  """A successful trajectory with 3 calls (reward 1 each) and a failed one with 1 call (0).

  Paper: each call's score is its trajectory's mean, normalised over the K = 2 trajectory values
  [1, 0]: mean 1/2, unbiased std sqrt(2 * (1/2)^2 / 1) = 1/sqrt(2), so +-(1/2) * sqrt(2).
  Per-call GRPO (population std over [1, 1, 1, 0]) would give [0.577] * 3 + [-1.732] instead.
  """
  # 4 padding rows (masked out) so that 8 devices split the batch evenly.
  batch = make_batch([0.0] * 8, team_rewards=[1.0, 1.0, 1.0, 0.0] * 2, traj_id=[0, 0, 0, 1] * 2,
                     sample_mask=[True] * 4 + [False] * 4)
  cfg = AdvantageConfig("traj_grpo", alpha=1.0)
  want = np.r_[np.array([1, 1, 1, -1]) / math.sqrt(2), np.zeros(4)]
  for out in run_both(batch, cfg, GroupSpace(1, num_trajs=2)):
    np.testing.assert_allclose(np.asarray(out.advantages[:, 0]), want, **TOL)
  per_call = estimate(batch, AdvantageConfig("grpo", alpha=1.0), GroupSpace(1))
  assert not np.allclose(np.asarray(per_call.advantages[:, 0]), want, atol=0.05)


def ref_traj_grpo(r, mask, problem, traj, ddof=1, normalize_std=True, eps=1e-6):
  """Dr. MAS's code: trajectory mean of the calls' scores; per problem, mean and torch.std
  (unbiased) over the trajectory means; one trajectory: mean 0, std 1."""
  calls = collections.defaultdict(list)
  for i in np.flatnonzero(mask):
    calls[(int(problem[i]), int(traj[i]))].append(i)
  traj_mean = {k: float(np.mean(r[v])) for k, v in calls.items()}
  by_problem = collections.defaultdict(list)
  for (p, t), m in traj_mean.items():
    by_problem[p].append(m)
  adv = np.zeros(len(r))
  for (p, t), idx in calls.items():
    values = np.array(by_problem[p])
    mu, sd = (values.mean(), values.std(ddof=ddof)) if len(values) > 1 else (0.0, 1.0)
    adv[idx] = (traj_mean[(p, t)] - mu) / (sd + eps) if normalize_std else traj_mean[(p, t)] - mu
  return adv


@pytest.mark.parametrize("normalize_std", [True, False])
def test_traj_grpo_matches_dr_mas_code(normalize_std):
  rng = np.random.default_rng(0)
  k, num_problems = 4, 4
  problem, traj, team, local = [], [], [], []
  for p in range(num_problems):
    for j in range(1 if p == num_problems - 1 else k):  # the last problem: one trajectory
      calls = int(rng.integers(1, 5))  # trajectories make different numbers of calls
      problem += [p] * calls
      traj += [p * k + j] * calls
      team += [float(rng.integers(0, 2))] * calls  # the episode reward, on every call
      local += list(-0.1 * (rng.random(calls) < 0.3))  # format penalties
  n = len(problem)
  pad = 64 - n
  dup = rng.integers(0, n, pad)  # padding duplicates real ids with shifted rewards
  fields = dict(problem_id=np.r_[problem, np.array(problem)[dup]],
                traj_id=np.r_[traj, np.array(traj)[dup]],
                team_rewards=np.r_[team, np.array(team)[dup] + 100.0],
                rewards=np.r_[local, np.zeros(pad)],
                sample_mask=np.r_[np.ones(n, bool), np.zeros(pad, bool)])
  perm = rng.permutation(64)
  fields = {key: v[perm] for key, v in fields.items()}
  batch = make_batch(**fields)
  r = fields["team_rewards"] + fields["rewards"]
  want = ref_traj_grpo(r, fields["sample_mask"], fields["problem_id"], fields["traj_id"],
                       normalize_std=normalize_std)
  cfg = AdvantageConfig("traj_grpo", alpha=1.0, normalize_std=normalize_std)
  for out in run_both(batch, cfg, GroupSpace(num_problems, num_trajs=num_problems * k)):
    np.testing.assert_allclose(np.asarray(out.advantages[:, 0]), want, **TOL)
    np.testing.assert_array_equal(np.asarray(out.sample_mask), fields["sample_mask"])


def test_traj_grpo_refuses_group_options():
  with pytest.raises(ValueError, match="filter 'lowest_mean' applies to"):
    AdvantageConfig("traj_grpo", filter="lowest_mean")
  with pytest.raises(ValueError, match="needs GroupSpace.num_trajs > 0"):
    estimate(make_batch([1.0]), AdvantageConfig("traj_grpo"), GroupSpace(1))


# ----------------------------------------------------------------------------- per-policy filter


def _two_agent_batch(rng, policy_per_agent: bool):
  """6 problems x 2 agents x K=4 samples at one turn; agent 1's rewards are shifted by +5."""
  p, a, _ = (x.reshape(-1) for x in np.meshgrid(np.arange(6), np.arange(2), np.arange(4),
                                                 indexing="ij"))
  r = rng.normal(size=p.size) + 5.0 * a
  policy = a if policy_per_agent else np.zeros_like(a)
  return make_batch(r, problem_id=p, agent_id=a, policy_id=policy), p, a, r


def test_lowest_mean_filter_ranks_each_policys_groups_on_its_own():
  """PettingLLMs filters each model's batch separately: with one policy per agent each agent
  keeps its 6 - floor(0.5 * 6) = 3 highest-mean groups (one global ranking would drop all of
  agent 0's groups, whose rewards sit 5 lower)."""
  batch, p, a, r = _two_agent_batch(np.random.default_rng(3), policy_per_agent=True)
  want = np.zeros(len(r), bool)
  for agent in (0, 1):
    means = {q: r[(p == q) & (a == agent)].mean() for q in range(6)}
    for q in sorted(means, key=means.get)[3:]:
      want[(p == q) & (a == agent)] = True
  cfg = AdvantageConfig("at_grpo", filter="lowest_mean")
  for out in run_both(batch, cfg, GroupSpace(6, 1, 2)):
    keep = np.asarray(out.sample_mask)
    np.testing.assert_array_equal(keep, want)
    assert [len(set(p[keep & (a == agent)])) for agent in (0, 1)] == [3, 3]
    assert out.metrics["groups_kept"] == 6 and out.metrics["groups"] == 12


def test_lowest_mean_filter_with_a_shared_policy_is_one_ranking():
  batch, _, a, _ = _two_agent_batch(np.random.default_rng(3), policy_per_agent=False)
  out = run_both(batch, AdvantageConfig("at_grpo", filter="lowest_mean"), GroupSpace(6, 1, 2))[0]
  np.testing.assert_array_equal(np.asarray(out.sample_mask), a == 1)  # 6 lowest: all of agent 0


def ref_policy_filter(r, mask, keys, policy, fraction=0.5):
  """Per policy: the groups holding its samples, ranked by (group mean, group key); the lowest
  floor(fraction * n) are dropped for that policy's samples."""
  members = collections.defaultdict(list)
  for i in np.flatnonzero(mask):
    members[keys[i]].append(i)
  means = {k: r[v].mean() for k, v in members.items()}
  keep = np.zeros(len(r), bool)
  for pol in set(policy[mask].tolist()):
    groups = sorted({keys[i] for i in np.flatnonzero(mask & (policy == pol))},
                    key=lambda k: (means[k], k))
    kept = set(groups[int(math.floor(fraction * len(groups))):])
    for i in np.flatnonzero(mask & (policy == pol)):
      keep[i] = keys[i] in kept
  return keep


@pytest.mark.parametrize("group_by", ["problem_turn_agent", "problem"])
def test_per_policy_filter_matches_numpy(group_by):
  rng = np.random.default_rng(4)
  n, n_total = 56, 64
  p, t, a = rng.integers(0, 6, n), rng.integers(0, 2, n), rng.integers(0, 2, n)
  r = rng.choice([0.0, 0.5, 1.0], n) + 1e-2 * (p * 4 + t * 2 + a)  # exact, distinct group means
  mask = np.r_[np.ones(n, bool), np.zeros(n_total - n, bool)]
  pad = lambda x, fill: np.r_[x, np.full(n_total - n, fill)]
  fields = dict(rewards=pad(r, 100.0), problem_id=pad(p, 0), turn=pad(t, 0), agent_id=pad(a, 1),
                policy_id=pad(a, 1), sample_mask=mask)
  batch = make_batch(**fields)
  cols = {"problem": (fields["problem_id"],),
          "problem_turn_agent": (fields["problem_id"], fields["turn"], fields["agent_id"])}
  keys = list(zip(*(c.tolist() for c in cols[group_by])))
  want = ref_policy_filter(fields["rewards"], mask, keys, fields["policy_id"])
  cfg = AdvantageConfig("grpo", group_by=group_by, filter="lowest_mean")
  outs = run_both(batch, cfg, GroupSpace(6, 2, 2))
  for out in outs:
    np.testing.assert_array_equal(np.asarray(out.sample_mask), want)
  assert 0 < want.sum() < n


def test_filter_drops_policy_ids_past_the_agents():
  batch = make_batch([1.0, 2.0, 3.0, 4.0], problem_id=[0, 0, 1, 1], policy_id=[0, 0, 0, 2])
  out = estimate(batch, AdvantageConfig("grpo", filter="lowest_mean"), GroupSpace(2))
  assert out.metrics["out_of_range"] == 1 and not bool(out.sample_mask[3])


# ----------------------------------------------------------------------------- std convention


def test_at_grpo_divides_by_the_unbiased_std_of_verl():
  """PettingLLMs computes AT-GRPO advantages with verl's GRPO (torch.std: unbiased); at K = 4 the
  rewards [0, 1, 2, 3] have std sqrt(5/3), so A = (r - 1.5) / sqrt(5/3), sqrt(4/3) = 1.155 times
  smaller than with the population std."""
  batch = make_batch([0.0, 1.0, 2.0, 3.0])
  want = (np.arange(4) - 1.5) / (math.sqrt(5 / 3) + 1e-6)
  out = estimate(batch, AdvantageConfig("at_grpo"), GroupSpace(1))
  np.testing.assert_allclose(np.asarray(out.advantages[:, 0]), want, **TOL)
  population = estimate(batch, AdvantageConfig("at_grpo", std_ddof=0), GroupSpace(1))
  np.testing.assert_allclose(np.asarray(population.advantages[:, 0]) / want, math.sqrt(4 / 3),
                             rtol=1e-5)


@pytest.mark.parametrize("estimator, ddof", [("at_grpo", 1), ("drmas", 1), ("traj_grpo", 1),
                                             ("grpo", 0)])
def test_std_defaults(estimator, ddof):
  assert AdvantageConfig(estimator).resolved().std_ddof == ddof
