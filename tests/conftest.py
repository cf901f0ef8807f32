"""Test session set-up: CPU, with 8 fake CPU devices so multi-device code paths run on one machine.

XLA reads the flags once, when jax first initialises its backend, so they must be set before any
test module imports jax. The suite is a CPU suite on any host: on a GPU or TPU machine it still
runs on the CPU (JAX_PLATFORMS=cpu unless the caller set it), and a host whose XLA_FLAGS already
holds options (GPU images often set some) keeps them and gains the device count.
Multi-device tests that find fewer devices skip with the reason (`host.cpu_devices`).
"""
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")


import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402


@pytest.fixture(scope="module")
def shared_compiles(tmp_path_factory):
  """A persistent compilation cache for one module's runs, restored afterwards: trainer runs
  that build the same step again (resumes, runs compared with each other) load its programs
  instead of compiling them. Use with `pytestmark = pytest.mark.usefixtures("shared_compiles")`."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {n: getattr(jax.config, n) for n in names}
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield
  for n, value in saved.items():
    jax.config.update(n, value)
  compilation_cache.reset_cache()
