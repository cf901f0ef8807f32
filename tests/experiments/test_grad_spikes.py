"""experiments.grad_spikes on hand-written runs: spike counts, medians and group means derived
by hand."""

from __future__ import annotations

import json

import pytest

from experiments import grad_spikes
from marl_jax.errors import UserInputError


def write_run(path, name, solver_norms, verifier_norms, rewards, accuracies):
  path.mkdir()
  (path / "hparams.json").write_text(json.dumps({"name": name}))
  rows = []
  for step, (s, v, r) in enumerate(zip(solver_norms, verifier_norms, rewards), start=1):
    rows.append({"step": step, "agent/grad_norm/solver": s, "agent/grad_norm/verifier": v,
                 "rollout/reward/solver": r, "rollout/success": float(step % 2)})
  for step, acc in accuracies:
    rows[step - 1]["eval/accuracy"] = acc
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_spikes_and_group_means(tmp_path):
  # Solver updates 1, 2, 10, 1.5 (the 0 is no update): median 1.75, threshold 3 x 1.75 = 5.25,
  # one spike (10). Verifier updates 0.5, 0.5, 0.6, 0.4: median 0.5, threshold 1.5, none.
  a = write_run(tmp_path / "a", "drmas", [0, 1.0, 2.0, 10.0, 1.5], [0.5, 0.5, 0.6, 0, 0.4],
                [-0.1, 0, 0.5, 0.5, 0], [(2, 0.125), (5, 0.25)])
  run = grad_spikes.run_spikes(a, 3.0)
  assert run["config"] == "drmas" and run["eval_accuracy"] == 0.25
  assert run["rollout_success"] == pytest.approx(0.6)  # steps 1, 3, 5 of 5 succeed
  assert run["agents"]["solver"] == {"steps": 5, "updates": 4, "median": 1.75, "max": 10.0,
                                     "spikes": 1, "reward": pytest.approx(0.18)}
  assert run["agents"]["verifier"]["spikes"] == 0 and run["agents"]["verifier"]["median"] == 0.5
  # A second seed: updates 1, 1, 1, 4, 5 -> median 1, threshold 3: two spikes (4, 5). Group
  # mean of (1, 2) spikes = 1.5, SE = std([1, 2], ddof=1) / sqrt(2) = 0.5.
  b = write_run(tmp_path / "b", "drmas", [1, 1, 1, 4, 5], [1, 1, 1, 1, 1], [0] * 5, [(5, 0.5)])
  group = grad_spikes.summarize([run, grad_spikes.run_spikes(b, 3.0)])["drmas"]
  assert group["runs"] == 2
  assert group["solver/spikes"] == pytest.approx((1.5, 0.5))
  assert group["eval_accuracy"] == pytest.approx((0.375, 0.125))
  assert group["verifier/reward"] is None  # no verifier reward logged


def test_refuses_runs_without_norms(tmp_path):
  (tmp_path / "plain").mkdir()
  (tmp_path / "plain" / "hparams.json").write_text(json.dumps({"name": "x"}))
  (tmp_path / "plain" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
  with pytest.raises(UserInputError, match="logged no agent/grad_norm/<agent>"):
    grad_spikes.run_spikes(str(tmp_path / "plain"), 3.0)
  with pytest.raises(UserInputError, match="has no metrics.jsonl"):
    grad_spikes.run_spikes(str(tmp_path / "missing"), 3.0)
