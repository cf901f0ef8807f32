"""`python -m experiments.generate` as a new user runs it: help, a completion, and user errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.generate", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "PYTHONPATH": REPO})


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> None:
  """Non-zero exit, one `error:` line naming the problem, no traceback."""
  assert result.returncode != 0, result
  assert "Traceback" not in result.stderr, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]


def test_help_explains_every_flag():
  result = run_cli("--help")  # absl prints the help to stdout, then exits with status 1
  assert "Traceback" not in result.stderr and not result.stderr, result.stderr
  for flag in ("--model", "--prompt", "--max_new_tokens", "--temperature", "--top_p", "--top_k",
               "--seed"):
    assert flag in result.stdout
  assert "chat template" in result.stdout and "greedy" in result.stdout


def test_unknown_model():
  assert_user_error(run_cli("--model=gpt-17-ultra", "--prompt=hi"), "unknown model",
                    "'gpt-17-ultra'")


def test_corrupt_gguf_file(tmp_path):
  path = tmp_path / "broken.gguf"
  path.write_bytes(b"GGUF" + b"\x00" * 20)
  assert_user_error(run_cli(f"--model={path}", "--prompt=hi"), str(path))


def test_missing_path(tmp_path):
  assert_user_error(run_cli(f"--model={tmp_path}/nothing.gguf", "--prompt=hi"), "nothing.gguf")


def test_bad_flag_value():
  assert_user_error(run_cli("--prompt=hi", "--top_p=1.5"), "top_p=1.5")


@pytest.mark.parametrize("case", ["too_long", "completion"])
def test_embedded_model(case):
  if case == "too_long":
    result = run_cli("--prompt=" + "word " * 9000)
    assert_user_error(result, "tokens", "context is 8192")
  else:
    result = run_cli("--prompt=What is the capital of France?", "--max_new_tokens=8")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "finish_reason=" in result.stderr
