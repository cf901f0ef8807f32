"""Optimizers: schedules, AdamW against a NumPy re-derivation, per-policy settings, hold, frozen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos import optim


def numpy_adamw(p, grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, max_norm=None):
  """Reference AdamW (decoupled decay) with optional global-norm clipping, one array."""
  m, v = np.zeros_like(p), np.zeros_like(p)
  for t, g in enumerate(grads, start=1):
    if max_norm is not None:
      g = g * min(1.0, max_norm / np.linalg.norm(g))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    p = p - lr[t - 1] * (update + wd * p)
  return p


def run(tx, params, grads):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  return params


def test_schedules():
  cos = optim.make_schedule(optim.OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2,
                                              decay_steps=4, end_lr_ratio=0.1))
  got = [float(cos(i)) for i in range(7)]
  want = [0.0, 0.5] + [0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * k / 4)) for k in range(4)] + [0.1]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  lin = optim.make_schedule(optim.OptimConfig(lr=2.0, schedule="linear", decay_steps=4))
  np.testing.assert_allclose([float(lin(i)) for i in range(5)], [2.0, 1.5, 1.0, 0.5, 0.0])


def test_adamw_with_clipping_matches_numpy():
  rng = np.random.default_rng(0)
  p = rng.normal(size=(5, 3)).astype(np.float32)
  grads = [rng.normal(size=p.shape).astype(np.float32) * 3 for _ in range(4)]
  cfg = optim.OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, schedule="linear",
                          decay_steps=4)
  got = run(optim.make_optimizer(cfg), {"w": p}, [{"w": g} for g in grads])["w"]
  want = numpy_adamw(p.astype(np.float64), grads, lr=[1e-2 * (1 - t / 4) for t in range(4)],
                     wd=0.1, max_norm=1.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_per_policy_settings_hold_and_frozen():
  """Stacked params [L, P, ...] (LoRA layout): each policy slice has its own optimizer and its
  own clipping norm; a held policy is untouched until its hold ends; a frozen one never moves."""
  rng = np.random.default_rng(1)
  p = rng.normal(size=(2, 3, 4)).astype(np.float32)  # [L, P=3, 4]
  grads = [rng.normal(size=p.shape).astype(np.float32) for _ in range(3)]
  cfgs = [optim.OptimConfig(lr=1e-2, max_grad_norm=0.5, weight_decay=0.0),
          optim.OptimConfig(lr=1e-1, max_grad_norm=None, weight_decay=0.0, hold_steps=2),
          optim.OptimConfig(frozen=True)]
  tx = optim.per_policy([optim.make_optimizer(c) for c in cfgs], policy_axes=1)
  got = run(tx, p, grads)
  want0 = numpy_adamw(p[:, 0].astype(np.float64), [g[:, 0] for g in grads], lr=[1e-2] * 3,
                      max_norm=0.5)
  np.testing.assert_allclose(got[:, 0], want0, rtol=1e-5, atol=1e-7)
  # Policy 1: steps 1-2 held (no update, no moment update), step 3 is its first Adam step.
  want1 = numpy_adamw(p[:, 1].astype(np.float64), [grads[2][:, 1]], lr=[1e-1])
  np.testing.assert_allclose(got[:, 1], want1, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(got[:, 2], p[:, 2])
  held = run(tx, p, grads[:2])
  np.testing.assert_array_equal(held[:, 1], p[:, 1])


def test_by_key_checks_keys():
  tx = optim.by_key({"policy": optim.make_optimizer(optim.OptimConfig())})
  with pytest.raises(ValueError, match=r"params have keys \['critic', 'policy'\]"):
    tx.init({"policy": jnp.zeros(2), "critic": jnp.zeros(2)})


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="exp"), "unknown schedule 'exp'"),
    (dict(schedule="cosine"), "needs decay_steps"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(lr=-1.0), ">= 0"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optim.OptimConfig(**kwargs)
