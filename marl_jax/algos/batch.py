"""The batch: rollout samples -> the learner's flat `TrainBatch`, and every id rule.

One sample is one agent's response at one turn (one LLM call). Every field has a leading sample
axis `N`, so the whole batch can be split along that axis by `shard_map` (`in_specs=P('data')`);
all group ids are globally unique and dense, so per-device segment statistics can be summed across
devices into exact global statistics.

Ids are dense per step and their rules live here only: the rollout numbers problems
0..num_problems-1 and the j-th trajectory of a problem `traj_id(problem_id, j, trajs_per_problem)`
(one per problem in tree mode, K for independent rollouts, G^T leaves of a MAGRPO joint-action
tree, `child_traj`); `build_rows` assigns every other id (a MAGRPO node is one (trajectory, turn)
pair, `node_id`, and its parent follows `parent_node`), so the estimators' static segment counts
(`BatchShape.space`) follow from the config alone. The estimators decode group ids
with `group_ids` and mix rewards with `mixed_reward`.

Host side (NumPy): `build_rows` pads samples into one flat block; shapes are bucketed so a run
compiles a handful of train steps, not one per batch: rows round up with `round_rows` (multiples
of `ROW_BLOCK`, powers of two below it; 40 samples take 40 rows, not 64), prompt and response
widths to multiples of `BatchShape.width_block`: a 301-token game prompt pads to 320, not 512.
The price: prompts of up to P tokens can take ceil(P / 64) widths instead of log2(P) ones, so a
run whose prompt lengths wander compiles more step shapes. Padding rows carry
`sample_mask=False` and an all-False token mask: they never enter a statistic or a loss (the
Dr. MAS public code padded with duplicated samples *before* computing advantages; we do not).
Arranging blocks per policy kind is the policy layout's job (`parallel/layouts.py`).

(Over 400 lines: every id rule lives here and only here, the host-side ones too (`group_key`,
`mix`, `slot_ids`, `branch_of`, `id_layout`), beside the batch they number.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import chex
import flax.struct
import jax
import numpy as np

from marl_jax.algos.segments import in_range
from marl_jax.shapes import bucket, round_bucket, round_up

ROW_BLOCK = 8  # row counts: powers of two below it, then its multiples (`round_rows`)


@dataclasses.dataclass(frozen=True)
class GroupSpace:
  """Static sizes of the id spaces, so segment reductions have static segment counts.

  Attributes:
    num_problems: problem ids lie in [0, num_problems).
    max_turns: turns lie in [0, max_turns); also the depth of MAGRPO trees.
    num_agents: agent ids lie in [0, num_agents).
    num_trajs: trajectory ids lie in [0, num_trajs) (needed by `gae_*`; 0 = unused).
    num_nodes: node ids lie in [0, num_nodes) (needed by `magrpo`; 0 = unused).
    num_states: observed-state ids lie in [0, num_states) (the `group_by`s that split by state;
      1 when the workflow's observations declare none).
  """
  num_problems: int
  max_turns: int = 1
  num_agents: int = 1
  num_trajs: int = 0
  num_nodes: int = 0
  num_states: int = 1

  def __post_init__(self):
    for name in ("num_problems", "max_turns", "num_agents", "num_trajs", "num_nodes",
                 "num_states"):
      value = getattr(self, name)
      low = 0 if name in ("num_trajs", "num_nodes") else 1
      if not isinstance(value, int) or value < low:
        raise ValueError(f"GroupSpace.{name} must be an int >= {low}, got {value!r}")


@flax.struct.dataclass
class SampleBatch:
  """Per-sample arrays (`N` samples, `T` response tokens).

  Attributes:
    rewards: f32[N] local (agent) reward of the sample.
    team_rewards: f32[N] team/global reward; estimators use `alpha * team_rewards + rewards`.
    sample_mask: bool[N]; False marks padding, which never enters any statistic.
    problem_id: i32[N] globally unique problem id, dense in [0, num_problems).
    turn: i32[N] turn index in [0, max_turns).
    agent_id: i32[N] agent index in [0, num_agents), also its position in the turn order.
    policy_id: i32[N] which policy (params / LoRA adapter) produced the sample.
    traj_id: i32[N] trajectory (branch) id, globally unique, dense in [0, num_trajs).
    node_id: i32[N] MAGRPO joint-action node of the sample, dense in [0, num_nodes); all agents'
      samples of one joint action share the node.
    parent_node: i32[N] node that spawned this sample's node; -1 at the root (first turn).
    state: i32[N] the discrete state the agent observed when it replied, in [0, num_states)
      (`envs.base.Observation.state`); decisions in different states never share a group of a
      `group_by` that splits by state.
    values: f32[N] critic value of the sample's state (`gae_action`).
    token_values: f32[N, T] critic value per response token (`gae_token`).
    token_mask: bool[N, T] True on response tokens.
  """
  rewards: jax.Array
  team_rewards: jax.Array
  sample_mask: jax.Array
  problem_id: jax.Array
  turn: jax.Array
  agent_id: jax.Array
  policy_id: jax.Array
  traj_id: jax.Array
  node_id: jax.Array
  parent_node: jax.Array
  state: jax.Array
  values: jax.Array
  token_values: jax.Array
  token_mask: jax.Array


# field -> (dtype, default fill, rank). Rank 1 fields are [N], rank 2 fields are [N, T].
_FIELDS: dict[str, tuple[Any, Any, int]] = {
    "rewards": (np.float32, None, 1),
    "team_rewards": (np.float32, 0.0, 1),
    "sample_mask": (np.bool_, True, 1),
    "problem_id": (np.int32, 0, 1),
    "turn": (np.int32, 0, 1),
    "agent_id": (np.int32, 0, 1),
    "policy_id": (np.int32, 0, 1),
    "traj_id": (np.int32, 0, 1),
    "node_id": (np.int32, 0, 1),
    "parent_node": (np.int32, -1, 1),
    "state": (np.int32, 0, 1),
    "values": (np.float32, 0.0, 1),
    "token_values": (np.float32, 0.0, 2),
    "token_mask": (np.bool_, True, 2),
}


def make_batch(rewards: Any, *, num_tokens: int | None = None, **fields: Any) -> SampleBatch:
  """Builds a `SampleBatch` from host arrays, filling the fields an estimator does not use.

  Defaults: team reward 0, every sample valid, all ids 0 except `parent_node` -1 (root), not
  greedy, values 0, and every token a response token. `T` comes from `token_mask` or
  `token_values` when given, else from `num_tokens` (default 1).

  Args:
    rewards: f32[N] local rewards.
    num_tokens: `T` when neither `token_mask` nor `token_values` is given.
    **fields: any other `SampleBatch` field as an array-like of the documented shape.

  Returns:
    The batch as host (NumPy) arrays with the documented dtypes, ready for `jax.device_put`,
    `jax.make_array_from_process_local_data` or a jitted call.
  """
  unknown = sorted(set(fields) - set(_FIELDS))
  if unknown:
    raise TypeError(f"unknown SampleBatch fields {unknown}; expected a subset of {sorted(_FIELDS)}")
  rewards = np.asarray(rewards, np.float32)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must have shape [N], got {rewards.shape}")
  n = rewards.shape[0]
  shapes = [np.shape(fields[k]) for k in ("token_mask", "token_values") if k in fields]
  t = shapes[0][1] if shapes and len(shapes[0]) == 2 else (num_tokens or 1)
  out = {}
  for name, (dtype, default, rank) in _FIELDS.items():
    want = (n,) if rank == 1 else (n, t)
    if name == "rewards":
      value = rewards
    elif name in fields:
      value = np.asarray(fields[name]).astype(dtype)
    else:
      value = np.full(want, default, dtype)
    if value.shape != want:
      raise ValueError(f"SampleBatch field {name!r} has shape {value.shape}; expected {want}")
    out[name] = value
  return SampleBatch(**out)


def validate_batch(batch: SampleBatch, space: GroupSpace) -> None:
  """Host-side check that every valid sample's ids lie in the ranges `space` declares.

  On device an out-of-range id cannot raise; estimators drop such samples and count them in the
  `out_of_range` metric. Call this before the train step to fail early with the culprit named
  instead (an id past its range would otherwise be a silent, wrong group).
  """
  mask = np.asarray(batch.sample_mask)
  ranges = {"problem_id": (0, space.num_problems), "turn": (0, space.max_turns),
            "agent_id": (0, space.num_agents), "state": (0, space.num_states)}
  if space.num_trajs:
    ranges["traj_id"] = (0, space.num_trajs)
  if space.num_nodes:
    ranges["node_id"] = (0, space.num_nodes)
    ranges["parent_node"] = (-1, space.num_nodes)
  for name, (low, high) in ranges.items():
    ids = np.asarray(getattr(batch, name))
    bad = np.flatnonzero(mask & ((ids < low) | (ids >= high)))
    if bad.size:
      i = int(bad[0])
      raise ValueError(f"sample {i}: {name}={int(ids[i])} outside [{low}, {high}) declared by "
                       f"{space}")


def mix(reward: Any, team_reward: Any, alpha: float) -> Any:
  """The reward every estimator, metric and refill uses: `alpha * team_reward + reward` (numbers
  on the host, arrays on device)."""
  return alpha * team_reward + reward


def mixed_reward(batch: SampleBatch, alpha: float) -> jax.Array:
  """`mix` of a batch's rewards, f32[N]."""
  return mix(batch.rewards, batch.team_rewards, alpha)


# ----------------------------------------------------------------------------- id rules

MAX_TREE_LEAVES = 256  # a MAGRPO tree of G^T leaves per problem; the paper's T is small


def id_layout(mode: str, k: int, max_turns: int) -> tuple[int, int]:
  """(trajectories per problem, branching) of a rollout mode (`workflows/rollout.MODES`), for
  `BatchShape`.

  Raises ValueError when a MAGRPO tree would grow more than MAX_TREE_LEAVES leaves per problem.
  """
  if mode == "independent":
    return k, 1
  if mode == "tree":
    return 1, 1
  leaves = k ** max_turns
  if leaves > MAX_TREE_LEAVES:
    raise ValueError(f"rollout mode 'magrpo_tree' with k={k} over max_turns={max_turns} grows "
                     f"k**max_turns={leaves} leaves per problem; expected at most "
                     f"{MAX_TREE_LEAVES} (lower k or max_turns)")
  return leaves, k



def traj_id(problem_id: int, branch: int, trajs_per_problem: int) -> int:
  """Trajectory id of branch `branch` of problem `problem_id`, dense in
  [0, num_problems * trajs_per_problem)."""
  return problem_id * trajs_per_problem + branch


def child_traj(traj: int, turn: int, branch: int, branching: int, max_turns: int) -> int:
  """Trajectory of the `branch`-th joint action sampled at `turn` from the node of `traj`.

  In a MAGRPO tree (G = `branching` joint actions from every node, at most `max_turns` levels) a
  node is named by its first leaf: the path that takes branch 0 at every later turn. The problem's
  G^T leaves are the base-G numbers of their branch choices, turn 0 the most significant digit,
  so a node's trajectory is its parent's plus `branch * G^(T - 1 - turn)`.
  """
  return traj + branch * branching ** (max_turns - 1 - turn)


def node_id(traj: int, turn: int, max_turns: int) -> int:
  """MAGRPO node of (trajectory, turn): every agent's sample of the joint action shares it."""
  return traj * max_turns + turn


def parent_node(traj: int, turn: int, max_turns: int, branching: int = 1) -> int:
  """The node a turn's node grew from; -1 at the first turn. Linear trajectories (`branching` 1)
  grow from their own previous turn; in a G-ary tree the parent's trajectory drops the digits
  from `turn` on (see `child_traj`)."""
  if not turn:
    return -1
  span = branching ** (max_turns - turn)
  return node_id(traj - traj % span, turn - 1, max_turns)


def group_ids(batch: SampleBatch, group_by: str,
              space: GroupSpace) -> tuple[jax.Array, int, jax.Array]:
  """Mixed-radix group code [N] of ([problem][, turn][, agent][, state]), its segment count, and
  whether each sample's ids are in range [N]. `group_by`: "problem", "problem_agent",
  "problem_turn_agent", "problem_turn_agent_state" or "turn_agent_state"; each factor has its
  own radix, so groups with a problem factor never mix problems.

  Why a state factor: independent trajectories reach a turn in different states, so a
  (problem, turn, agent) group compares decisions taken in different situations, and the
  state's value leaks into each action's advantage (a stop after a matching check against a
  continue after a mismatch). With the state the agent observed as a factor, a group compares
  actions only.

  Why "turn_agent_state" drops the problem: split by state, a (problem, turn, agent) group of K
  trajectories leaves one or two samples in a rare state, often a singleton with nothing to
  compare against. Pooled over the step's problems, each (turn, agent, state) group holds all of
  that state's decisions: a per-state baseline (the mean reward after that observation) for
  problems of similar difficulty."""
  p, t, a = batch.problem_id, batch.turn, batch.agent_id
  ok = in_range(p, 0, space.num_problems)
  if group_by == "problem":
    return p, space.num_problems, ok
  ok &= in_range(a, 0, space.num_agents)
  if group_by == "problem_agent":
    return p * space.num_agents + a, space.num_problems * space.num_agents, ok
  ok &= in_range(t, 0, space.max_turns)
  if group_by == "turn_agent_state":
    ok &= in_range(batch.state, 0, space.num_states)
    return ((t * space.num_agents + a) * space.num_states + batch.state,
            space.max_turns * space.num_agents * space.num_states, ok)
  ids = (p * space.max_turns + t) * space.num_agents + a
  num = space.num_problems * space.max_turns * space.num_agents
  if group_by == "problem_turn_agent":
    return ids, num, ok
  ok &= in_range(batch.state, 0, space.num_states)
  return ids * space.num_states + batch.state, num * space.num_states, ok


def group_key(sample: RolloutSample, group_by: str) -> tuple[int, ...]:
  """The estimator group of one rollout sample on the host, keyed by its problem first: the
  factors of `group_ids`' code (DAPO's refill asks which problems hold a group with reward
  variance, `training/refill.py`). A grouping that pools problems has no problem's group."""
  factors = {"problem": ("problem_id",), "problem_agent": ("problem_id", "agent_id"),
             "problem_turn_agent": ("problem_id", "turn", "agent_id"),
             "problem_turn_agent_state": ("problem_id", "turn", "agent_id", "state")}
  if group_by not in factors:
    raise ValueError(f"group_by {group_by!r} pools problems, so no problem carries a group of "
                     "its own; expected a grouping with a problem factor")
  return tuple(getattr(sample, name) for name in factors[group_by])


def slot_ids(batch: SampleBatch, space: GroupSpace) -> tuple[jax.Array, int, int, jax.Array]:
  """(dense slot [N] of each sample in the [num_trajs, max_turns * num_agents] acting-order
  grid, the slot count, slots per trajectory, whether the sample's ids are in range [N]):
  the order MARFT's GAE runs its agents in (turn by turn, agents in order within a turn)."""
  s = space.max_turns * space.num_agents
  ok = (in_range(batch.traj_id, 0, space.num_trajs) & in_range(batch.turn, 0, space.max_turns)
        & in_range(batch.agent_id, 0, space.num_agents))
  slot = batch.traj_id * s + batch.turn * space.num_agents + batch.agent_id
  return slot, space.num_trajs * s, s, ok


def branch_of(traj: int, trajs_per_problem: int) -> int:
  """The branch of trajectory `traj` within its problem (the inverse of `traj_id`)."""
  return traj % trajs_per_problem


# ----------------------------------------------------------------------------- the train batch


@flax.struct.dataclass
class TrainBatch:
  """Training samples: prompt + response tokens of N LLM calls.

  Flat here; a policy layout may stack blocks ([P, N/P, ...] leaves) or key them by policy name
  (`parallel/layouts.py`). `samples.token_mask` is [N, R] over the response tokens.

  `num_prompts` (static: part of the tree's structure, so a new value compiles a new step): an
  upper bound on the distinct (prompt, policy) rows of any block, and so of any subset of its
  rows (a device's shard, a micro-batch, a mini-batch). Given, the learner computes each distinct
  prompt once (`algos/logprobs.response_hidden`); None: every row computes its own.
  """
  prompt: jax.Array  # [N, Tp] int32, left-padded
  prompt_mask: jax.Array  # [N, Tp] bool, False on padding
  response: jax.Array  # [N, R] int32, right-padded
  old_logp: jax.Array  # [N, R] f32 behaviour log-probs from the sampler
  samples: SampleBatch
  ref_logp: jax.Array | None = None  # [N, R] f32 frozen reference log-probs (KL term)
  num_prompts: int | None = flax.struct.field(pytree_node=False, default=None)
  # Static: the policy of each block of a stacked batch that holds only some policies' blocks
  # (an update on the trained rows, `parallel/update.py`); None: block p is policy p.
  policies: tuple[int, ...] | None = flax.struct.field(pytree_node=False, default=None)


class RolloutSample(Protocol):
  """What the batch reads of a rollout sample (`workflows.rollout.Sample`)."""
  problem_id: int
  traj_id: int
  turn: int
  agent_id: int
  policy_id: int
  state: int
  reward: float
  team_reward: float
  trained: bool  # False: the tokens are masked out of the loss (config.train.agents)
  generation: Any  # .prompt_ids, .token_ids, .logprobs


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """Static sizes of one step's batch."""

  num_problems: int
  trajs_per_problem: int  # 1 in tree mode (one state per problem), K independent, G^T magrpo_tree
  max_turns: int
  num_agents: int
  num_states: int = 1  # observed-state ids (`GroupSpace.num_states`)
  branching: int = 1  # G of a MAGRPO joint-action tree (`child_traj`); 1 = linear trajectories
  multiple: int = 1  # rows per policy block must divide by devices x micro-batches
  min_rows: int = 8
  min_prompt: int = 32
  min_response: int = 16
  width_block: int = 64  # prompt / response widths: powers of two below it, then its multiples

  @property
  def space(self) -> GroupSpace:
    trajs = self.num_problems * self.trajs_per_problem
    return GroupSpace(num_problems=self.num_problems, max_turns=self.max_turns,
                      num_agents=self.num_agents, num_trajs=trajs,
                      num_nodes=trajs * self.max_turns, num_states=self.num_states)

  def sizes(self, samples: Sequence[RolloutSample], block_rows: int) -> tuple[int, int, int]:
    """(rows per block, prompt width, response width) that hold `samples` with at most
    `block_rows` samples in one block: bucketed, rows a multiple of `multiple`."""
    if not samples:
      raise ValueError("no samples to train on; the rollout produced none")
    width = max(self.min_prompt, round_bucket(max(len(s.generation.prompt_ids) for s in samples),
                                              self.width_block))
    resp = max(self.min_response,
               round_bucket(max(len(s.generation.token_ids) for s in samples), self.width_block))
    return round_rows(block_rows, self.multiple, self.min_rows), width, resp


def round_rows(n: int, multiple: int = 1, minimum: int = 1) -> int:
  """The rows that hold `n` samples: at least `minimum`, bucketed by `round_bucket` with
  `ROW_BLOCK` (padding under 8 rows, few shapes) and a multiple of `multiple` (the devices x
  micro-batches the rows split over). A batch's blocks (`BatchShape.sizes`) and the PPO
  mini-batches that hold fewer kept samples than `mini_batch_size` (`parallel/update.py`)."""
  return round_up(max(minimum, round_bucket(n, ROW_BLOCK)), multiple)


def count_prompts(samples: Sequence[RolloutSample], rows: int) -> int:
  """The `num_prompts` bound of a block of `rows` rows holding `samples`: its distinct
  (prompt, policy) pairs, one more for the padding rows' empty prompt, rounded up to a power of
  two (fewer step shapes to compile) and at most `rows`."""
  distinct = len({(tuple(s.generation.prompt_ids), s.policy_id) for s in samples})
  return min(rows, bucket(distinct + (len(samples) < rows), 1))


def build_rows(samples: Sequence[RolloutSample], shape: BatchShape, pad_id: int, rows: int,
               width: int, resp_width: int, num_prompts: int | None = None) -> TrainBatch:
  """One flat block of `rows` rows: the samples with their ids, then padding (host arrays).
  `num_prompts`: the batch's bound (`TrainBatch.num_prompts`), None: no prompt sharing."""
  if len(samples) > rows:
    raise ValueError(f"{len(samples)} samples do not fit in a block of {rows} rows")
  prompt = np.full((rows, width), pad_id, np.int32)
  prompt_mask = np.zeros((rows, width), bool)
  response = np.full((rows, resp_width), pad_id, np.int32)
  old_logp = np.zeros((rows, resp_width), np.float32)
  token_mask = np.zeros((rows, resp_width), bool)
  fields = {k: np.zeros(rows, np.int32) for k in
            ("problem_id", "turn", "agent_id", "policy_id", "traj_id", "node_id", "state")}
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
    token_mask[i, :r] = s.trained
    values = dict(problem_id=s.problem_id, turn=s.turn, agent_id=s.agent_id,
                  policy_id=s.policy_id, traj_id=s.traj_id, state=s.state,
                  node_id=node_id(s.traj_id, s.turn, shape.max_turns),
                  parent_node=parent_node(s.traj_id, s.turn, shape.max_turns, shape.branching),
                  team_rewards=s.team_reward, sample_mask=True)
    for name, value in values.items():
      fields[name][i] = value
    rewards[i] = s.reward
  samples_batch = jax.tree.map(np.asarray, make_batch(rewards, token_mask=token_mask, **fields))
  out = TrainBatch(prompt=prompt, prompt_mask=prompt_mask, response=response,
                   old_logp=old_logp, samples=samples_batch, num_prompts=num_prompts)
  chex.assert_shape([out.prompt, out.prompt_mask], (rows, width))
  chex.assert_shape([out.response, out.old_logp, out.samples.token_mask], (rows, resp_width))
  return out
