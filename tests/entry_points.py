"""Runs an `experiments` entry point as a user would (a subprocess on CPU with 8 host devices and
the suite's compiler options) and reads its one-line `error:` report; shared by the entry-point
tests."""

from __future__ import annotations

import os
import subprocess
import sys

import host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(module: str, *args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {host.SUITE_XLA_FLAGS}"}
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=env)


def error_line(result: subprocess.CompletedProcess, *needles: str) -> str:
  """The single `error:` line; asserts the exit status, no traceback and that it names `needles`."""
  assert result.returncode != 0, result
  assert "Traceback" not in result.stderr, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, result.stderr
  assert result.stderr.strip().splitlines()[-1] == errors[0], result.stderr  # nothing after it
  for needle in needles:
    assert needle in errors[0], errors[0]
  return errors[0]
