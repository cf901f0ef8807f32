"""The agent-keyed environment over one AT-GRPO game (modes and reward bookkeeping: games/base.py).

Agents per mode: 'mas' = MAS_AGENTS (the tool agent, then the plan agent), 'single' =
SINGLE_AGENTS (one solver); games/task.py declares the workflows over them.
"""

from __future__ import annotations

import copy
from typing import Any

from marl_jax.envs import actions as actions_lib
from marl_jax.envs.base import Observation, StepResult
from marl_jax.envs.games import prompts
from marl_jax.envs.games.base import Game, evaluate_actions, own_term, plan_reward
from marl_jax.envs.games.prompts import ToolRecord, TurnRecord

MODES = ("mas", "single")
MAS_AGENTS = ("tool", "plan")
SINGLE_AGENTS = ("solver",)


class GameEnv:
  """Agent-keyed environment over one `Game` (module doc: modes, reward bookkeeping).

  The environment runs no code: in 'mas' mode the workflow runs the tool agent's program (in the
  sandbox) and passes its stdout to `step("tool", response, tool_output=...)`. Turn order is the
  workflow's; the env only requires that a turn's tool step precedes its plan step to show the
  plan agent the tool's work. `clone()` is cheap: the game is shallow-copied, the rest immutable.
  """

  def __init__(self, game: Game, *, mode: str = "mas", max_turns: int = 4, prompt: str = "full"):
    if mode not in MODES:
      raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if prompt not in prompts.STYLES:
      raise ValueError(f"unknown prompt style {prompt!r}; expected one of {prompts.STYLES}")
    self.prompt = prompt
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.game = game
    self.mode = mode
    self.agents = MAS_AGENTS if mode == "mas" else SINGLE_AGENTS
    self.max_turns = max_turns
    self.turn = 0
    self.tool_record: ToolRecord | None = None
    self.history: tuple[TurnRecord, ...] = ()

  @property
  def done(self) -> bool:
    return self.game.done or self.turn >= self.max_turns

  @property
  def solved(self) -> bool:
    return self.game.solved

  def clone(self) -> GameEnv:
    other = copy.copy(self)
    other.game = self.game.clone()
    return other

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    system, user = prompts.build(agent, self.game, self.turn, self.max_turns, self.history,
                                 self.tool_record, self.prompt)
    return Observation(agent, self.turn, system, user)

  def demonstration(self, agent: str) -> str | None:
    """A correct reply of `agent` in the current state (the supervised warm-start's target,
    `training/sft.py`): the tool agent's is the game's solver program in a ```python block, the
    others answer `#### ` + the oracle's moves. None when the game has no solver program (tool)
    or the state cannot be solved any more."""
    self._check_agent(agent)
    moves = self.game.oracle()
    if moves is None:
      return None
    if agent == "tool":
      program = self.game.solver_program()
      return None if program is None else f"```python\n{program}```"
    return f"{actions_lib.PLAN_MARKER} {self.game.format_actions(moves)}"

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    """One agent's step from its raw reply. Malformed replies cost rewards, never raise."""
    self._check_agent(agent)
    if self.done:
      raise ValueError(f"step({agent!r}) on a finished episode (turn {self.turn}, "
                       f"solved={self.solved})")
    if agent == "tool":
      return self._tool_step(response, tool_output)
    return self._answer_step(agent, response)

  def _tool_step(self, response: str, tool_output: str | None) -> StepResult:
    if not isinstance(tool_output, str):
      raise ValueError("the tool agent's step needs its program's stdout as tool_output (str); "
                       f"got {type(tool_output).__name__}")
    acts = self._coerce(actions_lib.parse_tool_output(tool_output))
    r_own, branch = evaluate_actions(self.game, acts)
    self.tool_record = ToolRecord(actions_lib.extract_code(response) or "", tool_output, acts)
    return StepResult("tool", acts, {"tool": own_term(acts, r_own)}, False,
                      {"env_reward": r_own, "solved_on_clone": branch.solved})

  def _answer_step(self, agent: str, response: str) -> StepResult:
    acts = self._coerce(actions_lib.parse_plan_answer(response))
    outcome = self.game.step(acts)
    r = outcome.reward
    if agent == "plan":
      rewards = {"plan": plan_reward(acts, r)}
      if self.tool_record is not None:
        rewards["tool"] = r
    else:
      rewards = {agent: own_term(acts, r)}
    self.history += (TurnRecord(self.turn, agent, acts, r),)
    self.tool_record = None
    self.turn += 1
    return StepResult(agent, acts, rewards, self.done,
                      {"env_reward": r, "move_rewards": outcome.move_rewards,
                       "solved": self.solved, "format_error": outcome.format_error})

  def _coerce(self, raw: list[Any] | None) -> tuple[Any, ...] | None:
    return None if raw is None else self.game.coerce_actions(raw)

  def _check_agent(self, agent: str) -> None:
    if agent not in self.agents:
      raise ValueError(f"unknown agent {agent!r} in mode {self.mode!r}; expected one of "
                       f"{self.agents}")
