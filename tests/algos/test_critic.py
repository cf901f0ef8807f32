"""MARFT value head vs a NumPy MLP; shapes, init scale, frozen base and bad sizes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos.critic import init_value_head, value_head


def test_value_head_matches_numpy_mlp():
  params = init_value_head(jax.random.key(0), 16, sizes=(32, 8))
  assert [l["w"].shape for l in params["layers"]] == [(16, 32), (32, 8), (8, 1)]
  # Non-zero biases so they are checked too.
  params = jax.tree.map(lambda p: p + 0.1, params)
  hidden = np.random.default_rng(0).normal(size=(3, 5, 16)).astype(np.float32)
  x = hidden.astype(np.float64)
  for i, layer in enumerate(params["layers"]):
    x = x @ np.asarray(layer["w"], np.float64) + np.asarray(layer["b"], np.float64)
    if i < 2:
      x = np.maximum(x, 0.0)
  out = value_head(params, hidden)
  assert out.shape == (3, 5) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, x[..., 0], rtol=1e-5, atol=1e-5)
  # A bf16 base still gets an fp32 head.
  assert value_head(params, jnp.asarray(hidden, jnp.bfloat16)).dtype == jnp.float32


def test_default_sizes_and_small_initial_values():
  params = init_value_head(jax.random.key(1), 64)
  assert [l["w"].shape for l in params["layers"]] == [(64, 1024), (1024, 512), (512, 1)]
  hidden = jax.random.normal(jax.random.key(2), (2, 4, 64))
  assert float(jnp.max(jnp.abs(value_head(params, hidden)))) < 0.5


def test_gradients_reach_the_head_but_not_the_base():
  params = init_value_head(jax.random.key(3), 8, sizes=(16,))
  hidden = jax.random.normal(jax.random.key(4), (2, 3, 8))
  g_params, g_hidden = jax.grad(lambda p, h: jnp.sum(value_head(p, h) ** 2),
                                argnums=(0, 1))(params, hidden)
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(g_params))
  np.testing.assert_array_equal(g_hidden, 0.0)


def test_bad_sizes_raise():
  with pytest.raises(ValueError, match=r"sizes=\(1024, 0\)"):
    init_value_head(jax.random.key(0), 8, sizes=(1024, 0))
