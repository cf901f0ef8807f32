"""Advantage estimation: the options (`AdvantageConfig`), the output, the estimator record and
registry, `estimate`, and the finalisation every estimator ends with.

Every estimator is one `Estimator` record: its function and each property the rest of the code
asks about it (group-relative or not, reads gamma / lam, needs a critic and where its values sit,
the ids it needs, its paper defaults). The options' checks here, the critic rule
(`algos/critic.py`), the config's rollout rules (`training/config_checks.py`) and the value loss
(`parallel/gradients.py`) read the record, never a name. The functions live in their own modules
(`group_estimators`, `return_estimators`, `rloo`), which import this one, so the registry names
them lazily ("module:RECORD"); adding an estimator is its module, its test and one `register`
line below (docs/design.md, "Adding an estimator"). With `axis_name` given (inside `shard_map`
with the batch split along the sample axis) every estimator's statistics are exact global values,
identical on every device (`segments`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from marl_jax.algos.batch import GroupSpace, SampleBatch, mixed_reward
from marl_jax.algos.segments import AxisName, count, psum
from marl_jax.registry import Registry

GROUPINGS = ("problem", "problem_agent", "problem_turn_agent", "problem_turn_agent_state",
             "turn_agent_state")
STATE_GROUPINGS = ("problem_turn_agent_state", "turn_agent_state")  # split by observed state
FILTERS = ("none", "lowest_mean", "zero_variance")
MAGRPO_BASELINES = ("mean", "none", "loo", "max")


@dataclasses.dataclass(frozen=True)
class Estimator:
  """One advantage estimator: its function and what the rest of the code asks about it.

  Attributes:
    fn: `(batch, cfg, space, axis_name) -> AdvantageOutput`.
    defaults: the paper's values of the `AdvantageConfig` options left None (`resolved`).
    grouped: group-relative over `group_by` groups, so `group_by` and `filter` apply.
    singleton_zero: a group of one sample gets advantage 0, so rollouts that put one sample in
      every group teach nothing (config_checks refuses them).
    divides_std: may divide by a std, so `normalize_std` applies.
    gamma: reads the discount `gamma`.
    lam: reads the GAE `lam`.
    siblings: compares each joint-action node with its siblings (MAGRPO's tree), so `baseline`
      applies and a rollout that gives a node no sibling leaves every advantage 0.
    critic: where a critic's values sit: None (no critic), "sample" (one per sample, from the
      state before the reply) or "token" (one per token).
    needs: the `GroupSpace` count this estimator needs > 0 (e.g. "num_trajs"), or None.
  """
  fn: Callable[..., AdvantageOutput]
  defaults: Mapping[str, Any]
  grouped: bool = False
  singleton_zero: bool = False
  divides_std: bool = False
  gamma: bool = False
  lam: bool = False
  siblings: bool = False
  critic: str | None = None
  needs: str | None = None

  def __post_init__(self):
    if self.critic not in (None, "sample", "token"):
      raise ValueError(f"Estimator critic={self.critic!r}; expected None, 'sample' or 'token'")


ESTIMATORS: Registry[Estimator] = Registry("estimator")
ESTIMATORS.register("grpo", "marl_jax.algos.group_estimators:GRPO")
ESTIMATORS.register("at_grpo", "marl_jax.algos.group_estimators:AT_GRPO")
ESTIMATORS.register("drmas", "marl_jax.algos.group_estimators:DRMAS")
ESTIMATORS.register("dr_grpo", "marl_jax.algos.group_estimators:DR_GRPO")
ESTIMATORS.register("traj_grpo", "marl_jax.algos.group_estimators:TRAJ_GRPO")
ESTIMATORS.register("rloo", "marl_jax.algos.rloo:RLOO")
ESTIMATORS.register("magrpo", "marl_jax.algos.return_estimators:MAGRPO")
ESTIMATORS.register("gae_action", "marl_jax.algos.return_estimators:GAE_ACTION")
ESTIMATORS.register("gae_token", "marl_jax.algos.return_estimators:GAE_TOKEN")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Estimator choice and options. Fields left None take the estimator's paper default.

  Attributes:
    estimator: registry name (see `advantages.ESTIMATORS`).
    group_by: grouping of group estimators: "problem", "problem_agent", "problem_turn_agent",
      "problem_turn_agent_state" (also split by the state the agent observed) or
      "turn_agent_state" (the same pooled over the step's problems: a baseline per turn, agent
      and state), see `batch.group_ids` (None: grpo/dr_grpo/rloo "problem", at_grpo
      "problem_turn_agent", drmas "problem_agent").
    std_ddof: 0 (population) or 1 (unbiased) for group, sibling and batch standard deviations
      (None: 1 for at_grpo, drmas and traj_grpo, whose paper code divides by verl's unbiased
      `torch.std`; else 0).
    eps: added to the std before dividing.
    normalize_std: divide by the group std (grpo/at_grpo/drmas/traj_grpo, default True; False
      gives the mean-only variant) or z-score siblings (magrpo, default False). Not allowed for
      estimators that never divide by a std.
    filter: "none", "lowest_mean" (drop the `filter_fraction` of non-empty groups with the lowest
      mean reward, AT-GRPO; ranked per policy, as PettingLLMs filters each model's batch on its
      own; policy ids must lie in [0, num_agents), others are dropped and counted as
      out_of_range) or "zero_variance" (drop groups whose rewards are all equal, DAPO); group
      estimators only.
    filter_fraction: fraction of each policy's groups dropped by "lowest_mean" (floor of
      fraction x that policy's non-empty groups).
    alpha: reward mixing, `r = alpha * team_rewards + rewards`.
    gamma: discount of magrpo's tree returns and MARFT's GAE (None: magrpo 0.9, gae_* 0.99);
      refused for the others, which do not discount.
    lam: GAE lambda (None: 0.95); refused for the estimators without GAE.
    clamp: clip advantages to [-clamp, clamp] (None: 10 for magrpo, else no clip).
    baseline: magrpo sibling baseline: "mean" (MAGRPO), "none" (raw returns), "loo" (RLOO) or
      "max" (CoMLRL's MAReMax: `R - max_siblings R`).
    normalize_batch: z-score advantages over all kept samples (tokens for gae_token) of the
      global batch after estimation (MARFT).
    balance_states: weigh each state an agent was observed in equally: a sample's advantage is
      scaled by n_a / (S_a x n_as), n_as the agent's kept samples in that state, n_a their sum
      and S_a the states seen, so a frequent state cannot outvote a rare one on the features
      both share (a learned stopper's matched and mismatched reviews). Needs a group_by
      that splits by state (`STATE_GROUPINGS`).
    normalize_states: divide each kept sample's advantage by the root mean square of its
      agent's kept advantages in that state (+ eps), so every state's advantages have unit scale
      while their ratios within the state stay as the estimator made them. With
      normalize_std=False, a stopper's mismatched review keeps its 0.9 correctness gap above
      its 0.1 round-cost gap (group z-scores make both +-0.7), and its matched review's cost
      gaps are not outweighed by the mismatched state's larger rewards. Applied before
      balance_states; needs a group_by that splits by state.
  """
  estimator: str = "grpo"
  group_by: str | None = None
  std_ddof: int | None = None
  eps: float = 1e-6
  normalize_std: bool | None = None
  filter: str = "none"
  filter_fraction: float = 0.5
  alpha: float = 0.0
  gamma: float | None = None
  lam: float | None = None
  clamp: float | None = None
  baseline: str = "mean"
  normalize_batch: bool = False
  balance_states: bool = False
  normalize_states: bool = False

  def __post_init__(self):
    name = self.estimator
    record = ESTIMATORS.get(name)  # refuses an unknown name, listing the known ones
    if self.group_by is not None:
      if self.group_by not in GROUPINGS:
        raise ValueError(f"unknown group_by {self.group_by!r}; expected one of {list(GROUPINGS)}")
      if not record.grouped:
        raise ValueError(f"group_by applies to {ESTIMATORS.having('grouped')}, not {name!r}")
    if self.filter not in FILTERS:
      raise ValueError(f"unknown filter {self.filter!r}; expected one of {list(FILTERS)}")
    if self.filter != "none" and not record.grouped:
      raise ValueError(f"filter {self.filter!r} applies to {ESTIMATORS.having('grouped')}, not "
                       f"{name!r}")
    if not 0.0 <= self.filter_fraction < 1.0:
      raise ValueError(f"filter_fraction must be in [0, 1), got {self.filter_fraction}")
    if self.std_ddof not in (None, 0, 1):
      raise ValueError(f"std_ddof must be 0 or 1, got {self.std_ddof!r}")
    if not self.eps > 0.0:
      raise ValueError(f"eps must be > 0, got {self.eps}")
    if self.normalize_std and not record.divides_std:
      raise ValueError(f"estimator {name!r} never divides by a group std; set normalize_std to "
                       "None or False (normalize_batch z-scores the whole batch)")
    for field in ("balance_states", "normalize_states"):
      if getattr(self, field) and self.group_by not in STATE_GROUPINGS:
        raise ValueError(f"{field} scales the states the groups split by; it needs group_by "
                         f"in {list(STATE_GROUPINGS)}, got {self.group_by!r}")
    if self.baseline not in MAGRPO_BASELINES:
      raise ValueError(f"unknown baseline {self.baseline!r}; expected one of "
                       f"{list(MAGRPO_BASELINES)}")
    if self.baseline != "mean" and not record.siblings:
      raise ValueError(f"baseline {self.baseline!r} applies to {ESTIMATORS.having('siblings')}, "
                       f"not {name!r}")
    for field in ("gamma", "lam"):
      value = getattr(self, field)
      if value is not None and not getattr(record, field):
        raise ValueError(f"{field} applies to {ESTIMATORS.having(field)}, not {name!r}")
      if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{field} must be in [0, 1], got {value}")
    if self.clamp is not None and not self.clamp > 0.0:
      raise ValueError(f"clamp must be > 0 (math.inf disables it), got {self.clamp}")

  @property
  def record(self) -> Estimator:
    """The registered record of `estimator`."""
    return ESTIMATORS.get(self.estimator)

  def resolved(self) -> AdvantageConfig:
    """This config with every None option replaced by the estimator's default."""
    fill = {k: v for k, v in self.record.defaults.items() if getattr(self, k) is None}
    out = dataclasses.replace(self, **fill)
    return dataclasses.replace(out, clamp=math.inf if out.clamp is None else out.clamp)


