"""Padded sizes: the rounding rules every bucketed shape uses (the sampler's rows, prompt widths
and new-token slots; the learner's rows and widths, `algos/batch.py`), so a shape recompiles only
when it crosses a bucket."""

from __future__ import annotations


def bucket(n: int, minimum: int) -> int:
  """Smallest power of two >= n, and at least `minimum`."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def round_up(n: int, multiple: int) -> int:
  """Smallest multiple of `multiple` >= max(n, 1)."""
  return -(-max(n, 1) // multiple) * multiple


def round_bucket(n: int, multiple: int) -> int:
  """Powers of two below `multiple`, then multiples of it (1, 2, 4, 8, 16, 24, ... for 8): few
  shapes for small n, and padding under `multiple` for large n. The sampler's row buckets (a group
  of one prompt is not prefilled 8 times) and the learner's widths (`algos.batch.BatchShape`)."""
  return bucket(n, 1) if n < multiple else round_up(n, multiple)
