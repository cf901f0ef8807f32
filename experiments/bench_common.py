"""What the sampler benchmarks share: timing, JAX compile time, the PyTorch reference model."""

from __future__ import annotations

import os
import time


def best_time(fn, repeats: int) -> tuple[float, object]:
  """Fastest wall time of `repeats` calls of fn, and the last call's result."""
  best, out = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - start)
  return best, out


def compile_seconds_log() -> list[float]:
  """A list that collects the seconds of every later XLA compilation in this process."""
  import jax

  log: list[float] = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, **_: log.append(secs)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  return log


def load_torch_reference():
  """The embedded GGUF through transformers' own loader (dequantised to fp32), in eval mode."""
  import torch
  import transformers

  from marl_jax.models.loading import embedded_gguf_path
  path = embedded_gguf_path()
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
