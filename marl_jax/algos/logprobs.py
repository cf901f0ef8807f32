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
                               response: jax.Array, temperature: float, with_entropy: bool
                               ) -> tuple[jax.Array, jax.Array | None]:
  """log_softmax(logits / temperature) at the response tokens [n, R], and the entropies."""
  logits = decoder.lm_logits(params, hidden, config) / temperature  # [n, R, V]
  lse = jax.nn.logsumexp(logits, axis=-1)
  logp = jnp.take_along_axis(logits, response[..., None], axis=-1)[..., 0] - lse
  if not with_entropy:
    return logp, None
  return logp, lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
