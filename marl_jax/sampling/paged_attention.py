"""Attention over a paged K/V pool: the `PagedKV.attend` implementations the rollout engine picks.

Every implementation takes (q [B, T, Hq, Dh], k_pool, v_pool [Hkv, L * N, page, Dh], tables
[B, P] (layer-offset page ids), positions [B, T]) and returns [B, T, Hq * Dh]: query t of row b
attends over the row's positions 0 .. positions[b, t] (its own key included: the decoder writes
this call's keys/values into the pool first).

  gather   portable (CPU, GPU, TPU; prefill and decode): each row's P pages are gathered into
           one [Hkv, P * page, Dh] span and `decoder.attention`'s grouped einsums run over it,
           positions past the query masked. It reads every gathered page of every row, so the
           engine buckets P to the pages its rows need (`paged_runner`), and on CPU it costs one
           copy of the rows' keys/values per layer beside the matmuls.
  pallas   GPU decode (T = 1): jax's Pallas paged-attention kernel
           (`jax.experimental.pallas.ops.gpu.paged_attention`), which reads the pages in place
           through the block tables, split over `k_splits` partitions of the pages. Used when it
           compiles on the installed jax (checked once per shape, `choose`); otherwise a one-time
           warning and the gather path. On CPU it runs in Pallas interpret mode (tests only).
  TPU      the gather path this round. The anchor is a ragged paged attention kernel
           (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, behind vLLM-TPU and
           SGLang-JAX), which wants K and V interleaved per page
           ([pages, page, 2 * Hkv, Dh]); adopting it means that pool layout, not this one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging

from marl_jax.models import decoder

IMPLEMENTATIONS = ("auto", "gather", "pallas")


def gather(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, tables: jax.Array,
           positions: jax.Array) -> jax.Array:
  """The portable path (see the module docstring)."""
  Hkv, _, page, Dh = k_pool.shape
  B, P = tables.shape
  span = lambda pool: pool[:, tables].reshape(Hkv, B, P * page, Dh).swapaxes(0, 1)
  visible = jnp.arange(P * page)[None, None, :] <= positions[:, :, None]  # [B, T, P * page]
  return decoder.attention(q, span(k_pool), span(v_pool), visible)


def pallas_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, tables: jax.Array,
                  positions: jax.Array, *, interpret: bool = False) -> jax.Array:
  """One decode step (T = 1) through the Pallas GPU kernel. The kernel does not scale scores,
  so q is scaled by 1 / sqrt(Dh) first; P must be a multiple of the kernel's `k_splits`."""
  from jax.experimental.pallas.ops.gpu import paged_attention as kernel

  B, T, Hq, Dh = q.shape
  if T != 1:
    raise ValueError(f"pallas_decode attends one query per row; got T={T}")
  P = tables.shape[1]
  splits = math.gcd(P, 16)
  out = kernel.paged_attention(
      (q[:, 0] / math.sqrt(Dh)).astype(k_pool.dtype), k_pool, v_pool, tables,
      positions[:, 0].astype(jnp.int32) + 1, k_splits=splits,
      pages_per_compute_block=min(8, P // splits), interpret=interpret)
  return out.astype(q.dtype).reshape(B, 1, Hq * Dh)


# One object (a static argument of the engine's jitted programs: a new partial would recompile).
_pallas_interpreted = functools.partial(pallas_decode, interpret=True)


@functools.cache
def _pallas_compiles(shapes: tuple, dtype: str) -> bool:
  """Whether the Pallas kernel lowers and compiles for these shapes on this jax and device."""
  (B, Hq, Dh), (Hkv, N, page), P = shapes
  args = (jax.ShapeDtypeStruct((B, 1, Hq, Dh), dtype),
          jax.ShapeDtypeStruct((Hkv, N, page, Dh), dtype),
          jax.ShapeDtypeStruct((Hkv, N, page, Dh), dtype),
          jax.ShapeDtypeStruct((B, P), jnp.int32), jax.ShapeDtypeStruct((B, 1), jnp.int32))
  try:
    jax.jit(pallas_decode).lower(*args).compile()
    return True
  except Exception as e:  # any lowering or compile failure means: use the portable path
    logging.warning("Pallas paged attention does not compile here (%s: %s); decoding with the "
                    "gather path", type(e).__name__, str(e).splitlines()[0][:200])
    return False


def choose(implementation: str, *, decode: bool, q_shape: tuple[int, ...],
           pool_shape: tuple[int, ...], pages: int, dtype) -> decoder.PagedAttention:
  """The attention a paged forward uses. "auto": the Pallas kernel for decode on GPU when it
  compiles for these shapes, else gather; "pallas" insists on the kernel for decode (interpret
  mode off GPU, for tests); prefill always gathers (it is matmul-bound, and the kernel attends
  one query per row)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"paged attention {implementation!r}; expected one of {IMPLEMENTATIONS}")
  if not decode or implementation == "gather":
    return gather
  on_gpu = jax.default_backend() == "gpu"
  if implementation == "pallas":
    return pallas_decode if on_gpu else _pallas_interpreted
  B, _, Hq, Dh = q_shape
  Hkv, N, page, _ = pool_shape
  if on_gpu and _pallas_compiles(((B, Hq, Dh), (Hkv, N, page), pages), jnp.dtype(dtype).name):
    return pallas_decode
  return gather
