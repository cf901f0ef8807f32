"""Optimizers: AdamW with schedules and global-norm clipping, one per policy if wanted.

Dr. MAS lets every agent's model have its own settings (learning rate, schedule, weight decay);
with policies stacked along an axis (per-agent LoRA adapters, stacked full models) the stacked
leaves are sliced per policy, each slice gets its own optimizer (and its own clipping norm, as a
separate model would), and the updates are restacked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW settings of one policy (defaults: AT-GRPO's lr 1e-6, wd 0.01, clip 1.0).

  Attributes:
    lr: peak learning rate.
    schedule: "constant", "cosine" or "linear" decay to `end_lr_ratio * lr` over `decay_steps`
      after the warm-up.
    warmup_steps: linear warm-up from 0 to `lr`.
    decay_steps: length of the cosine/linear decay (required by those schedules).
    end_lr_ratio: final learning rate as a fraction of `lr`.
    weight_decay: decoupled weight decay (AdamW).
    b1, b2, eps: Adam moments.
    max_grad_norm: clip this policy's gradient to this global norm; None disables.
    hold_steps: the first `hold_steps` updates leave params and optimizer state untouched (MARFT's
      critic-only warm-up: set it on the policy so only the critic trains at first).
    frozen: never update (MARFT's option to train one agent at a time).
  """
  lr: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  decay_steps: int = 0
  end_lr_ratio: float = 0.0
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float | None = 1.0
  hold_steps: int = 0
  frozen: bool = False

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"unknown schedule {self.schedule!r}; expected one of {list(SCHEDULES)}")
    if self.schedule != "constant" and self.decay_steps < 1:
      raise ValueError(f"schedule {self.schedule!r} needs decay_steps >= 1, got "
                       f"{self.decay_steps}")
    if (not (0 <= self.lr < math.inf and 0 <= self.weight_decay < math.inf)
        or self.warmup_steps < 0 or self.hold_steps < 0):  # NaN fails every comparison
      raise ValueError(f"lr and weight_decay must be finite and >= 0, warmup_steps and "
                       f"hold_steps >= 0: {self}")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.eps > 0 and self.end_lr_ratio >= 0):
      raise ValueError(f"Adam needs 0 <= b1, b2 < 1, eps > 0 and end_lr_ratio >= 0; got "
                       f"b1={self.b1}, b2={self.b2}, eps={self.eps}, "
                       f"end_lr_ratio={self.end_lr_ratio}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Learning rate as a function of the update count (warm-up, then constant/cosine/linear)."""
  end = cfg.lr * cfg.end_lr_ratio
  if cfg.schedule == "constant":
    main = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    main = optax.cosine_decay_schedule(cfg.lr, cfg.decay_steps, alpha=cfg.end_lr_ratio)
  else:
    main = optax.linear_schedule(cfg.lr, end, cfg.decay_steps)
  if not cfg.warmup_steps:
    return main
  warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  return optax.join_schedules([warmup, main], [cfg.warmup_steps])


class HoldState(NamedTuple):
  count: jax.Array  # [] int32 updates seen
  inner: Any


def _hold(inner: optax.GradientTransformation, steps: int) -> optax.GradientTransformation:
  """Zero updates and a frozen inner state for the first `steps` updates (schedules start after)."""

  def init(params):
    return HoldState(count=jnp.zeros((), jnp.int32), inner=inner.init(params))

  def update(grads, state, params=None):
    updates, new_inner = inner.update(grads, state.inner, params)
    active = state.count >= steps
    updates = jax.tree.map(lambda u: jnp.where(active, u, jnp.zeros_like(u)), updates)
    new_inner = jax.tree.map(lambda n, o: jnp.where(active, n, o), new_inner, state.inner)
    return updates, HoldState(count=state.count + 1, inner=new_inner)

  return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """clip_by_global_norm -> AdamW(schedule), or zero updates when frozen."""
  if cfg.frozen:
    return optax.set_to_zero()
  parts = [] if cfg.max_grad_norm is None else [optax.clip_by_global_norm(cfg.max_grad_norm)]
  parts.append(optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  tx = optax.chain(*parts)
  return _hold(tx, cfg.hold_steps) if cfg.hold_steps else tx


def per_policy(txs: Sequence[optax.GradientTransformation],
               policy_axes: Any) -> optax.GradientTransformation:
  """One optimizer per policy over params stacked along a policy axis.

  Args:
    txs: P optimizers; policy p's slice of every leaf goes to `txs[p]`.
    policy_axes: params-shaped pytree (or prefix) of ints, the axis of each leaf that indexes
      policies (1 for LoRA adapters `[L, P, ...]`, 0 for stacked models `[P, ...]`).
  """

  def leaf_axes(tree):  # expand a prefix of axes to one int per leaf of `tree`
    return jax.tree.map(lambda ax, sub: jax.tree.map(lambda _: ax, sub), policy_axes, tree)

  def slices(tree, p):
    return jax.tree.map(lambda ax, x: jnp.take(x, p, axis=ax), leaf_axes(tree), tree)

  def init(params):
    return tuple(tx.init(slices(params, p)) for p, tx in enumerate(txs))

  def update(grads, state, params=None):
    outs = [tx.update(slices(grads, p), s, None if params is None else slices(params, p))
            for p, (tx, s) in enumerate(zip(txs, state))]
    updates = jax.tree.map(lambda ax, *us: jnp.stack(us, axis=ax), leaf_axes(grads),
                           *[u for u, _ in outs])
    return updates, tuple(s for _, s in outs)

  return optax.GradientTransformation(init, update)


def by_key(txs: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
  """A different optimizer per top-level key of a dict of params (policy vs critic, or one per
  named model); nests, unlike optax.multi_transform's masking."""

  def check(tree):
    if sorted(tree) != sorted(txs):
      raise ValueError(f"params have keys {sorted(tree)}; the optimizers are for {sorted(txs)}")

  def init(params):
    check(params)
    return {k: tx.init(params[k]) for k, tx in txs.items()}

  def update(grads, state, params=None):
    check(grads)
    outs = {k: tx.update(grads[k], state[k], None if params is None else params[k])
            for k, tx in txs.items()}
    return {k: u for k, (u, _) in outs.items()}, {k: s for k, (_, s) in outs.items()}

  return optax.GradientTransformation(init, update)
