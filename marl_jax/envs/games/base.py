"""The AT-GRPO games' shared state and its rewards (docs/papers.md section 1).

Two layers, so that workflows can copy branches cheaply and score actions without side effects:

- `Game`: the shared state of one puzzle instance (Plan-Path, Sokoban, Sudoku). Deterministic from
  a seed, `clone()` is a shallow copy (every state field is immutable), `render()` is a compact
  text grid, `step(actions)` returns the env reward of an action list, `oracle()` an optimal or
  valid action list from the current state (scripted policies, tests).
- `GameEnv` (games/env.py): the agent-keyed environment over a game, in one of two modes:
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
import json
from collections.abc import Sequence
from typing import Any, ClassVar

FORMAT_PENALTY = -2.0  # an agent's own term for empty/unparseable actions (AT-GRPO games).
# Largest grid side and step count a generated instance may ask for (`envs.base.check_int`): the
# papers' grids are 4..10 a side, and a config or a replayed trace must not make one episode cost
# seconds and gigabytes.
MAX_SIDE = 50
MAX_STEPS = 10_000
# How a game's potential-based shaping lambda * (gamma * phi(s') - phi(s)) enters move t's
# reward (`potential_term`). "paper": as the papers' code adds it to every move, undiscounted,
# which a cycle earns: with phi <= 0 each move that stays, or goes and comes back, gains
# (1 - gamma) * |phi| * lambda, so a 4x4 Plan-Path plan that oscillates its first move to the step
# cap outscores the optimal plan (docs/fidelity.md). "discounted": the term of move t (t counted
# over the episode) is weighted by gamma^t, so the shaping of any move sequence telescopes to
# lambda * (gamma^T phi(s_T) - phi(s_0)) (Ng et al. 1999): no cycle pays, and the most the
# shaping can give is lambda * |phi(s_0)|, which reaching the goal at once earns (phi(goal) = 0).
SHAPINGS = ("paper", "discounted")


def check_shaping(shaping: str) -> None:
  if shaping not in SHAPINGS:
    raise ValueError(f"shaping={shaping!r}; expected one of {list(SHAPINGS)}")


def potential_term(shaping: str, lam: float, gamma: float, phi: float, phi_next: float,
                   t: int) -> float:
  """The shaping reward of move t (0-based within the episode) from phi to phi_next."""
  term = lam * (gamma * phi_next - phi)
  return term * gamma ** t if shaping == "discounted" else term


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

  def short_rules(self) -> str:
    """The rules in a few tokens (compact prompts); default: `rules()`."""
    return self.rules()

  @abc.abstractmethod
  def oracle(self) -> list[Any] | None:
    """A solving action list from the current state (optimal where the game has a notion of it);
    None when the current state cannot be solved any more."""

  def solver_program(self) -> str | None:
    """A self-contained Python program that searches the current state for a solution and prints
    it as `**Actions List**: [...]` (the tool agent's demonstration); None when the game has none.
    The search is real (the program holds the state, not the answer)."""
    return None

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


def plan_reward(plan_actions: Sequence[Any] | None, r_shared: float) -> float:
  """AT-GRPO plan agent: 2 x env reward of its step on the shared state."""
  return own_term(plan_actions, r_shared, scale=2.0)
