"""RLOO (REINFORCE leave-one-out): each sample's baseline is the mean reward of the *other* samples
of its group, an unbiased baseline since it does not depend on the sample's own reward.

`r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g)`; a group of one sample has no
other member, so its advantage is 0. It groups like GRPO (`group_by`, default "problem") and
shares its filtering (`group_estimators.group_estimate`); it never divides by a std.

This module is the worked example of docs/design.md ("Adding an estimator"): the function, its
record, and one `register` line in `advantage_config.py`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax.algos.advantage_config import AdvantageConfig, AdvantageOutput, Estimator
from marl_jax.algos.batch import GroupSpace, SampleBatch
from marl_jax.algos.group_estimators import group_estimate
from marl_jax.algos.segments import AxisName


def _leave_one_out(r: jax.Array, cnt: jax.Array, mean: jax.Array, std: jax.Array,
                   cfg: AdvantageConfig) -> jax.Array:
  del std, cfg
  return jnp.where(cnt > 1, cnt / jnp.maximum(cnt - 1.0, 1.0) * (r - mean), 0.0)


def rloo(batch: SampleBatch, cfg: AdvantageConfig, space: GroupSpace,
         axis_name: AxisName = None) -> AdvantageOutput:
  """RLOO over the `cfg.group_by` groups (module docstring)."""
  return group_estimate(batch, cfg, space, axis_name, "rloo", _leave_one_out)


RLOO = Estimator(rloo, dict(group_by="problem", std_ddof=0, normalize_std=False), grouped=True,
                 singleton_zero=True)
