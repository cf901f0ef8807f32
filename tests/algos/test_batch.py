"""The batch module: id rules (derived here by hand), group codes, reward mix, rows and sizes."""
from __future__ import annotations

import chex
import numpy as np
import pytest

from marl_jax.algos import batch as batch_lib
from marl_jax.algos.batch import BatchShape, GroupSpace, make_batch
from marl_jax.workflows.rollout import Generation, Sample

SHAPE = BatchShape(num_problems=2, trajs_per_problem=3, max_turns=2, num_agents=2)


def sample(problem, branch, turn, agent, prompt, response, reward=0.0, team=0.0, policy=None):
  gen = Generation("x", tuple(prompt), tuple(response), tuple(-0.5 * (i + 1)
                                                              for i in range(len(response))))
  traj = batch_lib.traj_id(problem, branch, SHAPE.trajs_per_problem)
  return Sample(problem, traj, turn, f"a{agent}", agent, agent if policy is None else policy,
                branch, -1, [], gen, reward=reward, team_reward=team)


def test_id_rules():
  # 3 trajectories per problem: problem 1's branch 2 is trajectory 1 * 3 + 2 = 5.
  assert batch_lib.traj_id(1, 2, 3) == 5
  assert batch_lib.traj_id(0, 0, 3) == 0
  # 4 turns: trajectory 5's turn 3 is node 5 * 4 + 3 = 23, grown from node 22; turn 0 is a root.
  assert batch_lib.node_id(5, 3, 4) == 23
  assert batch_lib.parent_node(5, 3, 4) == 22
  assert batch_lib.parent_node(5, 0, 4) == -1
  space = SHAPE.space
  assert (space.num_trajs, space.num_nodes) == (6, 12)


def test_group_ids_are_mixed_radix_codes():
  space = GroupSpace(num_problems=3, max_turns=2, num_agents=2)
  b = make_batch(np.zeros(4), problem_id=[2, 0, 3, 1], turn=[1, 0, 0, 2], agent_id=[1, 1, 0, 0])
  ids, num, ok = batch_lib.group_ids(b, "problem", space)
  np.testing.assert_array_equal(ids, [2, 0, 3, 1])
  assert num == 3
  np.testing.assert_array_equal(ok, [True, True, False, True])  # problem 3 is out of range
  ids, num, _ = batch_lib.group_ids(b, "problem_agent", space)
  np.testing.assert_array_equal(ids, [2 * 2 + 1, 0 * 2 + 1, 3 * 2 + 0, 1 * 2 + 0])
  assert num == 6
  ids, num, ok = batch_lib.group_ids(b, "problem_turn_agent", space)
  np.testing.assert_array_equal(ids[:2], [(2 * 2 + 1) * 2 + 1, (0 * 2 + 0) * 2 + 1])
  assert num == 12
  np.testing.assert_array_equal(ok, [True, True, False, False])  # turn 2 is out of range too
  space = GroupSpace(num_problems=3, max_turns=2, num_agents=2, num_states=2)
  b = b.replace(state=np.array([1, 0, 1, 2], np.int32))
  ids, num, ok = batch_lib.group_ids(b, "problem_turn_agent_state", space)
  np.testing.assert_array_equal(ids[:2], [((2 * 2 + 1) * 2 + 1) * 2 + 1,
                                          ((0 * 2 + 0) * 2 + 1) * 2 + 0])
  assert num == 24
  np.testing.assert_array_equal(ok, [True, True, False, False])  # state 2 is out of range
  ids, num, ok = batch_lib.group_ids(b, "turn_agent_state", space)  # problems pooled
  np.testing.assert_array_equal(ids[:2], [(1 * 2 + 1) * 2 + 1, (0 * 2 + 1) * 2 + 0])
  assert num == 8
  np.testing.assert_array_equal(ok, [True, True, False, False])  # problem 3 still out of range
  with pytest.raises(ValueError, match=r"sample 3: state=2 outside \[0, 2\)"):
    batch_lib.validate_batch(b.replace(problem_id=np.array([2, 0, 1, 1], np.int32),
                                       turn=np.array([1, 0, 0, 1], np.int32)), space)


def test_mixed_reward():
  b = make_batch([1.0, -2.0], team_rewards=[2.0, 4.0])
  np.testing.assert_allclose(batch_lib.mixed_reward(b, 0.5), [2.0, 0.0])
  np.testing.assert_allclose(batch_lib.mixed_reward(b, 0.0), [1.0, -2.0])


