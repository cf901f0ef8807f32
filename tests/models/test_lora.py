"""LoRA adapters: layout, zero initial delta, per-row selection equals merged kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models import decoder, lora
from marl_jax.models.config import get_preset

CONFIG = get_preset("tiny-llama")


def _inputs(batch=4, length=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  return tokens, positions


def test_layout_and_init():
  cfg = lora.LoraConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))  # MARFT
  params = lora.init_lora(CONFIG, cfg, num_policies=3, key=jax.random.key(0))
  L, D = CONFIG.num_hidden_layers, CONFIG.hidden_size
  q_out = CONFIG.num_attention_heads * CONFIG.head_dim
  kv_out = CONFIG.num_key_value_heads * CONFIG.head_dim
  assert set(params) == {"self_attn"} and set(params["self_attn"]) == {"q_proj", "v_proj"}
  assert params["self_attn"]["q_proj"]["a"].shape == (L, 3, D, 8)
  assert params["self_attn"]["q_proj"]["b"].shape == (L, 3, 8, q_out)
  assert params["self_attn"]["v_proj"]["b"].shape == (L, 3, 8, kv_out)
  for ab in params["self_attn"].values():
    assert not np.any(np.asarray(ab["b"]))
    a = np.asarray(ab["a"])
    assert np.all(np.abs(a) <= 1 / np.sqrt(D)) and a.std() > 0
    assert not np.allclose(a[:, 0], a[:, 1])  # policies start from different A
  assert cfg.scale == 2.0
  assert lora.num_lora_policies(params) == 3


def test_all_modules_shapes_match_base():
  cfg = lora.LoraConfig()  # AT-GRPO: rank 16, alpha 32, every projection
  params = lora.init_lora(CONFIG, cfg, 2, jax.random.key(1))
  base = decoder.init_params(CONFIG, jax.random.key(2))
  for group, modules in params.items():
    for name, ab in modules.items():
      kernel = base["layers"][group][name]["kernel"]  # [L, in, out]
      assert ab["a"].shape == (kernel.shape[0], 2, kernel.shape[1], 16)
      assert ab["b"].shape == (kernel.shape[0], 2, 16, kernel.shape[2])


def test_fresh_adapters_do_not_change_the_model():
  base = decoder.init_params(CONFIG, jax.random.key(0))
  cfg = lora.LoraConfig(rank=4, alpha=8.0)
  params = lora.init_lora(CONFIG, cfg, 2, jax.random.key(1))
  tokens, positions = _inputs()
  want, _ = decoder.forward(base, tokens, positions, CONFIG)
  got, _ = decoder.forward(base, tokens, positions, CONFIG, adapters=lora.adapters(
      params, jnp.array([0, 1, 1, 0]), cfg))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_per_row_adapters_equal_merged_kernels():
  """Row b of a mixed batch must see exactly policy_ids[b]'s model W + scale * A @ B."""
  base = decoder.init_params(CONFIG, jax.random.key(0))
  cfg = lora.LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
  params = lora.init_lora(CONFIG, cfg, 2, jax.random.key(1))
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape), params)
  tokens, positions = _inputs()
  policy_ids = jnp.array([0, 1, 1, 0])
  got, _ = decoder.forward(base, tokens, positions, CONFIG,
                           adapters=lora.adapters(params, policy_ids, cfg))
  for p in (0, 1):
    merged = lora.merge_lora(base, params, cfg, p)
    want, _ = decoder.forward(merged, tokens, positions, CONFIG)
    rows = np.flatnonzero(np.asarray(policy_ids) == p)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], rtol=1e-5,
                               atol=1e-5)
  # The merge itself against a NumPy re-derivation, and the base left untouched.
  a = np.asarray(params["self_attn"]["q_proj"]["a"][:, 1], np.float64)
  b = np.asarray(params["self_attn"]["q_proj"]["b"][:, 1], np.float64)
  w = np.asarray(base["layers"]["self_attn"]["q_proj"]["kernel"], np.float64)
  merged = lora.merge_lora(base, params, cfg, 1)
  np.testing.assert_allclose(np.asarray(merged["layers"]["self_attn"]["q_proj"]["kernel"]),
                             w + 2.0 * a @ b, rtol=1e-5, atol=1e-6)
  assert merged["layers"]["mlp"]["up_proj"]["kernel"] is base["layers"]["mlp"]["up_proj"]["kernel"]
  np.testing.assert_array_equal(np.asarray(base["layers"]["self_attn"]["q_proj"]["kernel"]),
                                w.astype(np.float32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank"),
    (dict(alpha=0.0), "alpha"),
    (dict(target_modules=("q_proj", "qkv")), "qkv"),
    (dict(target_modules=()), "non-empty"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    lora.LoraConfig(**kwargs)


def test_merge_rejects_missing_policy():
  base = decoder.init_params(CONFIG, jax.random.key(0))
  cfg = lora.LoraConfig(rank=2, alpha=4.0)
  params = lora.init_lora(CONFIG, cfg, 2, jax.random.key(1))
  with pytest.raises(ValueError, match="policy 2 out of range"):
    lora.merge_lora(base, params, cfg, 2)
