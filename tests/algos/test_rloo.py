"""RLOO (marl_jax/algos/rloo.py), the worked example of docs/design.md "Adding an estimator",
against a NumPy re-derivation of the leave-one-out baseline written here."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from marl_jax.algos.advantage_config import ESTIMATORS, AdvantageConfig, estimate
from marl_jax.algos.batch import GroupSpace, make_batch
from marl_jax.algos.rloo import RLOO


def leave_one_out(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
  """Each reward minus the mean of the *other* rewards of its group; 0 alone in its group."""
  adv = np.zeros(len(rewards))
  for i in range(len(rewards)):
    others = rewards[(groups == groups[i]) & (np.arange(len(rewards)) != i)]
    adv[i] = rewards[i] - others.mean() if len(others) else 0.0
  return adv


def test_rloo_matches_numpy():
  rng = np.random.default_rng(0)
  problems = rng.integers(0, 4, 24)
  problems[-1] = 4  # problem 4 has a single sample: advantage 0
  rewards = rng.normal(size=24)
  batch = make_batch(rewards, problem_id=problems, num_tokens=3)
  out = jax.jit(lambda b: estimate(b, AdvantageConfig("rloo"), GroupSpace(num_problems=5)))(batch)
  want = leave_one_out(rewards, problems)
  assert want[-1] == 0.0 and np.all(want[:-1] != 0.0)
  np.testing.assert_allclose(np.asarray(out.advantages), np.repeat(want[:, None], 3, axis=1),
                             rtol=1e-5, atol=1e-5)


def test_rloo_is_registered_by_its_record():
  """The registry holds the module's record, and the options check reads its properties."""
  assert ESTIMATORS.get("rloo") is RLOO
  assert AdvantageConfig("rloo").resolved().group_by == "problem"  # the record's default
  with pytest.raises(ValueError, match="estimator 'rloo' never divides by a group std"):
    AdvantageConfig("rloo", normalize_std=True)
  with pytest.raises(ValueError, match=r"gamma applies to \['gae_action', 'gae_token', "
                                       r"'magrpo'\], not 'rloo'"):
    AdvantageConfig("rloo", gamma=0.9)
