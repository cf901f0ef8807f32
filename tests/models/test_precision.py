"""The precision policy: which leaves a compute copy casts, and what "auto" means per backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models import decoder, lora, precision
from marl_jax.models.config import PRESETS


def test_compute_dtype_auto_is_bf16_on_accelerators_and_fp32_on_cpu():
  assert precision.compute_dtype("auto", "cpu") == "float32"
  assert precision.compute_dtype("auto", "gpu") == "bfloat16"
  assert precision.compute_dtype("auto", "tpu") == "bfloat16"
  assert precision.compute_dtype("float32", "gpu") == "float32"
  assert precision.compute_dtype("auto") == "float32"  # this suite runs on CPU
  with pytest.raises(ValueError, match="compute_dtype='fp8'; expected one of"):
    precision.compute_dtype("fp8")


def test_compute_copy_casts_kernels_keeps_norms_and_casts_the_head_on_request():
  config = PRESETS.get("tiny-qwen3")  # untied head, q/k norms
  params = decoder.init_params(config, jax.random.key(0))
  flat = lambda tree: {"/".join(str(getattr(k, "key", k)) for k in path): x
                       for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  for head in (False, True):
    copy = flat(precision.compute_copy(params, "bfloat16", head=head))
    for name, x in flat(params).items():
      if name.endswith("scale"):
        want = jnp.float32
      elif name.startswith(("embed_tokens", "lm_head")):
        want = jnp.bfloat16 if head else jnp.float32
      else:
        want = jnp.bfloat16
      assert copy[name].dtype == want, (head, name, copy[name].dtype)
      np.testing.assert_array_equal(np.asarray(copy[name], np.float32),
                                    np.asarray(x.astype(want), np.float32))
  # Nothing to cast (fp32 compute): the very same arrays, no copy.
  same = precision.compute_copy(params, "float32", head=True)
  assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)))


def test_compute_copy_casts_lora_factors_and_stacked_models():
  config = PRESETS.get("tiny-llama")
  adapters = lora.init_lora(config, lora.LoraConfig(rank=2), 3, jax.random.key(1))
  assert all(x.dtype == jnp.bfloat16 for x in
             jax.tree.leaves(precision.compute_copy(adapters, "bfloat16", head=False)))
  params = decoder.init_params(config, jax.random.key(2))
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), params)
  copy = precision.compute_copy(stacked, "bfloat16", head=False)
  assert copy["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.bfloat16
  assert copy["layers"]["input_layernorm"]["scale"].dtype == jnp.float32
  assert copy["embed_tokens"]["embedding"].dtype == jnp.float32
