"""Parts of the train step called alone: the guarded update, the per-agent VJP, value inputs and
micro-batch splitting, against values derived here by hand."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, make_batch
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import by_key
from marl_jax.models.config import get_preset
from marl_jax.parallel import gradients
from marl_jax.parallel.mesh import BATCH_AXES, make_mesh
from marl_jax.parallel.policies import PolicyConfig
from marl_jax.parallel.train_config import TrainConfig, TrainSettings, TrainState
from marl_jax.parallel.train_step import guarded_update
from host import cpu_devices

MODEL = get_preset("tiny-llama")


def _cfg(kind="shared", **train):
  P_ = 1 if kind == "shared" else 2
  return TrainConfig(policy=PolicyConfig(kind=kind, models=(MODEL,), num_policies=P_),
                     advantage=AdvantageConfig("grpo"), loss=LossConfig(),
                     space=GroupSpace(num_problems=1, num_agents=P_),
                     train=TrainSettings(**train))


def _state(w):
  parts = {"policy": optax.sgd(0.5)}
  params = {"policy": jnp.asarray(w)}
  return parts, TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=by_key(parts).init(params), skipped=jnp.zeros((), jnp.int32))


def test_guarded_update_applies_skips_and_counts():
  cfg = _cfg(target_kl=0.1)
  parts, state = _state([1.0, 2.0])
  grads = {"policy": jnp.asarray([2.0, -4.0])}
  # SGD at lr 0.5: w - 0.5 * g = [0, 4]; grad norm sqrt(4 + 16).
  new, metrics = guarded_update(cfg, by_key(parts), parts, state, grads,
                                {"loss": jnp.float32(1.0), "approx_kl": jnp.float32(0.0)})
  np.testing.assert_allclose(new.params["policy"], [0.0, 4.0])
  np.testing.assert_allclose(metrics["grad_norm"], np.sqrt(20.0), rtol=1e-6)
  assert bool(metrics["finite"]) and bool(metrics["policy_updated"])
  assert (int(new.step), int(new.skipped)) == (1, 0)
  # target_kl: KL 0.5 > 0.1 keeps the policy but counts no skip (the step was finite).
  new, metrics = guarded_update(cfg, by_key(parts), parts, state, grads,
                                {"loss": jnp.float32(1.0), "approx_kl": jnp.float32(0.5)})
  np.testing.assert_array_equal(new.params["policy"], [1.0, 2.0])
  assert bool(metrics["finite"]) and not bool(metrics["policy_updated"])
  assert int(new.skipped) == 0
  # A non-finite loss: nothing changes and the skip is counted.
  new, metrics = guarded_update(_cfg(), by_key(parts), None, state, grads,
                                {"loss": jnp.float32(np.nan)})
  np.testing.assert_array_equal(new.params["policy"], [1.0, 2.0])
  assert not bool(metrics["finite"]) and int(new.skipped) == 1 and int(new.step) == 1


def test_agent_vjp_grads_differentiate_every_row():
  """Loss rows [p0^2 + p1^2, p0, 2 p1]: their gradients are [2p, e0, 2 e1], from one forward."""
  mesh = make_mesh(devices=cpu_devices(1))
  loss_fn = lambda p: (jnp.stack([jnp.sum(p ** 2), p[0], 2.0 * p[1]]), {"aux": p[0]})

  def body(p):  # params vary over the batch axes, as `local_grads` marks them
    grads, out, aux = gradients.agent_vjp_grads(loss_fn, gradients.vary(p), num_agents=2)
    return jax.lax.psum((grads, out), BATCH_AXES)  # one device: the all-reduce is the identity

  grads, out = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(
      jnp.asarray([3.0, -1.0]))
  chex.assert_shape(grads, (3, 2))
  np.testing.assert_allclose(grads, [[6.0, -2.0], [1.0, 0.0], [0.0, 2.0]])
  np.testing.assert_allclose(out, [10.0, 3.0, -2.0])


def test_value_inputs_per_action_and_per_token():
  values = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  returns = jnp.asarray([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
  mask = jnp.asarray([[True, True, False], [False, False, False]])
  samples = make_batch([0.0, 0.0], values=[0.5, 0.25], token_values=np.ones((2, 3)))
  v, old, ret, m = gradients.value_inputs(AdvantageConfig("gae_action"), values, samples, returns,
                                          mask)
  # One value per sample: the state before the response (column 0); return = mean over tokens.
  np.testing.assert_allclose(v, [[1.0], [4.0]])
  np.testing.assert_allclose(old, [[0.5], [0.25]])
  np.testing.assert_allclose(ret, [[2.0], [0.0]])
  np.testing.assert_array_equal(m, [[True], [False]])
  v, old, ret, m = gradients.value_inputs(AdvantageConfig("gae_token"), values, samples, returns,
                                          mask)
  assert v is values and ret is returns and m is mask
  np.testing.assert_allclose(old, np.ones((2, 3)))


def test_split_micro_moves_the_sample_axis_first():
  x = jnp.arange(2 * 8 * 3).reshape(2, 8, 3)  # stacked: [P, n, R]
  out = gradients.split_micro(_cfg("stacked", micro_batches=4), x)
  chex.assert_shape(out, (4, 2, 2, 3))
  # Micro-batch m of block p holds rows 2m, 2m + 1 of that block.
  np.testing.assert_array_equal(out[1, 0], x[0, 2:4])
  np.testing.assert_array_equal(out[3, 1], x[1, 6:8])
  flat = gradients.split_micro(_cfg(micro_batches=2), jnp.arange(8))
  np.testing.assert_array_equal(flat, [[0, 1, 2, 3], [4, 5, 6, 7]])
