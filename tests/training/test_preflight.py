"""Run-input checks before any model loads: config.build's value checks, the mesh against the
devices, the workdir and the datasets (training/preflight.py)."""

from __future__ import annotations

import json
import os

import jax
import pytest

from marl_jax.errors import UserInputError
from marl_jax.training import config as config_lib
from marl_jax.training import preflight
from host import cpu_devices


@pytest.mark.parametrize("field, value, expected", [
    ("rollout.tool_timeout_s", -1.0, "config.rollout.tool_timeout_s=-1.0; expected a finite "
     "number > 0"),
    ("rollout.tool_timeout_s", 0.0, "config.rollout.tool_timeout_s=0.0; expected a finite"),
    ("rollout.tool_timeout_s", float("inf"), "config.rollout.tool_timeout_s=inf; expected a"),
    ("rollout.tool_memory_mb", 0, "config.rollout.tool_memory_mb=0; expected a finite number > 0"),
    ("rollout.tool_memory_mb", -5, "config.rollout.tool_memory_mb=-5; expected"),
    ("sampling.temperature", -0.5, "config.sampling.temperature=-0.5; expected a finite number "
     ">= 0"),
    ("eval.temperature", float("nan"), "config.eval.temperature=nan; expected"),
    ("sampling.top_k", -1, "config.sampling.top_k=-1; expected an integer >= 0"),
    ("logging.samples_every", -1, "config.logging.samples_every=-1; expected an integer >= 0 "
     "(0: never)"),
    ("logging.samples_episodes", 0, "config.logging.samples_episodes=0; expected an integer >= 1"),
    ("train.mesh", (2, 0, 1), "config.train.mesh=(2, 0, 1); expected (data, fsdp, tensor) sizes"),
    ("train.mesh", (2, 2), "config.train.mesh=(2, 2); expected"),
])
def test_build_refuses_bad_values_in_one_line(field, value, expected):
  c = config_lib.base_config()
  group, name = field.split(".")
  with c.unlocked():
    c[group][name] = value
  with pytest.raises(UserInputError) as raised:
    config_lib.build(c)
  assert str(raised.value).startswith(expected), str(raised.value)
  assert "\n" not in str(raised.value)


def test_build_accepts_the_boundary_values():
  c = config_lib.base_config()
  c.rollout.tool_timeout_s, c.rollout.tool_memory_mb = 0.001, 1
  c.sampling.temperature, c.eval.temperature, c.sampling.top_k = 0.0, 0.0, 0
  c.logging.samples_every, c.logging.samples_episodes = 0, 1
  c.train.mesh = (-1, 2, 1)
  config_lib.build(c)


def test_every_build_error_is_a_user_input_error():
  """The dataclasses' own ValueErrors (e.g. an unknown estimator) come out as UserInputError."""
  c = config_lib.base_config()
  c.algo.estimator = "nope"
  with pytest.raises(UserInputError, match="config.algo: .*'nope'"):
    config_lib.build(c)


def test_mesh_larger_than_the_devices():
  assert config_lib.mesh_shape((-1, 2, 1), 8) == (4, 2, 1)
  with pytest.raises(UserInputError, match=r"mesh=\(16, 1, 1\) does not multiply to the 8 "
                     r"available devices; expected sizes whose product is 8"):
    config_lib.mesh_shape((16, 1, 1), 8)
  with pytest.raises(UserInputError, match="at most one -1"):
    config_lib.mesh_shape((-1, -1, 1), 8)


def test_check_workdir(tmp_path):
  preflight.check_workdir(tmp_path / "new" / "run")  # created
  assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(UserInputError, match=f"workdir '{a_file}' is a file; expected a directory"):
    preflight.check_workdir(a_file)
  with pytest.raises(UserInputError, match=f"workdir '{a_file}/run' is not writable"):
    preflight.check_workdir(a_file / "run")
  with pytest.raises(UserInputError, match="workdir is empty"):
    preflight.check_workdir("")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_workdir_read_only(tmp_path):
  read_only = tmp_path / "ro"
  read_only.mkdir()
  read_only.chmod(0o500)
  try:
    with pytest.raises(UserInputError, match="is not writable .*Permission denied"):
      preflight.check_workdir(read_only)
  finally:
    read_only.chmod(0o700)


