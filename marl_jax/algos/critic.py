"""MARFT's centralised critic head: a trainable MLP over a frozen base model's hidden states.

The base LM is shared with the policies and stays frozen, so the critic's trainable state is
only this small head; `value_head` stops gradients into `hidden` to make that structural.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from marl_jax.algos.advantage_config import ESTIMATORS

ValueHeadParams = dict[str, list[dict[str, jax.Array]]]


def check_critic(estimator: str, critic: Sequence[int] | None, *,
                 estimator_field: str = "estimator", critic_field: str = "critic") -> None:
  """The one rule: an estimator whose record reads a critic's values (`Estimator.critic`) needs a
  critic, given as hidden sizes (`check_sizes`), and any other uses none. `*_field` name the
  settings in the error (config fields or dataclass attributes)."""
  needs = ESTIMATORS.get(estimator).critic is not None
  if needs and critic is None:
    raise ValueError(f"{estimator_field}={estimator!r} needs a critic; set {critic_field} to the "
                     "value head's hidden sizes, e.g. (1024, 512)")
  if critic is not None and not needs:
    raise ValueError(f"{critic_field}={tuple(critic)!r} but {estimator_field}={estimator!r} uses "
                     f"no critic; set {critic_field}=None or an estimator in "
                     f"{ESTIMATORS.having('critic')}")
  if critic is not None:
    check_sizes(critic, critic_field)


def check_sizes(sizes: Sequence[int], field: str = "sizes") -> None:
  """The value head's hidden sizes: one or more integers >= 1."""
  if not sizes or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1
                          for h in sizes):
    raise ValueError(f"{field}={tuple(sizes)!r}; expected hidden sizes, integers >= 1")


def init_value_head(key: jax.Array, hidden_size: int, sizes: Sequence[int] = (1024, 512),
                    out_scale: float = 0.01) -> ValueHeadParams:
  """Initialises the MLP `hidden_size -> sizes... -> 1` (MARFT: 1024, 512).

  Hidden layers use He-normal weights (ReLU) and zero biases; the output layer is scaled by
  `out_scale` so initial values are near 0 and the first value losses stay small.

  Returns:
    {"layers": [{"w": [d_in, d_out], "b": [d_out]}, ...]} in float32, the last layer 1-wide.
  """
  check_sizes(sizes)
  if hidden_size < 1:
    raise ValueError(f"hidden_size={hidden_size}; expected the base model's width, >= 1")
  dims = [hidden_size, *sizes, 1]
  keys = jax.random.split(key, len(dims) - 1)
  layers = []
  for i, (k, d_in, d_out) in enumerate(zip(keys, dims[:-1], dims[1:])):
    w = jax.nn.initializers.he_normal()(k, (d_in, d_out), jnp.float32)
    if i == len(dims) - 2:
      w = w * out_scale
    layers.append({"w": w, "b": jnp.zeros((d_out,), jnp.float32)})
  return {"layers": layers}


def value_head(params: ValueHeadParams, hidden: jax.Array) -> jax.Array:
  """Values per position.

  Args:
    params: from `init_value_head`.
    hidden: [N, T, D] final hidden states of the frozen base (any float dtype).

  Returns:
    f32[N, T] values (take the positions you need: one per token for `gae_token`, one per
    sample for `gae_action`).
  """
  x = jax.lax.stop_gradient(hidden).astype(jnp.float32)
  layers = params["layers"]
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  out = layers[-1]
  return (x @ out["w"] + out["b"])[..., 0]
