"""Advantage estimators for teams of agents, as segment reductions that are exact across devices.

Every estimator maps a `SampleBatch` to per-token advantages. Group statistics are
`jax.ops.segment_sum` over static segment counts (`GroupSpace`); when `axis_name` is given (the
estimator runs inside `shard_map` with the batch split along the sample axis) the segment sums are
`psum`-ed, so a group whose samples sit on different devices gets exact global statistics, and
every device derives identical group decisions (filtering ranks) from identical global values.

Padding (`sample_mask` False) is excluded from every statistic by construction: its values are
zeroed and its segment id points past the last segment, which `segment_sum` drops. This is what
Dr. MAS's public code gets wrong (padding duplicates enter the statistics). Group ids are
mixed-radix codes of (problem, turn, agent) with each factor's own size, so distinct problems can
never share a group (AT-GRPO's public code divides the problem index by K twice and merges them).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from marl_jax.algos import gae
from marl_jax.algos.batch import GroupSpace, SampleBatch, group_ids, mixed_reward
from marl_jax.registry import Registry

__all__ = ["AdvantageConfig", "AdvantageOutput", "ESTIMATORS", "GroupSpace", "estimate",
           "get_estimator"]

AxisName = str | tuple[str, ...] | None

GROUPINGS = ("problem", "problem_agent", "problem_turn_agent")
FILTERS = ("none", "lowest_mean", "zero_variance")
MAGRPO_BASELINES = ("mean", "none", "loo", "max")
_GROUP_ESTIMATORS = ("grpo", "at_grpo", "drmas", "dr_grpo", "rloo", "remax")
_NO_STD = ("dr_grpo", "rloo", "remax", "gae_action", "gae_token")

# Paper defaults for the options left as None (see AdvantageConfig).
_DEFAULTS = {
    "grpo": dict(group_by="problem", std_ddof=0, normalize_std=True),
    "at_grpo": dict(group_by="problem_turn_agent", std_ddof=1, normalize_std=True),
    "drmas": dict(group_by="problem_agent", std_ddof=1, normalize_std=True),
    "traj_grpo": dict(std_ddof=1, normalize_std=True),
    "dr_grpo": dict(group_by="problem", std_ddof=0, normalize_std=False),
    "rloo": dict(group_by="problem", std_ddof=0, normalize_std=False),
    "remax": dict(group_by="problem", std_ddof=0, normalize_std=False),
    "magrpo": dict(std_ddof=0, normalize_std=False, gamma=0.9, clamp=10.0),
    "gae_action": dict(std_ddof=0, normalize_std=False, gamma=0.99),
    "gae_token": dict(std_ddof=0, normalize_std=False, gamma=0.99),
}


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Estimator choice and options. Fields left None take the estimator's paper default.

  Attributes:
    estimator: registry name (see `ESTIMATORS`).
    group_by: grouping of group estimators: "problem", "problem_agent" or "problem_turn_agent"
      (None: grpo/dr_grpo/rloo/remax "problem", at_grpo "problem_turn_agent", drmas
      "problem_agent").
    std_ddof: 0 (population) or 1 (unbiased) for group, sibling and batch standard deviations
      (None: 1 for at_grpo, drmas and traj_grpo, whose paper code divides by verl's unbiased
      `torch.std`; else 0).
    eps: added to the std before dividing.
    normalize_std: divide by the group std (grpo/at_grpo/drmas/traj_grpo, default True; False
      gives the mean-only variant) or z-score siblings (magrpo, default False). Not allowed for
      estimators that never divide by a std.
    filter: "none", "lowest_mean" (drop the `filter_fraction` of non-empty groups with the lowest
      mean reward, AT-GRPO; ranked per policy, as PettingLLMs filters each model's batch on its
      own; policy ids must lie in [0, num_agents), others are dropped and counted as
      out_of_range) or "zero_variance" (drop groups whose rewards are all equal, DAPO); group
      estimators only.
    filter_fraction: fraction of each policy's groups dropped by "lowest_mean" (floor of
      fraction x that policy's non-empty groups).
    alpha: reward mixing, `r = alpha * team_rewards + rewards`.
    gamma: discount (None: magrpo 0.9, gae_* 0.99).
    lam: GAE lambda.
    clamp: clip advantages to [-clamp, clamp] (None: 10 for magrpo, else no clip).
    baseline: magrpo sibling baseline: "mean" (MAGRPO), "none" (raw returns), "loo" (RLOO) or
      "max" (CoMLRL's MAReMax: `R - max_siblings R`).
    normalize_batch: z-score advantages over all kept samples (tokens for gae_token) of the
      global batch after estimation (MARFT).
  """
  estimator: str = "grpo"
  group_by: str | None = None
  std_ddof: int | None = None
  eps: float = 1e-6
  normalize_std: bool | None = None
  filter: str = "none"
  filter_fraction: float = 0.5
  alpha: float = 0.0
  gamma: float | None = None
  lam: float = 0.95
  clamp: float | None = None
  baseline: str = "mean"
  normalize_batch: bool = False

  def __post_init__(self):
    name = self.estimator
    if name not in ESTIMATORS:
      raise ValueError(f"unknown estimator {name!r}; expected one of {sorted(ESTIMATORS)}")
    if self.group_by is not None:
      if self.group_by not in GROUPINGS:
        raise ValueError(f"unknown group_by {self.group_by!r}; expected one of {list(GROUPINGS)}")
      if name not in _GROUP_ESTIMATORS:
        raise ValueError(f"group_by applies to {list(_GROUP_ESTIMATORS)}, not {name!r}")
    if self.filter not in FILTERS:
      raise ValueError(f"unknown filter {self.filter!r}; expected one of {list(FILTERS)}")
    if self.filter != "none" and name not in _GROUP_ESTIMATORS:
      raise ValueError(f"filter {self.filter!r} applies to {list(_GROUP_ESTIMATORS)}, not {name!r}")
    if not 0.0 <= self.filter_fraction < 1.0:
      raise ValueError(f"filter_fraction must be in [0, 1), got {self.filter_fraction}")
    if self.std_ddof not in (None, 0, 1):
      raise ValueError(f"std_ddof must be 0 or 1, got {self.std_ddof!r}")
    if not self.eps > 0.0:
      raise ValueError(f"eps must be > 0, got {self.eps}")
    if self.normalize_std and name in _NO_STD:
      raise ValueError(f"estimator {name!r} never divides by a group std; set normalize_std to "
                       "None or False (normalize_batch z-scores the whole batch)")
    if self.baseline not in MAGRPO_BASELINES:
      raise ValueError(f"unknown baseline {self.baseline!r}; expected one of "
                       f"{list(MAGRPO_BASELINES)}")
    if self.baseline != "mean" and name != "magrpo":
      raise ValueError(f"baseline {self.baseline!r} applies to magrpo only, not {name!r}")
    if self.gamma is not None and not 0.0 <= self.gamma <= 1.0:
      raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
    if not 0.0 <= self.lam <= 1.0:
      raise ValueError(f"lam must be in [0, 1], got {self.lam}")
    if self.clamp is not None and not self.clamp > 0.0:
      raise ValueError(f"clamp must be > 0 (math.inf disables it), got {self.clamp}")

  def resolved(self) -> AdvantageConfig:
    """This config with every None option replaced by the estimator's default."""
    defaults = _DEFAULTS[self.estimator]
    fill = {k: v for k, v in defaults.items() if getattr(self, k) is None}
    out = dataclasses.replace(self, **fill)
    return dataclasses.replace(out, gamma=1.0 if out.gamma is None else out.gamma,
                               clamp=math.inf if out.clamp is None else out.clamp)


