"""Advantage estimators vs NumPy re-derivations, on one device and split over 8 fake devices."""
from __future__ import annotations

import collections
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from marl_jax.algos.advantage_config import ESTIMATORS, AdvantageConfig, AdvantageOutput, estimate
from marl_jax.algos.batch import GroupSpace, SampleBatch, make_batch, validate_batch
from host import cpu_devices

TOL = dict(rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- harness


def run(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace) -> AdvantageOutput:
  """The estimator on one device, jitted (eager dispatch of many small ops is slow)."""
  return jax.jit(lambda b: estimate(b, cfg, space))(batch)


def run_both(batch: SampleBatch, cfg: AdvantageConfig,
             space: GroupSpace) -> tuple[AdvantageOutput, AdvantageOutput]:
  """The estimator on one device and inside shard_map over 8 devices (sample axis split)."""
  single = run(batch, cfg, space)
  mesh = Mesh(np.array(cpu_devices(8)), ("data",))
  specs = AdvantageOutput(advantages=P("data"),
                          returns=None if single.returns is None else P("data"),
                          sample_mask=P("data"), metrics=P())
  sharded = jax.jit(jax.shard_map(lambda b: estimate(b, cfg, space, "data"), mesh=mesh,
                                  in_specs=(P("data"),), out_specs=specs))(batch)
  return single, sharded


def check(batch, cfg, space, ref_adv, ref_keep, ref_returns=None):
  """Both runs equal the reference (sample-level refs are broadcast over response tokens)."""
  tmask = np.asarray(batch.token_mask)
  ref_keep = np.asarray(ref_keep, bool)
  ref_adv = np.asarray(ref_adv, np.float64)
  if ref_adv.ndim == 1:
    ref_adv = ref_adv[:, None]
  ref_adv = np.where(tmask & ref_keep[:, None], ref_adv, 0.0)
  outs = run_both(batch, cfg, space)
  for out in outs:
    np.testing.assert_array_equal(np.asarray(out.sample_mask), ref_keep)
    np.testing.assert_allclose(np.asarray(out.advantages), ref_adv, **TOL)
    if ref_returns is not None:
      ref_ret = np.where(tmask & ref_keep[:, None], np.asarray(ref_returns).reshape(
          len(ref_keep), -1), 0.0)
      np.testing.assert_allclose(np.asarray(out.returns), ref_ret, **TOL)
  single, sharded = outs
  assert single.metrics.keys() == sharded.metrics.keys()
  for k in single.metrics:
    np.testing.assert_allclose(np.asarray(sharded.metrics[k]), np.asarray(single.metrics[k]),
                               rtol=1e-5, atol=1e-5, err_msg=k)
  return single


def shuffle_and_pad(rng, fields: dict, n_total: int) -> dict:
  """Appends padding rows that duplicate real samples (with other rewards) and shuffles."""
  n = len(fields["rewards"])
  dup = rng.integers(0, n, n_total - n)
  out = {}
  for k, v in fields.items():
    v = np.asarray(v)
    pad = v[dup].copy()
    if k in ("rewards", "team_rewards", "values", "token_values"):
      pad = pad + 100.0  # would shift every statistic if padding leaked in
    out[k] = np.concatenate([v, pad])
  out["sample_mask"] = np.concatenate([np.ones(n, bool), np.zeros(n_total - n, bool)])
  perm = rng.permutation(n_total)
  return {k: v[perm] for k, v in out.items()}


# ----------------------------------------------------------------------------- group estimators

GSPACE = GroupSpace(num_problems=6, max_turns=3, num_agents=2, num_states=2)


def group_batch(rng, dyadic=False, n_valid=52, n_total=64):
  p = rng.integers(0, GSPACE.num_problems - 1, n_valid)
  p[-1] = GSPACE.num_problems - 1  # a problem with a single sample: singleton in every grouping
  t = rng.integers(0, GSPACE.max_turns, n_valid)
  a = rng.integers(0, GSPACE.num_agents, n_valid)
  if dyadic:  # exact fp32 sums; a per-(problem, agent) offset keeps group means apart
    r = rng.choice([0.0, 0.5, 1.0], n_valid) + 1e-2 * (p * GSPACE.num_agents + a)
  else:
    r = rng.normal(size=n_valid)
  fields = dict(rewards=r, team_rewards=rng.normal(size=n_valid), problem_id=p, turn=t,
                agent_id=a, token_mask=rng.random((n_valid, 4)) < 0.7,
                state=rng.integers(0, GSPACE.num_states, n_valid))
  return make_batch(**shuffle_and_pad(rng, fields, n_total))


def ref_group(batch, kind, group_by, ddof, eps=1e-6, normalize_std=True, filt="none",
              fraction=0.5, alpha=0.0):
  r = alpha * np.asarray(batch.team_rewards, np.float64) + np.asarray(batch.rewards, np.float64)
  mask = np.asarray(batch.sample_mask)
  cols = {"problem": ("problem_id",), "problem_agent": ("problem_id", "agent_id"),
          "problem_turn_agent": ("problem_id", "turn", "agent_id"),
          "problem_turn_agent_state": ("problem_id", "turn", "agent_id", "state"),
          "turn_agent_state": ("turn", "agent_id", "state")}[group_by]
  groups = collections.defaultdict(list)
  for i in np.flatnonzero(mask):
    groups[tuple(int(getattr(batch, c)[i]) for c in cols)].append(i)
  means = {k: r[v].mean() for k, v in groups.items()}
  keys = sorted(groups)
  if filt == "lowest_mean":
    ranked = sorted(keys, key=lambda k: (means[k], k))
    keys = ranked[int(math.floor(fraction * len(ranked))):]
  elif filt == "zero_variance":
    keys = [k for k in keys if r[groups[k]].max() > r[groups[k]].min()]
  adv = np.zeros(len(r))
  keep = np.zeros(len(r), bool)
  for k in keys:
    idx = np.array(groups[k])
    v = r[idx]
    n, mean = len(v), v.mean()
    std = v.std(ddof=ddof) if n > ddof else 0.0
    if kind == "rloo":
      adv[idx] = [(x - (v.sum() - x) / (n - 1)) if n > 1 else 0.0 for x in v]
    else:
      if kind == "drmas" and n == 1:
        mean, std = 0.0, 1.0
      adv[idx] = (v - mean) / (std + eps) if normalize_std else v - mean
    keep[idx] = True
  return adv, keep


GROUP_CASES = [
    # (config kwargs, reference kwargs)
    (dict(estimator="grpo"), dict(kind="grpo", group_by="problem", ddof=0)),
    (dict(estimator="at_grpo", std_ddof=1, alpha=0.5),
     dict(kind="at_grpo", group_by="problem_turn_agent", ddof=1, alpha=0.5)),
    (dict(estimator="at_grpo", group_by="problem_turn_agent_state"),
     dict(kind="at_grpo", group_by="problem_turn_agent_state", ddof=1)),
    (dict(estimator="at_grpo", group_by="turn_agent_state", filter="lowest_mean"),
     dict(kind="at_grpo", group_by="turn_agent_state", ddof=1, filt="lowest_mean")),
    (dict(estimator="drmas"), dict(kind="drmas", group_by="problem_agent", ddof=1)),
    (dict(estimator="drmas", normalize_std=False),
     dict(kind="drmas", group_by="problem_agent", ddof=1, normalize_std=False)),
    (dict(estimator="dr_grpo"), dict(kind="dr_grpo", group_by="problem", ddof=0,
                                     normalize_std=False)),
    (dict(estimator="rloo", group_by="problem_agent"),
     dict(kind="rloo", group_by="problem_agent", ddof=0)),
]


@pytest.mark.parametrize("cfg_kw,ref_kw", GROUP_CASES, ids=lambda x: str(x))
def test_group_estimators_match_numpy(cfg_kw, ref_kw):
  batch = group_batch(np.random.default_rng(0))
  adv, keep = ref_group(batch, **ref_kw)
  check(batch, AdvantageConfig(**cfg_kw), GSPACE, adv, keep)


def test_balance_states_weighs_each_agents_states_equally():
  """at_grpo over state-matched groups, each advantage scaled by n_a / (S_a x n_as) (derived
  here over the reference's kept samples): every state of an agent then sums to the same
  weight n_a / S_a, on one device and on eight."""
  batch = group_batch(np.random.default_rng(3))
  adv, keep = ref_group(batch, "at_grpo", "problem_turn_agent_state", 1)
  agent, state = np.asarray(batch.agent_id), np.asarray(batch.state)
  n_as = collections.Counter(zip(agent[keep], state[keep]))
  assert len(set(n_as.values())) > 1  # the states are unevenly filled, so weights differ
  weight = np.zeros(len(adv))
  for i in np.flatnonzero(keep):
    n_a = sum(n for (a, _), n in n_as.items() if a == agent[i])
    s_a = sum(1 for (a, _) in n_as if a == agent[i])
    weight[i] = n_a / (s_a * n_as[(agent[i], state[i])])
  assert np.any(np.abs(weight[keep] - 1.0) > 0.05)  # the balancing changes some advantages
  check(batch, AdvantageConfig("at_grpo", group_by="problem_turn_agent_state",
                               balance_states=True), GSPACE, adv * weight, keep)


@pytest.mark.parametrize("balance", [False, True])
def test_normalize_states_gives_each_agents_states_unit_scale(balance):
  """Mean-centred at_grpo over state-matched groups, each advantage divided by the root mean
  square of its (agent, state)'s kept advantages (derived here), then, with balance_states, the
  weights n_a / (S_a x n_as): each (agent, state) ends with mean square 1 (times its weight
  squared), on one device and on eight."""
  batch = group_batch(np.random.default_rng(3))
  adv, keep = ref_group(batch, "at_grpo", "problem_turn_agent_state", 1, normalize_std=False)
  agent, state = np.asarray(batch.agent_id), np.asarray(batch.state)
  pairs = collections.defaultdict(list)
  for i in np.flatnonzero(keep):
    pairs[(agent[i], state[i])].append(i)
  rms = {k: np.sqrt(np.mean(adv[v] ** 2)) for k, v in pairs.items()}
  assert max(rms.values()) > 1.5 * min(rms.values())  # the scales differ before
  want = np.zeros(len(adv))
  for k, v in pairs.items():
    want[v] = adv[v] / (rms[k] + 1e-6)
    if balance:
      n_a = sum(len(u) for (a, _), u in pairs.items() if a == k[0])
      s_a = sum(1 for (a, _) in pairs if a == k[0])
      want[v] *= n_a / (s_a * len(v))
  check(batch, AdvantageConfig("at_grpo", group_by="problem_turn_agent_state",
                               normalize_std=False, normalize_states=True,
                               balance_states=balance), GSPACE, want, keep)


@pytest.mark.parametrize("field", ["balance_states", "normalize_states"])
def test_state_scaling_needs_state_matched_groups(field):
  with pytest.raises(ValueError, match=f"{field} scales the states the groups split by; it "
                     r"needs group_by in \['problem_turn_agent_state', 'turn_agent_state'\], "
                     "got 'problem_turn_agent'"):
    AdvantageConfig("at_grpo", group_by="problem_turn_agent", **{field: True})


@pytest.mark.parametrize("filt,group_by", [("lowest_mean", "problem_turn_agent"),
                                           ("lowest_mean", "problem_agent"),
                                           ("zero_variance", "problem_turn_agent")])
def test_group_filtering_matches_numpy(filt, group_by):
  batch = group_batch(np.random.default_rng(1), dyadic=True)
  adv, keep = ref_group(batch, "at_grpo", group_by, 1, filt=filt, fraction=0.5)
  out = check(batch, AdvantageConfig("at_grpo", group_by=group_by, filter=filt), GSPACE, adv,
              keep)
  assert 0 < out.metrics["groups_kept"] < out.metrics["groups"]


def test_lowest_mean_ties_drop_lower_group_id_first():
  # Three problems, all with mean 0.5: floor(0.5 * 3) = 1 group dropped, the lowest id.
  batch = make_batch([0.0, 1.0, 1.0, 0.0, 0.5, 0.5], problem_id=[0, 0, 1, 1, 2, 2])
  out = run(batch, AdvantageConfig("grpo", filter="lowest_mean"), GroupSpace(3))
  np.testing.assert_array_equal(np.asarray(out.sample_mask), [0, 0, 1, 1, 1, 1])


def test_constant_group_gets_exactly_zero_advantage():
  # 0.1 is not exact in fp32: a sum/count mean is off by an ulp and ulp / eps is not small.
  batch = make_batch([0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3], problem_id=[0, 0, 0, 1, 1, 1, 1])
  out = run(batch, AdvantageConfig("grpo"), GroupSpace(2))
  np.testing.assert_array_equal(np.asarray(out.advantages), 0.0)


def test_padding_duplicates_do_not_change_statistics():
  """Dr. MAS's public code pads with duplicated samples before computing advantages."""
  rng = np.random.default_rng(2)
  n = 12
  fields = dict(rewards=rng.normal(size=n), problem_id=rng.integers(0, 2, n),
                agent_id=rng.integers(0, 2, n))
  space = GroupSpace(2, 1, 2)
  base = run(make_batch(**fields), AdvantageConfig("drmas"), space)
  # Pad to 16 with exact duplicates (same ids and rewards), masked out.
  dup = np.arange(4)
  padded = {k: np.concatenate([v, v[dup]]) for k, v in fields.items()}
  padded["sample_mask"] = np.arange(16) < n
  out = run(make_batch(**padded), AdvantageConfig("drmas"), space)
  np.testing.assert_array_equal(np.asarray(out.advantages[:n]), np.asarray(base.advantages))
  np.testing.assert_array_equal(np.asarray(out.advantages[n:]), 0.0)
  np.testing.assert_array_equal(np.asarray(out.sample_mask), padded["sample_mask"])


def test_distinct_problems_never_merge():
  """AT-GRPO's public code divides the problem index by K twice, merging K problems per group."""
  k = 4  # branches per problem
  num_problems, turns, agents = 2 * k, 2, 2
  p, t, a = np.meshgrid(np.arange(num_problems), np.arange(turns), np.arange(agents),
                        indexing="ij")
  p, t, a = (np.repeat(x.reshape(-1), k) for x in (p, t, a))
  # Every group holds rewards {0, 1, 2, 3} + 10 * problem: merged problems would change all.
  r = np.tile(np.arange(k), num_problems * turns * agents) + 10.0 * p
  batch = make_batch(r, problem_id=p, turn=t, agent_id=a)
  out = run(batch, AdvantageConfig("at_grpo"), GroupSpace(num_problems, turns, agents))
  z = (np.arange(k) - 1.5) / (np.arange(k).std(ddof=1) + 1e-6)  # at_grpo: unbiased std
  np.testing.assert_allclose(np.asarray(out.advantages[:, 0]),
                             np.tile(z, num_problems * turns * agents), **TOL)
  assert out.metrics["groups"] == num_problems * turns * agents


def test_out_of_range_ids_are_dropped_and_counted():
  batch = make_batch([1.0, 2.0, 3.0, 4.0], problem_id=[0, 0, 1, 1], turn=[0, 0, 0, 5])
  space = GroupSpace(2, 2, 1)
  out = run(batch, AdvantageConfig("at_grpo"), space)
  np.testing.assert_array_equal(np.asarray(out.sample_mask), [1, 1, 1, 0])
  assert out.metrics["out_of_range"] == 1
  with pytest.raises(ValueError, match=r"sample 3: turn=5 outside \[0, 2\)"):
    validate_batch(batch, space)


# ----------------------------------------------------------------------------- MAGRPO tree

TSPACE = GroupSpace(num_problems=3, max_turns=3, num_agents=2, num_nodes=48)


def tree_batch(rng, n_total=96):
  """Random joint-action trees: 1-3 roots per problem, 0-2 children per node, 1-2 agents/node."""
  nodes = []  # (parent, problem, turn)
  frontier = [(-1, p, 0) for p in range(TSPACE.num_problems) for _ in range(rng.integers(1, 4))]
  while frontier:
    parent, prob, turn = frontier.pop()
    nodes.append((parent, prob, turn))
    me = len(nodes) - 1
    if turn + 1 < TSPACE.max_turns:
      frontier += [(me, prob, turn + 1)] * int(rng.integers(0, 3))
  assert len(nodes) <= TSPACE.num_nodes
  rows = collections.defaultdict(list)
  for node, (parent, prob, turn) in enumerate(nodes):
    for agent in rng.permutation(2)[:rng.integers(1, 3)]:
      for k, v in dict(node_id=node, parent_node=parent, problem_id=prob, turn=turn,
                       agent_id=agent, rewards=rng.normal(), team_rewards=rng.normal()).items():
        rows[k].append(v)
  assert len(rows["rewards"]) <= n_total
  return make_batch(**shuffle_and_pad(rng, rows, n_total))


def ref_magrpo(batch, gamma, baseline, zscore, clamp, alpha=0.0, eps=1e-6):
  r = alpha * np.asarray(batch.team_rewards, np.float64) + np.asarray(batch.rewards, np.float64)
  mask = np.asarray(batch.sample_mask)
  node_r, parent, prob = collections.defaultdict(list), {}, {}
  for i in np.flatnonzero(mask):
    n = int(batch.node_id[i])
    node_r[n].append(r[i])
    parent[n], prob[n] = int(batch.parent_node[i]), int(batch.problem_id[i])
  children = collections.defaultdict(list)
  for n, par in parent.items():
    if par >= 0:
      children[par].append(n)

  def ret(n):
    kids = children[n]
    return np.mean(node_r[n]) + (gamma * np.mean([ret(c) for c in kids]) if kids else 0.0)

  sibs = collections.defaultdict(list)
  for n, par in parent.items():
    sibs[par if par >= 0 else ("root", prob[n])].append(n)
  node_adv = {}
  for group in sibs.values():
    big_r = np.array([ret(n) for n in group])
    m = len(group)
    if baseline == "mean":
      a = big_r - big_r.mean()
    elif baseline == "none":
      a = big_r
    elif baseline == "loo":
      a = np.array([(x - (big_r.sum() - x) / (m - 1)) if m > 1 else 0.0 for x in big_r])
    else:
      a = big_r - big_r.max()
    if zscore and m > 1:
      a = (a - a.mean()) / (a.std() + eps)
    node_adv.update(zip(group, np.clip(a, -clamp, clamp)))
  adv = np.array([node_adv.get(int(n), 0.0) for n in np.asarray(batch.node_id)])
  return np.where(mask, adv, 0.0), mask


@pytest.mark.parametrize("baseline,zscore,clamp,alpha", [
    ("mean", False, None, 1.0), ("none", True, None, 0.0), ("loo", False, None, 0.0),
    ("max", False, 0.3, 0.0)])
def test_magrpo_matches_numpy(baseline, zscore, clamp, alpha):
  batch = tree_batch(np.random.default_rng(3))
  cfg = AdvantageConfig("magrpo", baseline=baseline, normalize_std=zscore, clamp=clamp,
                        alpha=alpha)
  adv, keep = ref_magrpo(batch, 0.9, baseline, zscore, 10.0 if clamp is None else clamp, alpha)
  check(batch, cfg, TSPACE, adv, keep)


# ----------------------------------------------------------------------------- MARFT GAE

GAE_SPACE = GroupSpace(num_problems=1, max_turns=3, num_agents=3, num_trajs=6)


def gae_batch(rng, n_total=64, num_tokens=5):
  """Trajectories of 1-3 turns; some agents skip a turn; response tokens with gaps."""
  rows = collections.defaultdict(list)
  for traj in range(GAE_SPACE.num_trajs):
    for turn in range(int(rng.integers(1, GAE_SPACE.max_turns + 1))):
      for agent in range(GAE_SPACE.num_agents):
        if rng.random() < 0.2 and not (turn == 0 and agent == 0):
          continue
        tm = rng.random(num_tokens) < 0.7
        tm[rng.integers(0, num_tokens)] = True
        for k, v in dict(traj_id=traj, turn=turn, agent_id=agent, rewards=rng.normal(),
                         values=rng.normal(), token_values=rng.normal(size=num_tokens),
                         token_mask=tm).items():
          rows[k].append(v)
  assert len(rows["rewards"]) <= n_total
  return make_batch(**shuffle_and_pad(rng, rows, n_total))


def ordered_samples(batch):
  """Valid sample indices per trajectory in acting order (turn, then agent)."""
  mask = np.asarray(batch.sample_mask)
  per_traj = collections.defaultdict(list)
  for i in np.flatnonzero(mask):
    per_traj[int(batch.traj_id[i])].append((int(batch.turn[i]), int(batch.agent_id[i]), i))
  return {k: [i for *_, i in sorted(v)] for k, v in per_traj.items()}


def ref_gae_action(batch, gamma, lam):
  """MARFT APPO loop: backwards over turns, then agents; the last agent bootstraps from the
  next turn's first acting agent, and nothing after the last turn (done)."""
  r, v = np.asarray(batch.rewards, np.float64), np.asarray(batch.values, np.float64)
  adv = np.zeros(len(r))
  for order in ordered_samples(batch).values():
    gae_acc, next_value = 0.0, 0.0
    for i in reversed(order):
      delta = r[i] + gamma * next_value - v[i]
      gae_acc = delta + gamma * lam * gae_acc
      adv[i], next_value = gae_acc, v[i]
  return adv, adv + v


def ref_gae_token(batch, gamma, lam):
  """TPPO = GAE over the trajectory's response tokens flattened in acting order, with each
  sample's reward on its last token and V = 0 after the last token."""
  tv = np.asarray(batch.token_values, np.float64)
  tm = np.asarray(batch.token_mask)
  adv = np.zeros(tv.shape)
  for order in ordered_samples(batch).values():
    pos = [(i, k) for i in order for k in np.flatnonzero(tm[i])]
    rew = np.zeros(len(pos))
    for j, (i, k) in enumerate(pos):
      if j + 1 == len(pos) or pos[j + 1][0] != i:
        rew[j] = batch.rewards[i]
    vals = np.array([tv[p] for p in pos] + [0.0])
    acc = 0.0
    for j in reversed(range(len(pos))):
      acc = rew[j] + gamma * vals[j + 1] - vals[j] + gamma * lam * acc
      adv[pos[j]] = acc
  return adv, adv + tv


@pytest.mark.parametrize("estimator", ["gae_action", "gae_token"])
def test_gae_matches_numpy(estimator):
  batch = gae_batch(np.random.default_rng(4))
  ref = ref_gae_action if estimator == "gae_action" else ref_gae_token
  adv, ret = ref(batch, 0.99, 0.95)
  out = check(batch, AdvantageConfig(estimator), GAE_SPACE, adv, batch.sample_mask, ret)
  assert out.metrics["slot_collisions"] == 0


@pytest.mark.parametrize("estimator", ["gae_action", "gae_token"])
def test_gae_batch_normalisation_and_clamp(estimator):
  batch = gae_batch(np.random.default_rng(5))
  ref = ref_gae_action if estimator == "gae_action" else ref_gae_token
  adv, ret = ref(batch, 0.9, 0.8)
  mask = np.asarray(batch.sample_mask)
  # Normalised over the valid samples (gae_action) or valid tokens (gae_token), ddof 1.
  w = mask if estimator == "gae_action" else np.asarray(batch.token_mask) & mask[:, None]
  z = np.clip((adv - adv[w].mean()) / (adv[w].std(ddof=1) + 1e-6), -1.5, 1.5)
  cfg = AdvantageConfig(estimator, gamma=0.9, lam=0.8, normalize_batch=True, std_ddof=1,
                        clamp=1.5)
  check(batch, cfg, GAE_SPACE, z, mask, ret)


# ----------------------------------------------------------------------------- bad inputs


def test_unknown_names_raise_clear_errors():
  with pytest.raises(ValueError, match=r"unknown estimator 'ppo'; expected one of \['at_grpo'"):
    ESTIMATORS.get("ppo")
  with pytest.raises(ValueError, match="unknown estimator 'grop'"):
    AdvantageConfig("grop")
  with pytest.raises(ValueError, match=r"unknown filter 'top'; expected one of \['none'"):
    AdvantageConfig(filter="top")
  with pytest.raises(ValueError, match="unknown group_by 'turn'"):
    AdvantageConfig(group_by="turn")
  with pytest.raises(ValueError, match="unknown baseline 'median'"):
    AdvantageConfig("magrpo", baseline="median")
  assert sorted(ESTIMATORS) == sorted(["grpo", "at_grpo", "drmas", "dr_grpo", "rloo", "traj_grpo",
                                       "magrpo", "gae_action", "gae_token"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(estimator="dr_grpo", normalize_std=True), "never divides by a group std"),
    (dict(estimator="gae_action", filter="lowest_mean"), "filter 'lowest_mean' applies to"),
    (dict(estimator="magrpo", group_by="problem"), "group_by applies to"),
    (dict(estimator="grpo", baseline="max"), r"baseline 'max' applies to \['magrpo'\], not 'grpo'"),
    (dict(filter_fraction=1.0), r"filter_fraction must be in \[0, 1\)"),
    (dict(std_ddof=2), "std_ddof must be 0 or 1"),
    (dict(estimator="magrpo", gamma=1.5), r"gamma must be in \[0, 1\]"),
    # Fields an estimator never reads are refused, as an inapplicable baseline is.
    (dict(estimator="grpo", gamma=0.9),
     r"gamma applies to \['gae_action', 'gae_token', 'magrpo'\], not 'grpo'"),
    (dict(estimator="magrpo", lam=0.9),
     r"lam applies to \['gae_action', 'gae_token'\], not 'magrpo'"),
    (dict(clamp=0.0), "clamp must be > 0"),
])
def test_inconsistent_options_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AdvantageConfig(**kwargs)


def test_space_and_dispatch_errors():
  batch = make_batch([1.0, 2.0])
  with pytest.raises(ValueError, match=r"needs GroupSpace.num_trajs > 0"):
    run(batch, AdvantageConfig("gae_action"), GroupSpace(1))
  with pytest.raises(ValueError, match="config names estimator 'grpo' but 'rloo' was called"):
    ESTIMATORS.get("rloo").fn(batch, AdvantageConfig("grpo"), GroupSpace(1))
  with pytest.raises(ValueError, match="GroupSpace.max_turns must be an int >= 1"):
    GroupSpace(1, 0)
  with pytest.raises(TypeError, match=r"unknown SampleBatch fields \['reward'\]"):
    make_batch([1.0], reward=[1.0])
  with pytest.raises(ValueError, match=r"'turn' has shape \(3,\); expected \(2,\)"):
    make_batch([1.0, 2.0], turn=[0, 1, 2])
