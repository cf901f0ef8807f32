"""Tokenizer from GGUF metadata (no torch) against transformers' GGUF tokenizer; HF directories."""

from __future__ import annotations

import json

import gguf
import jax
import pytest
import regex
import transformers
from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

from marl_jax.models import decoder
from marl_jax.models.config import PRESETS
from marl_jax.models.gguf_loader import metadata, open_gguf
from marl_jax.models.hf import WeightsError, export_hf_dir
from marl_jax.models.loading import embedded_gguf_path, load_model
from marl_jax.models.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    "héllo wörld — naïve café, Ünïcödé “quotes” …",
    "日本語のテキスト、中文，한국어 😀🎉 👩‍👩‍👧",
    "  leading spaces,\ttabs and\r\nwindows newlines\n\n\nparagraphs   ",
    "I'm sure they'll say it's fine; DON'T YOU think? We've seen it.",
    "12345 + 678 = 13023 and 3.14159",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "a" * 200,
]
# Whitespace running into a digit: the only place the "smollm" pre-tokenizer differs from the
# GPT-2 regex that transformers falls back to.
DIGIT_TEXTS = ["x  1", "\n\n1. first\n2. second", "total:\t\t42", "a   7 b\n 8"]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3."}],
]


@pytest.fixture(scope="module")
def reader():
  return open_gguf(embedded_gguf_path())


@pytest.fixture(scope="module")
def tokenizers_pair(reader, transformers_smollm2):
  """(ours from the embedded GGUF's metadata, transformers' own GGUF tokenizer: `conftest.py`)."""
  reference = transformers.AutoTokenizer.from_pretrained(transformers_smollm2)
  return Tokenizer.from_gguf(reader), reference


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_gguf_tokenizer(tokenizers_pair, text):
  ours, reference = tokenizers_pair
  ids = ours.encode(text)
  assert ids == reference.encode(text, add_special_tokens=False)
  assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_split_like_llama_cpp_smollm(tokenizers_pair, text):
  """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) splits every digit off
  first, then applies the GPT-2 regex to each piece: encode each piece with transformers."""
  ours, reference = tokenizers_pair
  pieces = regex.findall(r"\p{N}|[^\p{N}]+", text)
  expected = [i for piece in pieces for i in reference.encode(piece, add_special_tokens=False)]
  assert ours.encode(text) == expected
  assert ours.decode(expected) == text


@pytest.mark.parametrize("messages", MESSAGES, ids=["single", "multi-turn"])
def test_chat_template_equals_transformers(tokenizers_pair, messages):
  ours, reference = tokenizers_pair
  for add in (True, False):
    text = ours.apply_chat_template(messages, add_generation_prompt=add)
    assert text == reference.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add)
  assert text.startswith("<|im_start|>")
  assert ours.encode(text) == reference.encode(text, add_special_tokens=False)


def test_special_ids(tokenizers_pair):
  ours, reference = tokenizers_pair
  assert ours.stop_token_ids == (2,) and ours.hf.eos_token == "<|im_end|>"
  assert ours.pad_id == reference.pad_token_id == 2
  assert ours.vocab_size == len(reference) == 49152
  assert (ours.hf.bos_token, ours.hf.unk_token) == (reference.bos_token, reference.unk_token)
  # add_bos_token is false in this file: special tokens are only those the text spells.
  assert ours.encode("hi", add_special_tokens=True) == reference.encode("hi")


@pytest.fixture(scope="module")
def small_vocab(reader):
  """The first 4000 tokens of the embedded vocabulary and the merges that stay inside them."""
  tokens = metadata(reader, "tokenizer.ggml.tokens")[:4000]
  known = set(tokens)
  merges = []
  for merge in metadata(reader, "tokenizer.ggml.merges"):
    left, right = merge.split(" ", 1)
    if not {left, right, left + right} <= known:
      break
    merges.append(merge)
  return tokens, merges, metadata(reader, "tokenizer.ggml.token_type")[:4000]


def _write_tokenizer_gguf(path, vocab, arch, pre):
  """A tensor-free GGUF holding `vocab` under the pre-tokenizer name `pre`."""
  tokens, merges, types = vocab
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_context_length(4096)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(types)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


@pytest.mark.parametrize("arch,pre", [("qwen2", "qwen2"), ("llama", "llama-bpe")])
def test_other_pre_tokenizers_equal_transformers(small_vocab, arch, pre, tmp_path):
  path = _write_tokenizer_gguf(tmp_path / "tok.gguf", small_vocab, arch, pre)
  ours = Tokenizer.from_gguf(path)
  reference, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(path)[:2])
  for text in TEXTS + DIGIT_TEXTS:
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


def test_unsupported_tokenizers(small_vocab, tmp_path):
  path = _write_tokenizer_gguf(tmp_path / "tok.gguf", small_vocab, "llama", "jais")
  with pytest.raises(WeightsError,
                     match="unsupported GGUF pre-tokenizer tokenizer.ggml.pre='jais'"):
    Tokenizer.from_gguf(path)


def test_hf_directory_round_trip(tokenizers_pair, tmp_path):
  """Export writes tokenizer files + generation_config.json that transformers and we read back."""
  ours, _ = tokenizers_pair
  config = PRESETS.get("tiny-llama")
  export_hf_dir(decoder.init_params(config, jax.random.PRNGKey(0)), config, str(tmp_path),
                tokenizer=ours)
  generation = json.loads((tmp_path / "generation_config.json").read_text())
  assert generation["eos_token_id"] == [2] and generation["pad_token_id"] == 2
  reloaded = Tokenizer.from_hf_dir(str(tmp_path))
  assert Tokenizer.from_hf_dir(str(tmp_path)) is reloaded  # parsed once while the files stay
  auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = ours.apply_chat_template(MESSAGES[1]) + "\n\n1. 2 3"
  assert reloaded.encode(text) == ours.encode(text) == auto.encode(text, add_special_tokens=False)
  assert reloaded.apply_chat_template(MESSAGES[0]) == ours.apply_chat_template(MESSAGES[0])
  assert reloaded.stop_token_ids == (2,)
  # Extra stop ids from generation_config.json are honoured.
  generation["eos_token_id"] = [2, 0]
  (tmp_path / "generation_config.json").write_text(json.dumps(generation))
  assert Tokenizer.from_hf_dir(str(tmp_path)).stop_token_ids == (0, 2)
  model = load_model(str(tmp_path))
  assert model.config == config and model.tokenizer.stop_token_ids == (0, 2)


def test_hf_directory_without_tokenizer(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(WeightsError, match="cannot load a tokenizer"):
    Tokenizer.from_hf_dir(str(tmp_path))
