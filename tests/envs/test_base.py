"""The environment contract (envs/base.py): a Task refuses an incomplete env class when it is
declared, the factory's envs are checked when built, and each capability is a named Protocol."""

from __future__ import annotations

import typing

import pytest

from marl_jax.envs import base
from marl_jax.workflows import registry


class _Complete:
  agents, turn, done, solved = ("a",), 0, False, False

  def clone(self):
    return self

  def observe(self, agent):
    return base.Observation(agent, 0, "system", "user")

  def step(self, agent, response, *, tool_output=None):
    return base.StepResult(agent, None, {}, True, {})


class _NoClone:
  agents, turn, done, solved = ("a",), 0, False, False

  def observe(self, agent):
    return base.Observation(agent, 0, "system", "user")

  def step(self, agent, response, *, tool_output=None):
    return base.StepResult(agent, None, {}, True, {})


def test_the_checked_members_are_the_protocols():
  """The names the checks use are the members `Environment` declares."""
  declared = typing._get_protocol_attrs(base.Environment)  # pylint: disable=protected-access
  assert declared == set(base.REQUIRED_METHODS + base.REQUIRED_DATA)


def _task(make_env, envs=()):
  return base.Task(make_env, {"one": base.Workflow(("a",))}, lambda v, t, seed: {}, envs=envs)


def test_a_class_missing_a_required_method_is_refused_when_declared():
  with pytest.raises(TypeError, match=r"^Task env <class '.*_NoClone'> lacks the methods "
                                      r"\['clone'\]; expected a class defining \['clone', "
                                      r"'observe', 'step'\] \(envs.base.Environment\)$"):
    _task(_NoClone, envs=(_NoClone,))
  assert _task(_Complete, envs=(_Complete,)).envs == (_Complete,)


def test_built_envs_are_checked():
  """A declared Task's factory may build only its declared classes; an undeclared Task's env must
  still have every member of the contract."""
  assert isinstance(_task(_Complete, envs=(_Complete,)).make(), _Complete)
  with pytest.raises(TypeError, match=r"built a _NoClone, which its Task does not declare; "
                                      r"expected one of \['_Complete'\]"):
    _task(_NoClone, envs=(_Complete,)).make()
  with pytest.raises(TypeError, match=r"_NoClone lacks \['clone'\]; expected every member of "
                                      r"envs.base.Environment"):
    _task(_NoClone).make()


@pytest.mark.parametrize("name", ["plan_path", "sokoban", "sudoku", "math", "code", "writing",
                                  "search"])
def test_every_family_declares_its_env_classes(name):
  """Every registered family names the classes its factory builds, so each was checked when its
  Task was declared."""
  envs = registry.TASKS.get(name).envs
  assert envs and all(callable(getattr(cls, m)) for cls in envs for m in base.REQUIRED_METHODS)


@pytest.mark.parametrize("name, kwargs, has", [
    ("plan_path", dict(seed=0), {base.Demonstrates}),
    ("math", dict(problem={"question": "1+1?", "answer": "2"}, workflow="drmas"),
     {base.Demonstrates, base.MakesMistakes, base.GradesAnswers}),
    ("math", dict(problem={"question": "1+1?", "answer": "2"}, workflow="learned_stop"),
     {base.Demonstrates, base.MakesMistakes, base.GradesAnswers, base.RewardsDecisions}),
    ("writing", dict(seed=0), set()),
])
def test_capabilities(name, kwargs, has):
  env = registry.make_env(name, **kwargs)
  capabilities = {base.Demonstrates, base.MakesMistakes, base.RewardsDecisions,
                  base.GradesAnswers}
  assert {c for c in capabilities if isinstance(env, c)} == has
  assert isinstance(env, base.Environment)
