"""Sudoku with a unique solution (AT-GRPO, docs/papers.md section 1); 4x4 by default, 9x9 supported.

Generation: a random complete grid (backtracking with shuffled digits), then clues are removed in
random order, each removal kept only while the puzzle still has exactly one solution; this stops
at a minimal puzzle, or earlier once `max_blanks` cells are empty.

Moves are fills (row, col, digit), 0-based row/col. Digits the agent placed may be overwritten;
givens may not. A move writing the digit a cell already holds is a no-op (no reward, not counted
as a move), which lets a complete grid be submitted as an action list.

Reward of one move (the "dense progress/constraint terms" are defined here):
  invalid (row/col/digit out of range, or changing a given): -0.10, grid unchanged;
  otherwise -0.01
    + 1.0 * (change in filled cells) / (cells empty at the start)    progress; sums to 1.0
    - 0.10 * (change in conflicts)                                   constraints
  where conflicts = sum over rows, columns and boxes of (filled cells - distinct digits);
  on solving (grid full, no conflicts): + 2.0 + 0.5 * min(1, blanks / moves taken), the
  efficiency bonus being 0.5 when no move was wasted. The episode ends when solved or after
  `max_steps` moves (default 2 * size^2), without extra penalty. An unparseable action list
  costs -1.0 (format penalty).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

from marl_jax.envs.base import check_seed
from marl_jax.envs.games.base import Game
from marl_jax.envs.games.env import GameEnv

SIZES = (4, 9)


@dataclasses.dataclass(frozen=True)
class SudokuRewards:
  step: float = -0.01
  invalid: float = -0.10
  progress: float = 1.0
  conflict: float = -0.10
  solved: float = 2.0
  efficiency: float = 0.5
  format_penalty: float = -1.0


def _units(size: int) -> tuple[tuple[int, ...], ...]:
  """Flat cell indices of every row, column and box."""
  box = math.isqrt(size)
  rows = [tuple(r * size + c for c in range(size)) for r in range(size)]
  cols = [tuple(r * size + c for r in range(size)) for c in range(size)]
  boxes = [tuple((br + r) * size + bc + c for r in range(box) for c in range(box))
           for br in range(0, size, box) for bc in range(0, size, box)]
  return tuple(rows + cols + boxes)


def solve(cells: Sequence[int], size: int, limit: int = 2,
          rng: random.Random | None = None) -> list[tuple[int, ...]]:
  """Up to `limit` solutions of a flat grid (0 = empty) by backtracking on the most constrained
  cell; digits are tried in random order when `rng` is given (to draw random full grids)."""
  box = math.isqrt(size)
  grid = list(cells)
  row_m, col_m, box_m = [0] * size, [0] * size, [0] * size
  for i, v in enumerate(grid):
    if v:
      r, c, bit = i // size, i % size, 1 << v
      b = (r // box) * box + c // box
      if (row_m[r] | col_m[c] | box_m[b]) & bit:
        return []  # the clues already clash.
      row_m[r] |= bit
      col_m[c] |= bit
      box_m[b] |= bit
  empties = [i for i, v in enumerate(grid) if v == 0]
  full = (1 << (size + 1)) - 2  # bits 1..size
  solutions: list[tuple[int, ...]] = []

  def search() -> bool:  # True once `limit` solutions are found.
    best, best_free, best_count = -1, 0, size + 1
    for i in empties:
      if grid[i] == 0:
        r, c = i // size, i % size
        free = full & ~(row_m[r] | col_m[c] | box_m[(r // box) * box + c // box])
        count = free.bit_count()
        if count < best_count:
          best, best_free, best_count = i, free, count
          if count <= 1:
            break
    if best < 0:
      solutions.append(tuple(grid))
      return len(solutions) >= limit
    digits = [d for d in range(1, size + 1) if best_free >> d & 1]
    if rng is not None:
      rng.shuffle(digits)
    r, c = best // size, best % size
    b = (r // box) * box + c // box
    for d in digits:
      bit = 1 << d
      grid[best] = d
      row_m[r] |= bit
      col_m[c] |= bit
      box_m[b] |= bit
      stop = search()
      grid[best] = 0
      row_m[r] &= ~bit
      col_m[c] &= ~bit
      box_m[b] &= ~bit
      if stop:
        return True
    return False

  search()
  return solutions


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


class Sudoku(Game):
  """One puzzle: `puzzle` is size rows of size ints, 0 = empty; it must have exactly one solution."""

  name = "sudoku"

  def __init__(self, puzzle: Sequence[Sequence[int]], *, max_steps: int | None = None,
               rewards: SudokuRewards = SudokuRewards()):
    size = len(puzzle)
    if size not in SIZES:
      raise ValueError(f"puzzle must have {' or '.join(map(str, SIZES))} rows, got {size}")
    if any(len(row) != size or not all(_is_int(v) and 0 <= v <= size for v in row)
           for row in puzzle):
      raise ValueError(f"puzzle rows must hold {size} ints in 0..{size}, got {puzzle!r}")
    self.size, self.box = size, math.isqrt(size)
    self.givens = tuple(v for row in puzzle for v in row)
    solutions = solve(self.givens, size, limit=2)
    if len(solutions) != 1:
      raise ValueError(f"puzzle has {'no' if not solutions else '>= 2'} solutions; expected "
                       f"exactly 1: {puzzle!r}")
    self.solution = solutions[0]
    self.units = _units(size)
    self.units_of = tuple(tuple(u for u in self.units if i in u) for i in range(size * size))
    self.n_blanks = self.givens.count(0)
    self.max_steps = 2 * size * size if max_steps is None else max_steps
    self.rewards = rewards
    self.format_penalty = rewards.format_penalty
    self.grid = self.givens
    self.filled = size * size - self.n_blanks
    self.conflicts = 0  # givens of a solvable puzzle never clash.
    self.steps = 0

  @property
  def solved(self) -> bool:
    return self.filled == self.size * self.size and self.conflicts == 0

  def _unit_conflicts(self, grid: tuple[int, ...], units: tuple[tuple[int, ...], ...]) -> int:
    total = 0
    for unit in units:
      digits = [grid[i] for i in unit if grid[i]]
      total += len(digits) - len(set(digits))
    return total

  def _move(self, move: tuple[int, int, int]) -> float:
    rw, n = self.rewards, self.size
    r, c, v = move
    i = r * n + c
    if not (0 <= r < n and 0 <= c < n and 1 <= v <= n) or (self.givens[i] and self.givens[i] != v):
      self.steps += 1
      return rw.invalid
    if self.grid[i] == v:
      return 0.0
    units = self.units_of[i]
    before = self._unit_conflicts(self.grid, units)
    newly_filled = int(self.grid[i] == 0)
    self.grid = self.grid[:i] + (v,) + self.grid[i + 1:]
    after = self._unit_conflicts(self.grid, units)
    self.filled += newly_filled
    self.conflicts += after - before
    self.steps += 1
    reward = rw.step + rw.progress * newly_filled / self.n_blanks + rw.conflict * (after - before)
    if self.solved:
      reward += rw.solved + rw.efficiency * min(1.0, self.n_blanks / self.steps)
    return reward

  def coerce_actions(self, raw: list[Any]) -> tuple[tuple[int, int, int], ...] | None:
    n = self.size
    if len(raw) == n and all(isinstance(row, list) and len(row) == n and all(map(_is_int, row))
                             for row in raw):
      return tuple((r, c, v) for r, row in enumerate(raw) for c, v in enumerate(row) if v)
    if all(isinstance(t, list) and len(t) == 3 and all(map(_is_int, t)) for t in raw):
      return tuple(tuple(t) for t in raw)
    return None

  def _grid_text(self, cells: tuple[int, ...]) -> str:
    n = self.size
    return "\n".join("".join(str(v) if v else "." for v in cells[r * n:(r + 1) * n])
                     for r in range(n))

  def render(self) -> str:
    text = self._grid_text(self.grid)
    if self.grid != self.givens:  # show what is fixed once the agents have written digits.
      text += "\ngivens:\n" + self._grid_text(self.givens)
    return text

  def rules(self) -> str:
    n, b = self.size, self.box
    return (f"Sudoku {n}x{n}: fill every '.' with a digit 1-{n} so that each row, column and "
            f"{b}x{b} box holds every digit once. Rows and columns are 0-based. Given digits are "
            "fixed; digits you placed may be overwritten. Action list: [row, col, digit] fills, "
            f"e.g. [[0, 2, 3], [1, 0, 4]], or the complete grid as a list of {n} rows.")

  def oracle(self) -> list[tuple[int, int, int]]:
    n = self.size
    return [(i // n, i % n, v) for i, v in enumerate(self.solution) if self.grid[i] != v]


def generate(seed: int, *, size: int = 4, max_blanks: int | None = None,
             max_steps: int | None = None, rewards: SudokuRewards = SudokuRewards()) -> Sudoku:
  """The puzzle of `seed` (same seed and size -> same puzzle), with a unique solution."""
  rng = random.Random(check_seed(seed))
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size}")
  puzzle = list(solve([0] * size * size, size, limit=1, rng=rng)[0])
  order = list(range(size * size))
  rng.shuffle(order)
  blanks = 0
  for i in order:
    if max_blanks is not None and blanks >= max_blanks:
      break
    digit, puzzle[i] = puzzle[i], 0
    if len(solve(puzzle, size, limit=2)) == 1:
      blanks += 1
    else:
      puzzle[i] = digit
  rows = [puzzle[r * size:(r + 1) * size] for r in range(size)]
  return Sudoku(rows, max_steps=max_steps, rewards=rewards)


def make_env(*, seed: int, mode: str = "mas", max_turns: int = 4, prompt: str = "full",
             **config: Any) -> GameEnv:
  """Registry factory: `config` goes to `generate` (size, max_blanks, ...); `prompt` is the prompt
  style (`prompts.STYLES`)."""
  return GameEnv(generate(seed, **config), mode=mode, max_turns=max_turns, prompt=prompt)
