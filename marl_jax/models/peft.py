"""One policy's LoRA adapter as PEFT adapter files, so `peft.PeftModel.from_pretrained` (and
vLLM, lm-eval's `peft=`) load it over the exported base model.

PEFT's format (its `save_pretrained` for a LoRA on a causal LM): `adapter_config.json` and
`adapter_model.safetensors` with, per adapted projection of layer i,

    base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_B.weight   [out, r]

and the update `W x + (lora_alpha / r) * B A x`. Our adapters are stored `a: [L, P, in, r]`,
`b: [L, P, r, out]` with the same scale (`models/lora.py`), so policy p's tensors are the
transposes of its slices: no arithmetic, the export is exact.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import safetensors.numpy

from marl_jax.models.lora import MODULE_GROUPS, LoraConfig, num_lora_policies

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"


def adapter_config(lora_config: LoraConfig, base_model: str) -> dict[str, Any]:
  """adapter_config.json of a plain LoRA (no dropout at inference, no bias, no rsLoRA)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": lora_config.rank, "lora_alpha": lora_config.alpha,
          "target_modules": sorted(lora_config.target_modules), "lora_dropout": 0.0,
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "inference_mode": True, "modules_to_save": None}


def adapter_tensors(lora_params: Any, policy: int) -> dict[str, np.ndarray]:
  """PEFT-named tensors of policy `policy`'s adapter (`lora_params`: `models/lora.py` layout)."""
  P = num_lora_policies(lora_params)
  if not 0 <= policy < P:
    raise ValueError(f"policy {policy} out of range; the adapters hold {P} policies")
  tensors = {}
  for group, modules in lora_params.items():
    for name, ab in modules.items():
      if MODULE_GROUPS.get(name) != group:
        raise ValueError(f"LoRA module {group}/{name}; expected one of {MODULE_GROUPS}")
      a = np.asarray(ab["a"][:, policy])  # [L, in, r]
      b = np.asarray(ab["b"][:, policy])  # [L, r, out]
      for i in range(a.shape[0]):
        stem = f"{_PREFIX}.{i}.{group}.{name}"
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
  return tensors


def write_adapter(lora_params: Any, lora_config: LoraConfig, policy: int, path: str,
                  base_model: str) -> None:
  """Writes policy `policy`'s adapter to directory `path`; `base_model` is what
  adapter_config.json names as the base (the exported base directory)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(adapter_config(lora_config, base_model), f, indent=2)
  safetensors.numpy.save_file(adapter_tensors(lora_params, policy),
                              os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
