"""Group-relative advantage estimators: GRPO, AT-GRPO, Dr. MAS, Dr. GRPO and Dr. MAS's trajectory
GRPO, and `group_estimate`, the group statistics, filtering and state scaling that every estimator
over `group_by` groups shares (RLOO, `rloo.py`, is one more such estimator in its own module).

Group statistics are segment reductions over static segment counts (`GroupSpace`, see
`segments`), exact across devices, so every device derives identical group decisions (filtering
ranks) from identical global values. Padding (`sample_mask` False) is excluded from every statistic
by construction, which Dr. MAS's public code gets wrong (padding duplicates enter the statistics).
Group ids are mixed-radix codes of (problem, turn, agent) with each factor's own size, so distinct
problems can never share a group (AT-GRPO's public code divides the problem index by K twice and
merges them).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from marl_jax.algos.advantage_config import (AdvantageConfig, AdvantageOutput, Estimator,
                                             check_estimator, finalize)
from marl_jax.algos.batch import GroupSpace, SampleBatch, group_ids, mixed_reward
from marl_jax.algos.segments import AxisName, in_range, moments, seg_max, seg_sum, take


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
    return ~take(constant, ids)
  if cfg.filter != "lowest_mean":
    return jnp.ones_like(valid)
  pair = policy * num + ids  # (policy, group), policy-major: row p of a [num_policies, num] grid
  present = seg_sum(jnp.ones(ids.shape, jnp.float32), pair, valid, num_policies * num,
                    axis_name).reshape(num_policies, num) > 0
  order = jnp.argsort(jnp.where(present, mean[None, :], jnp.inf), axis=1, stable=True)
  rank = jnp.argsort(order, axis=1)  # rank of each group within its policy's row
  k = jnp.floor(cfg.filter_fraction * jnp.sum(present, axis=1))  # [num_policies]
  keep = present & (rank >= k[:, None])
  return take(keep.reshape(-1), pair)


# (r, count, mean, std, resolved cfg) of each sample's group, all [N] -> the sample's advantage [N]
GroupAdvantage = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, AdvantageConfig],
                          jax.Array]


def group_estimate(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
                   axis_name: AxisName, name: str, advantage: GroupAdvantage) -> AdvantageOutput:
  """Estimator `name` over the `cfg.group_by` groups: the groups' global statistics, `advantage`
  of each sample from its group's, then the group filter, the state scaling and `finalize`."""
  check_estimator(cfg, name, space)
  cfg = cfg.resolved()
  r = mixed_reward(batch, cfg.alpha)
  ids, num, ok = group_ids(batch, cfg.group_by, space)
  if cfg.filter == "lowest_mean":  # ranked per policy; one policy per agent at most
    ok &= in_range(batch.policy_id, 0, space.num_agents)
  valid = batch.sample_mask & ok
  cnt, mean, std = moments(r, ids, valid, num, cfg.std_ddof, axis_name)
  constant = seg_max(r, ids, valid, num, axis_name) <= -seg_max(-r, ids, valid, num, axis_name)
  keep = valid & _filter_keep(ids, num, valid, batch.policy_id, space.num_agents, mean, constant,
                              cfg, axis_name)
  adv = advantage(r, take(cnt, ids), take(mean, ids), take(std, ids), cfg)
  if cfg.normalize_states:
    adv = adv / (_state_rms(adv, batch, space, keep, axis_name) + cfg.eps)
  if cfg.balance_states:
    adv = adv * _state_weights(batch, space, keep, axis_name)
  kept_cnt = seg_sum(jnp.ones_like(r), ids, keep, num, axis_name)
  metrics = dict(groups=jnp.sum(cnt > 0).astype(jnp.float32),
                 groups_kept=jnp.sum(kept_cnt > 0).astype(jnp.float32))
  return finalize(jnp.where(keep, adv, 0.0), None, valid, keep, batch, cfg, axis_name, metrics)


def _centred(r: jax.Array, cnt: jax.Array, mean: jax.Array, std: jax.Array,
             cfg: AdvantageConfig) -> jax.Array:
  """`r - mean`, divided by `std + eps` when `cfg.normalize_std`."""
  del cnt
  adv = r - mean
  return adv / (std + cfg.eps) if cfg.normalize_std else adv


def _drmas_centred(r: jax.Array, cnt: jax.Array, mean: jax.Array, std: jax.Array,
                   cfg: AdvantageConfig) -> jax.Array:
  """`_centred`, except that a singleton group has no statistics: mean 0, std 1 (Dr. MAS)."""
  return _centred(r, cnt, jnp.where(cnt > 1, mean, 0.0), jnp.where(cnt > 1, std, 1.0), cfg)


def _agent_state_ids(batch: SampleBatch, space: GroupSpace) -> tuple[jax.Array, int]:
  """(int[N] id of each sample's (agent, observed state) pair, the number of pairs); in range
  where kept (`group_ids` checked both)."""
  return batch.agent_id * space.num_states + batch.state, space.num_agents * space.num_states


