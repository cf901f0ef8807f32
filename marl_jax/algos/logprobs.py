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
) -> jax.Array:
  """Hidden states [n, R, D] of the states that emit each response token.

  The forward runs over prompt + response[:-1]; the state before response token t sits at
  position Tp - 1 + t, so only these R positions go on to the vocabulary projection or the value
  head (the prompt's positions never do).
  """
  Tp = prompt.shape[1]
  tokens = jnp.concatenate([prompt, response[:, :-1]], axis=1)
  attn_mask = jnp.concatenate([prompt_mask, jnp.ones(response[:, :-1].shape, bool)], axis=1)
  hidden, _ = decoder.hidden_states(params, tokens, decoder.positions_from_mask(attn_mask), config,
                                    attn_mask=attn_mask, adapters=adapters,
                                    layer_hook=layer_hook, remat=remat)
  return hidden[:, Tp - 1:]


def token_logprobs_from_hidden(params: Params, config: ModelConfig, hidden: jax.Array,
                               response: jax.Array, temperature: float, with_entropy: bool,
                               chunk: int | None = None) -> tuple[jax.Array, jax.Array | None]:
  """log_softmax(logits / temperature) at the response tokens [n, R], and the entropies.

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
                    temperature: float, with_entropy: bool) -> tuple[jax.Array, jax.Array | None]:
  """hidden [n, c, D], response [n, c] -> log-probs [n, c] and entropies [n, c] (or None)."""
  logits = decoder.lm_logits(params, hidden, config) / temperature  # [n, c, V]
  lse = jax.nn.logsumexp(logits, axis=-1)
  logp = jnp.take_along_axis(logits, response[..., None], axis=-1)[..., 0] - lse
  if not with_entropy:
    return logp, None
  return logp, lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
