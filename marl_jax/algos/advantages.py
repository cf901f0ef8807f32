"""Advantage estimators for teams of agents: the registry and `estimate`.

Every estimator maps a `SampleBatch` to per-token advantages (`AdvantageOutput`) from an
`AdvantageConfig` (both in `advantage_config`). Group-relative estimators live in
`group_estimators`, return-based ones (MAGRPO, MARFT GAE) in `return_estimators`; all of them use
the cross-device segment reductions of `segments`, so with `axis_name` given (inside `shard_map`
with the batch split along the sample axis) their statistics are exact global values, identical on
every device.
"""
from __future__ import annotations

from typing import Callable

from marl_jax.algos.advantage_config import AdvantageConfig, AdvantageOutput
from marl_jax.algos.batch import GroupSpace, SampleBatch
from marl_jax.algos.group_estimators import at_grpo, dr_grpo, drmas, grpo, rloo, traj_grpo
from marl_jax.algos.return_estimators import gae_action, gae_token, magrpo
from marl_jax.algos.segments import AxisName
from marl_jax.registry import Registry

__all__ = ["ESTIMATORS", "Estimator", "estimate", "get_estimator"]

Estimator = Callable[[SampleBatch, AdvantageConfig, GroupSpace, AxisName], AdvantageOutput]

ESTIMATORS: Registry[Estimator] = Registry("estimator")
for _name, _estimator in (("grpo", grpo), ("at_grpo", at_grpo), ("drmas", drmas),
                          ("dr_grpo", dr_grpo), ("rloo", rloo), ("traj_grpo", traj_grpo),
                          ("magrpo", magrpo), ("gae_action", gae_action),
                          ("gae_token", gae_token)):
  ESTIMATORS.register(_name, _estimator)


def get_estimator(name: str) -> Estimator:
  """The registered estimator `name`; raises ValueError listing the known names otherwise."""
  return ESTIMATORS.get(name)


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
  return get_estimator(cfg.estimator)(batch, cfg, space, axis_name)
