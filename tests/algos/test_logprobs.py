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

  grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  (_, (logp, ent)), (g_params, g_hidden) = grad(params, jnp.asarray(hidden))
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


# ----------------------------------------------------------------------------- shared prompts

TP, RS = 5, 4


def _full_logp(params, prompt, prompt_mask, response, adapters=None):
  """Reference log-probs [n, R]: one full forward over prompt + response per row, read at each
  response position (no prompt sharing, no response-only slicing)."""
  tokens = jnp.concatenate([prompt, response], axis=1)
  mask = jnp.concatenate([prompt_mask, jnp.ones(response.shape, bool)], axis=1)
  logits, _ = decoder.forward(params, tokens, decoder.positions_from_mask(mask), CONFIG,
                              attn_mask=mask, adapters=adapters)
  logp = jax.nn.log_softmax(logits[:, TP - 1:-1], axis=-1)
  return jnp.take_along_axis(logp, response[..., None], axis=-1)[..., 0]


def _group_batch(rng):
  """7 rows over 3 prompts: A x3 (rows 0, 2, 5), B x2 (rows 1, 6; left-padded), C x1 (row 3),
  and row 4: A's tokens with one more padding slot, a different prompt."""
  a, b, c = (rng.integers(1, CONFIG.vocab_size, TP) for _ in range(3))
  prompt = np.stack([a, b, a, c, a, a, b]).astype(np.int32)
  prompt_mask = np.ones((7, TP), bool)
  prompt_mask[[1, 6], :2] = False
  prompt_mask[4, :1] = False
  prompt = np.where(prompt_mask, prompt, 0)
  response = rng.integers(1, CONFIG.vocab_size, (7, RS)).astype(np.int32)
  return prompt, prompt_mask, response


def test_distinct_prompts_by_hand():
  prompt, prompt_mask, _ = _group_batch(np.random.default_rng(0))
  rows, slot = logprobs.distinct_prompts(jnp.asarray(prompt), jnp.asarray(prompt_mask), None, 6)
  # Leaders in row order: 0 (A), 1 (B), 3 (C), 4 (A with padding); then row 0 as filler.
  assert rows.tolist() == [0, 1, 3, 4, 0, 0] and slot.tolist() == [0, 1, 0, 2, 3, 0, 1]
  keys = jnp.asarray([0, 0, 1, 0, 0, 0, 0])  # row 2 holds A under another adapter
  rows, slot = logprobs.distinct_prompts(jnp.asarray(prompt), jnp.asarray(prompt_mask), keys, 5)
  assert rows.tolist() == [0, 1, 2, 3, 4] and slot.tolist() == [0, 1, 2, 3, 4, 0, 1]


@pytest.mark.parametrize("use_lora", [False, True])
def test_shared_prompts_match_full_forward(use_lora):
  """Log-probs and every gradient with each prompt computed once equal a full forward per row;
  with per-row adapters, a prompt under two adapters is two prompts."""
  from marl_jax.models import lora
  rng = np.random.default_rng(1)
  prompt, prompt_mask, response = map(jnp.asarray, _group_batch(rng))
  params = decoder.init_params(CONFIG, jax.random.key(0), scale=0.2)
  weights = rng.normal(size=response.shape).astype(np.float32)
  lora_cfg = lora.LoraConfig(rank=2, alpha=4.0)
  lora_params = jax.tree.map(lambda x: x + 0.1, lora.init_lora(CONFIG, lora_cfg, 2,
                                                               jax.random.key(1)))
  policy_ids = jnp.asarray([0, 0, 1, 0, 0, 1, 0])  # rows 0, 5 and 2 split A into two prompts
  num = 5 if use_lora else 4

  def loss(params, lora_params, shared):
    adapters = lora.adapters(lora_params, policy_ids, lora_cfg) if use_lora else None
    if shared:
      hidden = logprobs.response_hidden(params, CONFIG, prompt, prompt_mask, response,
                                        adapters=adapters, num_prompts=num)
      logp, _ = logprobs.token_logprobs_from_hidden(params, CONFIG, hidden, response, 1.0, False)
    else:
      logp = _full_logp(params, prompt, prompt_mask, response, adapters)
    return jnp.sum(weights * logp), logp

  grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True), static_argnums=2)
  (_, got), got_grads = grad(params, lora_params, True)
  (_, want), want_grads = grad(params, lora_params, False)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Gradients to 1e-5 of each array's scale, as tests/parallel/test_train_step.assert_close (the
  # two programs sum the same float32 terms in different orders).
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
