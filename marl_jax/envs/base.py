"""Environment API: games (shared puzzle state), agent-keyed game environments, a registry.

Two layers, so that workflows can copy branches cheaply and score actions without side effects:

- `Game`: the shared state of one puzzle instance (Plan-Path, Sokoban, Sudoku). Deterministic from
  a seed, `clone()` is a shallow copy (every state field is immutable), `render()` is a compact
  text grid, `step(actions)` returns the env reward of an action list, `oracle()` an optimal or
  valid action list from the current state (scripted policies, tests).
- `GameEnv`: the agent-keyed environment over a game, in one of two modes (PAPERS.md section 1):
    'mas'    AT-GRPO's turn of two agents: the tool agent's program prints `**Actions List**: [...]`
             (the workflow runs it in the sandbox and passes its stdout), then the plan agent
             answers after `####`.
    'single' one solver agent answers after `####` (the SA baselines).

Rewards are additive agent-keyed contributions: the reward of one LLM call (one agent at one turn)
is the sum of `rewards[agent]` over the steps of its turn. In 'mas' mode:
    tool step -> {"tool": r_own}             r_own = env reward of its actions on a clone
    plan step -> {"plan": 2 * r, "tool": r}  r = env reward of the plan's step on the shared state
                                             (the game's format penalty if the answer did not parse)
so tool = r_own + r (own actions + the shared state after the turn) and plan = 2 r. When an
agent's actions are empty or unparseable its own term is FORMAT_PENALTY (-2) instead. The acting
agent's entry is also its branch score for tree sampling (known right after its own step).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import importlib
import json
from collections.abc import Sequence
from typing import Any, ClassVar

from marl_jax.envs import actions as actions_lib
from marl_jax.envs import prompts

FORMAT_PENALTY = -2.0  # an agent's own term for empty/unparseable actions (AT-GRPO games).
MODES = ("mas", "single")
MAS_AGENTS = ("tool", "plan")
SINGLE_AGENTS = ("solver",)


@dataclasses.dataclass(frozen=True)
class MoveOutcome:
  """What one `Game.step` did: the env reward of an action list and its per-move parts."""

  reward: float  # sum of move_rewards, or the game's format penalty when format_error.
  move_rewards: tuple[float, ...]  # one per move applied; moves after the game ended are dropped.
  done: bool
  solved: bool
  format_error: bool = False


class Game(abc.ABC):
  """Shared state of one puzzle instance.

  Subclasses keep every state field immutable (ints, tuples, frozensets) so `clone` can be a
  shallow copy: tree sampling clones every branch at every agent step.
  """

  name: ClassVar[str]
  format_penalty: float  # env reward of an action list that failed to parse.
  max_steps: int
  steps: int  # moves applied since the start of the episode.

  @property
  @abc.abstractmethod
  def solved(self) -> bool:
    """Whether the puzzle is solved (the task-success metric)."""

  @property
  def done(self) -> bool:
    return self.solved or self.steps >= self.max_steps

  @abc.abstractmethod
  def _move(self, move: Any) -> float:
    """Apply one coerced move (legal or not), advance `steps`, return its reward."""

  @abc.abstractmethod
  def coerce_actions(self, raw: list[Any]) -> tuple[Any, ...] | None:
    """Game moves from a parsed list literal; None when its structure is not this game's format."""

  @abc.abstractmethod
  def render(self) -> str:
    """Compact, unambiguous text of the current state (it goes into every prompt)."""

  @abc.abstractmethod
  def rules(self) -> str:
    """Task statement: symbols, coordinates, moves, the action-list format."""

  @abc.abstractmethod
  def oracle(self) -> list[Any] | None:
    """A solving action list from the current state (optimal where the game has a notion of it);
    None when the current state cannot be solved any more."""

  @abc.abstractmethod
  def instance_key(self) -> str:
    """Identity of the generated instance (not of the current state), for determinism checks."""

  def step(self, actions: Sequence[Any] | None) -> MoveOutcome:
    """Apply coerced moves in order until the game ends; None (parse failure) costs the format
    penalty and leaves the state unchanged."""
    if actions is None:
      return MoveOutcome(self.format_penalty, (), self.done, self.solved, format_error=True)
    move_rewards = []
    for move in actions:
      if self.done:
        break
      move_rewards.append(self._move(move))
    return MoveOutcome(float(sum(move_rewards)), tuple(move_rewards), self.done, self.solved)

  def clone(self) -> Game:
    return copy.copy(self)

  def format_actions(self, moves: Sequence[Any]) -> str:
    """Moves as the JSON list an agent would answer (scripted policies, prompts)."""
    return json.dumps([list(m) if isinstance(m, tuple) else m for m in moves])


