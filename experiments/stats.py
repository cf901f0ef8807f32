"""Summary statistics shared by the experiment scripts (no flags: safe to import anywhere)."""

from __future__ import annotations

import math


def mean_se(values: list[float]) -> tuple[float, float | None]:
  """Mean and standard error (unbiased std / sqrt(n); None for one value)."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return mean, None
  var = sum((v - mean) ** 2 for v in values) / (n - 1)
  return mean, math.sqrt(var / n)