@flax.struct.dataclass
class AdvantageOutput:
  """Estimator result.

  Attributes:
    advantages: f32[N, T]; sample-level advantages are broadcast over tokens; 0 off `token_mask`
      and on samples outside `sample_mask`.
    returns: f32[N, T] critic targets (advantage before batch normalisation + value) for gae_*,
      else None.
    sample_mask: bool[N] samples to train on (input mask minus filtered groups, out-of-range ids
      and ReMax greedy samples).
    metrics: global scalars (identical on every device).
  """
  advantages: jax.Array
  returns: jax.Array | None
  sample_mask: jax.Array
  metrics: dict[str, jax.Array]


# ----------------------------------------------------------------------------- reductions


def _psum(x, axis_name: AxisName):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _seg_sum(x: jax.Array, ids: jax.Array, mask: jax.Array, num: int,
             axis_name: AxisName) -> jax.Array:
  """Global per-segment sum of `x` over masked samples; masked-out samples go to a dropped id."""
  x = jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, 0)
  return _psum(jax.ops.segment_sum(x, jnp.where(mask, ids, num), num_segments=num), axis_name)


def _seg_max(x: jax.Array, ids: jax.Array, mask: jax.Array, num: int,
             axis_name: AxisName) -> jax.Array:
  """Global per-segment max (the dtype's lowest value, or -inf, for empty segments)."""
  m = jax.ops.segment_max(x, jnp.where(mask, ids, num), num_segments=num)
  return m if axis_name is None else jax.lax.pmax(m, axis_name)


