"""Padded sizes: the rounding rules every bucketed shape uses (the sampler's rows, prompt widths
and new-token slots; the learner's rows and widths, `algos/batch.py`), so a shape recompiles only
when it crosses a bucket."""

from __future__ import annotations


def bucket(n: int, minimum: int) -> int:
  """Smallest power of two >= n, and at least `minimum`."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def fine_bucket(n: int, minimum: int) -> int:
  """Smallest of 2^k and 3 * 2^(k - 1) >= n (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), and at least
  `minimum`: at most a third of padding for two shapes per doubling. The continuous engine's rows
  and block-table widths, where a step's work grows with both (decode attention on CPU reads
  every slot of the table)."""
  n = max(n, minimum, 1)
  power = bucket(n, 1)
  return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


def round_up(n: int, multiple: int) -> int:
  """Smallest multiple of `multiple` >= max(n, 1)."""
  return -(-max(n, 1) // multiple) * multiple


def round_bucket(n: int, multiple: int) -> int:
  """Powers of two below `multiple`, then multiples of it (1, 2, 4, 8, 16, 24, ... for 8): few
  shapes for small n, and padding under `multiple` for large n. The sampler's row buckets (a group
  of one prompt is not prefilled 8 times) and the learner's widths (`algos.batch.BatchShape`)."""
  return bucket(n, 1) if n < multiple else round_up(n, multiple)
