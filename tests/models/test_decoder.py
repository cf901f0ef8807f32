"""Attention implementations: `jax.nn.dot_product_attention` ("sdpa") against the grouped-query
einsums ("eager") the decoder had before it, forward and backward, with and without a shared
prompt; and the fp32 final norm and LM head.

On CPU both run in fp32 (`sdpa` takes its XLA path there), so they must agree to fp32 rounding:
the same softmax over the same keys, summed in another order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos import logprobs
from marl_jax.models import decoder, precision
from marl_jax.models.config import PRESETS

# fp32 attention summed in another order: a few ulps of the O(1) hidden states.
ATOL = 2e-5


def _configs(name):
  base = PRESETS.get(name)
  return base.replace(attn_implementation="eager"), base.replace(attn_implementation="sdpa")


def _batch(vocab, lengths, seed=0):
  rng = np.random.default_rng(seed)
  T = max(lengths)
  tokens = rng.integers(1, vocab, (len(lengths), T)).astype(np.int32)
  mask = np.arange(T)[None, :] >= T - np.asarray(lengths)[:, None]
  return tokens, mask, np.asarray(decoder.positions_from_mask(mask))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_sdpa_matches_eager_on_left_padded_rows(name):
  eager, sdpa = _configs(name)
  params = decoder.init_params(eager, jax.random.key(0), scale=0.2)
  tokens, mask, positions = _batch(eager.vocab_size, [9, 4, 1, 7])
  run = lambda c: decoder.hidden_states(params, tokens, positions, c, attn_mask=mask)[0]
  want, got = np.asarray(run(eager)), np.asarray(run(sdpa))
  np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)
  assert np.isfinite(got).all()  # a padding query (no key to see) still gets a finite row


def test_sdpa_prefill_cache_matches_eager():
  eager, sdpa = _configs("tiny-qwen2")
  params = decoder.init_params(eager, jax.random.key(1), scale=0.2)
  tokens, mask, positions = _batch(eager.vocab_size, [6, 3, 5])
  run = lambda c: decoder.hidden_states(params, tokens, positions, c, attn_mask=mask,
                                        fill_cache=True)
  (h_e, cache_e), (h_s, cache_s) = run(eager), run(sdpa)
  np.testing.assert_allclose(np.asarray(h_s)[mask], np.asarray(h_e)[mask], atol=ATOL, rtol=0)
  real = np.asarray(mask)[None, :, None, :, None]  # [L, B, Hkv, T, Dh] slots of real tokens
  for a, b in ((cache_s.k, cache_e.k), (cache_s.v, cache_e.v)):
    np.testing.assert_allclose(np.where(real, a, 0), np.where(real, b, 0), atol=ATOL, rtol=0)


def _loss(params, config, prompt, prompt_mask, response, num_prompts):
  hidden = logprobs.response_hidden(params, config, prompt, prompt_mask, response,
                                    num_prompts=num_prompts)
  logp, _ = logprobs.token_logprobs_from_hidden(params, config, hidden, response, 1.0, False)
  return jnp.sum(logp), logp


@pytest.mark.parametrize("shared", [False, True], ids=["per_row", "shared_prompt"])
def test_sdpa_log_probs_and_gradients_match_eager(shared):
  """The learner's response log-probs and their gradients: per-row prompts, and a prompt shared
  by G rows (pass 2 attends to its rows' gathered prefix plus their own tokens)."""
  eager, sdpa = _configs("tiny-llama")
  params = decoder.init_params(eager, jax.random.key(2), scale=0.2)
  rng = np.random.default_rng(3)
  G, U, R = 3, 2, 5
  prompt, prompt_mask, _ = _batch(eager.vocab_size, [6, 2], seed=4)
  prompt, prompt_mask = prompt.repeat(G, axis=0), prompt_mask.repeat(G, axis=0)  # [U * G, Tp]
  response = rng.integers(1, eager.vocab_size, (U * G, R)).astype(np.int32)
  grad = jax.grad(_loss, has_aux=True)
  num = U if shared else None
  g_e, lp_e = grad(params, eager, prompt, prompt_mask, response, num)
  g_s, lp_s = grad(params, sdpa, prompt, prompt_mask, response, num)
  np.testing.assert_allclose(np.asarray(lp_s), np.asarray(lp_e), atol=ATOL, rtol=0)
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_e)):
    scale = float(np.max(np.abs(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * max(scale, 1.0), rtol=0)


def test_auto_picks_sdpa_for_16_bit_compute_only():
  base = PRESETS.get("tiny-llama")
  assert not base.uses_sdpa  # fp32 compute: the eager einsums
  assert base.replace(compute_dtype="bfloat16").uses_sdpa
  assert not base.replace(compute_dtype="bfloat16", attn_implementation="eager").uses_sdpa
  with pytest.raises(ValueError, match="attn_implementation='flash'; expected one of"):
    base.replace(attn_implementation="flash")


def test_bf16_compute_keeps_the_final_norm_and_fp32_head_in_fp32():
  """Under bf16 compute with fp32 weights, the final hidden states and the LM head are fp32:
  the logits equal an fp32 product of the returned hidden states and the fp32 head; with a bf16
  head (the sampler's compute copy) the product runs on bf16 inputs, accumulated in fp32."""
  config = PRESETS.get("tiny-qwen3").replace(compute_dtype="bfloat16")
  params = decoder.init_params(config, jax.random.key(5), scale=0.2)
  tokens, mask, positions = _batch(config.vocab_size, [5, 3])
  hidden, _ = decoder.hidden_states(params, tokens, positions, config, attn_mask=mask)
  assert hidden.dtype == jnp.float32
  logits = decoder.lm_logits(params, hidden, config)
  want = np.asarray(hidden, np.float64) @ np.asarray(params["lm_head"]["kernel"], np.float64)
  np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5, rtol=1e-5)
  copy = precision.compute_copy(params, "bfloat16", head=True)
  logits16 = decoder.lm_logits(copy, hidden, config)
  h16 = np.asarray(hidden.astype(jnp.bfloat16), np.float64)
  k16 = np.asarray(copy["lm_head"]["kernel"], np.float64)
  assert logits16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits16), h16 @ k16, atol=1e-5, rtol=1e-5)