def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
  return table[jnp.clip(ids, 0, table.shape[0] - 1)]


def _count(mask: jax.Array, axis_name: AxisName) -> jax.Array:
  return _psum(jnp.sum(mask.astype(jnp.float32)), axis_name)


def _moments(x, ids, mask, num, ddof, axis_name):
  """Per-segment (count, mean, std), two-pass and shifted by the segment max.

  Shifting by a member's value makes a constant group's deviations exactly 0 in fp32 (a plain
  sum / count mean can be off by an ulp, and `ulp / (0 + eps)` is a large spurious advantage).
  """
  cnt = _seg_sum(jnp.ones_like(x), ids, mask, num, axis_name)
  top = jnp.where(cnt > 0, _seg_max(x, ids, mask, num, axis_name), 0.0)
  d = x - _take(top, ids)
  mean_d = _seg_sum(d, ids, mask, num, axis_name) / jnp.maximum(cnt, 1.0)
  sq = _seg_sum(jnp.square(d - _take(mean_d, ids)), ids, mask, num, axis_name)
  std = jnp.sqrt(jnp.where(cnt > ddof, sq / jnp.maximum(cnt - ddof, 1.0), 0.0))
  return cnt, top + mean_d, std


def _in_range(ids: jax.Array, low: int, high: int) -> jax.Array:
  return (ids >= low) & (ids < high)


# ----------------------------------------------------------------------------- finalisation


def _finalize(adv: jax.Array, returns: jax.Array | None, valid: jax.Array, keep: jax.Array,
              batch: SampleBatch, cfg: AdvantageConfig, axis_name: AxisName,
              metrics: dict[str, jax.Array]) -> AdvantageOutput:
  """Batch normalisation, clamp, token broadcast and the metrics every estimator reports."""
  tmask = batch.token_mask & keep[:, None]
  token_level = adv.ndim == 2
  weight = tmask if token_level else keep
  n = _count(weight, axis_name)
  mean = _psum(jnp.sum(jnp.where(weight, adv, 0.0)), axis_name) / jnp.maximum(n, 1.0)
  sq = _psum(jnp.sum(jnp.where(weight, jnp.square(adv - mean), 0.0)), axis_name)
  std = jnp.sqrt(jnp.where(n > cfg.std_ddof, sq / jnp.maximum(n - cfg.std_ddof, 1.0), 0.0))
  if cfg.normalize_batch:
    adv = (adv - mean) / (std + cfg.eps)
  adv = jnp.clip(adv, -cfg.clamp, cfg.clamp)
  adv = jnp.where(tmask, adv if token_level else adv[:, None], 0.0)
  if returns is not None:
    returns = jnp.where(tmask, returns if returns.ndim == 2 else returns[:, None], 0.0)
  r = mixed_reward(batch, cfg.alpha)
  n_valid = _count(valid, axis_name)
  metrics = dict(metrics)
  metrics.update(
      reward_mean=_psum(jnp.sum(jnp.where(valid, r, 0.0)), axis_name) / jnp.maximum(n_valid, 1.0),
      adv_mean=mean,  # before batch normalisation and clamp
      adv_std=std,
      valid_samples=n_valid,
      kept_samples=_count(keep, axis_name),
      out_of_range=_count(batch.sample_mask & ~valid, axis_name),
  )
  return AdvantageOutput(advantages=adv, returns=returns, sample_mask=keep, metrics=metrics)


