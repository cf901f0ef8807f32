"""The rollout's safety net: an env step that raises on a reply becomes a failed sample with a
`safety_event` in the trace and a count in the result; the rollout goes on."""

from __future__ import annotations

import pytest

import toy_task
from marl_jax.sandbox import runner as sandbox
from marl_jax.traces import schema
from marl_jax.workflows import rollout as R
from marl_jax.workflows.spec import WorkflowSpec


@pytest.fixture
def exploding_env(monkeypatch):
  toy_task.register()
  honest = toy_task.VowelEnv.step

  def step(self, agent, response):
    if "boom" in response:
      self.turn = 99  # half-way mutated state, then a crash the env did not anticipate
      raise RecursionError("maximum recursion depth exceeded")
    return honest(self, agent, response)

  monkeypatch.setattr(toy_task.VowelEnv, "step", step)


def _generate(texts):
  def generate(requests, policy_id, params):
    return [R.Generation(texts[i % len(texts)]) for i, _ in enumerate(requests)]
  return generate


@pytest.mark.parametrize("mode", ["independent", "tree"])
def test_raising_step_is_a_failed_sample(exploding_env, mode):
  spec = WorkflowSpec(("writer",), max_turns=1)
  problems = [R.Problem(toy_task.NAME, {"seed": s}, s) for s in range(2)]
  res = R.rollout(problems, spec, _generate(["boom", "aeiou"]), None,
                  R.RolloutConfig(mode=mode, k=2, trace_clock="logical"))
  rewards = sorted(s.reward for s in res.samples)
  assert rewards == [0.0, 0.0, 1.0, 1.0]  # two exploded (format failure), two scored vowels
  assert res.safety_events == 2
  if mode == "tree":  # the branch that did not raise is the one continued
    assert all(s.selected == (s.reward == 1.0) for s in res.samples)
  events = [e for ep in res.episodes for e in ep.trace["events"] if e["type"] == "safety_event"]
  assert len(events) == 2 and all(e["agent"] == "writer" for e in events)
  for ep in res.episodes:
    schema.validate(ep.trace)


def test_all_branches_raising_ends_the_episode(exploding_env):
  spec = WorkflowSpec(("writer",), max_turns=1)
  res = R.rollout([R.Problem(toy_task.NAME, {"seed": 0}, 0)], spec, _generate(["boom"]), None,
                  R.RolloutConfig(mode="tree", k=3, trace_clock="logical"))
  assert [s.reward for s in res.samples] == [0.0] * 3 and res.safety_events == 3
  assert not res.episodes[0].solved and res.episodes[0].turns == 1


def test_refused_isolation_is_not_swallowed(monkeypatch):
  toy_task.register()

  def step(self, agent, response):
    raise sandbox.IsolationUnavailable("refusing to run model-written code unconfined")

  monkeypatch.setattr(toy_task.VowelEnv, "step", step)
  with pytest.raises(sandbox.IsolationUnavailable):
    R.rollout([R.Problem(toy_task.NAME, {"seed": 0}, 0)], WorkflowSpec(("writer",), max_turns=1),
              _generate(["x"]), None, R.RolloutConfig(k=1, trace_clock="logical"))
