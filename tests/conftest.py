"""Test session set-up: CPU, with 8 fake CPU devices so multi-device code paths run on one machine.

XLA reads the flags once, when jax first initialises its backend, so they must be set before any
test module imports jax. The suite is a CPU suite on any host: on a GPU or TPU machine it still
runs on the CPU (JAX_PLATFORMS=cpu unless the caller set it), and a host whose XLA_FLAGS already
holds options (GPU images often set some) keeps them and gains the device count.
Multi-device tests that find fewer devices skip with the reason (`host.cpu_devices`).

Every compilation of the session (its subprocesses' too, which inherit XLA_FLAGS) gets the
options of `host.SUITE_XLA_FLAGS`, probed in a child process since this process's XLA reads its
flags once, when its backend starts; the xdist workers and test subprocesses get them through the
environment. MARL_JAX_TEST_XLA_OPTIONS=none runs the suite with XLA's defaults.
"""
import os
import pathlib
import subprocess
import sys

_SUITE = "MARL_JAX_TEST_SUITE_XLA_FLAGS"  # the probed options, once per session
if _SUITE not in os.environ:
  os.environ[_SUITE] = subprocess.run(
      [sys.executable, "-c", "import host; print(host.SUITE_XLA_FLAGS)"],
      cwd=pathlib.Path(__file__).parent, env=dict(os.environ, JAX_PLATFORMS="cpu"),
      capture_output=True, text=True, check=True).stdout.strip()
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags = f"{_flags} --xla_force_host_platform_device_count=8"
if os.environ[_SUITE] not in _flags:
  _flags = f"{_flags} {os.environ[_SUITE]}"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")


import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

import host  # noqa: E402

host.save_shards_whole()


@pytest.fixture(scope="session")
def _compile_cache_dir(tmp_path_factory) -> str:
  """One directory per test process (an xdist worker writes only its own: jax's cache writes
  without a lock)."""
  return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def shared_compiles(_compile_cache_dir):
  """A persistent compilation cache for the runs of the modules that use it, restored after each:
  trainer runs that build the same programs again (resumes, runs compared with each other, the
  same tiny model's sampler in another module) load them instead of compiling them. Use with
  `pytestmark = pytest.mark.usefixtures("shared_compiles")`."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {n: getattr(jax.config, n) for n in names}
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", _compile_cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield
  for n, value in saved.items():
    jax.config.update(n, value)
  compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
  """The toy tests' tiny random model as an HF directory (`toy_task.write_tiny_model`), written
  once per test process; tests only read it. Registers the toy task."""
  import toy_task
  path = str(tmp_path_factory.mktemp("tiny_model"))
  toy_task.write_tiny_model(path)
  toy_task.register()
  return path


@pytest.fixture(scope="session")
def transformers_smollm2(tmp_path_factory) -> str:
  """An HF directory of the embedded SmolLM2 GGUF as transformers' own GGUF loader reads it
  (model dequantised to fp32, tokenizer), the reference that is independent of marl_jax's
  loader. That load takes ~40 s (its GGUF reader builds the 49k-token vocabulary in Python), a
  from_pretrained of this directory ~1 s: it is made once per session, shared by the xdist
  workers under a file lock."""
  import filelock
  import torch
  import transformers
  from marl_jax.models.loading import embedded_gguf_path
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # workers' base temps sit in one session directory
    root = root.parent
  out = root / "transformers_smollm2"
  with filelock.FileLock(str(out) + ".lock"):
    if not (out / "done").exists():
      directory, file = embedded_gguf_path().rsplit("/", 1)
      model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=file,
                                                                dtype=torch.float32)
      # The weights are plain fp32 tensors now; transformers refuses to save a model that
      # still names its GGUF quantizer.
      del model.config.quantization_config
      model.hf_quantizer = None
      model.save_pretrained(out)
      want = model.state_dict()
      got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32
                                                              ).state_dict()
      assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
      transformers.AutoTokenizer.from_pretrained(directory, gguf_file=file).save_pretrained(out)
      (out / "done").touch()
  return str(out)
