"""The AT-GRPO games (Plan-Path, Sokoban, Sudoku): one declaration of their workflows and problem
source, one Task per game.

'mas' is the two-agent team: the tool agent's reply is a program run in the sandbox, then the plan
agent answers; 'single' is the single-agent baseline. Every seed is its own generated instance.
"""

from __future__ import annotations

from typing import Any

from marl_jax.envs.base import Task, Workflow
from marl_jax.envs.games import plan_path, sokoban, sudoku
from marl_jax.envs.games.env import MAS_AGENTS, SINGLE_AGENTS, GameEnv

WORKFLOWS = {
    "mas": Workflow(MAS_AGENTS, tool_agents=frozenset({"tool"})),
    "single": Workflow(SINGLE_AGENTS, topology="unknown"),
}


def problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  return dict(seed=seed, mode=variant, max_turns=max_turns)


PLAN_PATH = Task(plan_path.make_env, WORKFLOWS, problem, envs=(GameEnv,))
SOKOBAN = Task(sokoban.make_env, WORKFLOWS, problem, envs=(GameEnv,))
SUDOKU = Task(sudoku.make_env, WORKFLOWS, problem, envs=(GameEnv,))
