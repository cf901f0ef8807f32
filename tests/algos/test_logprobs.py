"""Learner log-probs from hidden states, whole and in LM-head slices, against NumPy.

The reference is written here: logits = h E^T / T, log_softmax, the entropy, and the gradients
of sum(w * logp) with respect to the hidden states and the (tied) embedding, derived by hand:
d logp_t / d z = (onehot(y_t) - softmax(z_t / T)) / T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos import logprobs
from marl_jax.models import decoder
from marl_jax.models.config import get_preset

CONFIG = get_preset("tiny-llama")
N, R, TEMP = 3, 7, 0.7


def numpy_reference(embedding, hidden, response, weights):
  """(logp [N, R], entropy [N, R], d/d hidden, d/d embedding) of sum(weights * logp)."""
  e, h = embedding.astype(np.float64), hidden.astype(np.float64)
  z = h @ e.T / TEMP  # [N, R, V]
  z -= z.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  logp_all = np.log(p)
  logp = np.take_along_axis(logp_all, response[..., None], -1)[..., 0]
  entropy = -(p * logp_all).sum(-1)
  onehot = np.eye(e.shape[0])[response]
  d_logits = weights[..., None] * (onehot - p) / TEMP  # d loss / d (h E^T)
  return logp, entropy, d_logits @ e, np.einsum("nrv,nrd->vd", d_logits, h)


@pytest.mark.parametrize("chunk", [None, 7, 3, 1])  # whole, one slice, ragged slices, per token
def test_logprobs_entropy_and_gradients_match_numpy(chunk):
  assert CONFIG.tie_word_embeddings
  rng = np.random.default_rng(0)
  params = decoder.init_params(CONFIG, jax.random.key(0), scale=0.5)
  hidden = rng.normal(size=(N, R, CONFIG.hidden_size)).astype(np.float32)
  response = rng.integers(0, CONFIG.vocab_size, (N, R)).astype(np.int32)
  weights = rng.normal(size=(N, R)).astype(np.float32)

  def loss(p, h):
    logp, ent = logprobs.token_logprobs_from_hidden(p, CONFIG, h, response, TEMP, True, chunk)
    return jnp.sum(weights * logp), (logp, ent)

  (_, (logp, ent)), (g_params, g_hidden) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      params, jnp.asarray(hidden))
  want_logp, want_ent, want_gh, want_ge = numpy_reference(
      np.asarray(params["embed_tokens"]["embedding"]), hidden, response, weights)
  np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g_hidden, want_gh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(g_params["embed_tokens"]["embedding"], want_ge, rtol=1e-4, atol=1e-5)


def test_slices_never_hold_the_whole_logits():
  """With slices of 2 the compiled gradient holds no [N, R, V] array: besides the embedding's
  gradient (accumulated over slices), its temporaries stay under an eighth of the logits."""
  config = dataclasses.replace(CONFIG, vocab_size=8192)  # logits dominate, as in real models
  params = jax.eval_shape(lambda: decoder.init_params(config, jax.random.key(0)))
  hidden = jax.ShapeDtypeStruct((N, 64, config.hidden_size), jnp.float32)
  response = jnp.zeros((N, 64), jnp.int32)

  def temp_bytes(chunk):
    grad = jax.jit(jax.grad(lambda p, h: jnp.sum(logprobs.token_logprobs_from_hidden(
        p, config, h, response, 1.0, True, chunk)[0]), (0, 1)))
    return grad.lower(params, hidden).compile().memory_analysis().temp_size_in_bytes

  whole_logits = N * 64 * config.vocab_size * 4
  embedding_grad = config.vocab_size * config.hidden_size * 4
  assert temp_bytes(None) >= whole_logits
  assert temp_bytes(2) < whole_logits / 8 + embedding_grad
