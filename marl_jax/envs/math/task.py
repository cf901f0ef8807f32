"""The math family (AT-GRPO, Dr. MAS, MARFT, single): its env factory, workflows and problem
source. Generated problems are seeded arithmetic word problems; with `path` (and `fmt`) in the env
kwargs, seed s is row s % rows of that file.
"""

from __future__ import annotations

from typing import Any

from marl_jax.envs.base import Task, Workflow
from marl_jax.envs.data import file_rows
from marl_jax.envs.math import data as math_data
from marl_jax.envs.math import grading
from marl_jax.envs.math.env import (ATGRPOMathEnv, DrMASMathEnv, MARFTMathEnv, MathEnv,
                                    MathProblem, SingleMathEnv, approves)
from marl_jax.envs.math.orchestration_spawn import DelegateMathEnv, SpawnMathEnv, delegates, spawns
from marl_jax.envs.math.orchestration_stop import CheckedStopMathEnv, LearnedStopMathEnv, stops

# 'atgrpo' tool -> reasoner (tool replies run in the sandbox), 'drmas' solver <-> verifier loop
# exiting on approval, 'learned_stop' that loop exiting on a coordinator's learned decision (the
# cap a safety limit), 'stop_by_verifier' / 'stop_at_cap' that team with the exit fixed,
# 'learned_stop_checked' the loop with a program checker (its replies run in the sandbox) and its
# fixed exits 'stop_by_check' / 'stop_at_cap_checked' (the coordinator's observed state: whether
# the answer matched the check, 1, or not, 0), 'spawn' a dispatcher spawning 1-4 solvers and an
# aggregator, 'delegate' a dispatcher picking which of 4 specialists solve and an aggregator,
# 'spawn_vote' / 'delegate_vote' those teams with the aggregate fixed to the workers' plurality,
# 'spawn_checked' the spawn team with the aggregate fixed to the first worker answer that passes
# the problem's check by substitution (problems with a check: level 'equation'),
# 'marft' the profiled chain (default roles), 'single' one solver.
WORKFLOWS = {
    "atgrpo": Workflow(ATGRPOMathEnv.agents, max_turns=4, tool_agents=frozenset({"tool"})),
    "drmas": Workflow(DrMASMathEnv.agents, kind="loop", max_turns=2, exit_agent="verifier",
                      exit_when=approves),
    "learned_stop": Workflow(LearnedStopMathEnv.agents, kind="loop", max_turns=3,
                             exit_agent="coordinator", exit_when=stops),
    "stop_by_verifier": Workflow(LearnedStopMathEnv.agents, kind="loop", max_turns=3,
                                 exit_agent="verifier", exit_when=approves),
    "stop_at_cap": Workflow(LearnedStopMathEnv.agents, kind="loop", max_turns=3,
                            exit_agent="coordinator", exit_when=lambda response: False),
    "learned_stop_checked": Workflow(CheckedStopMathEnv.agents, kind="loop", max_turns=3,
                                     exit_agent="coordinator", exit_when=stops,
                                     tool_agents=frozenset({"checker"}), num_states=2),
    **{name: Workflow(CheckedStopMathEnv.agents, kind="loop", max_turns=3,
                      exit_agent="coordinator", exit_when=lambda response: False,
                      tool_agents=frozenset({"checker"}), num_states=2)
       for name in ("stop_by_check", "stop_at_cap_checked")},
    **{name: Workflow(SpawnMathEnv.agents, kind="spawn", max_turns=1, fixed_turns=True,
                      spawn=spawns, topology="hierarchical")
       for name in ("spawn", "spawn_vote", "spawn_checked")},
    **{name: Workflow(DelegateMathEnv.agents, kind="spawn", max_turns=1, fixed_turns=True,
                      spawn=delegates, topology="hierarchical")
       for name in ("delegate", "delegate_vote")},
    "marft": Workflow(("reasoner", "actor"), max_turns=3),
    "single": Workflow(SingleMathEnv.agents, max_turns=1, fixed_turns=True, topology="unknown"),
}


