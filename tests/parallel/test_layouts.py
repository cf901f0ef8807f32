"""Policy layouts: per-kind batch arrangement, pad ids, flatten round trips, batch checks."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos.batch import BatchShape
from marl_jax.models.config import get_preset
from marl_jax.models.lora import LoraConfig
from marl_jax.parallel import layouts
from marl_jax.parallel.policies import PolicyConfig
from marl_jax.workflows.rollout import Generation, Sample

MODEL = get_preset("tiny-llama")
SHAPE = BatchShape(num_problems=2, trajs_per_problem=1, max_turns=1, num_agents=2, min_rows=2,
                   min_prompt=4, min_response=2)
AGENTS = (0, 1)


def policy(kind: str) -> PolicyConfig:
  P = 1 if kind == "shared" else 2
  return PolicyConfig(kind=kind, models=(MODEL,) * (2 if kind == "mapped" else 1),
                      num_policies=P, names=("solver", "checker") if kind == "mapped" else (),
                      lora=LoraConfig(rank=2, alpha=4.0) if kind == "lora" else None)


def samples(kind: str) -> list[Sample]:
  """Problem 0: both agents; problem 1: agent 0 only (3 samples, policy blocks of 2 and 1)."""
  out = []
  for problem, agent in ((0, 0), (0, 1), (1, 0)):
    gen = Generation("x", (5, 6), (7,), (-1.0,))
    out.append(Sample(problem, problem, 0, f"a{agent}", agent, 0 if kind == "shared" else agent,
                      0, -1, [], gen, reward=float(problem + agent)))
  return out


@pytest.mark.parametrize("kind", ["shared", "lora", "stacked", "mapped"])
def test_build_batch_arranges_rows_per_kind(kind):
  cfg = policy(kind)
  pads = [90, 91][:len(cfg.models)]
  batch = layouts.build_batch(cfg, samples(kind), SHAPE, pads)
  layout = layouts.of(cfg)
  if kind in ("shared", "lora"):  # one flat block of 3 samples -> 4 rows (power of two)
    chex.assert_shape(batch.response, (4, 2))
    np.testing.assert_array_equal(batch.samples.sample_mask, [True] * 3 + [False])
    np.testing.assert_array_equal(batch.response[3], [90, 90])
  elif kind == "stacked":  # [P, rows]: blocks of 2 and 1 samples, both padded to 2 rows
    chex.assert_shape(batch.response, (2, 2, 2))
    np.testing.assert_array_equal(batch.samples.policy_id[0, :2], [0, 0])
    np.testing.assert_array_equal(batch.samples.sample_mask, [[True, True], [True, False]])
    np.testing.assert_array_equal(batch.response[1, 1], [90, 90])
  else:  # one block per name, each padded with its own model's pad id
    assert list(batch) == ["solver", "checker"]
    np.testing.assert_array_equal(batch["checker"].samples.sample_mask, [True, False])
    np.testing.assert_array_equal(batch["checker"].response[1], [91, 91])
    np.testing.assert_array_equal(batch["solver"].samples.problem_id, [0, 1])
  layouts.validate_batch(cfg, SHAPE.space, AGENTS if kind != "shared" else (0, 0), batch,
                         shards=2)
  # flatten / unflatten are inverse; flat rows keep the block order.
  flat = layout.flatten(cfg, batch)
  chex.assert_rank(flat.response, 2)
  back = layout.unflatten(cfg, flat, batch)
  chex.assert_trees_all_close(back, batch)
  spec = layouts.batch_spec(cfg, "x")
  assert tuple(spec) == ((None, "x") if kind == "stacked" else ("x",))
  # The distinct-prompt bound (every sample's prompt is (5, 6)): shared, 1 prompt + the padding
  # row's -> 2; lora, one per adapter + padding -> 3 -> 4; stacked / mapped, the larger block:
  # policy 1's sample + its padding row -> 2. Set on every block only when asked.
  bound = {"shared": 2, "lora": 4, "stacked": 2, "mapped": 2}[kind]
  rows = layouts.batch_sizes(cfg, samples(kind), SHAPE)[0]
  assert layouts.prompt_bound(cfg, samples(kind), rows) == bound
  assert {b.num_prompts for b in jax.tree.leaves(
      layout.groups(cfg, batch, lambda b: [b]), is_leaf=lambda x: hasattr(x, "num_prompts"))} == {
      None}
  shared = layouts.build_batch(cfg, samples(kind), SHAPE, pads, num_prompts=bound)
  assert {b.num_prompts for b in jax.tree.leaves(
      layout.groups(cfg, shared, lambda b: [b]), is_leaf=lambda x: hasattr(x, "num_prompts"))} == {
      bound}
  if bound > 1:  # a bound below the distinct prompts would pair rows with wrong prompts
    with pytest.raises(ValueError, match=f"num_prompts={bound - 1} is below these samples' "
                                         f"prompt bound {bound} "):
      layouts.build_batch(cfg, samples(kind), SHAPE, pads, num_prompts=bound - 1)


def test_batch_checks_name_the_culprit():
  stacked, mapped = policy("stacked"), policy("mapped")
  batch = layouts.build_batch(stacked, samples("stacked"), SHAPE, [0])
  with pytest.raises(ValueError, match="do not split into 4"):
    layouts.validate_batch(stacked, SHAPE.space, AGENTS, batch, shards=4)
  swapped = jax.tree.map(lambda x: x[::-1], batch)  # policy 1's block sits first
  with pytest.raises(ValueError, match="sits in policy 0's block of the stacked batch"):
    layouts.validate_batch(stacked, SHAPE.space, AGENTS, swapped, shards=2)
  three = jax.tree.map(lambda x: np.concatenate([x, x[:1]]), batch)
  with pytest.raises(ValueError, match="3 policy blocks; expected num_policies=2"):
    layouts.validate_batch(stacked, SHAPE.space, AGENTS, three, shards=2)
  one = jax.tree.map(lambda x: x[1:], batch)  # policy 1's block alone
  layouts.validate_batch(stacked, SHAPE.space, AGENTS, one.replace(policies=(1,)), shards=2)
  with pytest.raises(ValueError, match="sits in policy 0's block of the stacked batch"):
    layouts.validate_batch(stacked, SHAPE.space, AGENTS, one.replace(policies=(0,)), shards=2)
  with pytest.raises(ValueError, match=r"1 policy blocks for policies \(0, 1\); expected one "
                     r"block per listed policy, each in \[0, 2\)"):
    layouts.validate_batch(stacked, SHAPE.space, AGENTS, one.replace(policies=(0, 1)), shards=2)
  with pytest.raises(ValueError, match=r"keys \['checker', 'solver'\], got TrainBatch"):
    layouts.validate_batch(mapped, SHAPE.space, AGENTS, batch, shards=2)
  with pytest.raises(ValueError, match="2 pad ids for the 1 model config"):
    layouts.build_batch(stacked, samples("stacked"), SHAPE, [0, 1])
  with pytest.raises(ValueError, match="unknown policy kind 'per_role'"):
    PolicyConfig(kind="per_role", models=(MODEL,))


def test_acting_params_pick_the_policy():
  trainable = {"policy": {"w": jnp.arange(6.0).reshape(2, 3)}}
  index, params, adapters = layouts.of(policy("stacked")).acting_params(
      policy("stacked"), trainable, {}, 1, n=4)
  np.testing.assert_array_equal(params["w"], [3.0, 4.0, 5.0])
  assert index == 0 and adapters is None
  mapped = policy("mapped")
  team = {"policy": {"solver": "S", "checker": "C"}}
  assert layouts.of(mapped).acting_params(mapped, team, {}, 1, n=4) == (1, "C", None)
  shared = policy("shared")
  assert layouts.of(shared).acting_params(shared, team, {}, 0, n=4) == (0, team["policy"], None)
