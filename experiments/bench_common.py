"""What the sampler benchmarks share: set-up, timing, JAX compile time, the PyTorch reference."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def best_time(fn, repeats: int) -> tuple[float, object]:
  """Fastest wall time of `repeats` calls of fn, and the last call's result."""
  best, out = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - start)
  return best, out


def timed_jax(run, repeats: int, compile_log: list[float]) -> tuple[float, Any, dict[str, float]]:
  """(best seconds, last output, {first_call_s, compile_s}) of a jitted `run`: the first call
  (which compiles) is timed apart from the `repeats` measured ones."""
  compiles_before = len(compile_log)
  start = time.perf_counter()
  run()
  first = time.perf_counter() - start
  seconds, out = best_time(run, repeats)
  return seconds, out, {"first_call_s": first, "compile_s": sum(compile_log[compiles_before:])}


def left_padded(prompts: list[list[int]], pad_id: int):
  """(input ids [B, W], attention mask [B, W]) torch tensors of left-padded prompts."""
  import torch

  width = max(map(len, prompts))
  inputs = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  return inputs, mask


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


def setup(with_torch: bool) -> tuple[Any, Any, dict[str, Any], list[float]]:
  """(embedded model, its PyTorch reference or None, the report's header, compile-time log)."""
  import jax
  import transformers
  from absl import logging

  from marl_jax.models.loading import load_model

  logging.set_verbosity(logging.WARNING)
  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  compile_log = compile_seconds_log()
  model = load_model("smollm2-135m-instruct")
  torch_model = load_torch_reference() if with_torch else None
  header = {"model": "smollm2-135m-instruct (GGUF Q4_1 dequantised to fp32)",
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "jax": jax.__version__, "transformers": transformers.__version__,
            "load_avg_before": os.getloadavg()}
  return model, torch_model, header, compile_log


def cpu_header() -> dict[str, Any]:
  """The CPU and its vector flags (figures change with AVX-512 vs AVX2), cores, load, versions."""
  import jax

  flags_line = ""
  with open("/proc/cpuinfo") as f:
    for line in f:
      if line.startswith("flags"):
        flags_line = line
        break
  vector = sorted({w for w in flags_line.split() if w.startswith(("avx", "fma", "amx"))})
  model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
  return {"cpu": model, "cpu_flags": vector, "cores": os.cpu_count(), "jax": jax.__version__,
          "load_avg_before": os.getloadavg()}
