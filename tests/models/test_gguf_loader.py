"""GGUF loading: the embedded SmolLM2-135M Q4_1 file against transformers' own GGUF loader,
synthetic GGUFs for the qwen2/qwen3 paths, and the error cases."""

from __future__ import annotations

import copy
import functools
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from marl_jax.models import decoder
from marl_jax.models.config import PRESETS
from marl_jax.models.gguf_loader import load_gguf, open_gguf, unpermute_rows
from marl_jax.models.hf import WeightsError, tensors_from_params
from marl_jax.models.loading import embedded_gguf_path, load_model
from marl_jax.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm(transformers_smollm2):
  """Our load of the embedded GGUF and transformers' (PyTorch, fp32) load of the same file
  (`conftest.py`)."""
  start = time.perf_counter()
  loaded = load_model("smollm2-135m-instruct")
  jax.block_until_ready(loaded.params)
  print(f"\nload_model('smollm2-135m-instruct'): {time.perf_counter() - start:.1f} s")
  model = transformers.AutoModelForCausalLM.from_pretrained(transformers_smollm2,
                                                            dtype=torch.float32)
  return loaded, model


def test_config_matches_preset(smollm):
  loaded, model = smollm
  assert loaded.config == PRESETS.get("smollm2-135m-instruct")
  assert model.config.tie_word_embeddings and loaded.config.tie_word_embeddings


def test_weights_equal_transformers_gguf_loader(smollm):
  """Dequantisation, q/k un-permutation and layout agree with transformers, bit for bit."""
  loaded, model = smollm
  ours = tensors_from_params(loaded.params, loaded.config)
  theirs = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
  assert sorted(ours) == sorted(theirs)
  for name, value in ours.items():
    np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def test_dequantisation_matches_numpy_rederivation(smollm):
  """Q4_1 and Q8_0 blocks decoded by hand from the raw bytes (ggml's block formats)."""
  loaded, _ = smollm
  tensors = {t.name: t for t in open_gguf(embedded_gguf_path()).tensors}
  # Q4_1 block of 32 weights: f16 scale d, f16 min m, 16 bytes; byte j holds weight j in its low
  # nibble and weight j + 16 in its high nibble; w = d * q + m.
  raw = np.asarray(tensors["blk.2.ffn_up.weight"].data)  # [rows, blocks * 20] uint8
  assert tensors["blk.2.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
  blocks = raw.reshape(raw.shape[0], -1, 20)
  d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
  m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
  nibbles = np.concatenate([blocks[..., 4:] & 0x0F, blocks[..., 4:] >> 4], axis=-1)
  expected = (d * nibbles + m).reshape(raw.shape[0], -1)  # [out, in]
  np.testing.assert_array_equal(
      np.asarray(loaded.params["layers"]["mlp"]["up_proj"]["kernel"][2]).T, expected)
  # Q8_0 block of 32 weights: f16 scale d, 32 int8; w = d * q.
  raw = np.asarray(tensors["token_embd.weight"].data)[:100]
  assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
  blocks = raw.reshape(100, -1, 34)
  d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
  q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(loaded.params["embed_tokens"]["embedding"][:100]),
                                (d * q).reshape(100, -1))


def test_logits_match_transformers_on_chat_prompt(smollm):
  """Every position's logits of a chat prompt, ours in fp32 jitted as the sampler runs, against
  transformers' forward of the same weights in fp64 (the exact answer fp32 approximates).

  The bound is the fp32 noise floor of this 30-layer model on the machine that runs the test:
  twice transformers' own fp32 error there, and never below 1e-4. Measured: AMD EPYC
  (2026-11-25) ours 8.7e-5 from the fp64 forward, transformers' fp32 9.3e-5; Intel Xeon with
  AVX-512 (2026-11-27) ours 1.10e-4, transformers' 7.7e-5 (logits up to 38.5), where the
  earlier fixed 1e-4 failed. A wrong layer (rope, norm, a bf16 path) errs by 1e-2 and more.
  Two fp32 forwards can err in opposite directions, so the reference is fp64.
  """
  loaded, model = smollm
  tok = loaded.tokenizer
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
  tokens = np.asarray([ids], np.int32)
  with torch.no_grad():
    ref = copy.deepcopy(model).double()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  forward = jax.jit(functools.partial(decoder.forward, config=loaded.config))
  ours, _ = forward(loaded.params, jnp.asarray(tokens), jnp.arange(len(ids))[None])
  assert ours.dtype == jnp.float32 and theirs.dtype == np.float32
  diff = np.abs(np.asarray(ours, np.float64) - ref).max()
  floor = max(1e-4, 2 * np.abs(theirs.astype(np.float64) - ref).max())
  assert diff <= floor, (diff, floor)


def test_next_token_logits_match_on_left_padded_batch(smollm):
  """Chat prompts of different lengths, left-padded: the logits that generation samples from."""
  loaded, model = smollm
  tok = loaded.tokenizer
  questions = ["What is the capital of France? Answer in one word.", "Solve: 12 * 7 + 3 = ?",
               "Write a haiku about the sea."]
  rows = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
          for q in questions]
  T = max(map(len, rows))
  tokens = np.full((len(rows), T), tok.pad_id, np.int32)
  mask = np.zeros((len(rows), T), bool)
  for i, row in enumerate(rows):
    tokens[i, T - len(row):] = row
    mask[i, T - len(row):] = True
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()[:, -1]
  forward = jax.jit(functools.partial(decoder.forward, config=loaded.config))
  ours, _ = forward(loaded.params, jnp.asarray(tokens), jnp.asarray(positions),
                    attn_mask=jnp.asarray(mask))
  diff = np.abs(np.asarray(ours)[:, -1] - ref).max()
  assert diff <= 1e-4, diff


