"""The continuous engine's device programs (vLLM's model runner): prefill chunks and decode steps
over a paged K/V pool. Pure functions of (params, pool, the rows' host-built inputs); the engine
(`continuous.py`) jits them with the pool donated, so each call updates the pool in place.

Every row carries its own PRNG key, knobs and stop ids, and samples generated token s with
fold_in(key, s): the same draw `decode.generate_tokens` makes for that request, so tokens do not
depend on the batch, the slot or the engine. Shapes are the engine's buckets: rows B and
block-table width P (`shapes.fine_bucket`), prefill chunk width C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig
from marl_jax.sampling.logits import Knobs, select_tokens


def init_pool(config: ModelConfig, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
  """Zeroed (k, v) pools [Hkv, L * num_pages, page_size, Dh] in the compute dtype."""
  shape = (config.num_key_value_heads, config.num_hidden_layers * num_pages, page_size,
           config.head_dim)
  dtype = jnp.dtype(config.compute_dtype)
  return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def bytes_per_token(config: ModelConfig) -> int:
  """K/V bytes one token takes in the pool (every layer, keys and values)."""
  c = config
  return (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
          * jnp.dtype(c.compute_dtype).itemsize)


def _adapters(adapters: decoder.LoraAdapters | None, ids: jax.Array):
  return None if adapters is None else adapters.replace(policy_ids=ids)


def prefill(
    params: decoder.Params,
    k_pool: jax.Array,  # [Hkv, L * N, page, Dh]
    v_pool: jax.Array,
    tokens: jax.Array,  # [B, C] int32: each row's next chunk of its sequence, right-padded
    starts: jax.Array,  # [B] int32: position of the chunk's first token (tokens already cached)
    counts: jax.Array,  # [B] int32: real tokens in the chunk (0: a padding row)
    tables: jax.Array,  # [B, P] int32 block tables
    keys: jax.Array,  # [B] typed keys
    knobs: Knobs,  # [B]
    adapter_ids: jax.Array,  # [B] int32
    adapters: decoder.LoraAdapters | None,
    *,
    config: ModelConfig,
    attend: decoder.PagedAttention,
    modes: frozenset[int],
    candidates: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Writes each row's chunk into its pages; returns the pool and, drawn from the logits after
  the chunk's last real token, each row's generated token 0 and its log-prob (used for rows whose
  chunk ends their prompt)."""
  B, C = tokens.shape
  positions = starts[:, None] + jnp.arange(C, dtype=jnp.int32)
  valid = jnp.arange(C) < counts[:, None]
  paged = decoder.PagedKV(k_pool, v_pool, tables, starts, valid, attend)
  hidden, paged = decoder.paged_hidden_states(params, tokens, positions, config, paged,
                                              adapters=_adapters(adapters, adapter_ids))
  last = hidden[jnp.arange(B), jnp.maximum(counts - 1, 0)]  # [B, D]
  logits = decoder.lm_logits(params, last, config)
  step0 = jax.vmap(jax.random.fold_in, (0, None))(keys, 0)
  first, logp = select_tokens(logits, step0, knobs, modes=modes, candidates=candidates)
  return paged.k, paged.v, first, logp


def decode(
    params: decoder.Params,
    k_pool: jax.Array,  # [Hkv, L * N, page, Dh]
    v_pool: jax.Array,
    tokens: jax.Array,  # [B] int32: each row's last generated token, not yet in the pool
    lengths: jax.Array,  # [B] int32: tokens in the pool (the fed token goes to this position)
    produced: jax.Array,  # [B] int32: tokens generated so far (the next one is number `produced`)
    max_new: jax.Array,  # [B] int32: the row's budget
    stop_ids: jax.Array,  # [B, K] int32, -1 = unused
    live: jax.Array,  # [B] bool: a running row (False: padding)
    tables: jax.Array,  # [B, P] int32 block tables covering every position this call writes
    keys: jax.Array,  # [B] typed keys
    knobs: Knobs,  # [B]
    adapter_ids: jax.Array,  # [B] int32
    adapters: decoder.LoraAdapters | None,
    *,
    config: ModelConfig,
    attend: decoder.PagedAttention,
    steps: int,
    modes: frozenset[int],
    candidates: int,
) -> tuple[jax.Array, ...]:
  """Up to `steps` decode steps of every live row (a `lax.while_loop` that exits once no row is
  live): feed its token, write its key/value, draw the next token. A row stops at a stop token
  or its budget; it then writes only to the scratch page. Returns (k_pool, v_pool, tokens
  [B, steps], log-probs [B, steps] (pad 0 where a row produced nothing), produced [B] after the
  call, stopped [B]: ended by a stop token)."""
  B = tokens.shape[0]
  ad = _adapters(adapters, adapter_ids)
  out_tokens = jnp.zeros((B, steps), jnp.int32)
  out_logp = jnp.zeros((B, steps), jnp.float32)

  def body(carry):
    i, k_pool, v_pool, tokens, lengths, produced, live, stopped, out_tokens, out_logp = carry
    paged = decoder.PagedKV(k_pool, v_pool, tables, lengths, live[:, None], attend)
    hidden, paged = decoder.paged_hidden_states(params, tokens[:, None], lengths[:, None],
                                                config, paged, adapters=ad)
    logits = decoder.lm_logits(params, hidden[:, 0], config)
    step_keys = jax.vmap(jax.random.fold_in)(keys, produced)
    new, logp = select_tokens(logits, step_keys, knobs, modes=modes, candidates=candidates)
    out_tokens = out_tokens.at[:, i].set(jnp.where(live, new, 0))
    out_logp = out_logp.at[:, i].set(jnp.where(live, logp, 0.0))
    hit = live & jnp.any(new[:, None] == stop_ids, axis=-1)
    lengths = lengths + live
    produced = produced + live
    stopped = stopped | hit
    live = live & ~hit & (produced < max_new)
    return (i + 1, paged.k, paged.v, new, lengths, produced, live, stopped, out_tokens,
            out_logp)

  carry = (jnp.int32(0), k_pool, v_pool, tokens, lengths, produced, live & (produced < max_new),
           jnp.zeros((B,), bool), out_tokens, out_logp)
  carry = jax.lax.while_loop(lambda c: (c[0] < steps) & jnp.any(c[6]), body, carry)
  _, k_pool, v_pool, _, _, produced, _, stopped, out_tokens, out_logp = carry
  return k_pool, v_pool, out_tokens, out_logp, produced, stopped