def _check(cfg: AdvantageConfig, name: str, space: GroupSpace, needs: str | None = None):
  if cfg.estimator != name:
    raise ValueError(f"config names estimator {cfg.estimator!r} but {name!r} was called")
  if needs is not None and getattr(space, needs) == 0:
    raise ValueError(f"estimator {name!r} needs GroupSpace.{needs} > 0, got {space}")


# ----------------------------------------------------------------------------- group estimators


def _filter_keep(ids: jax.Array, num: int, valid: jax.Array, policy: jax.Array,
                 num_policies: int, mean: jax.Array, constant: jax.Array, cfg: AdvantageConfig,
                 axis_name: AxisName) -> jax.Array:
  """bool[N]: the sample's group survives filtering (decided from global values, so identically
  on every device).

  "lowest_mean" ranks each policy's groups on their own: PettingLLMs filters every model's batch
  separately, so with one policy per agent each agent loses its own lowest-mean fraction (a
  shared policy is one ranking, as before). A group whose samples come from several policies
  (group_by "problem") enters the ranking of each of them with the group's mean. Ties drop the
  lower group id first.
  """
  if cfg.filter == "zero_variance":
    return ~_take(constant, ids)
  if cfg.filter != "lowest_mean":
    return jnp.ones_like(valid)
  pair = policy * num + ids  # (policy, group), policy-major: row p of a [num_policies, num] grid
  present = _seg_sum(jnp.ones(ids.shape, jnp.float32), pair, valid, num_policies * num,
                     axis_name).reshape(num_policies, num) > 0
  order = jnp.argsort(jnp.where(present, mean[None, :], jnp.inf), axis=1, stable=True)
  rank = jnp.argsort(order, axis=1)  # rank of each group within its policy's row
  k = jnp.floor(cfg.filter_fraction * jnp.sum(present, axis=1))  # [num_policies]
  keep = present & (rank >= k[:, None])
  return _take(keep.reshape(-1), pair)


def _group_estimate(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
                    axis_name: AxisName, name: str) -> AdvantageOutput:
  _check(cfg, name, space)
  cfg = cfg.resolved()
  r = mixed_reward(batch, cfg.alpha)
  ids, num, ok = group_ids(batch, cfg.group_by, space)
  if cfg.filter == "lowest_mean":  # ranked per policy; one policy per agent at most
    ok &= _in_range(batch.policy_id, 0, space.num_agents)
  valid = batch.sample_mask & ok
  cnt, mean, std = _moments(r, ids, valid, num, cfg.std_ddof, axis_name)
  constant = _seg_max(r, ids, valid, num, axis_name) <= -_seg_max(-r, ids, valid, num, axis_name)
  in_kept_group = valid & _filter_keep(ids, num, valid, batch.policy_id, space.num_agents, mean,
                                       constant, cfg, axis_name)
  g_cnt, g_mean, g_std = _take(cnt, ids), _take(mean, ids), _take(std, ids)
  train = valid
  metrics = {}
  if name == "rloo":
    # Leave-one-out mean: r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean).
    adv = jnp.where(g_cnt > 1, g_cnt / jnp.maximum(g_cnt - 1.0, 1.0) * (r - g_mean), 0.0)
  elif name == "remax":
    greedy = valid & batch.is_greedy
    n_greedy = _seg_sum(jnp.ones_like(r), ids, greedy, num, axis_name)
    base = _seg_sum(r, ids, greedy, num, axis_name) / jnp.maximum(n_greedy, 1.0)
    has_base = _take(n_greedy, ids) > 0
    adv = jnp.where(has_base, r - _take(base, ids), 0.0)
    train = valid & ~batch.is_greedy & has_base
    metrics["groups_without_greedy"] = jnp.sum((cnt > 0) & (n_greedy == 0)).astype(jnp.float32)
  else:
    if name == "drmas":  # a singleton group has no statistics: mean 0, std 1
      g_mean = jnp.where(g_cnt > 1, g_mean, 0.0)
      g_std = jnp.where(g_cnt > 1, g_std, 1.0)
    adv = r - g_mean
    if cfg.normalize_std:
      adv = adv / (g_std + cfg.eps)
  keep = train & in_kept_group
  kept_cnt = _seg_sum(jnp.ones_like(r), ids, in_kept_group, num, axis_name)
  metrics.update(groups=jnp.sum(cnt > 0).astype(jnp.float32),
                 groups_kept=jnp.sum(kept_cnt > 0).astype(jnp.float32))
  return _finalize(jnp.where(keep, adv, 0.0), None, valid, keep, batch, cfg, axis_name, metrics)


def grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
         axis_name: AxisName = None) -> AdvantageOutput:
  """GRPO: `(r - mean_g) / (std_g + eps)` over the samples of one problem."""
  return _group_estimate(batch, cfg, space, axis_name, "grpo")


def at_grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
            axis_name: AxisName = None) -> AdvantageOutput:
  """AT-GRPO: GRPO within (problem, turn, agent), whose members share one prompt (tree sampling)."""
  return _group_estimate(batch, cfg, space, axis_name, "at_grpo")


def drmas(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
          axis_name: AxisName = None) -> AdvantageOutput:
  """Dr. MAS: per-agent statistics over (problem, agent), unbiased std; singleton: mean 0, std 1."""
  return _group_estimate(batch, cfg, space, axis_name, "drmas")


def dr_grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
            axis_name: AxisName = None) -> AdvantageOutput:
  """Dr. GRPO: `r - mean_g`, no std division (avoids up-weighting near-constant groups)."""
  return _group_estimate(batch, cfg, space, axis_name, "dr_grpo")


def rloo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
         axis_name: AxisName = None) -> AdvantageOutput:
  """RLOO: baseline = mean of the *other* samples of the group (unbiased); singletons get 0."""
  return _group_estimate(batch, cfg, space, axis_name, "rloo")


def remax(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
          axis_name: AxisName = None) -> AdvantageOutput:
  """ReMax: baseline = reward of the group's greedy sample(s) (`is_greedy`; mean if several).

  The greedy samples only provide the baseline and are removed from the output `sample_mask`;
  a group without a greedy sample has no baseline, so its samples are dropped as well (counted in
  the `groups_without_greedy` metric). CoMLRL's "max" baseline is `magrpo` with `baseline="max"`.
  """
  return _group_estimate(batch, cfg, space, axis_name, "remax")


def traj_grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
              axis_name: AxisName = None) -> AdvantageOutput:
  """Dr. MAS's vanilla GRPO baseline: trajectories, not calls, are the group's members.

  Each call is scored with its trajectory's mean (mixed) reward, and those K trajectory values of
  a problem are normalised, `(R_traj - mean) / (std + eps)` (unbiased std by default), so a
  trajectory that makes more calls does not weigh more in the statistics. A problem with a single
  trajectory has no statistics: mean 0, std 1 (as in Dr. MAS's code). Needs `traj_id`; a
  trajectory's problem is its samples' `problem_id`.
  """
  _check(cfg, "traj_grpo", space, "num_trajs")
  cfg = cfg.resolved()
  n_t, n_p = space.num_trajs, space.num_problems
  traj = batch.traj_id
  valid = batch.sample_mask & _in_range(traj, 0, n_t) & _in_range(batch.problem_id, 0, n_p)
  r = mixed_reward(batch, cfg.alpha)
  t_cnt, r_traj, _ = _moments(r, traj, valid, n_t, 0, axis_name)  # [num_trajs], global
  present = t_cnt > 0
  prob = _seg_max(batch.problem_id, traj, valid, n_t, axis_name)
  # Trajectory arrays are already global, so problem statistics need no further collective.
  p_cnt, p_mean, p_std = (_take(x, prob) for x in _moments(r_traj, prob, present, n_p,
                                                           cfg.std_ddof, None))
  a = r_traj - jnp.where(p_cnt > 1, p_mean, 0.0)
  if cfg.normalize_std:
    a = a / (jnp.where(p_cnt > 1, p_std, 1.0) + cfg.eps)
  adv = jnp.where(valid, _take(a, traj), 0.0)
  metrics = dict(trajectories=jnp.sum(present).astype(jnp.float32))
  return _finalize(adv, None, valid, valid, batch, cfg, axis_name, metrics)


# ----------------------------------------------------------------------------- MAGRPO tree


def magrpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
           axis_name: AxisName = None) -> AdvantageOutput:
  """MAGRPO: group-relative advantage of the joint reward over sibling joint actions.

  A node is one joint action (all agents' samples of it share `node_id`); its reward is the mean
  of its samples' mixed rewards (the joint reward when every agent carries it). Multi-turn returns
  follow the tree, `R = r + gamma * mean(R of child nodes)`. Siblings are the nodes with the same
  parent (roots: the same problem). Only the `magrpo_tree` rollout gives a node siblings after the
  first turn (G joint actions from every node); a linear trajectory's later nodes are only
  children, whose advantage is 0 (config.build refuses that setting). The node advantage (R minus the sibling baseline, optionally
  z-scored over siblings, then clamped) goes to every agent's sample of the node.
  """
  _check(cfg, "magrpo", space, "num_nodes")
  cfg = cfg.resolved()
  m, p = space.num_nodes, space.num_problems
  node, parent, pid = batch.node_id, batch.parent_node, batch.problem_id
  valid = (batch.sample_mask & _in_range(node, 0, m) & _in_range(parent, -1, m)
           & _in_range(pid, 0, p))
  r = mixed_reward(batch, cfg.alpha)
  cnt = _seg_sum(jnp.ones_like(r), node, valid, m, axis_name)
  present = cnt > 0
  r_node = _seg_sum(r, node, valid, m, axis_name) / jnp.maximum(cnt, 1.0)
  par = jnp.where(present, _seg_max(parent, node, valid, m, axis_name), -1)
  prob = _seg_max(pid, node, valid, m, axis_name)
  ret = gae.tree_returns(r_node, par, present, cfg.gamma, space.max_turns)
  # Node arrays are already global, so sibling statistics need no further collective.
  sib, n_sib = jnp.where(par >= 0, par, m + prob), m + p
  s_cnt, s_mean, _ = _moments(ret, sib, present, n_sib, cfg.std_ddof, None)
  s_cnt, s_mean = _take(s_cnt, sib), _take(s_mean, sib)
  if cfg.baseline == "mean":
    a = ret - s_mean
  elif cfg.baseline == "none":
    a = ret
  elif cfg.baseline == "loo":
    a = jnp.where(s_cnt > 1, s_cnt / jnp.maximum(s_cnt - 1.0, 1.0) * (ret - s_mean), 0.0)
  else:  # "max"
    a = ret - _take(_seg_max(ret, sib, present, n_sib, None), sib)
  if cfg.normalize_std:
    a_cnt, a_mean, a_std = _moments(a, sib, present, n_sib, cfg.std_ddof, None)
    a = jnp.where(_take(a_cnt, sib) > 1,
                  (a - _take(a_mean, sib)) / (_take(a_std, sib) + cfg.eps), a)
  adv = jnp.where(valid, _take(a, node), 0.0)
  n_nodes = jnp.sum(present).astype(jnp.float32)
  metrics = dict(nodes=n_nodes,
                 return_mean=jnp.sum(jnp.where(present, ret, 0.0)) / jnp.maximum(n_nodes, 1.0))
  return _finalize(adv, None, valid, valid, batch, cfg, axis_name, metrics)


# ----------------------------------------------------------------------------- MARFT GAE


def _slots(batch: SampleBatch, space: GroupSpace) -> tuple[jax.Array, int, int, jax.Array]:
  """Dense slot of each sample in the [num_trajs, max_turns * num_agents] acting-order grid."""
  s = space.max_turns * space.num_agents
  ok = (_in_range(batch.traj_id, 0, space.num_trajs) & _in_range(batch.turn, 0, space.max_turns)
        & _in_range(batch.agent_id, 0, space.num_agents))
  slot = batch.traj_id * s + batch.turn * space.num_agents + batch.agent_id
  return slot, space.num_trajs * s, s, ok


