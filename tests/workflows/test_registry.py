"""The environment registry: declarations agree with the envs, specs, one-line errors."""

from __future__ import annotations

import pytest

from marl_jax.traces.replay import REPLAYERS
from marl_jax.workflows import registry
from marl_jax.workflows.replay import recompute_rewards


def _variants():
  for name in ("plan_path", "sokoban", "sudoku", "math", "code", "writing", "search"):
    for variant in registry.TASKS.get(name).workflows:
      yield name, variant


@pytest.mark.parametrize("name, variant", list(_variants()))
def test_declared_agents_are_the_envs_agents(name, variant):
  """Each family declares its agents once; the env its problem source builds must agree."""
  spec = registry.workflow_spec(name, variant, max_turns=2, per_role=True)
  env = registry.make_env(name, **registry.problem_kwargs(name, variant, 2, 0, {}))
  assert tuple(env.agents) == spec.agents
  assert spec.policy_of == {agent: i for i, agent in enumerate(spec.agents)}
  assert set(spec.tool_agents) <= set(spec.agents)
  assert REPLAYERS.get(name) is recompute_rewards


def test_turn_caps_defaults_and_fixed_variants():
  assert registry.workflow_spec("math", "drmas").max_turns == 2  # the variant's default
  assert registry.workflow_spec("math", "drmas", max_turns=5).max_turns == 5
  assert registry.workflow_spec("math", "single", max_turns=5).max_turns == 1  # one turn always
  assert registry.workflow_spec("sudoku", "single", max_turns=3).max_turns == 3
  shared = registry.workflow_spec("search", "drmas", max_turns=4)
  assert shared.num_policies == 1 and shared.kind == "router"


def test_unknown_names_fail_with_one_line():
  with pytest.raises(ValueError, match=r"unknown environment 'chess'; expected one of \["):
    registry.make_env("chess", seed=0)
  with pytest.raises(ValueError, match="unknown workflow 'debate' for environment 'math'; "
                                       "expected one of \\['atgrpo', 'drmas', 'learned_stop', "
                                       "'stop_by_verifier', 'stop_at_cap', "
                                       "'learned_stop_checked', 'stop_by_check', "
                                       "'stop_at_cap_checked', 'spawn', 'spawn_vote', 'spawn_checked', "
                                       "'delegate', 'delegate_vote', "
                                       "'marft', 'single'\\]"):
    registry.workflow_spec("math", "debate")


def test_shared_policies_number_in_agent_order():
  """`share` puts each group's agents on one policy; the rest keep their own; ids are numbered
  by each policy's first agent in turn order."""
  spec = registry.workflow_spec("math", "spawn", per_role=True,
                                share=("worker_2+aggregator", "worker_1+worker_4"))
  assert spec.agents == ("dispatcher", "worker_1", "worker_2", "worker_3", "worker_4",
                         "aggregator")
  assert spec.policy_of == {"dispatcher": 0, "worker_1": 1, "worker_2": 2, "worker_3": 3,
                            "worker_4": 1, "aggregator": 2}
  assert spec.num_policies == 4
  assert registry.policy_map(("a", "b", "c"), True, ("b+c",)) == {"a": 0, "b": 1, "c": 1}


@pytest.mark.parametrize("per_role, share, message", [
    (False, ("a+b",), r"share=\('a\+b',\) groups agents of a per-role team; with per_role=False"),
    (True, ("a+d",), r"share\[0\]='a\+d'; expected two or more distinct agents of \['a', 'b', "
                     r"'c'\] joined by '\+', each in one group \(not so: \['d'\]\)"),
    (True, ("a+b", "b+c"), r"share\[1\]='b\+c'; .* \(not so: \['b'\]\)"),
    (True, ("a+a",), r"share\[0\]='a\+a'; .* \(not so: \['a', 'a'\]\)"),
    (True, ("a",), r"share\[0\]='a'; expected two or more"),
])
def test_bad_share_groups_fail_with_one_line(per_role, share, message):
  with pytest.raises(ValueError, match=message) as info:
    registry.policy_map(("a", "b", "c"), per_role, share)
  assert "\n" not in str(info.value)
