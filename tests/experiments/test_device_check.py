"""`experiments.device_check --tiny` end to end on this machine's CPU: both parts finish, and
the numerics it reports hold what the precision policy promises (`models/precision.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from host import FAST_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_device_check_reports_every_part():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAGS)
  proc = subprocess.run([sys.executable, "-m", "experiments.device_check", "--tiny",
                         "--timeout_s=400"], cwd=REPO, capture_output=True, text=True,
                        timeout=900, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  jax_part, torch_part = report["jax"], report["torch"]
  assert jax_part["status"] == "ok" and torch_part["status"] == "ok", (jax_part, torch_part)
  assert jax_part["info"]["backend"] == "cpu"
  assert jax_part["info"]["compute_dtype_auto"] == "float32"
  step = jax_part["train_step"]
  assert step["step_s"] > 0 and step["useful_tokens_per_s"] > 0 and step["mfu"] is None  # no peak
  assert step["estimated_peak_bytes"] > 0 and step["peak_host_rss_bytes"] > 0
  assert jax_part["sampling"]["new_tokens"] == 2 * 2 * 8  # rows x group x new tokens, no stop
  assert torch_part["generate"]["new_tokens"] == 2 * 2 * 8
  assert torch_part["train_step"]["step_s"] > 0
  num = jax_part["numerics"]
  # A lr 1e-6 step: fp32 masters under bf16 compute move what an all-fp32 step moves; bf16
  # storage rounds it away (the weights' scale, 0.02, holds 2^-8 x 0.02 >> 1e-6 steps).
  assert num["moved_fp32_masters"] >= 0.95 * num["moved_fp32_everything"] > 0.5, num
  assert num["moved_bf16_storage"] < 0.1, num
  # bf16 rounding bound of tests/parallel/test_train_step.py (2 layers: n = 45 roundings of 2^-8).
  assert num["loss_rel_diff"] <= 45 * 2.0 ** -8 and num["grad_norm_rel_diff"] <= 90 * 2.0 ** -8
  assert 0 < num["sampler_learner_abs_logp_mean"] <= num["sampler_learner_abs_logp_max"] < 1
  assert "train step" in proc.stderr and "numerics" in proc.stderr  # the table