def gae_action(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
               axis_name: AxisName = None) -> AdvantageOutput:
  """MARFT action-level GAE: agents are sub-steps of a turn, ordered (turn, agent) per trajectory.

  `delta = r_i + gamma * V_{i+1} - V_i` with `V_{i+1}` the next agent's value in the same turn,
  or for the last agent the first agent's value at the next turn (0 when the trajectory has no
  next turn: done). Returns (critic targets) are `A + V`. Each (traj, turn, agent) slot must hold
  at most one sample (`slot_collisions` counts violations).
  """
  _check(cfg, "gae_action", space, "num_trajs")
  cfg = cfg.resolved()
  slot, num, s, ok = _slots(batch, space)
  valid = batch.sample_mask & ok
  r = mixed_reward(batch, cfg.alpha)
  cnt = _seg_sum(jnp.ones_like(r), slot, valid, num, axis_name)
  grid = lambda x: _seg_sum(x, slot, valid, num, axis_name).reshape(-1, s)
  adv_grid = gae.slot_gae(grid(r), grid(batch.values), cnt.reshape(-1, s) > 0, cfg.gamma, cfg.lam)
  adv = jnp.where(valid, _take(adv_grid.reshape(-1), slot), 0.0)
  returns = adv + batch.values
  metrics = dict(slot_collisions=jnp.sum(cnt > 1).astype(jnp.float32))
  return _finalize(adv, returns, valid, valid, batch, cfg, axis_name, metrics)


def gae_token(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
              axis_name: AxisName = None) -> AdvantageOutput:
  """MARFT token-level GAE: one value per token, chained across agents and turns.

  Inside a response `delta_k = gamma * V_{k+1} - V_k`; at the last token
  `delta = r + gamma * V(first token of the next sample in acting order) - V`. The cross-sample
  links go through the slot grid (two chains, each after a `psum`), so a trajectory may be split
  over devices.
  """
  _check(cfg, "gae_token", space, "num_trajs")
  cfg = cfg.resolved()
  slot, num, s, ok = _slots(batch, space)
  tmask = batch.token_mask & (batch.sample_mask & ok)[:, None]
  present = jnp.any(tmask, axis=1)
  first = jnp.argmax(tmask, axis=1)[:, None]
  at_first = lambda x: jnp.take_along_axis(x, first, axis=1)[:, 0]
  grid = lambda x: _seg_sum(x, slot, present, num, axis_name).reshape(-1, s)
  r = mixed_reward(batch, cfg.alpha)
  cnt = grid(jnp.ones_like(r))
  present_grid = cnt > 0
  _, v_after = gae.backward_chain(grid(at_first(batch.token_values)), 0.0, present_grid)
  v_boot = jnp.where(present, _take(v_after.reshape(-1), slot), 0.0)
  a0, d = gae.token_gae_local(batch.token_values, tmask, r, v_boot, cfg.gamma, cfg.lam)
  _, a_after = gae.backward_chain(grid(at_first(a0)), grid(at_first(d)), present_grid)
  a_boot = jnp.where(present, _take(a_after.reshape(-1), slot), 0.0)
  adv = jnp.where(tmask, a0 + d * a_boot[:, None], 0.0)
  returns = adv + batch.token_values
  valid = batch.sample_mask & ok
  metrics = dict(slot_collisions=jnp.sum(cnt > 1).astype(jnp.float32))
  return _finalize(adv, returns, valid, valid, batch, cfg, axis_name, metrics)


# ----------------------------------------------------------------------------- registry

Estimator = Callable[[SampleBatch, AdvantageConfig, GroupSpace, AxisName], AdvantageOutput]

ESTIMATORS: Registry[Estimator] = Registry("estimator")
for _name, _estimator in (("grpo", grpo), ("at_grpo", at_grpo), ("drmas", drmas),
                          ("dr_grpo", dr_grpo), ("rloo", rloo), ("remax", remax),
                          ("traj_grpo", traj_grpo),
                          ("magrpo", magrpo), ("gae_action", gae_action),
                          ("gae_token", gae_token)):
  ESTIMATORS.register(_name, _estimator)


def get_estimator(name: str) -> Estimator:
  """The registered estimator `name`; raises ValueError listing the known names otherwise."""
  return ESTIMATORS.get(name)


def estimate(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
             axis_name: AxisName = None) -> AdvantageOutput:
  """Runs the estimator `cfg.estimator`.

  Args:
    batch: the samples (inside `shard_map`: this device's slice of the sample axis).
    cfg: estimator and options.
    space: static id ranges (segment counts).
    axis_name: mesh axis (or axes) the sample axis is split over; None on one device.

  Returns:
    The `AdvantageOutput`; its metrics are global and identical on every device.
  """
  return get_estimator(cfg.estimator)(batch, cfg, space, axis_name)
