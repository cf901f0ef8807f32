"""The jittable generation core: prefill each distinct prompt once, then decode every row.

`generate_tokens` is a pure function of (params, unique prompts, their rows, the rows' keys and
knobs, stop ids, ...): it is what the host `Sampler` jits.

  * Shared prompts. RL asks for G samples of one prompt. The U distinct prompts [U, Tp] are
    prefilled once, and the R rows `rows[u]` continue prompt u: their first tokens are drawn from
    its last logits, and at every decode step they read its keys/values as one shared prefix
    (`decoder.hidden_states(prefix=...)`): the prompt's cache is neither copied per row nor read
    once per row. Its R rows' queries form one matrix against it, so the prompt part of decode
    attention is a real matmul instead of R thin ones. Each row's own cache holds only its
    generated tokens.
  * Decode runs inside `lax.while_loop`s that exit as soon as every row has finished or `max_new`
    tokens were produced; it never returns to the host mid-generation.
  * Bounded attention span. With `block > 0` the decode is split into blocks of `block` steps, a
    Python loop of static shapes: block j attends over the prompt and (j + 1) * block row slots
    (the rows' cache grows by `block` empty slots between blocks), so early steps do not read the
    empty tail of a new_slots cache. Blocks that start after every row finished run zero steps.
    The price is one compiled loop body per block (compile time, not compile count). It pays on
    CPU: one SmolLM2-135M decode step over a 320-token prompt took 0.48 s with a 384-slot cache
    vs 0.77 s with 576 slots at B = 8, and 1.77 s vs 2.80 s at B = 32 (min of 10-15 interleaved
    steps on a 2-core machine under heavy load from other jobs, so the absolute numbers are
    inflated; the ratio is what matters).

Measured on SmolLM2-135M, one Plan-Path prompt (301 tokens) x 8 samples, 128 new tokens, T = 1,
top-p 0.9, best of 2 interleaved calls on the loaded 2-core machine: 29.1 s with the shared
prefill and 64-step blocks, 38.2 s prefilling every row, 31.4 s with one 448-slot span.

No continuous batching (refilling finished rows). Within one `generate` call there is nothing to
refill with: the rollout hands over every request of a turn at once, and the next turn's prompts
depend on these replies. The remaining waste is finished rows riding along until the longest row
ends (decode step time grows about linearly with rows on CPU: see above), which only compacting
the batch would remove (host round trips between blocks and a program per (rows, span) pair).
It is small for the policy we train: SmolLM2-135M at T = 1, top-p 0.9, 128 new tokens, 8 samples
of one prompt spent 91% of its row-steps on useful tokens (math: 930 of 8 x 128; Plan-Path: 937),
because most rows run to the budget (`experiments/bench_rl.py` reports this fraction).

Conventions:
  * Prompts are left-padded. `rows[u, j] = -1` marks batch padding: such a row counts as finished
    from the start, so it never keeps the loop alive. Padding prompts (all-False mask) are fine.
  * Row `rows[u, j] = b` samples step s with key `fold_in(keys[b], s)` and knobs[b]: a row's
    tokens depend only on its own prompt, key and knobs, never on the other rows, the layout
    [U, R], or whether its prompt was shared with other rows (the rollout engine's slots draw
    the same way: `sampling/paged_runner.py`).
  * After a row finishes, its remaining slots hold `pad_id` with log-prob 0; `lengths` counts the
    produced tokens, including the stop token that ended the row.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig
from marl_jax.sampling.logits import Knobs, select_tokens


@flax.struct.dataclass
class Generated:
  tokens: jax.Array  # [B, N] int32, pad_id after a row's end
  logprobs: jax.Array  # [B, N] f32 policy log-probs, 0 after a row's end
  lengths: jax.Array  # [B] int32 tokens produced (stop token included)
  stopped: jax.Array  # [B] bool: ended by a stop token (else by the length limit)


def _grow(cache: decoder.KVCache, n: int) -> decoder.KVCache:
  """The same cache with n empty slots appended: [L, B, Hkv, S, Dh] -> [L, B, Hkv, S + n, Dh]."""
  pad = lambda x, axis: jnp.pad(x, [(0, n) if a == axis else (0, 0) for a in range(x.ndim)])
  return cache.replace(k=pad(cache.k, 3), v=pad(cache.v, 3), mask=pad(cache.mask, 1))


def block_spans(new_slots: int, block: int) -> list[int]:
  """New-token slots visible to each decode block: [block, 2 * block, ..., new_slots]."""
  if block <= 0:
    return [new_slots]
  return [min(j, new_slots) for j in range(block, new_slots + block, block)]


def generate_tokens(
    params: decoder.Params,
    prompt: jax.Array,  # [U, Tp] int32, left-padded distinct prompts
    prompt_mask: jax.Array,  # [U, Tp] bool, False on padding
    rows: jax.Array,  # [U, R] int32: the caller's index of each row continuing prompt u; -1 = pad
    keys: jax.Array,  # [N] typed PRNG keys, one per caller row (N <= U * R, padded to it)
    knobs: Knobs,  # [N] each, one per caller row
    stop_ids: jax.Array,  # [K] int32, -1 = unused slot
    max_new: jax.Array,  # [] int32, <= new_slots
    adapters: decoder.LoraAdapters | None = None,  # policy_ids: [U], one per prompt
    *,
    config: ModelConfig,
    new_slots: int,
    block: int,
    candidates: int,
    modes: frozenset[int],
    pad_id: int = 0,
) -> Generated:
  """Generates up to `max_new` tokens for each of the U * R rows (static buffers of
  `new_slots`); outputs are in row-major [U, R] order, flattened to [U * R, ...]."""
  U, R = rows.shape
  B = U * R
  hidden, prefix = decoder.hidden_states(params, prompt, decoder.positions_from_mask(prompt_mask),
                                         config, attn_mask=prompt_mask, fill_cache=True,
                                         adapters=adapters)
  per_row = lambda x: jnp.repeat(x, R, axis=0)  # [U, ...] -> [B, ...]
  logits = per_row(decoder.lm_logits(params, hidden[:, -1], config))  # [B, V]; last position
  cache = decoder.init_cache(config, B, 0)  # the rows' own slots; _grow adds them per block
  if adapters is not None:
    adapters = adapters.replace(policy_ids=per_row(adapters.policy_ids))
  prompt_lengths = per_row(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32))  # [B]
  row_ids = rows.reshape(B)
  row_keys = keys[jnp.maximum(row_ids, 0)]  # [B]
  row_knobs = jax.tree.map(lambda x: x[jnp.maximum(row_ids, 0)], knobs)

  def choose(logits, step):
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
    return select_tokens(logits, step_keys, row_knobs, modes=modes, candidates=candidates)

  def record(state, step, tokens, logp):
    """Writes step's tokens for rows still running and updates which rows are done."""
    out_tokens, out_logp, lengths, stopped, finished = state
    live = ~finished
    out_tokens = out_tokens.at[:, step].set(jnp.where(live, tokens, pad_id))
    out_logp = out_logp.at[:, step].set(jnp.where(live, logp, 0.0))
    hit = live & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
    return (out_tokens, out_logp, lengths + live, stopped | hit, finished | hit)

  state = (jnp.full((B, new_slots), pad_id, jnp.int32), jnp.zeros((B, new_slots), jnp.float32),
           jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), row_ids < 0)
  tokens, logp = choose(logits, 0)
  state = record(state, 0, tokens, logp)

  def body(carry):
    step, cache, tokens, state = carry
    pos = (prompt_lengths + step - 1)[:, None]  # the fed token was produced at step - 1
    hidden, cache = decoder.hidden_states(params, tokens[:, None], pos, config, cache=cache,
                                          prefix=prefix, adapters=adapters)
    tokens, logp = choose(decoder.lm_logits(params, hidden[:, 0], config), step)
    return step + 1, cache, tokens, record(state, step, tokens, logp)

  carry, visible = (jnp.int32(1), cache, tokens, state), 0
  for span in block_spans(new_slots, block):
    # Step s feeds its input token into the rows' slot s - 1, so this block can run steps
    # s <= span.
    carry = (carry[0], _grow(carry[1], span - visible)) + carry[2:]
    limit = jnp.minimum(max_new, span + 1)
    cond = lambda c, limit=limit: (c[0] < limit) & ~jnp.all(c[3][-1])
    carry, visible = jax.lax.while_loop(cond, body, carry), span
  out_tokens, out_logp, lengths, stopped, _ = carry[3]
  return Generated(tokens=out_tokens, logprobs=out_logp, lengths=lengths, stopped=stopped)
