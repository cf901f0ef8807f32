"""Backward recursions on dense grids: GAE over slots and tokens, and returns over a node tree.

These kernels see only dense, already globally reduced arrays, so they need no collectives and
every device can run them redundantly; `return_estimators` does the scatter into grids, the `psum`
and the gather back. Missing slots (an agent that did not act, turns after the episode ended)
are skipped: a recursion links each present slot to the next *present* slot, and the last present
slot of a row bootstraps with 0 (the episode is over).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def backward_chain(w: jax.Array, decay: jax.Array | float,
                   present: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Solves `x_s = w_s + decay_s * x_{next present slot after s}` along axis 1, backwards.

  The recursion is a composition of affine maps, so it runs as an associative scan (log depth)
  instead of a sequential loop over a possibly long axis (tokens).

  Args:
    w: f32[B, S] per-slot term.
    decay: f32[B, S] or scalar factor on the next present slot's value.
    present: bool[B, S]; absent slots are skipped (they pass the next value through).

  Returns:
    x: f32[B, S] solution at present slots (at absent slots: the next present slot's value).
    x_after: f32[B, S] value of the next present slot after s; 0 past the last one.
  """
  decay = jnp.broadcast_to(jnp.asarray(decay, w.dtype), w.shape)
  a = jnp.where(present, decay, 1.0)
  b = jnp.where(present, w, 0.0)

  def compose(later, current):
    # (current o later)(x) = a_c * (a_l * x + b_l) + b_c.
    a_l, b_l = later
    a_c, b_c = current
    return a_c * a_l, a_c * b_l + b_c

  _, x = jax.lax.associative_scan(compose, (a, b), reverse=True, axis=1)
  x_after = jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)
  return x, x_after


def slot_gae(rewards: jax.Array, values: jax.Array, present: jax.Array, gamma: float,
             lam: float) -> jax.Array:
  """GAE over ordered slots (MARFT action level: slots are (turn, agent) in acting order).

  `delta_s = r_s + gamma * V_next - V_s` where `V_next` is the value of the next present slot
  (the next agent in the same turn, or the first agent of the next turn) and 0 after the last;
  `A_s = delta_s + gamma * lam * A_next`.

  Args:
    rewards, values: f32[B, S].
    present: bool[B, S].
    gamma, lam: discount and GAE lambda.

  Returns:
    f32[B, S] advantages (0 at absent slots).
  """
  _, v_next = backward_chain(values, 0.0, present)
  delta = rewards + gamma * v_next - values
  adv, _ = backward_chain(delta, gamma * lam, present)
  return jnp.where(present, adv, 0.0)


def token_gae_local(token_values: jax.Array, token_mask: jax.Array, rewards: jax.Array,
                    v_boot: jax.Array, gamma: float,
                    lam: float) -> tuple[jax.Array, jax.Array]:
  """Token-level GAE inside each sample, as a linear function of the next sample's advantage.

  Inside a response `delta_k = gamma * V_{k+1} - V_k`; at the last token
  `delta = r + gamma * v_boot - V_last` with `v_boot` the next sample's first-token value.
  The true advantage is `A_k = A0_k + D_k * A_boot` where `A_boot` is the next sample's
  first-token advantage, which depends on samples that may live on other devices; returning
  (A0, D) lets the caller resolve `A_boot` with a slot-level chain.

  Args:
    token_values: f32[N, T] critic values.
    token_mask: bool[N, T] response tokens (need not be contiguous).
    rewards: f32[N] reward of each sample, credited at its last token.
    v_boot: f32[N] bootstrap value (0 when the sample is the last of its trajectory).
    gamma, lam: discount and GAE lambda.

  Returns:
    A0: f32[N, T] advantages with `A_boot = 0`.
    D: f32[N, T] `(gamma * lam) ** (valid tokens from k to the end)`.
  """
  gl = gamma * lam
  _, v_next_tok = backward_chain(token_values, 0.0, token_mask)
  _, has_later = backward_chain(jnp.ones_like(token_values), 0.0, token_mask)
  is_last = token_mask & (has_later == 0.0)
  delta = jnp.where(is_last, rewards[:, None] + gamma * v_boot[:, None],
                    gamma * v_next_tok) - token_values
  a0, _ = backward_chain(delta, gl, token_mask)
  d, _ = backward_chain(jnp.where(is_last, gl, 0.0), gl, token_mask)
  return jnp.where(token_mask, a0, 0.0), jnp.where(token_mask, d, 0.0)


def tree_returns(rewards: jax.Array, parent: jax.Array, present: jax.Array, gamma: float,
                 depth: int) -> jax.Array:
  """Returns over a node tree: `R = r + gamma * mean(R of children)` (leaves: `R = r`).

  Iterating the map `depth - 1` times from `R = r` makes one more tree level exact per
  iteration, so it is exact for any tree of at most `depth` levels without sorting nodes.

  Args:
    rewards: f32[M] node rewards.
    parent: i32[M] parent node, -1 at roots.
    present: bool[M] node exists.
    gamma: discount.
    depth: static maximum number of levels (turns).

  Returns:
    f32[M] returns (0 at absent nodes).
  """
  m = rewards.shape[0]
  has_parent = present & (parent >= 0)
  seg = jnp.where(has_parent, parent, m)  # out-of-range ids are dropped by segment_sum
  n_children = jax.ops.segment_sum(has_parent.astype(rewards.dtype), seg, num_segments=m)
  r = jnp.where(present, rewards, 0.0)

  def step(_, ret):
    child_sum = jax.ops.segment_sum(jnp.where(has_parent, ret, 0.0), seg, num_segments=m)
    child_mean = jnp.where(n_children > 0, child_sum / jnp.maximum(n_children, 1.0), 0.0)
    return r + gamma * child_mean

  return jax.lax.fori_loop(0, max(depth - 1, 0), step, r)