def load_problem(problem: dict[str, Any] | None = None, *, path: str | None = None,
                 fmt: str = "auto", index: int | None = None, seed: int | None = None,
                 level: str | None = None, grader: str = "builtin") -> MathProblem:
  """Exactly one source: a {"question", "answer"} dict, a file row (path, fmt, index) or a
  generated arithmetic word problem (seed, and its `level`, `data.LEVELS`); `grader` compares
  its answers (`grading.GRADERS`)."""
  grading.check_grader(grader)
  if sum(x is not None for x in (problem, path, seed)) != 1:
    raise ValueError("give exactly one of problem=, path= (+ index=), seed=")
  if level is not None and seed is None:
    raise ValueError(f"level={level!r} picks the generated problems' difficulty; it needs seed=, "
                     "not a problem or a file")
  if path is not None:
    if index is None:
      raise ValueError(f"path={path!r} needs index=")
    problem = math_data.load_math(path, fmt)[index]
  elif seed is not None:
    problem = math_data.arithmetic_problem(seed, level or "multi_step")
  if not isinstance(problem.get("question"), str) or problem.get("answer") is None:
    raise ValueError(f"a math problem needs 'question' (str) and 'answer'; got keys "
                     f"{sorted(problem)}")
  return MathProblem(problem["question"], str(problem["answer"]), problem.get("solution", ""),
                     problem.get("check", ""), grader)


def make_env(*, workflow: str = "atgrpo", max_turns: int | None = None,
             roles: list[str] | tuple[str, ...] = ("reasoner", "actor"),
             format_penalty: float = 0.1, round_cost: float = 0.0,
             premature_penalty: float = 0.0, spawn_cost: float = 0.0,
             latency_cost: float = 0.0, aggregation_bonus: float = 0.0,
             **source: Any) -> MathEnv:
  """Registry factory, e.g. make_env("math", problem={...}, workflow="drmas"). `max_turns` is the
  turn cap (atgrpo, default 4), loop cap (drmas, default 2; learned_stop and its fixed-exit
  variants, default 3) or step cap (marft, default 3). `round_cost` and `premature_penalty` price
  the coordinator's decisions (learned_stop and its fixed-exit variants only); `spawn_cost` each
  spawned solver, `latency_cost` the longest solver reply and `aggregation_bonus` rewards an
  aggregate that kept a right answer (spawn, delegate and their fixed-pick variants, which
  refuse the bonus); refused elsewhere when set. `grader` ('builtin' or 'math_verify',
  `grading.py`) compares every answer (a `load_problem` kwarg, passed through `source`)."""
  if workflow not in WORKFLOWS:
    raise ValueError(f"unknown math workflow {workflow!r}; expected one of {list(WORKFLOWS)}")
  checked = {"learned_stop_checked": "learned", "stop_by_check": "check",
             "stop_at_cap_checked": "cap"}
  stopping = ("learned_stop", "stop_by_verifier", "stop_at_cap", *checked)
  if workflow not in stopping and (round_cost or premature_penalty):
    raise ValueError(f"round_cost / premature_penalty price the learned_stop coordinator; "
                     f"workflow {workflow!r} has none (got {round_cost}, {premature_penalty})")
  spawning = dict(spawn_cost=spawn_cost, latency_cost=latency_cost,
                  aggregation_bonus=aggregation_bonus)
  spawners = {"spawn": (SpawnMathEnv, "learned"), "spawn_vote": (SpawnMathEnv, "vote"),
              "spawn_checked": (SpawnMathEnv, "check"), "delegate": (DelegateMathEnv, "learned"),
              "delegate_vote": (DelegateMathEnv, "vote")}
  if workflow not in spawners and any(spawning.values()):
    raise ValueError(f"{spawning} price the spawn and delegate workflows' dispatcher and "
                     f"aggregator; workflow {workflow!r} has none")
  if workflow == "spawn_checked" and source.get("seed") is not None and not source.get("level"):
    source = {**source, "level": "equation"}  # the one generated level whose rows carry a check
  problem = load_problem(**source)
  turns = max_turns or WORKFLOWS[workflow].max_turns
  if workflow == "atgrpo":
    return ATGRPOMathEnv(problem, turns)
  if workflow == "drmas":
    return DrMASMathEnv(problem, turns, format_penalty)
  if workflow in checked:
    return CheckedStopMathEnv(problem, turns, format_penalty, round_cost, premature_penalty,
                              exit=checked[workflow])
  if workflow in stopping:
    return LearnedStopMathEnv(problem, turns, format_penalty, round_cost, premature_penalty,
                              learned=workflow == "learned_stop")
  if workflow in spawners:
    team, pick = spawners[workflow]
    return team(problem, format_penalty, **spawning, pick=pick)
  if workflow == "marft":
    return MARFTMathEnv(problem, tuple(roles), turns)
  return SingleMathEnv(problem)


def problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  return dict(seed=seed, workflow=variant, max_turns=max_turns)


dataset_rows = file_rows("math", math_data.load_math, "path", "fmt", "auto")

TASK = Task(make_env, WORKFLOWS, problem, dataset_rows,
            envs=(ATGRPOMathEnv, DrMASMathEnv, LearnedStopMathEnv, CheckedStopMathEnv,
                  SpawnMathEnv, DelegateMathEnv, MARFTMathEnv, SingleMathEnv))
