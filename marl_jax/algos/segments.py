"""Segment reductions that are exact across devices: the statistics every advantage estimator uses.

A segment is a group of samples named by a static-range id. Each reduction is a
`jax.ops.segment_*` over the local samples followed, when `axis_name` is given (inside `shard_map`
with the sample axis split), by a `psum`/`pmax`, so a segment whose samples sit on different
devices gets exact global values, identical on every device. Masked-out samples (padding) are
excluded by construction: their values are zeroed and their id points past the last segment, which
`segment_sum` drops.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...] | None


def psum(x, axis_name: AxisName):
  """`x` summed over the devices of `axis_name` (unchanged when None)."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def seg_sum(x: jax.Array, ids: jax.Array, mask: jax.Array, num: int,
            axis_name: AxisName) -> jax.Array:
  """Global per-segment sum of `x` over masked samples; masked-out samples go to a dropped id."""
  x = jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, 0)
  return psum(jax.ops.segment_sum(x, jnp.where(mask, ids, num), num_segments=num), axis_name)


def seg_max(x: jax.Array, ids: jax.Array, mask: jax.Array, num: int,
            axis_name: AxisName) -> jax.Array:
  """Global per-segment max (the dtype's lowest value, or -inf, for empty segments)."""
  m = jax.ops.segment_max(x, jnp.where(mask, ids, num), num_segments=num)
  return m if axis_name is None else jax.lax.pmax(m, axis_name)


def take(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Each sample's row of a per-segment `table` (ids clipped into range; callers mask them)."""
  return table[jnp.clip(ids, 0, table.shape[0] - 1)]


def count(mask: jax.Array, axis_name: AxisName) -> jax.Array:
  """Global number of True entries of `mask`, as f32."""
  return psum(jnp.sum(mask.astype(jnp.float32)), axis_name)


def moments(x: jax.Array, ids: jax.Array, mask: jax.Array, num: int, ddof: int,
            axis_name: AxisName) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-segment (count, mean, std), two-pass and shifted by the segment max.

  Shifting by a member's value makes a constant group's deviations exactly 0 in fp32 (a plain
  sum / count mean can be off by an ulp, and `ulp / (0 + eps)` is a large spurious advantage).
  """
  cnt = seg_sum(jnp.ones_like(x), ids, mask, num, axis_name)
  top = jnp.where(cnt > 0, seg_max(x, ids, mask, num, axis_name), 0.0)
  d = x - take(top, ids)
  mean_d = seg_sum(d, ids, mask, num, axis_name) / jnp.maximum(cnt, 1.0)
  sq = seg_sum(jnp.square(d - take(mean_d, ids)), ids, mask, num, axis_name)
  std = jnp.sqrt(jnp.where(cnt > ddof, sq / jnp.maximum(cnt - ddof, 1.0), 0.0))
  return cnt, top + mean_d, std


def in_range(ids: jax.Array, low: int, high: int) -> jax.Array:
  """bool: `low <= ids < high`."""
  return (ids >= low) & (ids < high)
