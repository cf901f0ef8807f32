"""What a test may ask of its host: CPU devices, and the XLA options the installed jax takes.

The suite runs on CPU (`conftest.py` selects it and asks XLA for 8 host devices), also on a GPU
or TPU machine. Tests that compile much pass `FAST_COMPILE` (the CPU compiler's -O0 without its
MLIR fusion emitters: ~4x faster compiles of tiny models, the same numerics at 1e-5), which holds
only the options this jax accepts: jax 0.11 rejects `xla_cpu_use_fusion_emitters` ("No such
compile option"). Every compilation of the suite (`conftest.py`, which passes them to its
subprocesses too) gets `SUITE_XLA_FLAGS`, the fusion emitters off alone: a trainer test's
programs compile ~30% faster and run as fast, where -O0 would slow the runs that reuse them.
Multi-device tests take their devices from `cpu_devices(n)`, which skips the test, naming why,
when the process has fewer. `save_shards_whole` makes a test process's checkpoints skip orbax's
per-replica slicing, which on fake devices costs eager ops and nothing else.
"""

from __future__ import annotations

import functools
import os

import jax
import pytest

_WANTED = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
_SUITE = {"xla_cpu_use_fusion_emitters": False}


def _accepted(options: dict) -> dict:
  """The options of `options` that the CPU compiler of this jax accepts (one probe compile each).
  MARL_JAX_TEST_XLA_OPTIONS=none drops them all: the suite as a jax without them runs it."""
  if os.environ.get("MARL_JAX_TEST_XLA_OPTIONS") == "none":
    return {}
  kept = {}
  for name, value in options.items():
    try:
      jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(1.0).compile()
    except Exception:  # noqa: BLE001  (jax raises its runtime error type for an unknown option)
      continue
    kept[name] = value
  return kept


@functools.cache
def _cpu_options(wanted: tuple[tuple[str, object], ...]) -> dict:
  return _accepted(dict(wanted)) if jax.default_backend() == "cpu" else {}


def _as_flags(options: dict) -> str:
  return " ".join(f"--{k}={str(v).lower()}" for k, v in options.items())


def __getattr__(name: str):
  """FAST_COMPILE, and FAST_XLA_FLAGS / SUITE_XLA_FLAGS (options as XLA_FLAGS for test
  subprocesses: an unknown flag there aborts XLA), probed on first use: a process that must start
  jax's backend itself (`jax.distributed.initialize` in the multi-host workers) imports this
  module first."""
  if name == "FAST_COMPILE":
    return _cpu_options(tuple(_WANTED.items()))
  if name == "FAST_XLA_FLAGS":
    return _as_flags(_cpu_options(tuple(_WANTED.items())))
  if name == "SUITE_XLA_FLAGS":
    return _as_flags(_cpu_options(tuple(_SUITE.items())))
  raise AttributeError(name)


def cpu_devices(n: int) -> list[jax.Device]:
  """The first n CPU devices, or a skip saying why there are fewer."""
  try:
    devices = jax.devices("cpu")
  except RuntimeError:
    pytest.skip(f"needs {n} CPU devices; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r} "
                "leaves out the CPU backend")
  if len(devices) < n:
    pytest.skip(f"needs {n} CPU devices, this process has {len(devices)}: XLA_FLAGS="
                f"{os.environ.get('XLA_FLAGS', '')!r} (conftest.py adds "
                "--xla_force_host_platform_device_count=8 unless a count is already set)")
  return devices[:n]


def save_shards_whole() -> None:
  """Checkpoints of this process save each shard whole, as orbax does on GPU. On CPU and TPU
  orbax splits every replicated array into one slice per replica ("replica-parallel") so that
  devices share the writing; on 8 fake devices of one host memory that is nothing but one eager
  slice op a piece (~900 in a two-step preset run, 6 of its 48 s). The same files, the same
  restore; the multi-process tests and CLI subprocesses keep orbax's default."""
  import orbax.checkpoint as ocp
  from orbax.checkpoint._src.metadata import array_metadata_store
  from orbax.checkpoint._src.serialization import type_handler_registry
  type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
      jax.Array, ocp.type_handlers.ArrayHandler(
          use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
      override=True, ignore_warnings=True)
