"""HF checkpoint directories: export -> transformers (PyTorch) logits and prefill cache, load round
trips, errors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from marl_jax.models import decoder
from marl_jax.models.config import PRESETS
from marl_jax.models.hf import WeightsError, config_from_hf, export_hf_dir, load_hf_dir

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
# tiny-llama with Llama-3 rope frequency scaling, to check the rope_scaling export.
LLAMA3_SCALED = PRESETS.get("tiny-llama").replace(
    rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0, rope_original_max_position=64)


def random_params(config, seed=0):
  """init_params, with non-trivial norm scales so a swapped norm cannot go unnoticed."""
  params = decoder.init_params(config, jax.random.PRNGKey(seed), scale=0.1)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (x + 0.3 * jax.random.normal(next(keys), x.shape)
                       if path[-1].key == "scale" else x), params)


def left_padded_batch(vocab, lengths, seed=0):
  """tokens, attn_mask, positions [B, T] for rows of `lengths` real tokens, left-padded."""
  rng = np.random.default_rng(seed)
  T = max(lengths)
  tokens = rng.integers(0, vocab, (len(lengths), T)).astype(np.int32)
  mask = np.arange(T)[None, :] >= T - np.asarray(lengths)[:, None]
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def assert_trees_equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("config", [PRESETS.get(n) for n in TINY] + [LLAMA3_SCALED],
                         ids=[*TINY, "tiny-llama3-rope"])
def test_export_matches_transformers_logits(config, tmp_path):
  params = random_params(config)
  export_hf_dir(params, config, str(tmp_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert model.config.model_type == config.architecture
  tokens, mask, positions = left_padded_batch(config.vocab_size, [9, 5, 1, 7])
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
  ours, _ = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(positions), config,
                            attn_mask=jnp.asarray(mask))
  diff = np.abs(np.asarray(ours) - ref)[mask]  # padding positions have no meaningful logits
  assert diff.max() <= 1e-4, diff.max()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_fill_cache_holds_the_prompts_keys_and_values(name, tmp_path):
  """fill_cache=True returns the hidden states of a cacheless forward and, per layer, the
  post-rope keys and the values transformers keeps in its past_key_values, at every real token."""
  config = PRESETS.get(name)
  params = random_params(config)
  export_hf_dir(params, config, str(tmp_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  tokens, mask, positions = left_padded_batch(config.vocab_size, [9, 5, 1, 7])
  with torch.no_grad():
    past = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(positions, dtype=torch.long),
                 use_cache=True).past_key_values
  args = (params, jnp.asarray(tokens), jnp.asarray(positions), config)
  hidden, cache = decoder.hidden_states(*args, attn_mask=jnp.asarray(mask), fill_cache=True)
  plain, _ = decoder.hidden_states(*args, attn_mask=jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(hidden), np.asarray(plain))
  T = tokens.shape[1]
  assert int(cache.index) == T and cache.k.shape == (
      config.num_hidden_layers, 4, config.num_key_value_heads, T, config.head_dim)
  np.testing.assert_array_equal(np.asarray(cache.mask), mask)
  for layer in range(config.num_hidden_layers):
    ref_k, ref_v = past.layers[layer].keys.numpy(), past.layers[layer].values.numpy()
    for ours, ref in ((cache.k[layer], ref_k), (cache.v[layer], ref_v)):
      diff = np.abs(np.asarray(ours) - ref).transpose(0, 2, 1, 3)[mask]  # [real tokens, H, Dh]
      assert diff.max() <= 1e-5, (layer, diff.max())


def test_fill_cache_refuses_a_cache():
  config = PRESETS.get("tiny-llama")
  tokens = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="fill_cache=True builds a new cache; expected cache=None"):
    decoder.hidden_states(random_params(config), tokens, tokens, config, fill_cache=True,
                          cache=decoder.init_cache(config, 1, 3))


def test_prefix_rows_need_a_prefix():
  config = PRESETS.get("tiny-llama")
  tokens = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="prefix_rows picks entries of a prefix; expected prefix="):
    decoder.hidden_states(random_params(config), tokens, tokens, config,
                          prefix_rows=jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("name", TINY)
def test_load_round_trip_is_bitwise(name, tmp_path):
  config = PRESETS.get(name)
  params = random_params(config, seed=3)
  export_hf_dir(params, config, str(tmp_path))
  loaded_config, loaded = load_hf_dir(str(tmp_path))
  assert loaded_config == config
  assert_trees_equal(loaded, params)


def test_load_sharded_checkpoint_written_by_transformers(tmp_path):
  """transformers writes the shards + index; we must read back exactly what it was given."""
  config = PRESETS.get("tiny-qwen2")
  params = random_params(config, seed=5)
  export_hf_dir(params, config, str(tmp_path / "single"))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "single"))
  model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
  files = os.listdir(tmp_path / "sharded")
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 2
  loaded_config, loaded = load_hf_dir(str(tmp_path / "sharded"))
  assert loaded_config == config
  assert_trees_equal(loaded, params)


def test_bfloat16_load_and_export(tmp_path):
  config = PRESETS.get("tiny-llama")
  params = random_params(config)
  export_hf_dir(params, config, str(tmp_path / "f32"))
  loaded_config, loaded = load_hf_dir(str(tmp_path / "f32"), dtype="bfloat16")
  assert loaded_config.param_dtype == "bfloat16"
  expected = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  assert_trees_equal(loaded, expected)
  export_hf_dir(loaded, loaded_config, str(tmp_path / "bf16"))
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
  assert model.dtype == torch.bfloat16
  np.testing.assert_array_equal(
      model.model.layers[1].mlp.down_proj.weight.detach().float().numpy(),
      np.asarray(expected["layers"]["mlp"]["down_proj"]["kernel"][1], np.float32).T)
  assert_trees_equal(load_hf_dir(str(tmp_path / "bf16"), dtype="bfloat16")[1], expected)


def test_config_from_transformers_v5_dict():
  """transformers v5 writes `rope_parameters`; Llama-3 scaling must survive that spelling."""
  hf = transformers.LlamaConfig(
      vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
      tie_word_embeddings=True, rope_parameters={
          "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 2048}).to_dict()
  assert "rope_parameters" in hf
  config = config_from_hf(hf)
  assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (8, 2, 500000.0)
  assert (config.rope_scaling_factor, config.rope_original_max_position) == (32.0, 2048)
  assert config.tie_word_embeddings and not config.attention_bias
  assert config_from_hf(transformers.Qwen2Config(hidden_size=64, num_attention_heads=4,
                                                   num_key_value_heads=2)
                        .to_dict()).attention_bias


# ---------------------------------------------------------------------------------------------
# Bad input: one WeightsError naming the problem.


@pytest.fixture()
def exported(tmp_path):
  config = PRESETS.get("tiny-llama")
  export_hf_dir(random_params(config), config, str(tmp_path))
  return tmp_path


def _edit_config(path, **changes):
  with open(path / "config.json") as f:
    hf = json.load(f)
  hf.update(changes)
  with open(path / "config.json", "w") as f:
    json.dump(hf, f)


def _edit_tensors(path, edit):
  file = str(path / "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  edit(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def test_error_unknown_architecture(exported):
  _edit_config(exported, model_type="mistral")
  with pytest.raises(WeightsError, match="unknown architecture model_type='mistral'"):
    load_hf_dir(str(exported))


def test_error_missing_tensor(exported):
  _edit_tensors(exported, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(WeightsError,
                     match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_hf_dir(str(exported))


def test_error_shape_mismatch(exported):
  def shrink(t):
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
  _edit_tensors(exported, shrink)
  with pytest.raises(WeightsError, match=r"shape mismatch for tensor 'model\.layers\.0\.self_attn"
                     r"\.k_proj\.weight': checkpoint has \(16, 64\), config expects \(32, 64\)"):
    load_hf_dir(str(exported))


def test_error_config_disagrees_with_tensors(exported):
  _edit_config(exported, model_type="qwen3")  # qwen3 would need q_norm/k_norm tensors
  with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_norm"):
    load_hf_dir(str(exported))


def test_error_unexpected_tensor(exported):
  _edit_tensors(exported, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias":
                                              np.zeros(64, np.float32)}))
  with pytest.raises(WeightsError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj"):
    load_hf_dir(str(exported))


def test_error_garbage_safetensors(exported):
  (exported / "model.safetensors").write_bytes(b"\x00garbage" * 1000)
  with pytest.raises(WeightsError, match="corrupt or truncated safetensors file"):
    load_hf_dir(str(exported))


def test_error_truncated_safetensors(exported):
  file = exported / "model.safetensors"
  data = file.read_bytes()
  file.write_bytes(data[: len(data) // 2])
  with pytest.raises(WeightsError, match="corrupt or truncated safetensors file"):
    load_hf_dir(str(exported))


def test_error_corrupt_config_json(exported):
  (exported / "config.json").write_text("{not json")
  with pytest.raises(WeightsError, match="corrupt JSON file .*config.json"):
    load_hf_dir(str(exported))


def test_error_missing_directory_and_files(tmp_path):
  with pytest.raises(WeightsError, match="no such checkpoint directory"):
    load_hf_dir(str(tmp_path / "absent"))
  with pytest.raises(WeightsError, match="missing config.json"):
    load_hf_dir(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(WeightsError, match="config.json lacks the required key"):
    load_hf_dir(str(tmp_path))


def test_error_unsupported_rope_scaling():
  hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
  with pytest.raises(WeightsError, match="unsupported rope scaling 'yarn'"):
    config_from_hf(hf)