def test_check_reads_the_datasets_before_loading(tmp_path):
  c = config_lib.base_config()
  c.env.name, c.env.workflow, c.env.max_turns = "math", "atgrpo", 2
  with c.unlocked():
    c.env.kwargs.path = str(tmp_path / "rows.jsonl")
  (tmp_path / "rows.jsonl").write_text('{"question": "1+1", "answer": "2"}\n[oops\n')
  with pytest.raises(UserInputError, match=r"rows.jsonl:2: not valid JSON"):
    preflight.check(c, str(tmp_path / "run"))
  (tmp_path / "rows.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
  assert preflight.check(c, str(tmp_path / "run")).advantage.estimator == "at_grpo"
  with c.unlocked():  # evaluation's own split is read before loading too
    c.eval.env_kwargs.path = str(tmp_path / "test.jsonl")
  (tmp_path / "test.jsonl").write_text('{"question": "2+2", "answer": "4"}\n{oops\n')
  with pytest.raises(UserInputError, match=r"test.jsonl:2: not valid JSON"):
    preflight.check(c, str(tmp_path / "run"))


def test_mini_batches_must_split_over_the_mesh(tmp_path):
  """8 devices (conftest) on the default (-1, 1, 1) mesh, 2 micro-batches: 16 pieces."""
  cpu_devices(8)
  c = config_lib.base_config()
  c.train.micro_batches, c.train.mini_batch_size = 2, 24
  with pytest.raises(UserInputError, match=r"config.train.mini_batch_size=24 does not split into "
                                           r"data x fsdp x micro_batches = 8 x 1 x 2 = 16 pieces"):
    preflight.check(c, str(tmp_path / "run"))
  c.train.mini_batch_size = 32
  preflight.check(c, str(tmp_path / "run"))


def test_dynamic_sampling_needs_one_process(tmp_path, monkeypatch):
  """DAPO refills run on one process: refused before loading when two processes share the run."""
  c = config_lib.base_config()
  c.algo.filter, c.rollout.max_refills = "zero_variance", 2
  preflight.check(c, str(tmp_path / "one"))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(UserInputError, match=r"config.rollout.max_refills=2 with "
                     r"algo.filter='zero_variance'\) runs on one process only, got 2"):
    preflight.check(c, str(tmp_path / "two"))
  c.rollout.max_refills = 0
  preflight.check(c, str(tmp_path / "three"))


def test_decision_workflows_need_independent_rollouts(tmp_path):
  """learned_stop credits each coordinator decision with its own trajectory's episode; a tree
  rollout (branches sharing states) is refused before the model loads."""
  from configs import orchestration_stop
  c = orchestration_stop.get_config("cpu")
  preflight.check(c, str(tmp_path / "ok"))
  c.rollout.mode = "tree"
  with pytest.raises(UserInputError, match=r"^config.rollout.mode='tree': 'math' credits decisions "
                     r".* expected rollout.mode='independent'$"):
    preflight.check(c, str(tmp_path / "tree"))


@pytest.mark.parametrize("estimator, group_by, refused", [
    ("at_grpo", None, True),  # its default grouping is (problem, turn, agent)
    ("grpo", None, False),  # grouped by problem: k=1 still has the problem's other turns/agents
    ("grpo", "problem_turn_agent", True),
    ("at_grpo", "problem", False),
])
def test_one_sample_per_turn_group_follows_the_resolved_grouping(estimator, group_by, refused):
  c = config_lib.base_config()
  c.rollout.k, c.algo.estimator = 1, estimator
  with c.unlocked():
    c.algo.group_by = group_by
  if refused:
    with pytest.raises(UserInputError, match=r"config.rollout.k=1 puts one sample in every "
                       rf"\(problem, turn, agent\) group of estimator '{estimator}'"):
      config_lib.build(c)
  else:
    config_lib.build(c)


def test_check_resume_allows_length_logging_and_eval_changes_only():
  """A resume may run longer, log, checkpoint and evaluate differently; any other changed key is
  refused with its saved and new values."""
  c = config_lib.base_config()
  saved = json.loads(c.to_json_best_effort())
  resumed = config_lib.base_config()
  resumed.train.steps += 10
  resumed.eval.every += 1
  resumed.logging.progress = not c.logging.progress
  resumed.checkpoint.max_to_keep += 1
  resumed.name = "longer"
  config_lib.check_resume(saved, resumed)
  resumed.algo.estimator = "drmas" if c.algo.estimator != "drmas" else "grpo"
  with pytest.raises(config_lib.UserInputError,
                     match=rf"algo.estimator: {c.algo.estimator!r} -> {resumed.algo.estimator!r}"):
    config_lib.check_resume(saved, resumed)


def test_check_resume_compares_keys_either_side_lacks():
  """A key only one side has counts as the base config's default there: a field added since the
  run was saved, at its default, resumes; a value the run never had (a dataset path) or a field
  this code does not know is refused, naming it."""
  c = config_lib.base_config()
  saved = json.loads(c.to_json_best_effort())
  del saved["train"]["steps"], saved["optim"]["lr"]  # fields newer than the saved run
  config_lib.check_resume(saved, config_lib.base_config())
  resumed = config_lib.base_config()
  resumed.optim.lr = c.optim.lr * 2
  with pytest.raises(config_lib.UserInputError, match=rf"optim.lr: {c.optim.lr!r} -> "):
    config_lib.check_resume(saved, resumed)
  resumed = config_lib.base_config()
  resumed.env.kwargs.path = "other.jsonl"
  with pytest.raises(config_lib.UserInputError,
                     match=r"env.kwargs.path: \(absent\) -> 'other.jsonl'"):
    config_lib.check_resume(json.loads(c.to_json_best_effort()), resumed)
  with pytest.raises(config_lib.UserInputError, match=r"removed_section.x: 1 -> \(absent\)"):
    config_lib.check_resume({**json.loads(c.to_json_best_effort()), "removed_section": {"x": 1}},
                            config_lib.base_config())