def _state_rms(adv: jax.Array, batch: SampleBatch, space: GroupSpace, keep: jax.Array,
               axis_name: AxisName) -> jax.Array:
  """f32[N] `AdvantageConfig.normalize_states` scale: the root mean square of the kept
  advantages [N] of each sample's (agent, state)."""
  ids, num = _agent_state_ids(batch, space)
  n = seg_sum(jnp.ones_like(adv), ids, keep, num, axis_name)
  sq = seg_sum(jnp.square(adv), ids, keep, num, axis_name)
  return take(jnp.sqrt(sq / jnp.maximum(n, 1.0)), ids)


def _state_weights(batch: SampleBatch, space: GroupSpace, keep: jax.Array,
                   axis_name: AxisName) -> jax.Array:
  """f32[N] `AdvantageConfig.balance_states` weights, n_a / (S_a x n_as) over the kept samples:
  each state an agent was seen in carries the same total weight, and the agent's total is
  unchanged."""
  a, s = space.num_agents, space.num_states
  ids, num = _agent_state_ids(batch, space)
  n_as = seg_sum(jnp.ones_like(batch.rewards), ids, keep, num, axis_name).reshape(a, s)
  seen = n_as > 0
  n_a = n_as.sum(axis=1, keepdims=True)
  w = jnp.where(seen, n_a / (seen.sum(axis=1, keepdims=True) * jnp.maximum(n_as, 1.0)), 0.0)
  return take(w.reshape(-1), ids)


def grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
         axis_name: AxisName = None) -> AdvantageOutput:
  """GRPO: `(r - mean_g) / (std_g + eps)` over the samples of one problem."""
  return group_estimate(batch, cfg, space, axis_name, "grpo", _centred)


def at_grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
            axis_name: AxisName = None) -> AdvantageOutput:
  """AT-GRPO: GRPO within (problem, turn, agent), whose members share one prompt (tree sampling)."""
  return group_estimate(batch, cfg, space, axis_name, "at_grpo", _centred)


def drmas(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
          axis_name: AxisName = None) -> AdvantageOutput:
  """Dr. MAS: per-agent statistics over (problem, agent), unbiased std; singleton: mean 0, std 1."""
  return group_estimate(batch, cfg, space, axis_name, "drmas", _drmas_centred)


def dr_grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
            axis_name: AxisName = None) -> AdvantageOutput:
  """Dr. GRPO: `r - mean_g`, no std division (avoids up-weighting near-constant groups)."""
  return group_estimate(batch, cfg, space, axis_name, "dr_grpo", _centred)


def traj_grpo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
              axis_name: AxisName = None) -> AdvantageOutput:
  """Dr. MAS's vanilla GRPO baseline: trajectories, not calls, are the group's members.

  Each call is scored with its trajectory's mean (mixed) reward, and those K trajectory values of
  a problem are normalised, `(R_traj - mean) / (std + eps)` (unbiased std by default), so a
  trajectory that makes more calls does not weigh more in the statistics. A problem with a single
  trajectory has no statistics: mean 0, std 1 (as in Dr. MAS's code). Needs `traj_id`; a
  trajectory's problem is its samples' `problem_id`.
  """
  check_estimator(cfg, "traj_grpo", space)
  cfg = cfg.resolved()
  n_t, n_p = space.num_trajs, space.num_problems
  traj = batch.traj_id
  valid = batch.sample_mask & in_range(traj, 0, n_t) & in_range(batch.problem_id, 0, n_p)
  r = mixed_reward(batch, cfg.alpha)
  t_cnt, r_traj, _ = moments(r, traj, valid, n_t, 0, axis_name)  # [num_trajs], global
  present = t_cnt > 0
  prob = seg_max(batch.problem_id, traj, valid, n_t, axis_name)
  # Trajectory arrays are already global, so problem statistics need no further collective.
  p_cnt, p_mean, p_std = (take(x, prob) for x in moments(r_traj, prob, present, n_p,
                                                          cfg.std_ddof, None))
  a = r_traj - jnp.where(p_cnt > 1, p_mean, 0.0)
  if cfg.normalize_std:
    a = a / (jnp.where(p_cnt > 1, p_std, 1.0) + cfg.eps)
  adv = jnp.where(valid, take(a, traj), 0.0)
  metrics = dict(trajectories=jnp.sum(present).astype(jnp.float32))
  return finalize(adv, None, valid, valid, batch, cfg, axis_name, metrics)


GRPO = Estimator(grpo, dict(group_by="problem", std_ddof=0, normalize_std=True), grouped=True,
                 singleton_zero=True, divides_std=True)
AT_GRPO = Estimator(at_grpo, dict(group_by="problem_turn_agent", std_ddof=1, normalize_std=True),
                    grouped=True, singleton_zero=True, divides_std=True)
DRMAS = Estimator(drmas, dict(group_by="problem_agent", std_ddof=1, normalize_std=True),
                  grouped=True, divides_std=True)  # a singleton keeps its reward
DR_GRPO = Estimator(dr_grpo, dict(group_by="problem", std_ddof=0, normalize_std=False),
                    grouped=True, singleton_zero=True)
TRAJ_GRPO = Estimator(traj_grpo, dict(std_ddof=1, normalize_std=True), divides_std=True,
                      needs="num_trajs")
