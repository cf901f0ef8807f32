"""The resume guard reads the run's identity from its checkpoints: a deleted, emptied, truncated or
edited config.json cannot re-purpose a run, and is rewritten from the checkpoints."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import pytest

import toy_task
from marl_jax.errors import UserInputError
from marl_jax.training import run_identity, trainer
from marl_jax.training.checkpoint import Checkpointer

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A one-step toy run and its config."""
  model = str(tmp_path_factory.mktemp("tiny_model"))
  toy_task.write_tiny_model(model)
  toy_task.register()
  workdir = tmp_path_factory.mktemp("run")
  c = toy_task.toy_config(model, steps=1)
  trainer.train(c, str(workdir))
  return workdir, c


def _repurposed(c):
  other = c.copy_and_resolve_references()
  other.algo.estimator = "drmas" if c.algo.estimator != "drmas" else "grpo"
  other.optim.lr = 0.5
  other.train.steps = 2
  return other


@pytest.mark.parametrize("damage", ["deleted", "emptied", "truncated", "edited_to_match"])
def test_config_json_cannot_repurpose_the_run(trained, damage):
  workdir, c = trained
  path = workdir / "config.json"
  original = path.read_text()
  other = _repurposed(c)
  if damage == "deleted":
    path.unlink()
  elif damage == "emptied":
    path.write_text("{}")
  elif damage == "truncated":
    path.write_text(original[:len(original) // 2])
  else:
    path.write_text(other.to_json_best_effort(indent=2))
  try:
    with pytest.raises(UserInputError) as refused:
      trainer.train(other, str(workdir))
    line = refused.value.report()
    assert "\n" not in line and "trained under another config" in line
    assert "optim.lr" in line or "algo.estimator" in line
    # The same config resumes, and config.json is the checkpoint's again.
    run_identity.check_resume(str(workdir), c)
    assert json.loads(path.read_text()) == json.loads(original)
  finally:
    path.write_text(original)


def test_checkpoints_without_identity_need_a_readable_config_json(tmp_path):
  with Checkpointer(tmp_path / "checkpoints") as writer:  # as before they carried the identity
    writer.save(1, {"w": jnp.zeros(2)}, {"next_step": 1})
  c = toy_task.toy_config("unused", steps=1)
  for text in (None, "", "{}", '{"name": '):
    if text is None:
      if os.path.exists(tmp_path / "config.json"):
        os.remove(tmp_path / "config.json")
    else:
      (tmp_path / "config.json").write_text(text)
    with pytest.raises(UserInputError, match="config.json is missing, empty or not valid JSON"):
      run_identity.check_resume(str(tmp_path), c)
  (tmp_path / "config.json").write_text(c.to_json_best_effort())
  run_identity.check_resume(str(tmp_path), c)  # the old guard, as it was