def test_build_rows_assigns_every_id_and_pads():
  samples = [sample(1, 2, 1, 0, [7, 8, 9], [4, 5], reward=1.0, team=3.0),
             sample(0, 0, 0, 1, [6], [3, 2, 1])]
  rows = batch_lib.build_rows(samples, SHAPE, pad_id=0, rows=4, width=5, resp_width=4)
  chex.assert_shape([rows.prompt, rows.prompt_mask], (4, 5))
  chex.assert_shape([rows.response, rows.old_logp, rows.samples.token_mask], (4, 4))
  s = rows.samples
  # Sample 0: problem 1, branch 2 -> trajectory 1 * 3 + 2 = 5; turn 1 -> node 5 * 2 + 1 = 11,
  # parent node 10. Sample 1: trajectory 0, turn 0 -> node 0, a root.
  np.testing.assert_array_equal(s.problem_id, [1, 0, 0, 0])
  np.testing.assert_array_equal(s.traj_id, [5, 0, 0, 0])
  np.testing.assert_array_equal(s.turn, [1, 0, 0, 0])
  np.testing.assert_array_equal(s.agent_id, [0, 1, 0, 0])
  np.testing.assert_array_equal(s.policy_id, [0, 1, 0, 0])
  np.testing.assert_array_equal(s.node_id, [11, 0, 0, 0])
  np.testing.assert_array_equal(s.parent_node, [10, -1, -1, -1])
  np.testing.assert_array_equal(s.sample_mask, [True, True, False, False])
  np.testing.assert_allclose(s.rewards, [1.0, 0.0, 0.0, 0.0])
  np.testing.assert_allclose(s.team_rewards, [3.0, 0.0, 0.0, 0.0])
  # Prompts left-padded, responses right-padded, padding rows all masked out.
  np.testing.assert_array_equal(rows.prompt[0], [0, 0, 7, 8, 9])
  np.testing.assert_array_equal(rows.prompt_mask[1], [False] * 4 + [True])
  np.testing.assert_array_equal(rows.response[1], [3, 2, 1, 0])
  np.testing.assert_array_equal(s.token_mask[0], [True, True, False, False])
  np.testing.assert_allclose(rows.old_logp[1], [-0.5, -1.0, -1.5, 0.0])
  assert not s.token_mask[2:].any() and not rows.prompt_mask[2:].any()
  batch_lib.validate_batch(s, SHAPE.space)  # every id within the declared space


def test_sizes_bucket_and_round_to_the_multiple():
  samples = [sample(0, 0, 0, 0, [1] * 40, [2] * 17), sample(0, 1, 0, 1, [1] * 5, [2])]
  shape = BatchShape(num_problems=1, trajs_per_problem=2, max_turns=1, num_agents=2,
                     multiple=6)
  # Rows: 9 -> 16 (a multiple of row_block 8) -> multiple of 6: 18. Prompt 40 -> 64; response
  # 17 -> 32.
  assert shape.sizes(samples, block_rows=9) == (18, 64, 32)
  # Rows round to multiples of 8, not to powers of two: 20 -> 24 (not 32), 40 -> 40 (not 64);
  # powers of two below 8 (3 -> 4, then the minimum of 8 rows).
  one = BatchShape(1, 2, 1, 2)
  assert [one.sizes(samples, block_rows=n)[0] for n in (3, 20, 40, 65)] == [8, 24, 40, 72]
  assert BatchShape(1, 2, 1, 2, min_rows=1).sizes(samples, block_rows=3)[0] == 4
  # Widths above width_block = 64 round to its multiples, not to powers of two: a 301-token
  # prompt to 320 (not 512), a 130-token response to 192 (not 256); 64 stays 64.
  long = [sample(0, 0, 0, 0, [1] * 301, [2] * 130), sample(0, 1, 0, 1, [1] * 64, [2] * 64)]
  assert shape.sizes(long, block_rows=2) == (12, 320, 192)
  assert shape.sizes(long[1:], block_rows=1) == (12, 64, 64)
  # Minimums: 8 rows, 32 prompt tokens, 16 response tokens.
  assert BatchShape(1, 2, 1, 2).sizes(samples[1:], block_rows=1) == (8, 32, 16)
  with pytest.raises(ValueError, match="no samples"):
    shape.sizes([], block_rows=0)
  with pytest.raises(ValueError, match="3 samples do not fit in a block of 2 rows"):
    batch_lib.build_rows(samples + samples[:1], shape, 0, rows=2, width=64, resp_width=32)


def test_count_prompts_bounds_distinct_prompt_policy_pairs():
  # (1, 2) under policies 0 and 1 and (3,) under policy 0: 3 distinct pairs.
  samples = [sample(0, 0, 0, 0, [1, 2], [5]), sample(0, 1, 0, 0, [1, 2], [6]),
             sample(0, 2, 0, 0, [3], [5]), sample(1, 0, 0, 1, [1, 2], [5])]
  assert batch_lib.count_prompts(samples, rows=4) == 4  # 3 -> power of two 4
  assert batch_lib.count_prompts(samples, rows=8) == 4  # 3 + the padding rows' prompt
  assert batch_lib.count_prompts(samples[:3], rows=3) == 2  # (1, 2) and (3,): 2 pairs
  assert batch_lib.count_prompts(samples[1:], rows=3) == 3  # 3 pairs -> 4, capped at 3 rows


def test_tree_id_rules_name_nodes_by_their_first_leaf():
  """G = 3, T = 3, problem 1 (leaves 27..53): the path of branches (2, 0, 1) by hand."""
  g, t = 3, 3
  root = batch_lib.traj_id(1, 0, g ** t)
  assert root == 27
  t0 = batch_lib.child_traj(root, 0, 2, g, t)  # + 2 * 9
  t1 = batch_lib.child_traj(t0, 1, 0, g, t)  # + 0 * 3
  t2 = batch_lib.child_traj(t1, 2, 1, g, t)  # + 1 * 1
  assert (t0, t1, t2) == (45, 45, 46)
  assert batch_lib.parent_node(t2, 2, t, g) == batch_lib.node_id(45, 1, t) == 45 * 3 + 1
  assert batch_lib.parent_node(t1, 1, t, g) == batch_lib.node_id(45, 0, t) == 45 * 3
  assert batch_lib.parent_node(t0, 0, t, g) == -1
  # Branch 1 at turn 1 (traj 48) has the same parent as branch 0 (traj 45): siblings.
  assert batch_lib.parent_node(48, 1, t, g) == batch_lib.parent_node(45, 1, t, g)
  # Linear trajectories (branching 1) grow from their own previous turn.
  assert batch_lib.parent_node(46, 2, t) == batch_lib.node_id(46, 1, t)
