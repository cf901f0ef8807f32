"""The learner's log-probs: response hidden states and log_softmax(logits / temperature).

The learner's log-prob of response token t is `log_softmax(logits / temperature)[token]` from a
teacher-forced forward over prompt + response, the same quantity the sampler records, so PPO
ratios start at 1. Which params run for which rows is the policy layout's business
(`parallel/layouts.py`); this is the model maths every layout shares.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig

Params = dict[str, Any]


def response_hidden(
    params: Params,
    config: ModelConfig,
    prompt: jax.Array,  # [n, Tp] int32, left-padded
    prompt_mask: jax.Array,  # [n, Tp] bool
    response: jax.Array,  # [n, R] int32, right-padded
    *,
    adapters: decoder.LoraAdapters | None = None,
    layer_hook: decoder.LayerHook | None = None,
    remat: bool = False,
    num_prompts: int | None = None,
) -> jax.Array:
  """Hidden states [n, R, D] of the states that emit each response token.

  The forward runs over prompt + response[:-1]; the state before response token t sits at
  position Tp - 1 + t, so only these R positions go on to the vocabulary projection or the value
  head (the prompt's positions never do).

  `num_prompts`: an upper bound on the distinct (prompt, adapter) rows among the n (a static
  int the host computes, `TrainBatch.num_prompts`). Each distinct prompt then runs once and its
  keys/values serve every row that shares it (`_shared_prompt_hidden`): the G samples of a group
  pay for their prompt once, forward and backward. None (or >= n): every row runs its prompt.
  """
  if num_prompts is not None and num_prompts < prompt.shape[0]:
    return _shared_prompt_hidden(params, config, prompt, prompt_mask, response, num_prompts,
                                 adapters=adapters, layer_hook=layer_hook, remat=remat)
  Tp = prompt.shape[1]
  tokens = jnp.concatenate([prompt, response[:, :-1]], axis=1)
  attn_mask = jnp.concatenate([prompt_mask, jnp.ones(response[:, :-1].shape, bool)], axis=1)
  hidden, _ = decoder.hidden_states(params, tokens, decoder.positions_from_mask(attn_mask), config,
                                    attn_mask=attn_mask, adapters=adapters,
                                    layer_hook=layer_hook, remat=remat)
  return hidden[:, Tp - 1:]


def distinct_prompts(prompt: jax.Array, prompt_mask: jax.Array, keys: jax.Array | None,
                     num: int) -> tuple[jax.Array, jax.Array]:
  """(rows [num], slot [n]): the first row of each distinct (prompt, key) in row order, padded
  with row 0, and the index in `rows` of each row's prompt. Rows are equal when their real
  tokens, padding and key (the LoRA policy id: adapters change a prompt's keys/values) are.
  `num` must bound the distinct count, or rows would share a wrong prompt; the host guarantees
  it (`layouts.prompt_bound`)."""
  n = prompt.shape[0]
  tokens = jnp.where(prompt_mask, prompt, -1)
  same = jnp.all(tokens[:, None, :] == tokens[None, :, :], axis=-1)  # [n, n]
  if keys is not None:
    same &= keys[:, None] == keys[None, :]
  first = jnp.argmax(same, axis=1)  # the first row equal to each row (itself at worst)
  leader = first == jnp.arange(n)
  slot = (jnp.cumsum(leader) - 1)[first]
  return jnp.nonzero(leader, size=num, fill_value=0)[0], slot


def _shared_prompt_hidden(params, config, prompt, prompt_mask, response, num_prompts, *,
                          adapters, layer_hook, remat) -> jax.Array:
  """`response_hidden` with each distinct prompt computed once (see there).

  Pass 1 runs the `num_prompts` distinct prompts and keeps their per-layer keys/values (a KV
  cache of Tp slots). Pass 2 runs every row's response[:-1] against its prompt's keys/values as
  a read-only prefix, each row naming its entry (`hidden_states(prefix=..., prefix_rows=slot)`:
  the rows of a prompt are not consecutive in the batch; each layer gathers its own rows). The
  state before response token 0 is the prompt's last hidden state. Gradients flow back through
  the gather, so a shared prompt's gradient is the sum over its rows, as in the unshared
  forward."""
  R = response.shape[1]
  rows, slot = distinct_prompts(prompt, prompt_mask,
                                None if adapters is None else adapters.policy_ids, num_prompts)
  p_mask = prompt_mask[rows]
  p_adapters = None if adapters is None else adapters.replace(
      policy_ids=adapters.policy_ids[rows])
  p_hidden, cache = decoder.hidden_states(
      params, prompt[rows], decoder.positions_from_mask(p_mask), config, attn_mask=p_mask,
      fill_cache=True, adapters=p_adapters, layer_hook=layer_hook,
      remat=remat)  # [P, Tp, D]; cache [L, P, Hkv, Tp, Dh]
  first = p_hidden[slot, -1:]  # [n, 1, D]
  if R == 1:
    return first
  positions = jnp.sum(prompt_mask, axis=1, keepdims=True) + jnp.arange(R - 1)  # [n, R - 1]
  hidden, _ = decoder.hidden_states(params, response[:, :-1], positions, config,
                                    prefix=cache, prefix_rows=slot, adapters=adapters,
                                    layer_hook=layer_hook, remat=remat)
  return jnp.concatenate([first, hidden], axis=1)


def token_logprobs_from_hidden(params: Params, config: ModelConfig, hidden: jax.Array,
                               response: jax.Array, temperature: float | jax.Array,
                               with_entropy: bool, chunk: int | None = None
                               ) -> tuple[jax.Array, jax.Array | None]:
  """log_softmax(logits / temperature) at the response tokens [n, R], and the entropies.

  `temperature`: one number, or one per row [n] (a team whose agents sample at their own
  temperatures divides each row's logits by its agent's).

  `chunk`: response positions per LM-head slice. The [n, R, V] fp32 logits are then never whole:
  a scan computes one [n, chunk, V] slice at a time and the backward pass recomputes each slice
  (jax.checkpoint), so the logits' memory falls from n * R * V floats (and their softmax and
  gradient) to n * chunk * V. None: one slice.
  """
  R = response.shape[1]
  if chunk is None or chunk >= R:
    return _slice_logprobs(params, config, hidden, response, temperature, with_entropy)
  n, _, D = hidden.shape
  num = -(-R // chunk)
  pad = num * chunk - R
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(n, num, chunk, D).swapaxes(0, 1)
  tok = jnp.pad(response, ((0, 0), (0, pad))).reshape(n, num, chunk).swapaxes(0, 1)
  one = jax.checkpoint(lambda p, h_c, tok_c: _slice_logprobs(p, config, h_c, tok_c, temperature,
                                                             with_entropy))
  _, (logp, ent) = jax.lax.scan(lambda _, xs: (None, one(params, *xs)), None, (h, tok))
  whole = lambda x: x.swapaxes(0, 1).reshape(n, num * chunk)[:, :R]  # [num, n, chunk] -> [n, R]
  return whole(logp), None if ent is None else whole(ent)


def _slice_logprobs(params: Params, config: ModelConfig, hidden: jax.Array, response: jax.Array,
                    temperature: float | jax.Array, with_entropy: bool
                    ) -> tuple[jax.Array, jax.Array | None]:
  """hidden [n, c, D], response [n, c] -> log-probs [n, c] and entropies [n, c] (or None)."""
  if jnp.ndim(temperature):  # one per row [n]
    temperature = jnp.reshape(temperature, (-1, 1, 1))
  logits = decoder.lm_logits(params, hidden, config) / temperature  # [n, c, V]
  lse = jax.nn.logsumexp(logits, axis=-1)
  logp = jnp.take_along_axis(logits, response[..., None], axis=-1)[..., 0] - lse
  if not with_entropy:
    return logp, None
  return logp, lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
