"""Decoder architecture config and named presets.

One frozen dataclass covers Llama (SmolLM2, Llama-3.2), Qwen2/Qwen2.5 (q/k/v bias) and Qwen3
(q/k RMSNorm, head_dim independent of hidden size). Field names follow Hugging Face `config.json`
so that loading and exporting are a rename-free copy. The config is hashable: jitted functions take
it as a static argument.

Params pytree (HF-matching names; layers stacked along a leading L axis so they can be scanned):

    embed_tokens/embedding            [V, D]
    layers/input_layernorm/scale      [L, D]
    layers/self_attn/q_proj/kernel    [L, D, Hq*Dh]     (+ bias [L, Hq*Dh] when attention_bias)
    layers/self_attn/k_proj/kernel    [L, D, Hkv*Dh]    (+ bias)
    layers/self_attn/v_proj/kernel    [L, D, Hkv*Dh]    (+ bias)
    layers/self_attn/o_proj/kernel    [L, Hq*Dh, D]
    layers/self_attn/q_norm/scale     [L, Dh]           (qk_norm only)
    layers/self_attn/k_norm/scale     [L, Dh]           (qk_norm only)
    layers/post_attention_layernorm/scale [L, D]
    layers/mlp/gate_proj/kernel       [L, D, F]
    layers/mlp/up_proj/kernel         [L, D, F]
    layers/mlp/down_proj/kernel       [L, F, D]
    norm/scale                        [D]
    lm_head/kernel                    [D, V]            (absent when tie_word_embeddings)

Kernels are stored [in, out] (the transpose of torch's Linear weight).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marl_jax.registry import Registry

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one decoder. Names match HF `config.json` keys."""

  architecture: str = "llama"
  vocab_size: int = 49152
  hidden_size: int = 576
  intermediate_size: int = 1536
  num_hidden_layers: int = 30
  num_attention_heads: int = 9
  num_key_value_heads: int = 3
  head_dim: int = 64
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  max_position_embeddings: int = 8192
  tie_word_embeddings: bool = True
  attention_bias: bool = False  # q/k/v projection bias (Qwen2).
  qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3).
  # Llama-3 RoPE frequency scaling ("rope_scaling" with rope_type "llama3" in HF); factor 1 = off.
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  param_dtype: str = "float32"  # storage (`models/precision.py`)
  compute_dtype: str = "float32"  # matmuls and attention (`models/precision.py`)
  # Attention in full-sequence forwards (training, prefill): "sdpa" = jax.nn.dot_product_attention
  # (cuDNN flash attention on GPU in 16-bit compute, its XLA path elsewhere), "eager" = the
  # grouped-query einsums of `decoder.attention`; "auto" = sdpa in 16-bit compute, eager in fp32.
  # Decoding always reads its cache with the eager einsums (only the filled slots).
  attn_implementation: str = "auto"

  def __post_init__(self):
    if self.architecture not in ARCHITECTURES:
      raise ValueError(
          f"unknown architecture {self.architecture!r}; expected one of {ARCHITECTURES}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of "
          f"num_key_value_heads={self.num_key_value_heads}")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected float32, bfloat16 or float16")
    if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
      raise ValueError(f"attn_implementation={self.attn_implementation!r}; expected one of "
                       f"{ATTN_IMPLEMENTATIONS}")

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @property
  def uses_sdpa(self) -> bool:
    """Whether full-sequence forwards attend with `jax.nn.dot_product_attention`."""
    if self.attn_implementation == "auto":
      return self.compute_dtype != "float32"
    return self.attn_implementation == "sdpa"


def _llama(**kw) -> ModelConfig:
  return ModelConfig(architecture="llama", **kw)


def _qwen2(**kw) -> ModelConfig:
  return ModelConfig(architecture="qwen2", attention_bias=True, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=32768, **kw)


def _qwen3(**kw) -> ModelConfig:
  return ModelConfig(architecture="qwen3", qk_norm=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, vocab_size=151936, head_dim=128, **kw)


# Architecture presets. Weights come from the embedded GGUF (smollm2) or a local directory.
PRESETS: Registry[ModelConfig] = Registry("model preset")
for _name, _config in {
    "smollm2-135m-instruct": _llama(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen2.5-0.5b": _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           head_dim=64, tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen2(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                           num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           head_dim=128, tie_word_embeddings=True),
    "qwen2.5-3b": _qwen2(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                         num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                         head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": _qwen2(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         head_dim=128, tie_word_embeddings=False),
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "llama-3.2-1b": _llama(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, tie_word_embeddings=True,
                           rope_scaling_factor=32.0),
    "llama-3.2-3b": _llama(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                           num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                           head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, tie_word_embeddings=True,
                           rope_scaling_factor=32.0),
    # Tiny random configs for tests: same code paths, milliseconds per forward.
    "tiny-llama": _llama(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, tie_word_embeddings=True),
    "tiny-qwen2": _qwen2(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=False),
    "tiny-qwen3": ModelConfig(architecture="qwen3", qk_norm=True, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                              tie_word_embeddings=False),
}.items():
  PRESETS.register(_name, _config)


def get_preset(name: str) -> ModelConfig:
  """Returns the architecture preset called `name`; unknown names list the known ones."""
  if name not in PRESETS:
    raise ValueError(
        f"unknown model preset {name!r}; expected one of {list(PRESETS.names())} "
        "or a path to a GGUF file / HF checkpoint directory")
  return PRESETS.get(name)
