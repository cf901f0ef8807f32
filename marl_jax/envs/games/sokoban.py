"""Sokoban: push every box onto a target (AT-GRPO, docs/papers.md section 1).

Generation by reverse play (the idea of Schrader's gym-sokoban / Boxoban, written afresh):
  1. topology: a random walk of `num_steps` (25) steps through the interior of an all-wall room,
     turning with probability `p_change` (0.35), carving a small random stamp at each step;
  2. targets on random floor cells, boxes on the targets;
  3. reverse play: breadth-first over reverse moves (walk, or walk while pulling the box behind
     you) from every player cell, up to `search_depth` (200) moves. Every state reached can be
     played forward back to the solved one, so every room is solvable;
  4. keep the states whose boxes lie farthest (sum of distances to the nearest target) and pick
     one at random; a topology whose boxes cannot get `min_box_distance` (2) away is redrawn
     (the public generator's minimum too: it drops trivial one-push rooms).

Reward of one move (U/D/L/R; any other move string is an invalid move):
  -0.01 if it moves, -0.05 if invalid (wall, off grid, box blocked, unknown); the player then stays;
  + 1.0 when a push puts a box onto a target, -0.5 when a push takes one off;
  + lambda * (gamma * phi' - phi), phi = -sum over boxes of the distance to the nearest target,
    lambda 0.1, gamma 0.99 (shaping "paper"; "discounted" as in plan_path.py);
  + 10 on solving (episode ends); -5 when the `max_steps`-th (200th) move ends the episode unsolved.
An unparseable action list costs -1.0 (format penalty).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Iterable, Sequence
from typing import Any

from marl_jax.envs.base import check_int, check_seed
from marl_jax.envs.games.base import MAX_SIDE, MAX_STEPS, Game, check_shaping, potential_term
from marl_jax.envs.games.env import GameEnv
from marl_jax.envs.games.plan_path import MOVES, coerce_moves

Cell = tuple[int, int]
_STAMPS = (((0, 0),), ((0, 0), (0, 1)), ((0, 0), (1, 0)), ((0, 0), (0, 1), (1, 0), (1, 1)),
           ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1)))
_MAX_TRIES = 1_000
MAX_BOXES = 4  # room generation's reverse search grows fast with boxes (4: ~0.3-7 s)
# Render symbols: floor is '_' rather than ' ' so that rows keep their width through tokenizers.
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#_.$*@+"
_SYMBOLS = "#_ .$*@+"  # ' ' is read as floor too.


@dataclasses.dataclass(frozen=True)
class SokobanRewards:
  step: float = -0.01
  invalid: float = -0.05
  box_on_target: float = 1.0
  box_off_target: float = -0.5
  win: float = 10.0
  fail: float = -5.0
  gamma: float = 0.99
  lambda_pot: float = 0.1
  format_penalty: float = -1.0
  shaping: str = "paper"  # games.base.SHAPINGS

  def __post_init__(self):
    check_shaping(self.shaping)


def _add(cell: Cell, delta: Cell) -> Cell:
  return (cell[0] + delta[0], cell[1] + delta[1])


def box_distance(boxes: Iterable[Cell], targets: Iterable[Cell]) -> int:
  """Sum over boxes of the Manhattan distance to the nearest target (-phi)."""
  targets = tuple(targets)
  return sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in targets) for b in boxes)


def solve(floor: frozenset[Cell], targets: frozenset[Cell], boxes: frozenset[Cell],
          player: Cell, max_states: int = 200_000) -> list[str] | None:
  """Fewest-moves solution by BFS over (player, boxes); None if unsolvable (or too large)."""
  start = (player, boxes)
  parent: dict[Any, Any] = {start: None}
  queue = collections.deque([start])
  while queue:
    state = queue.popleft()
    pos, bxs = state
    if bxs <= targets:
      path = []
      while parent[state] is not None:
        state, move = parent[state]
        path.append(move)
      return path[::-1]
    for move, delta in MOVES.items():
      nxt = _add(pos, delta)
      if nxt not in floor:
        continue
      new_boxes = bxs
      if nxt in bxs:
        dest = _add(nxt, delta)
        if dest not in floor or dest in bxs:
          continue
        new_boxes = (bxs - {nxt}) | {dest}
      new_state = (nxt, new_boxes)
      if new_state not in parent:
        parent[new_state] = (state, move)
        queue.append(new_state)
        if len(parent) > max_states:
          return None
  return None


def render_rows(height: int, width: int, floor: frozenset[Cell], targets: frozenset[Cell],
                boxes: frozenset[Cell], player: Cell) -> list[str]:
  rows = []
  for r in range(height):
    row = []
    for c in range(width):
      cell, on_target = (r, c), (r, c) in targets
      if cell not in floor:
        row.append(WALL)
      elif cell == player:
        row.append(PLAYER_ON_TARGET if on_target else PLAYER)
      elif cell in boxes:
        row.append(BOX_ON_TARGET if on_target else BOX)
      else:
        row.append(TARGET if on_target else FLOOR)
    rows.append("".join(row))
  return rows


class Sokoban(Game):
  """One room, given as rows of the render symbols (' ' is accepted for floor). Cells outside
  the rows are walls."""

  name = "sokoban"

  def __init__(self, rows: Sequence[str], *, max_steps: int = 200,
               rewards: SokobanRewards = SokobanRewards()):
    rows = tuple(rows)
    if not rows or any(len(r) != len(rows[0]) for r in rows):
      raise ValueError(f"rows must be a non-empty rectangle, got {rows!r}")
    unknown = {ch for row in rows for ch in row} - set(_SYMBOLS)
    if unknown:
      raise ValueError(f"unknown symbols {sorted(unknown)} in {rows!r}; expected {_SYMBOLS!r}")
    cells = {sym: frozenset((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row)
                            if ch == sym) for sym in _SYMBOLS}
    players = cells[PLAYER] | cells[PLAYER_ON_TARGET]
    if len(players) != 1:
      raise ValueError(f"need exactly one player ('@' or '+'), found {len(players)} in {rows!r}")
    self.height, self.width = len(rows), len(rows[0])
    self.floor = frozenset((r, c) for r in range(self.height) for c in range(self.width)) \
        - cells[WALL]
    self.targets = cells[TARGET] | cells[BOX_ON_TARGET] | cells[PLAYER_ON_TARGET]
    self.boxes = cells[BOX] | cells[BOX_ON_TARGET]
    if not self.boxes or len(self.boxes) != len(self.targets):
      raise ValueError(f"need as many boxes as targets (>= 1), got {len(self.boxes)} boxes and "
                       f"{len(self.targets)} targets")
    (self.player,) = players
    self.max_steps = max_steps
    self.rewards = rewards
    self.format_penalty = rewards.format_penalty
    self.steps = 0

  @property
  def solved(self) -> bool:
    return self.boxes <= self.targets

  def _move(self, move: str) -> float:
    rw = self.rewards
    phi = -box_distance(self.boxes, self.targets)
    delta = MOVES.get(move)
    nxt = _add(self.player, delta) if delta else self.player
    reward = rw.invalid
    if delta is not None and nxt in self.floor:
      if nxt not in self.boxes:
        self.player, reward = nxt, rw.step
      else:
        dest = _add(nxt, delta)
        if dest in self.floor and dest not in self.boxes:
          self.boxes = (self.boxes - {nxt}) | {dest}
          self.player, reward = nxt, rw.step
          if dest in self.targets and nxt not in self.targets:
            reward += rw.box_on_target
          elif nxt in self.targets and dest not in self.targets:
            reward += rw.box_off_target
    reward += potential_term(rw.shaping, rw.lambda_pot, rw.gamma, phi,
                             -box_distance(self.boxes, self.targets), self.steps)
    self.steps += 1
    if self.solved:
      reward += rw.win
    elif self.steps >= self.max_steps:
      reward += rw.fail
    return reward

  def coerce_actions(self, raw: list[Any]) -> tuple[str, ...] | None:
    return coerce_moves(raw)

  def render(self) -> str:
    return "\n".join(render_rows(self.height, self.width, self.floor, self.targets, self.boxes,
                                  self.player))

  def rules(self) -> str:
    return (f"Sokoban in a {self.height}x{self.width} room. Rows top to bottom. Symbols: '#' wall, "
            "'_' floor, '.' target, '$' box, '*' box on target, '@' you, '+' you on a target. "
            "Moves: U (up), D (down), L (left), R (right). Walking into a box pushes it one cell "
            "if the cell behind it is free; boxes cannot be pulled. Solve by putting every box on "
            "a target; avoid pushing a box into a corner that is not a target. Action list "
            "example: [\"L\", \"U\", \"R\"]")

  def oracle(self) -> list[str] | None:
    return solve(self.floor, self.targets, self.boxes, self.player)


def _topology(rng: random.Random, height: int, width: int, num_steps: int,
              p_change: float) -> set[Cell]:
  interior = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
  pos = rng.choice(interior)
  direction = rng.choice(list(MOVES.values()))
  floor = {pos}
  for _ in range(num_steps):
    if rng.random() < p_change:
      direction = rng.choice(list(MOVES.values()))
    pos = (min(max(pos[0] + direction[0], 1), height - 2),
           min(max(pos[1] + direction[1], 1), width - 2))
    for offset in rng.choice(_STAMPS):
      cell = _add(pos, offset)
      if 0 < cell[0] < height - 1 and 0 < cell[1] < width - 1:
        floor.add(cell)
  return floor


def _reverse_play(floor: frozenset[Cell], targets: frozenset[Cell], search_depth: int,
                  min_box_distance: int) -> list[tuple[Cell, frozenset[Cell]]]:
  """All (player, boxes) states reachable from the solved room by reverse moves, farthest first.

  A reverse move walks the player to a free neighbour, optionally pulling the box that stood
  behind it into the cell it left; forward play undoes it with a push or a walk.
  """
  starts = [(p, targets) for p in sorted(floor - targets)]
  depth = {s: 0 for s in starts}
  queue = collections.deque(starts)
  while queue:
    state = queue.popleft()
    if depth[state] >= search_depth:
      continue
    pos, boxes = state
    for delta in MOVES.values():
      nxt = _add(pos, delta)
      if nxt not in floor or nxt in boxes:
        continue
      behind = (pos[0] - delta[0], pos[1] - delta[1])
      successors = [(nxt, boxes)]
      if behind in boxes:
        successors.append((nxt, (boxes - {behind}) | {pos}))
      for new_state in successors:
        if new_state not in depth:
          depth[new_state] = depth[state] + 1
          queue.append(new_state)
  best = max(box_distance(b, targets) for _, b in depth)
  if best < max(min_box_distance, 1):
    return []
  return [s for s in depth if box_distance(s[1], targets) == best]


def generate(seed: int, *, height: int = 6, width: int = 6, num_boxes: int = 1,
             num_steps: int = 25, p_change: float = 0.35, search_depth: int = 200,
             min_box_distance: int = 2, max_steps: int = 200,
             rewards: SokobanRewards = SokobanRewards(), shaping: str | None = None) -> Sokoban:
  """The room of `seed` (same seed and sizes -> same room); solvable by construction. `shaping`
  overrides `rewards.shaping` (`games.base.SHAPINGS`)."""
  if shaping is not None:
    rewards = dataclasses.replace(rewards, shaping=shaping)
  rng = random.Random(check_seed(seed))
  check_int("height", height, 3, MAX_SIDE)
  check_int("width", width, 3, MAX_SIDE)
  check_int("num_boxes", num_boxes, 1, MAX_BOXES)
  check_int("num_steps", num_steps, 1, MAX_STEPS)
  check_int("search_depth", search_depth, 1, MAX_STEPS)
  check_int("min_box_distance", min_box_distance, 0, 2 * MAX_SIDE)
  check_int("max_steps", max_steps, 1, MAX_STEPS)
  if not (isinstance(p_change, (int, float)) and 0.0 <= p_change <= 1.0):
    raise ValueError(f"p_change={p_change!r}; expected a number in [0, 1]")
  for _ in range(_MAX_TRIES):
    floor = frozenset(_topology(rng, height, width, num_steps, p_change))
    if len(floor) < 2 * num_boxes + 1:
      continue
    targets = frozenset(rng.sample(sorted(floor), num_boxes))
    candidates = _reverse_play(floor, targets, search_depth, min_box_distance)
    if not candidates:
      continue
    player, boxes = rng.choice(sorted(candidates, key=lambda s: (s[0], sorted(s[1]))))
    rows = render_rows(height, width, floor, targets, boxes, player)
    return Sokoban(rows, max_steps=max_steps, rewards=rewards)
  raise RuntimeError(f"no room with movable boxes in {_MAX_TRIES} tries "
                     f"({height}x{width}, {num_boxes} boxes, {num_steps} walk steps)")


def make_env(*, seed: int, mode: str = "mas", max_turns: int = 4, prompt: str = "full",
             **config: Any) -> GameEnv:
  """Registry factory: `config` goes to `generate` (height, width, num_boxes, ...); `prompt` is the prompt
  style (`prompts.STYLES`)."""
  return GameEnv(generate(seed, **config), mode=mode, max_turns=max_turns, prompt=prompt)
