"""Return-based advantage estimators: MAGRPO over the joint-action tree and MARFT's GAE.

Both aggregate per-sample values into global per-node (MAGRPO) or per-slot (MARFT) arrays with the
cross-device segment reductions of `segments`, then run the recursions of `gae` on those global
arrays, so a trajectory or tree may be split over devices.
"""
from __future__ import annotations

import jax.numpy as jnp

from marl_jax.algos import gae
from marl_jax.algos.advantage_config import (AdvantageConfig, AdvantageOutput, Estimator,
                                             check_estimator, finalize)
from marl_jax.algos.batch import GroupSpace, SampleBatch, mixed_reward, slot_ids
from marl_jax.algos.segments import AxisName, in_range, moments, seg_max, seg_sum, take


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
  check_estimator(cfg, "magrpo", space)
  cfg = cfg.resolved()
  m, p = space.num_nodes, space.num_problems
  node, parent, pid = batch.node_id, batch.parent_node, batch.problem_id
  valid = (batch.sample_mask & in_range(node, 0, m) & in_range(parent, -1, m)
           & in_range(pid, 0, p))
  r = mixed_reward(batch, cfg.alpha)
  cnt = seg_sum(jnp.ones_like(r), node, valid, m, axis_name)
  present = cnt > 0
  r_node = seg_sum(r, node, valid, m, axis_name) / jnp.maximum(cnt, 1.0)
  par = jnp.where(present, seg_max(parent, node, valid, m, axis_name), -1)
  prob = seg_max(pid, node, valid, m, axis_name)
  ret = gae.tree_returns(r_node, par, present, cfg.gamma, space.max_turns)
  # Node arrays are already global, so sibling statistics need no further collective.
  sib, n_sib = jnp.where(par >= 0, par, m + prob), m + p
  s_cnt, s_mean, _ = moments(ret, sib, present, n_sib, cfg.std_ddof, None)
  s_cnt, s_mean = take(s_cnt, sib), take(s_mean, sib)
  if cfg.baseline == "mean":
    a = ret - s_mean
  elif cfg.baseline == "none":
    a = ret
  elif cfg.baseline == "loo":
    a = jnp.where(s_cnt > 1, s_cnt / jnp.maximum(s_cnt - 1.0, 1.0) * (ret - s_mean), 0.0)
  else:  # "max"
    a = ret - take(seg_max(ret, sib, present, n_sib, None), sib)
  if cfg.normalize_std:
    a_cnt, a_mean, a_std = moments(a, sib, present, n_sib, cfg.std_ddof, None)
    a = jnp.where(take(a_cnt, sib) > 1,
                  (a - take(a_mean, sib)) / (take(a_std, sib) + cfg.eps), a)
  adv = jnp.where(valid, take(a, node), 0.0)
  n_nodes = jnp.sum(present).astype(jnp.float32)
  metrics = dict(nodes=n_nodes,
                 return_mean=jnp.sum(jnp.where(present, ret, 0.0)) / jnp.maximum(n_nodes, 1.0))
  return finalize(adv, None, valid, valid, batch, cfg, axis_name, metrics)


# ----------------------------------------------------------------------------- MARFT GAE


def gae_action(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
               axis_name: AxisName = None) -> AdvantageOutput:
  """MARFT action-level GAE: agents are sub-steps of a turn, ordered (turn, agent) per trajectory.

  `delta = r_i + gamma * V_{i+1} - V_i` with `V_{i+1}` the next agent's value in the same turn,
  or for the last agent the first agent's value at the next turn (0 when the trajectory has no
  next turn: done). Returns (critic targets) are `A + V`. Each (traj, turn, agent) slot must hold
  at most one sample (`slot_collisions` counts violations).
  """
  check_estimator(cfg, "gae_action", space)
  cfg = cfg.resolved()
  slot, num, s, ok = slot_ids(batch, space)
  valid = batch.sample_mask & ok
  r = mixed_reward(batch, cfg.alpha)
  cnt = seg_sum(jnp.ones_like(r), slot, valid, num, axis_name)
  grid = lambda x: seg_sum(x, slot, valid, num, axis_name).reshape(-1, s)
  adv_grid = gae.slot_gae(grid(r), grid(batch.values), cnt.reshape(-1, s) > 0, cfg.gamma, cfg.lam)
  adv = jnp.where(valid, take(adv_grid.reshape(-1), slot), 0.0)
  returns = adv + batch.values
  metrics = dict(slot_collisions=jnp.sum(cnt > 1).astype(jnp.float32))
  return finalize(adv, returns, valid, valid, batch, cfg, axis_name, metrics)


def gae_token(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
              axis_name: AxisName = None) -> AdvantageOutput:
  """MARFT token-level GAE: one value per token, chained across agents and turns.

  Inside a response `delta_k = gamma * V_{k+1} - V_k`; at the last token
  `delta = r + gamma * V(first token of the next sample in acting order) - V`. The cross-sample
  links go through the slot grid (two chains, each after a `psum`), so a trajectory may be split
  over devices.
  """
  check_estimator(cfg, "gae_token", space)
  cfg = cfg.resolved()
  slot, num, s, ok = slot_ids(batch, space)
  tmask = batch.token_mask & (batch.sample_mask & ok)[:, None]
  present = jnp.any(tmask, axis=1)
  first = jnp.argmax(tmask, axis=1)[:, None]
  at_first = lambda x: jnp.take_along_axis(x, first, axis=1)[:, 0]
  grid = lambda x: seg_sum(x, slot, present, num, axis_name).reshape(-1, s)
  r = mixed_reward(batch, cfg.alpha)
  cnt = grid(jnp.ones_like(r))
  present_grid = cnt > 0
  _, v_after = gae.backward_chain(grid(at_first(batch.token_values)), 0.0, present_grid)
  v_boot = jnp.where(present, take(v_after.reshape(-1), slot), 0.0)
  a0, d = gae.token_gae_local(batch.token_values, tmask, r, v_boot, cfg.gamma, cfg.lam)
  _, a_after = gae.backward_chain(grid(at_first(a0)), grid(at_first(d)), present_grid)
  a_boot = jnp.where(present, take(a_after.reshape(-1), slot), 0.0)
  adv = jnp.where(tmask, a0 + d * a_boot[:, None], 0.0)
  returns = adv + batch.token_values
  valid = batch.sample_mask & ok
  metrics = dict(slot_collisions=jnp.sum(cnt > 1).astype(jnp.float32))
  return finalize(adv, returns, valid, valid, batch, cfg, axis_name, metrics)


MAGRPO = Estimator(magrpo, dict(std_ddof=0, normalize_std=False, gamma=0.9, clamp=10.0),
                   divides_std=True, gamma=True, siblings=True, needs="num_nodes")
GAE_ACTION = Estimator(gae_action, dict(std_ddof=0, normalize_std=False, gamma=0.99, lam=0.95),
                       gamma=True, lam=True, critic="sample", needs="num_trajs")
GAE_TOKEN = Estimator(gae_token, dict(std_ddof=0, normalize_std=False, gamma=0.99, lam=0.95),
                      gamma=True, lam=True, critic="token", needs="num_trajs")