# ---------------------------------------------------------------------------------------------
# Synthetic GGUFs written with the gguf package (F32 tensors, llama.cpp names and metadata).

_LLAMA_CPP_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w, n_heads):
  """convert_hf_to_gguf's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def write_gguf(path, config, params, arch=None, edit=None):
  """Writes `params` as llama.cpp would; `edit(tensors)` may corrupt the name -> array dict."""
  c = config
  arch = arch or c.architecture
  tensors = {}
  for name, value in tensors_from_params(params, c).items():
    if name == "model.embed_tokens.weight":
      name = "token_embd.weight"
    elif name == "model.norm.weight":
      name = "output_norm.weight"
    elif name == "lm_head.weight":
      name = "output.weight"
    else:
      _, _, layer, rest = name.split(".", 3)
      module, kind = rest.rsplit(".", 1)
      name = f"blk.{layer}.{_LLAMA_CPP_NAMES[module]}.{kind}"
    if arch == "llama" and ".attn_q." in name:
      value = llama_cpp_permute(value, c.num_attention_heads)
    if arch == "llama" and ".attn_k." in name:
      value = llama_cpp_permute(value, c.num_key_value_heads)
    tensors[name] = np.ascontiguousarray(value, np.float32)
  if edit is not None:
    edit(tensors)
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_key_length(c.head_dim)
  writer.add_rope_freq_base(c.rope_theta)
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_vocab_size(c.vocab_size)
  for name, value in tensors.items():
    writer.add_tensor(name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_synthetic_gguf_round_trip(name, tmp_path):
  """llama GGUFs get their q/k rows un-permuted; qwen2/qwen3 ones are stored unpermuted."""
  config = PRESETS.get(name)
  params = decoder.init_params(config, jax.random.PRNGKey(0))
  loaded_config, loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params))
  assert loaded_config == config
  for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
  np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 6), 6), w)
  assert not np.array_equal(llama_cpp_permute(w, 6), w)


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_error_truncated_file(tmp_path):
  data = open(embedded_gguf_path(), "rb").read()
  for size in (len(data) // 2, 1000):
    (tmp_path / "cut.gguf").write_bytes(data[:size])
    with pytest.raises(WeightsError, match="corrupt or truncated GGUF file"):
      load_model(str(tmp_path / "cut.gguf"))


def test_error_garbage_file(tmp_path):
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file" * 100)
  with pytest.raises(WeightsError, match="corrupt or truncated GGUF file"):
    load_gguf(str(tmp_path / "junk.gguf"))


def test_error_unknown_architecture(tmp_path):
  config = PRESETS.get("tiny-llama")
  path = write_gguf(tmp_path / "m.gguf", config, decoder.init_params(config, jax.random.PRNGKey(0)),
                    arch="mamba")
  with pytest.raises(WeightsError, match="unknown architecture general.architecture='mamba'"):
    load_gguf(path)


def test_error_missing_tensor(tmp_path):
  config = PRESETS.get("tiny-llama")
  path = write_gguf(tmp_path / "m.gguf", config, decoder.init_params(config, jax.random.PRNGKey(0)),
                    edit=lambda t: t.pop("blk.1.ffn_gate.weight"))
  with pytest.raises(WeightsError, match=r"missing tensor 'blk\.1\.ffn_gate\.weight'"):
    load_gguf(path)


def test_error_shape_mismatch(tmp_path):
  config = PRESETS.get("tiny-qwen2")

  def shrink(tensors):
    tensors["blk.0.attn_v.weight"] = tensors["blk.0.attn_v.weight"][:, :48].copy()

  path = write_gguf(tmp_path / "m.gguf", config, decoder.init_params(config, jax.random.PRNGKey(0)),
                    edit=shrink)
  with pytest.raises(WeightsError, match=r"shape mismatch for tensor 'blk\.0\.attn_v\.weight': "
                     r"file has \(32, 48\), config expects \(32, 64\)"):
    load_gguf(path)


def test_error_llama3_rope_factors(tmp_path):
  config = PRESETS.get("tiny-llama")
  path = write_gguf(tmp_path / "m.gguf", config, decoder.init_params(config, jax.random.PRNGKey(0)),
                    edit=lambda t: t.update({"rope_freqs.weight": np.ones(8, np.float32)}))
  with pytest.raises(WeightsError, match="rope_freqs.weight"):
    load_gguf(path)


def test_error_bad_names_and_paths(tmp_path):
  with pytest.raises(WeightsError, match="unknown model 'no-such-model'"):
    load_model("no-such-model")
  with pytest.raises(WeightsError, match="preset 'qwen3-1.7b' has no embedded weights"):
    load_model("qwen3-1.7b")
  with pytest.raises(WeightsError, match="no such file or directory"):
    load_model(str(tmp_path / "absent.gguf"))
  with pytest.raises(WeightsError, match="no such GGUF file"):
    load_gguf(str(tmp_path / "absent.gguf"))
  (tmp_path / "weights.bin").write_bytes(b"x")
  with pytest.raises(WeightsError, match="expected a .gguf file or an HF checkpoint directory"):
    load_model(str(tmp_path / "weights.bin"))


def test_tokenizer_needs_tokenizer_metadata(tmp_path):
  config = PRESETS.get("tiny-llama")
  path = write_gguf(tmp_path / "m.gguf", config, decoder.init_params(config, jax.random.PRNGKey(0)))
  with pytest.raises(WeightsError, match="lacks the required key 'tokenizer.ggml"):
    Tokenizer.from_gguf(path)
