"""Plan-Path (AT-GRPO, docs/papers.md section 1): from start to goal on a grid with blocked cells.

Generation: exactly round(block_ratio * H * W) blocked cells drawn uniformly, start and goal two
distinct free cells drawn uniformly; rejected and redrawn until goal is reachable (BFS). Defaults:
10x10, 22% blocked.

Reward of one move (U/D/L/R; any other move string is an invalid move):
  -0.01 if it moves, -0.10 if invalid (off the grid, into '#', unknown); the agent then stays;
  + lambda * (gamma * phi(pos') - phi(pos)), phi = -Manhattan(pos, goal), gamma 0.99, lambda 1
    (shaping "paper", the default; "discounted" weights move t's term by gamma^t so that no
    cycle pays: `games.base.potential_term`);
  + 1.0 on reaching the goal, + 0.5 more if the episode's move count (invalid moves included)
    equals the shortest-path length.
An unparseable action list costs -1.0 (format penalty). The episode ends at the goal or after
`max_steps` moves (no extra penalty: the paper lists none).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from marl_jax.envs.base import check_int, check_seed
from marl_jax.envs.games.base import MAX_SIDE, MAX_STEPS, Game, check_shaping, potential_term
from marl_jax.envs.games.env import GameEnv

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
ALIASES = {"UP": "U", "DOWN": "D", "LEFT": "L", "RIGHT": "R"}
_MAX_TRIES = 10_000

Cell = tuple[int, int]


def coerce_moves(raw: list[Any]) -> tuple[str, ...] | None:
  """Grid moves ('U', 'down', ...) as canonical letters; None unless every item is a string.
  Unknown words pass through and count as invalid moves in the game."""
  if not all(isinstance(m, str) for m in raw):
    return None
  return tuple(ALIASES.get(m.strip().upper(), m.strip().upper()) for m in raw)


@dataclasses.dataclass(frozen=True)
class PlanPathRewards:
  step: float = -0.01
  invalid: float = -0.10
  goal: float = 1.0
  optimal: float = 0.5
  gamma: float = 0.99
  lambda_pot: float = 1.0
  format_penalty: float = -1.0
  shaping: str = "paper"  # games.base.SHAPINGS

  def __post_init__(self):
    check_shaping(self.shaping)


def shortest_moves(rows: Sequence[str], start: Cell, goal: Cell) -> list[str] | None:
  """BFS move list from start to goal through '.' cells (U, D, L, R tried in that order)."""
  height, width = len(rows), len(rows[0])
  parent: dict[Cell, tuple[Cell, str] | None] = {start: None}
  queue = collections.deque([start])
  while queue:
    cell = queue.popleft()
    if cell == goal:
      path = []
      while parent[cell] is not None:
        cell, move = parent[cell]
        path.append(move)
      return path[::-1]
    for move, (dr, dc) in MOVES.items():
      nxt = (cell[0] + dr, cell[1] + dc)
      if (0 <= nxt[0] < height and 0 <= nxt[1] < width and rows[nxt[0]][nxt[1]] == "."
          and nxt not in parent):
        parent[nxt] = (cell, move)
        queue.append(nxt)
  return None


class PlanPath(Game):
  """One grid instance. `rows` use '.' free and '#' blocked; cells are (row, col), 0-based."""

  name = "plan_path"

  def __init__(self, rows: Sequence[str], start: Cell, goal: Cell, *, max_steps: int = 200,
               rewards: PlanPathRewards = PlanPathRewards()):
    rows = tuple(rows)
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
      raise ValueError(f"rows must be a non-empty rectangle, got {rows!r}")
    if any(ch not in ".#" for r in rows for ch in r):
      raise ValueError(f"rows may only hold '.' and '#', got {rows!r}")
    self.rows = rows
    self.height, self.width = len(rows), len(rows[0])
    for label, cell in (("start", start), ("goal", goal)):
      if not self._free(tuple(cell)):
        raise ValueError(
            f"{label} {cell!r} is not a free cell of the {self.height}x{self.width} grid")
    self.start, self.goal = tuple(start), tuple(goal)
    path = shortest_moves(rows, self.start, self.goal)
    if path is None:
      raise ValueError(f"goal {self.goal} is unreachable from start {self.start}")
    self.optimal_steps = len(path)
    self.max_steps = max_steps
    self.rewards = rewards
    self.format_penalty = rewards.format_penalty
    self.pos: Cell = self.start
    self.steps = 0

  def _free(self, cell: Cell) -> bool:
    r, c = cell
    return 0 <= r < self.height and 0 <= c < self.width and self.rows[r][c] == "."

  def _phi(self, cell: Cell) -> float:
    return -float(abs(cell[0] - self.goal[0]) + abs(cell[1] - self.goal[1]))

  @property
  def solved(self) -> bool:
    return self.pos == self.goal

  def _move(self, move: str) -> float:
    rw = self.rewards
    delta = MOVES.get(move)
    nxt = (self.pos[0] + delta[0], self.pos[1] + delta[1]) if delta else self.pos
    valid = delta is not None and self._free(nxt)
    reward = rw.step if valid else rw.invalid
    new_pos = nxt if valid else self.pos
    reward += potential_term(rw.shaping, rw.lambda_pot, rw.gamma, self._phi(self.pos),
                             self._phi(new_pos), self.steps)
    self.pos = new_pos
    self.steps += 1
    if self.solved:
      reward += rw.goal + (rw.optimal if self.steps == self.optimal_steps else 0.0)
    return reward

  def coerce_actions(self, raw: list[Any]) -> tuple[str, ...] | None:
    return coerce_moves(raw)

  def render(self) -> str:
    lines = []
    for r, row in enumerate(self.rows):
      chars = list(row)
      if self.goal[0] == r:
        chars[self.goal[1]] = "G"
      if self.pos[0] == r:
        chars[self.pos[1]] = "P"
      lines.append("".join(chars))
    lines.append(f"P={self.pos} G={self.goal}")
    return "\n".join(lines)

  def rules(self) -> str:
    return (f"Plan-Path on a {self.height}x{self.width} grid. Cells are (row, col), 0-based, row 0 "
            "at the top. '.' free, '#' blocked, P = you, G = goal. Moves: U (row-1), D (row+1), "
            "L (col-1), R (col+1); moves off the grid or into '#' are invalid and cost reward. "
            "Reach G; a shortest path earns a bonus. Action list example: [\"R\", \"D\", \"D\"]")

  def short_rules(self) -> str:
    return (f"Plan-Path {self.height}x{self.width}: cells (row, col), '#' blocked, P you, G goal. "
            "Moves U D L R. Example: [\"R\", \"D\"]")

  def oracle(self) -> list[str]:
    return shortest_moves(self.rows, self.pos, self.goal)

  def solver_program(self) -> str:
    """Breadth-first search over the rendered grid (P and G count as free), moves tried in
    U, D, L, R order, so it prints `oracle()`'s path. The grid is written row per line, as the
    prompt renders it."""
    grid = "\n".join(self.render().splitlines()[:self.height])
    return (f"from collections import deque\n"
            f'grid = """\n{grid}\n""".split()\n'
            f"start, goal = {self.pos}, {self.goal}\n"
            "moves = {'U': (-1, 0), 'D': (1, 0), 'L': (0, -1), 'R': (0, 1)}\n"
            "queue, seen = deque([(start, [])]), {start}\n"
            "while queue:\n"
            "    (r, c), path = queue.popleft()\n"
            "    if (r, c) == goal:\n"
            "        print('**Actions List**:', path)\n"
            "        break\n"
            "    for m, (dr, dc) in moves.items():\n"
            "        n = (r + dr, c + dc)\n"
            "        if (0 <= n[0] < len(grid) and 0 <= n[1] < len(grid[0])\n"
            "                and grid[n[0]][n[1]] != '#' and n not in seen):\n"
            "            seen.add(n)\n"
            "            queue.append((n, path + [m]))\n")


def generate(seed: int, *, height: int = 10, width: int = 10, block_ratio: float = 0.22,
             max_steps: int = 200, rewards: PlanPathRewards = PlanPathRewards(),
             shaping: str | None = None) -> PlanPath:
  """The instance of `seed` (same seed and sizes -> same instance); `shaping` (the config's way
  to choose it, `games.base.SHAPINGS`) overrides `rewards.shaping`."""
  if shaping is not None:
    rewards = dataclasses.replace(rewards, shaping=shaping)
  rng = random.Random(check_seed(seed))
  check_int("height", height, 1, MAX_SIDE)
  check_int("width", width, 1, MAX_SIDE)
  check_int("max_steps", max_steps, 1, MAX_STEPS)
  if not (isinstance(block_ratio, (int, float)) and 0.0 <= block_ratio < 1.0):
    raise ValueError(f"block_ratio={block_ratio!r}; expected a number in [0, 1)")
  cells = [(r, c) for r in range(height) for c in range(width)]
  n_blocked = round(block_ratio * height * width)
  if len(cells) - n_blocked < 2:
    raise ValueError(f"a {height}x{width} grid with {n_blocked} blocked cells has < 2 free cells")
  for _ in range(_MAX_TRIES):
    blocked = set(rng.sample(cells, n_blocked))
    start, goal = rng.sample([cell for cell in cells if cell not in blocked], 2)
    rows = ["".join("#" if (r, c) in blocked else "." for c in range(width))
            for r in range(height)]
    if shortest_moves(rows, start, goal) is not None:
      return PlanPath(rows, start, goal, max_steps=max_steps, rewards=rewards)
  raise RuntimeError(f"no reachable start/goal pair in {_MAX_TRIES} draws "
                     f"(block_ratio {block_ratio} too high?)")


def make_env(*, seed: int, mode: str = "mas", max_turns: int = 4, prompt: str = "full",
             **config: Any) -> GameEnv:
  """Registry factory: `config` goes to `generate` (height, width, block_ratio, ...); `prompt`
  is the prompt style (`prompts.STYLES`)."""
  return GameEnv(generate(seed, **config), mode=mode, max_turns=max_turns, prompt=prompt)
