"""experiments.stats against hand-computed values."""

from __future__ import annotations

import math

import pytest

from experiments.stats import mean_se


def test_mean_and_standard_error():
  mean, se = mean_se([0.5, 0.75, 1.0])
  assert mean == pytest.approx(0.75)
  assert se == pytest.approx(math.sqrt(0.0625 / 3))  # unbiased variance 0.0625, n = 3
  assert mean_se([2.0]) == (2.0, None)
