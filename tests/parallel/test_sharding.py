"""FSDP specs of optimizer states: each moment split like its param, counts replicated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from marl_jax.algos import optim
from marl_jax.parallel import sharding


def _specs_by_path(tree):
  return {jax.tree_util.keystr(p): s for p, s in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]}


def test_state_specs_follow_params_through_nested_optimizers():
  """A mapped team (one optimizer per model name, nested by_key) and a critic: two models
  whose same-named kernels are split on different axes keep their own specs."""
  params = {"policy": {"solver": {"layers": {"k": jnp.zeros((2, 8, 16))}, "emb": jnp.zeros((32, 8))},
                       "verifier": {"layers": {"k": jnp.zeros((2, 8, 16))},
                                    "emb": jnp.zeros((32, 8))}},
            "critic": {"w": jnp.zeros((8, 4))}}
  specs = {"policy": {"solver": {"layers": {"k": P(None, None, "fsdp")}, "emb": P("fsdp")},
                      "verifier": {"layers": {"k": P(None, "fsdp", None)}, "emb": P("fsdp")}},
           "critic": {"w": P()}}
  tx = optim.by_key({"policy": optim.by_key({"solver": optax.adamw(1e-3),
                                             "verifier": optax.adamw(1e-3)}),
                     "critic": optax.adamw(1e-3)})
  got = _specs_by_path(sharding.state_specs(jax.eval_shape(tx.init, params), params, specs))
  for name, kernel in (("solver", P(None, None, "fsdp")), ("verifier", P(None, "fsdp", None))):
    for moment in ("mu", "nu"):
      assert got[f"['policy']['{name}'][0].{moment}['layers']['k']"] == kernel
      assert got[f"['policy']['{name}'][0].{moment}['emb']"] == P("fsdp", None)
    assert got[f"['policy']['{name}'][0].count"] == P()
  assert got["['critic'][0].mu['w']"] == P(None, None)


def test_state_specs_of_per_policy_slices_drop_the_policy_axis():
  """Stacked models [P, L, D, F]: each policy's moments are [L, D, F], split like the kernel
  without its (unsharded) policy axis; clip_by_global_norm's empty state adds nothing."""
  params = {"policy": {"layers": {"k": jnp.zeros((2, 3, 8, 16))}, "norm": jnp.zeros((2, 8))}}
  specs = {"policy": {"layers": {"k": P(None, None, None, "fsdp")}, "norm": P()}}
  adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  tx = optim.by_key({"policy": optim.per_policy([adamw, adamw], 0)})
  got = _specs_by_path(sharding.state_specs(jax.eval_shape(tx.init, params), params, specs))
  for p in (0, 1):
    assert got[f"['policy'][{p}][1][0].mu['layers']['k']"] == P(None, None, "fsdp")
    assert got[f"['policy'][{p}][1][0].nu['norm']"] == P(None)
    assert got[f"['policy'][{p}][1][0].count"] == P()