@flax.struct.dataclass
class AdvantageOutput:
  """Estimator result.

  Attributes:
    advantages: f32[N, T]; sample-level advantages are broadcast over tokens; 0 off `token_mask`
      and on samples outside `sample_mask`.
    returns: f32[N, T] critic targets (advantage before batch normalisation + value) for gae_*,
      else None.
    sample_mask: bool[N] samples to train on (input mask minus filtered groups and out-of-range
      ids).
    metrics: global scalars (identical on every device).
  """
  advantages: jax.Array
  returns: jax.Array | None
  sample_mask: jax.Array
  metrics: dict[str, jax.Array]


def finalize(adv: jax.Array, returns: jax.Array | None, valid: jax.Array, keep: jax.Array,
             batch: SampleBatch, cfg: AdvantageConfig, axis_name: AxisName,
             metrics: dict[str, jax.Array]) -> AdvantageOutput:
  """Batch normalisation, clamp, token broadcast and the metrics every estimator reports."""
  tmask = batch.token_mask & keep[:, None]
  token_level = adv.ndim == 2
  weight = tmask if token_level else keep
  n = count(weight, axis_name)
  mean = psum(jnp.sum(jnp.where(weight, adv, 0.0)), axis_name) / jnp.maximum(n, 1.0)
  sq = psum(jnp.sum(jnp.where(weight, jnp.square(adv - mean), 0.0)), axis_name)
  std = jnp.sqrt(jnp.where(n > cfg.std_ddof, sq / jnp.maximum(n - cfg.std_ddof, 1.0), 0.0))
  if cfg.normalize_batch:
    adv = (adv - mean) / (std + cfg.eps)
  adv = jnp.clip(adv, -cfg.clamp, cfg.clamp)
  adv = jnp.where(tmask, adv if token_level else adv[:, None], 0.0)
  if returns is not None:
    returns = jnp.where(tmask, returns if returns.ndim == 2 else returns[:, None], 0.0)
  r = mixed_reward(batch, cfg.alpha)
  n_valid = count(valid, axis_name)
  metrics = dict(metrics)
  metrics.update(
      reward_mean=psum(jnp.sum(jnp.where(valid, r, 0.0)), axis_name) / jnp.maximum(n_valid, 1.0),
      adv_mean=mean,  # before batch normalisation and clamp
      adv_std=std,
      valid_samples=n_valid,
      kept_samples=count(keep, axis_name),
      out_of_range=count(batch.sample_mask & ~valid, axis_name),
  )
  return AdvantageOutput(advantages=adv, returns=returns, sample_mask=keep, metrics=metrics)


def estimate(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
             axis_name: AxisName = None) -> AdvantageOutput:
  """Runs the estimator `cfg.estimator`.

  Args:
    batch: the samples (inside `shard_map`: this device's slice of the sample axis).
    cfg: estimator and options.
    space: static id ranges (segment counts).
    axis_name: mesh axis (or axes) the sample axis is split over; None on one device.

  Returns:
    The `AdvantageOutput`; its metrics are global and identical on every device.
  """
  return cfg.record.fn(batch, cfg, space, axis_name)


def check_estimator(cfg: AdvantageConfig, name: str, space: GroupSpace) -> None:
  """Refuses a config naming another estimator, or a `space` without the ids `name` needs."""
  if cfg.estimator != name:
    raise ValueError(f"config names estimator {cfg.estimator!r} but {name!r} was called")
  needs = ESTIMATORS.get(name).needs
  if needs is not None and getattr(space, needs) == 0:
    raise ValueError(f"estimator {name!r} needs GroupSpace.{needs} > 0, got {space}")