def evaluate_actions(game: Game, actions: Sequence[Any] | None) -> tuple[float, Game]:
  """Env reward of `actions` on a clone of `game`, and that clone; `game` is untouched."""
  branch = game.clone()
  return branch.step(actions).reward, branch


def own_term(actions: Sequence[Any] | None, env_reward: float, scale: float = 1.0) -> float:
  """An agent's own reward term: scale x env reward, or FORMAT_PENALTY for empty/None actions."""
  return FORMAT_PENALTY if not actions else scale * env_reward


def tool_reward(tool_actions: Sequence[Any] | None, r_own: float, r_shared: float) -> float:
  """AT-GRPO tool agent: its actions' env reward on a clone + the shared state's after the turn."""
  return own_term(tool_actions, r_own) + r_shared


def plan_reward(plan_actions: Sequence[Any] | None, r_shared: float) -> float:
  """AT-GRPO plan agent: 2 x env reward of its step on the shared state."""
  return own_term(plan_actions, r_shared, scale=2.0)


@dataclasses.dataclass(frozen=True)
class Observation:
  """One agent's prompt: chat messages are [system, user]."""

  agent: str
  turn: int
  system: str
  user: str

  def messages(self) -> list[dict[str, str]]:
    return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Result of one agent's step. `rewards` are additive contributions (see the module doc)."""

  agent: str
  actions: tuple[Any, ...] | None  # the coerced actions; None when the output did not parse.
  rewards: dict[str, float]
  done: bool
  info: dict[str, Any]


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


class GameEnv:
  """Agent-keyed environment over one `Game` (module doc: modes, reward bookkeeping).

  The environment runs no code: in 'mas' mode the workflow runs the tool agent's program (in the
  sandbox) and passes its stdout to `step("tool", response, tool_output=...)`. Turn order is the
  workflow's; the env only requires that a turn's tool step precedes its plan step to show the
  plan agent the tool's work. `clone()` is cheap: the game is shallow-copied, the rest immutable.
  """

  def __init__(self, game: Game, *, mode: str = "mas", max_turns: int = 4):
    if mode not in MODES:
      raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
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
    system, user = prompts.build(self, agent)
    return Observation(agent, self.turn, system, user)

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


# Name -> "module:factory"; a factory takes make_env's keyword arguments and returns an env.
# Imported lazily so that `base` does not import every environment (nor they `base` circularly).
_REGISTRY = {
    "plan_path": "marl_jax.envs.games.plan_path:make_env",
    "sokoban": "marl_jax.envs.games.sokoban:make_env",
    "sudoku": "marl_jax.envs.games.sudoku:make_env",
    "math": "marl_jax.envs.math.env:make_env",
    "code": "marl_jax.envs.code.env:make_env",
    "writing": "marl_jax.envs.writing.env:make_env",
    "search": "marl_jax.envs.search.env:make_env",
}


def env_names() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def make_env(name: str, **kwargs: Any) -> Any:
  """Build the environment registered as `name`, e.g. make_env("sokoban", seed=3, mode="single")."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; expected one of {env_names()}")
  module, factory = _REGISTRY[name].split(":")
  return getattr(importlib.import_module(module), factory)(**kwargs)


def check_seed(seed: int) -> int:
  """Seeds are non-negative ints: `random.Random` folds -s onto s, which would alias instances."""
  if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  return seed
