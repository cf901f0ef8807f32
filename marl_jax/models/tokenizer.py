"""Tokenizer + chat template + stop tokens, from a GGUF file or an HF checkpoint directory.

A thin wrapper over a `transformers` fast tokenizer, so the chat template renders exactly as in
transformers. For GGUF files we build that tokenizer ourselves from the metadata (vocabulary,
merges, token types, special ids, chat template) with the `tokenizers` library: transformers' own
GGUF tokenizer path imports torch, which marl_jax never does.

Pre-tokenization follows llama.cpp's `tokenizer.ggml.pre` name. For "smollm" that is llama.cpp's
sequence "split every digit, then the GPT-2 regex", the same as SmolLM2's own `tokenizer.json`
(`Digits(individual_digits)` + `ByteLevel`). transformers' GGUF tokenizer does not know "smollm"
and falls back to the GPT-2 regex alone; the two differ only where whitespace runs into a digit
("\\n\\n1." is [ĊĊ, 1, .] here and in SmolLM2's tokenizer.json, [Ċ, Ċ, 1, .] in transformers').
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Sequence

import gguf
import transformers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from marl_jax.models.gguf_loader import metadata, open_gguf
from marl_jax.models.hf import GENERATION_CONFIG_FILE, WeightsError

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp pre-tokenizer name -> the regexes it splits with, applied in order.
PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2_SPLIT,), "gpt-2": (_GPT2_SPLIT,), "smollm": (r"\p{N}", _GPT2_SPLIT),
    "qwen2": (_QWEN2_SPLIT,), "llama-bpe": (_LLAMA3_SPLIT,),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _gguf_backend(reader: gguf.GGUFReader) -> RustTokenizer:
  """A byte-level BPE `tokenizers.Tokenizer` from the GGUF vocabulary and merges."""
  kind = metadata(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise WeightsError(
        f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r}; expected 'gpt2' "
        "(byte-level BPE)")
  pre = metadata(reader, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZER_SPLITS:
    raise WeightsError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; expected one "
                       f"of {sorted(PRE_TOKENIZER_SPLITS)}")
  tokens = metadata(reader, "tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges")]
  backend = RustTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  backend.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  types = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, kind in zip(tokens, types) if kind == _CONTROL])
  backend.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
  if metadata(reader, "tokenizer.ggml.add_bos_token", False):
    bos = tokens[metadata(reader, "tokenizer.ggml.bos_token_id")]
    bos_id = metadata(reader, "tokenizer.ggml.bos_token_id")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return backend


class Tokenizer:
  """Text <-> ids, chat template and the ids that end a completion."""

  def __init__(self, hf: transformers.PreTrainedTokenizerBase, stop_token_ids: Sequence[int] = ()):
    if hf.eos_token_id is None and not stop_token_ids:
      raise WeightsError("the tokenizer defines no eos token and no stop token ids were given")
    self.hf = hf
    stops = {int(i) for i in stop_token_ids}
    if hf.eos_token_id is not None:
      stops.add(hf.eos_token_id)
    self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

  @classmethod
  def from_gguf(cls, path_or_reader: str | gguf.GGUFReader) -> "Tokenizer":
    """The tokenizer a GGUF file describes (no torch involved)."""
    reader = open_gguf(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    special: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
      index = metadata(reader, f"tokenizer.ggml.{key}_token_id", -1)
      if index >= len(tokens):
        raise WeightsError(f"tokenizer.ggml.{key}_token_id={index} is outside the vocabulary "
                           f"of {len(tokens)} tokens")
      if index >= 0:
        special[name] = tokens[index]
    template = metadata(reader, "tokenizer.chat_template", "") or None
    arch = metadata(reader, "general.architecture")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_gguf_backend(reader), chat_template=template,
        model_max_length=int(metadata(reader, f"{arch}.context_length", 1 << 30)), **special)
    # llama.cpp's end-of-turn / end-of-message tokens also end a completion.
    stops = [metadata(reader, f"tokenizer.ggml.{key}_token_id", -1) for key in ("eot", "eom")]
    return cls(hf, [s for s in stops if s >= 0])

  @classmethod
  def from_hf_dir(cls, path: str) -> "Tokenizer":
    """The tokenizer of an HF checkpoint directory, stop ids from its generation_config.json.

    Loaded once per process while the directory's files stay as they are (a 49k-token
    tokenizer.json takes ~1.5 s to parse; a run, its evaluation and an export each ask for it);
    a Tokenizer is never modified after it is built."""
    try:
      files = tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size)
                           for e in os.scandir(path) if e.is_file()))
    except OSError as e:
      raise WeightsError(f"cannot load a tokenizer from {path}: {e}") from None
    return _hf_dir_tokenizer(cls, os.path.abspath(path), files)

  @property
  def vocab_size(self) -> int:
    """Number of token ids the tokenizer can emit (the model's embedding may be larger)."""
    return len(self.hf)

  @property
  def pad_id(self) -> int:
    """Id used to fill left padding: the pad token, or the first stop token when there is none."""
    return self.hf.pad_token_id if self.hf.pad_token_id is not None else self.stop_token_ids[0]

  @property
  def end_of_reply_id(self) -> int:
    """The token that ends a chat reply: the eos token, else the first stop token."""
    return self.hf.eos_token_id if self.hf.eos_token_id is not None else self.stop_token_ids[0]

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Ids of `text`. Chat-templated text already spells its special tokens, so by default no
    BOS/EOS is added."""
    return self.hf.encode(text, add_special_tokens=add_special_tokens)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict[str, str]],
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The prompt string for `messages` ([{"role": ..., "content": ...}]) in the model's format."""
    if not self.hf.chat_template:
      raise WeightsError("this tokenizer has no chat template")
    return self.hf.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **kwargs)

  def special_token_ids(self) -> dict[str, int]:
    """bos/eos/pad ids for an exported config.json (only those the tokenizer defines)."""
    ids = {"bos_token_id": self.hf.bos_token_id, "eos_token_id": self.hf.eos_token_id,
           "pad_token_id": self.hf.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}

  def save(self, path: str) -> None:
    """Writes tokenizer.json + tokenizer_config.json (chat template included) to `path`."""
    self.hf.save_pretrained(path)


@functools.lru_cache(maxsize=8)
def _hf_dir_tokenizer(cls: type[Tokenizer], path: str,
                      files: tuple[tuple[str, int, int], ...]) -> Tokenizer:
  """`Tokenizer.from_hf_dir`, cached on the directory and its files' names, times and sizes."""
  del files  # part of the cache key only
  try:
    hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError) as e:
    raise WeightsError(f"cannot load a tokenizer from {path}: {e}") from None
  stops: list[int] = []
  generation_path = os.path.join(path, GENERATION_CONFIG_FILE)
  if os.path.exists(generation_path):
    with open(generation_path) as f:
      eos = json.load(f).get("eos_token_id")
    stops = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
  return cls(hf, stops)
