"""Rollout samples -> the padded `TrainBatch` of one training step (host side, NumPy).

Shapes are bucketed (sample rows, prompt width and response width round up to powers of two above
a minimum) so a run compiles a handful of train steps, not one per batch. Padding rows carry
`sample_mask=False` and an all-False token mask: they never enter a statistic or a loss (the
Dr. MAS public code padded with duplicated samples *before* computing advantages; we do not).

Ids are dense per step: the rollout numbers problems 0..num_problems-1 and trajectories
problem_id * trajs_per_problem + j, and a MAGRPO node is one (trajectory, turn) pair, so the
estimators' static segment counts (`BatchShape.space`) follow from the config alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from marl_jax.algos.batch import GroupSpace, make_batch
from marl_jax.algos.policies import PolicyConfig
from marl_jax.parallel.train_step import TrainBatch
from marl_jax.sampling.sampler import bucket
from marl_jax.workflows.rollout import Sample


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """Static sizes of one step's batch."""

  num_problems: int
  trajs_per_problem: int  # 1 in tree mode (one state per problem), K for independent rollouts
  max_turns: int
  num_agents: int
  multiple: int = 1  # rows per policy block must divide by devices x micro-batches
  min_rows: int = 8
  min_prompt: int = 32
  min_response: int = 16

  @property
  def space(self) -> GroupSpace:
    trajs = self.num_problems * self.trajs_per_problem
    return GroupSpace(num_problems=self.num_problems, max_turns=self.max_turns,
                      num_agents=self.num_agents, num_trajs=trajs,
                      num_nodes=trajs * self.max_turns)


def _rows(samples: Sequence[Sample], shape: BatchShape, pad_id: int, rows: int, width: int,
          resp_width: int) -> TrainBatch:
  """One block of `rows` rows: the samples, then padding."""
  prompt = np.full((rows, width), pad_id, np.int32)
  prompt_mask = np.zeros((rows, width), bool)
  response = np.full((rows, resp_width), pad_id, np.int32)
  old_logp = np.zeros((rows, resp_width), np.float32)
  token_mask = np.zeros((rows, resp_width), bool)
  fields = {k: np.zeros(rows, np.int32) for k in
            ("problem_id", "turn", "agent_id", "policy_id", "traj_id", "node_id")}
  fields["parent_node"] = np.full(rows, -1, np.int32)
  fields["team_rewards"] = np.zeros(rows, np.float32)
  fields["sample_mask"] = np.zeros(rows, bool)
  rewards = np.zeros(rows, np.float32)
  for i, s in enumerate(samples):
    gen = s.generation
    p, r = len(gen.prompt_ids), len(gen.token_ids)
    prompt[i, width - p:] = gen.prompt_ids
    prompt_mask[i, width - p:] = True
    response[i, :r] = gen.token_ids
    old_logp[i, :r] = gen.logprobs
    token_mask[i, :r] = True
    node = s.traj_id * shape.max_turns + s.turn
    values = dict(problem_id=s.problem_id, turn=s.turn, agent_id=s.agent_id,
                  policy_id=s.policy_id, traj_id=s.traj_id, node_id=node,
                  parent_node=node - 1 if s.turn else -1, team_rewards=s.team_reward,
                  sample_mask=True)
    for name, value in values.items():
      fields[name][i] = value
    rewards[i] = s.reward
  samples_batch = jax.tree.map(np.asarray, make_batch(rewards, token_mask=token_mask, **fields))
  return TrainBatch(prompt=prompt, prompt_mask=prompt_mask, response=response,
                    old_logp=old_logp, samples=samples_batch)


def batch_sizes(samples: Sequence[Sample], policy: PolicyConfig, shape: BatchShape
                ) -> tuple[int, int, int]:
  """(rows per block, prompt width, response width) that `build_batch` pads `samples` to.

  Multi-host runs take the element-wise maximum over processes (`multihost.agree_max`) and pass
  it to `build_batch`, so every process's rows have the same shapes.
  """
  if not samples:
    raise ValueError("no samples to train on; the rollout produced none")
  width = bucket(max(len(s.generation.prompt_ids) for s in samples), shape.min_prompt)
  resp = bucket(max(max(len(s.generation.token_ids), 1) for s in samples), shape.min_response)
  if policy.kind in ("shared", "lora"):
    n = len(samples)
  else:
    n = max(sum(s.policy_id == p for s in samples) for p in range(policy.num_policies))
  rows = bucket(max(n, 1), shape.min_rows)
  return -(-rows // shape.multiple) * shape.multiple, width, resp


def build_batch(samples: Sequence[Sample], policy: PolicyConfig, shape: BatchShape,
                pad_ids: Sequence[int], sizes: tuple[int, int, int] | None = None):
  """The step's TrainBatch in the layout of `policy` (flat, [P, n, ...] blocks, or a dict).

  `pad_ids`: one per model config of `policy` (a mapped team's models each pad with their own
  tokenizer's id, which must lie in that model's vocabulary); padding is masked out either way.
  `sizes`: (rows per block, prompt width, response width), at least `batch_sizes(samples, ...)`;
  default: exactly those.
  """
  if len(pad_ids) != len(policy.models):
    raise ValueError(f"{len(pad_ids)} pad ids for the {len(policy.models)} model config(s) of "
                     f"a {policy.kind!r} policy; expected one per model")
  need = batch_sizes(samples, policy, shape)
  rows, width, resp = need if sizes is None else sizes
  if any(s < n for s, n in zip((rows, width, resp), need)):
    raise ValueError(f"sizes (rows, prompt, response) = {tuple(sizes)} are smaller than the "
                     f"{need} these samples need")
  empty = [i for i, s in enumerate(samples) if not s.generation.token_ids]
  if empty:
    raise ValueError(f"samples {empty[:5]} have no response tokens; train batches need the "
                     "sampler's token ids (scripted policies cannot be trained)")
  if policy.kind in ("shared", "lora"):
    return _rows(samples, shape, pad_ids[0], rows, width, resp)
  blocks = [[s for s in samples if s.policy_id == p] for p in range(policy.num_policies)]
  pads = pad_ids if policy.kind == "mapped" else [pad_ids[0]] * policy.num_policies
  parts = [_rows(b, shape, pad, rows, width, resp) for b, pad in zip(blocks, pads)]
  if policy.kind == "mapped":
    return dict(zip(policy.names, parts))
  return jax.tree.map(lambda *xs: np.stack(xs), *parts)
