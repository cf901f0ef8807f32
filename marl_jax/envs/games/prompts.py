"""Role prompts of the AT-GRPO games (tool agent, plan agent, single solver) and the records of
earlier steps they show.

Prompts stay short: the game's rules line, the compact state rendering and, from the second turn
on, one line about the last applied actions. The "compact" style shortens the system prompts and
rules and shows the plan agent the tool's output without its program (CPU-sized runs). Untrusted text shown to the plan agent (the tool's
code and output) is truncated head + tail so that a flooding program cannot blow up the prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marl_jax.envs.base import truncate
from marl_jax.envs.games.base import Game

MAX_CODE_CHARS = 6000
MAX_OUTPUT_CHARS = 1500
MAX_ACTIONS_CHARS = 1000


@dataclasses.dataclass(frozen=True)
class ToolRecord:
  """The tool agent's contribution to the current turn, shown to the plan agent."""

  code: str
  output: str
  actions: tuple[Any, ...] | None


@dataclasses.dataclass(frozen=True)
class TurnRecord:
  """Actions applied to the shared state at one turn, for prompts of later turns."""

  turn: int
  agent: str
  actions: tuple[Any, ...] | None
  env_reward: float


TOOL_SYSTEM = (
    "You are the tool agent of a two-agent team solving a puzzle. Write one self-contained Python "
    "program in a ```python block. It reads no input: put the puzzle state in the code. Compute "
    "the answer with a real search (BFS or A* for moves, backtracking for Sudoku) rather than by "
    "guessing, and print the final answer as the last line, exactly as:\n"
    "**Actions List**: [...]\n"
    "The program runs under a time limit; a plan agent then checks your output.")
PLAN_SYSTEM = (
    "You are the plan agent of a two-agent team solving a puzzle. You see the task, the tool "
    "agent's program, its output and the actions parsed from it. Check them against the rules and "
    "the state: adopt them if they are right, fix or replace them if not. Reason briefly, then end "
    "your reply with #### followed by the action list, e.g. #### [...]")
# The compact style (`prompt="compact"`): the same protocol in few tokens, and the plan agent sees
# the tool's output, not its program, for CPU-sized runs where every prompt token is trained on.
TOOL_SYSTEM_COMPACT = (
    "Tool agent: write a Python program in a ```python block that searches the state below and "
    "prints **Actions List**: [...]")
PLAN_SYSTEM_COMPACT = ("Plan agent: check the tool agent's actions against the state and end "
                       "with #### [...]")
SOLVER_SYSTEM = (
    "You solve a puzzle. Reason briefly, then end your reply with #### followed by the action "
    "list, e.g. #### [...]")


STYLES = ("full", "compact")


def _task(game: Game, turn: int, max_turns: int, history: tuple[TurnRecord, ...],
          compact: bool) -> str:
  lines = [game.short_rules() if compact else game.rules(),
           f"Turn {turn + 1} of {max_turns}. State:", game.render()]
  if history:
    last = history[-1]
    applied = "unparseable" if last.actions is None else game.format_actions(last.actions)
    lines.append(f"Moves so far: {game.steps}. Last turn's actions: "
                 f"{truncate(applied, MAX_ACTIONS_CHARS)}.")
  return "\n".join(lines)


def build(agent: str, game: Game, turn: int, max_turns: int, history: tuple[TurnRecord, ...],
          record: ToolRecord | None, style: str = "full") -> tuple[str, str]:
  """(system, user) prompt of `agent` in a game env's current state, in one of STYLES."""
  if style not in STYLES:
    raise ValueError(f"unknown prompt style {style!r}; expected one of {list(STYLES)}")
  compact = style == "compact"
  task = _task(game, turn, max_turns, history, compact)
  plan_system = PLAN_SYSTEM_COMPACT if compact else PLAN_SYSTEM
  if agent == "tool":
    return TOOL_SYSTEM_COMPACT if compact else TOOL_SYSTEM, task
  if agent == "solver":
    return SOLVER_SYSTEM, task
  if record is None:
    return plan_system, task + "\nThe tool agent has not answered this turn."
  parsed = ("none (no parseable **Actions List**)" if record.actions is None
            else truncate(game.format_actions(record.actions), MAX_ACTIONS_CHARS))
  program = ("" if compact else
             f"Tool agent's program:\n```python\n{truncate(record.code, MAX_CODE_CHARS)}\n```\n")
  return plan_system, (f"{task}\n{program}"
                       f"{'Tool output' if compact else 'Its output'}:\n"
                       f"{truncate(record.output, MAX_OUTPUT_CHARS)}\n"
                       f"Parsed actions: {parsed}")
