"""The precision policy: what is stored in fp32, what computes in bf16, and the copies between.

Storage and compute are separate (`ModelConfig.param_dtype` / `compute_dtype`):

* Trainable params, AdamW moments and gradient accumulation are fp32. bf16 keeps about 3
  significant digits, so an update below 2^-8 of a weight rounds away: one AdamW step at lr 1e-6
  with bf16 storage changed 1.7% of Qwen3-0.6B's weights on an H200 (fp32 storage: 100%), so a
  paper run at lr 1e-6 to 1e-5 would silently not train.
* Compute is bf16 on GPU and TPU (`compute_dtype="auto"`) and fp32 on CPU, where bf16 is slower
  and less exact. In bf16 compute the matmuls and attention read bf16 copies of the kernels; the
  RMSNorm scales, RMSNorm itself, RoPE, the attention softmax, the LM head (when its weights are
  fp32), log-softmax, log-probs, losses and advantages stay fp32.
* Frozen weights (a LoRA base, the KL reference copy) and the sampler's weights are stored as
  compute copies (`compute_copy`): the learner casts each kernel to the compute dtype before use
  anyway, so a copy cast once gives the same values in half the bytes. The learner's and the
  reference's LM head and embedding stay in storage precision (`head=False`); the sampler's are
  cast too (`head=True`), since decoding is bound by reading weights, and the learner's recomputed
  old log-probs (`train.recompute_old_logp`) and truncated IS weights (`train.tis_cap`) correct
  the small sampler/learner mismatch this leaves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# "auto": bf16 on GPU and TPU, fp32 on CPU (`compute_dtype`).
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16")
_HEAD_KEYS = ("embed_tokens", "lm_head")


def compute_dtype(name: str, backend: str | None = None) -> str:
  """The compute dtype `name` means on `backend` (default: JAX's default backend)."""
  if name not in COMPUTE_DTYPES:
    raise ValueError(f"compute_dtype={name!r}; expected one of {list(COMPUTE_DTYPES)}")
  if name != "auto":
    return name
  backend = jax.default_backend() if backend is None else backend
  return "float32" if backend == "cpu" else "bfloat16"


def _key(entry: Any) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


def computes_in_low_precision(path: tuple[str, ...], head: bool) -> bool:
  """Whether the params leaf at `path` (dict keys) belongs in a compute copy: every kernel and
  bias and LoRA factor; the embedding and LM head only with `head`; never an RMSNorm scale
  (the norms run in fp32 on the stored scale)."""
  if path and path[-1] == "scale":
    return False
  if any(k in _HEAD_KEYS for k in path):
    return head
  return True


def compute_copy(params: Any, dtype: str, *, head: bool) -> Any:
  """`params` with every leaf `computes_in_low_precision` cast to `dtype` (others untouched).

  Works on one model's params, stacked [P, ...] models, a dict of named models, or LoRA
  adapters; a leaf already in `dtype` is returned as is (no copy)."""
  target = jnp.dtype(dtype)

  def cast(path, x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
      return x
    return x.astype(target) if computes_in_low_precision(tuple(map(_key, path)), head) else x

  return jax.tree_util.tree_map_with_path(cast, params)
