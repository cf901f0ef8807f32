"""AT-GRPO games: generators (checked by independent solvers written here), rewards on hand-made
instances, oracles, random play, clones and the agent-keyed reward bookkeeping."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from marl_jax.envs.games import plan_path
from marl_jax.envs.games import sokoban
from marl_jax.envs.games import sudoku
from marl_jax.envs.games import base
from marl_jax.envs.games.base import FORMAT_PENALTY
from marl_jax.envs.games.env import GameEnv
from marl_jax.workflows import registry

N_SEEDS = 1000
GAMES = {"plan_path": plan_path, "sokoban": sokoban, "sudoku": sudoku}
DIRS = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


# ---------------------------------------------------------------- independent reference solvers

def grid_distance(rows, start, goal):
  """Shortest path length by NumPy distance relaxation (not BFS); None when unreachable."""
  free = np.array([[ch == "." for ch in row] for row in rows])
  dist = np.full(free.shape, np.inf)
  dist[start] = 0
  while True:
    padded = np.pad(dist, 1, constant_values=np.inf)
    neighbours = np.minimum.reduce([padded[:-2, 1:-1], padded[2:, 1:-1],
                                    padded[1:-1, :-2], padded[1:-1, 2:]])
    new = np.where(free, np.minimum(dist, neighbours + 1), np.inf)
    if np.array_equal(new, dist):
      return None if np.isinf(dist[goal]) else int(dist[goal])
    dist = new


def sokoban_solvable(rows):
  """Depth-first search over pushes, the player abstracted to its reachable region."""
  walls, boxes, targets, player = set(), set(), set(), None
  for r, row in enumerate(rows):
    for c, ch in enumerate(row):
      if ch == "#":
        walls.add((r, c))
      if ch in "$*":
        boxes.add((r, c))
      if ch in ".*+":
        targets.add((r, c))
      if ch in "@+":
        player = (r, c)
  h, w = len(rows), len(rows[0])
  open_cell = lambda p: 0 <= p[0] < h and 0 <= p[1] < w and p not in walls

  def region(p, bxs):
    seen, stack = {p}, [p]
    while stack:
      q = stack.pop()
      for dr, dc in DIRS.values():
        n = (q[0] + dr, q[1] + dc)
        if open_cell(n) and n not in bxs and n not in seen:
          seen.add(n)
          stack.append(n)
    return seen

  seen_states, stack = set(), [(player, frozenset(boxes))]
  while stack:
    p, bxs = stack.pop()
    reach = region(p, bxs)
    key = (min(reach), bxs)
    if key in seen_states:
      continue
    seen_states.add(key)
    if bxs <= targets:
      return True
    for b in bxs:
      for dr, dc in DIRS.values():
        behind, ahead = (b[0] - dr, b[1] - dc), (b[0] + dr, b[1] + dc)
        if behind in reach and open_cell(ahead) and ahead not in bxs:
          stack.append((b, (bxs - {b}) | {ahead}))
  return False


def all_4x4_grids():
  """Every valid 4x4 Sudoku grid (288 of them), by enumerating rows as permutations."""
  perms = list(itertools.permutations(range(1, 5)))
  grids = []

  def ok(rows):
    cols = list(zip(*rows))
    if any(len(set(col)) != len(col) for col in cols):
      return False
    for br in range(0, len(rows), 2):
      for bc in (0, 2):
        box = [rows[r][c] for r in range(br, min(br + 2, len(rows))) for c in (bc, bc + 1)]
        if len(set(box)) != len(box):
          return False
    return True

  def extend(rows):
    if len(rows) == 4:
      grids.append(sum(rows, ()))
      return
    for p in perms:
      if ok(rows + [p]):
        extend(rows + [p])

  extend([])
  return np.array(grids)


def count_sudoku_solutions(puzzle, limit=2):
  """Plain set-based backtracking on the cell with fewest candidates (9x9 check)."""
  n, b = len(puzzle), int(len(puzzle) ** 0.5)
  grid = [list(row) for row in puzzle]

  def candidates(r, c):
    used = set(grid[r]) | {grid[i][c] for i in range(n)}
    used |= {grid[i][j] for i in range(r - r % b, r - r % b + b)
             for j in range(c - c % b, c - c % b + b)}
    return set(range(1, n + 1)) - used

  def count():
    empty = [(r, c) for r in range(n) for c in range(n) if grid[r][c] == 0]
    if not empty:
      return 1
    r, c = min(empty, key=lambda rc: len(candidates(*rc)))
    total = 0
    for v in candidates(r, c):
      grid[r][c] = v
      total += count()
      grid[r][c] = 0
      if total >= limit:
        break
    return total

  return count()


# ---------------------------------------------------------------- generators over 1,000 seeds

@pytest.fixture(scope="module")
def instances():
  return {name: [mod.generate(s) for s in range(N_SEEDS)] for name, mod in GAMES.items()}


@pytest.mark.parametrize("name", list(GAMES))
def test_same_seed_same_instance_and_seeds_differ(instances, name):
  keys = [g.render() for g in instances[name]]  # a fresh instance's state is the instance
  assert keys == [GAMES[name].generate(s).render() for s in range(N_SEEDS)]
  distinct = len(set(keys)) / N_SEEDS
  # 6x6 rooms with one box are a small space: a few seeds collide.
  assert distinct >= (0.93 if name == "sokoban" else 0.97), distinct
  assert sum(a != b for a, b in zip(keys, keys[1:])) >= 0.97 * (N_SEEDS - 1)


def test_plan_path_instances_solvable(instances):
  for g in instances["plan_path"]:
    assert g.height == g.width == 10 and sum(row.count("#") for row in g.rows) == 22
    assert g.start != g.goal and g.rows[g.start[0]][g.start[1]] == "."
    dist = grid_distance(g.rows, g.start, g.goal)
    assert dist is not None and dist == g.optimal_steps == len(g.oracle())


def test_sokoban_instances_solvable(instances):
  for g in instances["sokoban"]:
    rows = g.render().split("\n")
    assert len(rows) == 6 and all(len(r) == 6 for r in rows)
    assert sum(r.count("$") for r in rows) == 1 and not g.solved
    assert all(r[0] == r[-1] == "#" for r in rows) and rows[0] == rows[-1] == "######"
    assert sokoban_solvable(rows)


def test_sudoku_instances_unique(instances):
  grids = all_4x4_grids()
  assert len(grids) == 288
  for g in instances["sudoku"]:
    puzzle = np.array(g.givens)
    matches = ((grids == puzzle) | (puzzle == 0)).all(axis=1)
    assert matches.sum() == 1
    np.testing.assert_array_equal(grids[matches][0], g.solution)


def test_configured_sizes():
  g = plan_path.generate(3, height=5, width=7, block_ratio=0.3)
  assert (g.height, g.width) == (5, 7) and sum(r.count("#") for r in g.rows) == round(0.3 * 35)
  assert grid_distance(g.rows, g.start, g.goal) == g.optimal_steps
  for seed in range(20):
    room = sokoban.generate(seed, height=7, width=7, num_boxes=2)
    rows = room.render().split("\n")
    assert sum(r.count("$") + r.count("*") for r in rows) == 2 and sokoban_solvable(rows)
    assert room.clone().step(room.oracle()).solved
  for seed in range(3):
    big = sudoku.generate(seed, size=9)
    puzzle = [big.givens[r * 9:(r + 1) * 9] for r in range(9)]
    assert count_sudoku_solutions(puzzle) == 1
    assert big.clone().step(big.oracle()).solved
  assert sudoku.generate(0, max_blanks=6).n_blanks == 6


@pytest.mark.parametrize("call, match", [
    (lambda: registry.make_env("chess", seed=0), "unknown environment 'chess'"),
    (lambda: registry.make_env("sudoku", seed=-1), "non-negative"),
    (lambda: registry.make_env("sudoku", seed=0, mode="duo"), "unknown mode"),
    (lambda: sudoku.generate(0, size=16), "size must be one of"),
    (lambda: sudoku.Sudoku([[0] * 4] * 4), ">= 2 solutions"),
    (lambda: plan_path.PlanPath(["..#", "..#", "##."], (0, 0), (2, 2)), "unreachable"),
    (lambda: plan_path.PlanPath(["..", ".."], (0, 0), (5, 5)), "not a free cell"),
    (lambda: sokoban.Sokoban(["#@$#"]), "as many boxes as targets"),
    (lambda: plan_path.generate(0, block_ratio=1.5), "block_ratio"),
])
def test_bad_arguments_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ---------------------------------------------------------------- hand-computed rewards

def test_plan_path_rewards():
  rows = ["...", ".#.", "..."]
  game = plan_path.PlanPath(rows, (0, 0), (2, 2))
  out = game.clone().step(("R", "R", "D", "D"))
  # phi = -manhattan; step -0.01 + (0.99 phi' - phi); last move +1 goal +0.5 shortest.
  assert out.move_rewards == pytest.approx((1.02, 1.01, 1.00, 0.99 + 1.5))
  assert out.reward == pytest.approx(5.52) and out.solved and out.done
  out = game.clone().step(("R", "D", "U", "X", "R", "D", "D", "L"))
  # invalid: -0.10 + (0.99 - 1) * phi = -0.07 at distance 3; no shortest bonus; L dropped.
  assert out.move_rewards == pytest.approx((1.02, -0.07, -0.07, -0.07, 1.01, 1.00, 1.99))
  assert game.step(None).reward == -1.0 and game.steps == 0
  capped = plan_path.PlanPath(rows, (0, 0), (2, 2), max_steps=2)
  assert capped.step(("L", "L", "R")).move_rewards == pytest.approx((-0.06, -0.06))  # distance 4
  assert capped.done and not capped.solved


def test_sokoban_rewards():
  game = sokoban.Sokoban(["#######", "#@_$_.#", "#######"])
  out = game.clone().step(("R", "R", "R"))
  # walk: -0.01 + 0.1*(0.99*(-2) + 2); push: phi -2 -> -1; push onto target +1, win +10.
  assert out.move_rewards == pytest.approx((-0.008, 0.091, -0.01 + 1.0 + 0.1 + 10.0))
  assert out.solved and game.clone().step(("U",)).reward == pytest.approx(-0.048)
  two = sokoban.Sokoban(["#######", "#@*_$.#", "#######"])
  # push a box off its target: -0.01 - 0.5 + 0.1*(0.99*(-2) - (-1)).
  assert two.clone().step(("R",)).reward == pytest.approx(-0.608)
  # a box pushed into a box is blocked: invalid -0.05 + 0.1*(0.99*(-2) + 2).
  assert two.clone().step(("R", "R")).move_rewards[1] == pytest.approx(-0.048)
  capped = sokoban.Sokoban(["#######", "#@_$_.#", "#######"], max_steps=2)
  assert capped.step(("L", "L", "R")).move_rewards == pytest.approx((-0.048, -5.048))
  assert capped.done and not capped.solved
  assert sokoban.Sokoban(["#####", "#@$.#", "#####"]).step(None).reward == -1.0


SOLUTION = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
PUZZLE = [[0, 0, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]


def test_sudoku_rewards():
  game = sudoku.Sudoku(PUZZLE)
  assert game.n_blanks == 2 and game.solution == tuple(sum(SOLUTION, []))
  out = game.clone().step(((0, 0, 1), (0, 1, 2)))
  # -0.01 + progress 1/2; the last one also +2 solved + 0.5 * min(1, 2 blanks / 2 moves).
  assert out.move_rewards == pytest.approx((0.49, 0.49 + 2.5)) and out.solved
  g = game.clone()
  out = g.step(((0, 0, 2), (0, 1, 1), (0, 0, 1), (0, 1, 2)))
  # conflicts: +1 (col 0), +1 (col 1), then row+box dup +2 col -1, then -3; efficiency 2/4.
  assert out.move_rewards == pytest.approx((0.39, 0.39, -0.11, -0.01 + 0.3 + 2.0 + 0.25))
  assert g.solved and g.conflicts == 0 and g.steps == 4
  g = game.clone()
  out = g.step(((0, 2, 1), (0, 2, 3), (4, 0, 1), (0, 0, 5), (0, 0, 1), (0, 0, 1), (0, 1, 2)))
  # changing a given, out of range: -0.1 each; rewriting a held digit: 0 and not counted.
  assert out.move_rewards == pytest.approx((-0.1, 0.0, -0.1, -0.1, 0.49, 0.0,
                                            0.49 + 2.0 + 0.5 * 2 / 5))
  assert g.steps == 5
  full = game.clone()
  assert full.step(full.coerce_actions(SOLUTION)).reward == pytest.approx(3.48)
  assert full.steps == 2 and game.step(None).reward == -1.0


# ---------------------------------------------------------------- oracles, random play, clones

@pytest.mark.parametrize("name", list(GAMES))
def test_oracle_solves_every_seed(name):
  for seed in range(100):
    game = GAMES[name].generate(seed)
    out = game.step(game.oracle())
    assert out.solved and out.done and out.reward > 0
    if name == "plan_path":
      assert out.move_rewards[-1] > 1.5 - 1e-9  # shortest-path bonus earned


@pytest.mark.parametrize("name", list(GAMES))
@pytest.mark.parametrize("mode", ["mas", "single"])
def test_scripted_oracle_through_env(name, mode):
  for seed in range(100):
    env = registry.make_env(name, seed=seed, mode=mode)
    answer = "Reasoning...\n#### " + env.game.format_actions(env.game.oracle())
    if mode == "mas":
      code = "```python\nprint('**Actions List**:', moves)\n```"
      tool = env.step("tool", code, tool_output="**Actions List**: " +
                      env.game.format_actions(env.game.oracle()))
      assert tool.rewards["tool"] > 0 and tool.info["solved_on_clone"] and not env.game.steps
      assert "print('**Actions List**:', moves)" in env.observe("plan").user
      res = env.step("plan", answer)
      assert res.rewards == {"plan": 2 * res.info["env_reward"], "tool": res.info["env_reward"]}
    else:
      res = env.step("solver", answer)
      assert res.rewards == {"solver": res.info["env_reward"]}
    assert res.done and env.solved and res.info["env_reward"] > 0


@pytest.mark.parametrize("name", list(GAMES))
def test_random_policy_scores_low(name):
  rng = random.Random(0)
  solved, random_total, oracle_total = 0, 0.0, 0.0
  for seed in range(100):
    env = registry.make_env(name, seed=seed, mode="single")
    oracle_game = env.game.clone()
    oracle_total += oracle_game.step(oracle_game.oracle()).reward
    while not env.done:
      if name == "sudoku":
        n = env.game.size
        moves = [[rng.randrange(n), rng.randrange(n), rng.randint(1, n)] for _ in range(10)]
      else:
        moves = [rng.choice("UDLR") for _ in range(10)]
      random_total += env.step("solver", "#### " + json.dumps(moves)).rewards["solver"]
    solved += env.solved
  assert solved <= 25 and random_total < 0.35 * oracle_total, (solved, random_total, oracle_total)


@pytest.mark.parametrize("name", list(GAMES))
def test_clone_is_independent(name):
  game = GAMES[name].generate(5)
  before, clone = game.render(), game.clone()
  clone.step(clone.oracle())
  assert clone.solved and not game.solved and game.render() == before and game.steps == 0
  game.step(game.oracle()[:1])
  assert game.steps == 1 and clone.render() != game.render()
  env = registry.make_env(name, seed=5)
  env.step("tool", "", tool_output="**Actions List**: []")
  branch = env.clone()
  branch.step("plan", "#### " + env.game.format_actions(env.game.oracle()))
  assert branch.solved and branch.turn == 1 and len(branch.history) == 1
  assert not env.solved and env.turn == 0 and env.history == () and env.tool_record is not None
  assert env.game.render() == registry.make_env(name, seed=5).game.render()


# ---------------------------------------------------------------- agent-keyed bookkeeping

def test_two_agent_rewards_by_hand():
  env = GameEnv(plan_path.PlanPath(["...", ".#.", "..."], (0, 0), (2, 2)), max_turns=2)
  tool = env.step("tool", "```python\nprint(1)\n```", tool_output='**Actions List**: ["R", "R"]')
  assert tool.rewards == {"tool": pytest.approx(2.03)} and env.game.pos == (0, 0)
  plan = env.step("plan", '#### ["R", "R", "D", "D"]')
  assert plan.rewards == {"plan": pytest.approx(11.04), "tool": pytest.approx(5.52)}
  assert plan.done and env.solved
  assert base.own_term(("R", "R"), 2.03) + 5.52 == pytest.approx(7.55)  # tool: own + shared
  assert base.plan_reward(("R",), 5.52) == pytest.approx(11.04)
  assert base.own_term((), 0.0) + 1.0 == FORMAT_PENALTY + 1.0
  assert base.plan_reward(None, -1.0) == FORMAT_PENALTY
  reward, branch = base.evaluate_actions(env.game, ("L",))
  assert reward == 0.0 and branch is not env.game and branch.steps == 4  # done: no move


def test_empty_actions_and_turn_limit():
  env = registry.make_env("plan_path", seed=0, max_turns=2)
  res = env.step("tool", "no code", tool_output="**Actions List**: []")
  assert res.actions == () and res.rewards == {"tool": FORMAT_PENALTY}
  res = env.step("plan", "#### []")
  assert res.rewards == {"plan": FORMAT_PENALTY, "tool": 0.0} and not res.done
  assert "Last turn's actions: []" in env.observe("tool").user
  res = env.step("plan", "#### [\"U\"]")  # a plan step without a tool step: no tool reward
  assert set(res.rewards) == {"plan"} and res.done and env.turn == 2
  with pytest.raises(ValueError, match="finished episode"):
    env.step("plan", "#### []")
  with pytest.raises(ValueError, match="unknown agent 'solver'"):
    registry.make_env("sudoku", seed=0).step("solver", "")
  with pytest.raises(ValueError, match="tool_output"):
    registry.make_env("sudoku", seed=0).step("tool", "```python\n```")


@pytest.mark.parametrize("name", list(GAMES))
def test_prompts_are_compact_and_complete(name):
  env = registry.make_env(name, seed=2)
  obs = env.observe("tool")
  assert env.game.render() in obs.user and "**Actions List**" in obs.system
  assert obs.messages()[0]["role"] == "system" and obs.turn == 0
  assert len(env.game.render()) < 160
  flood = "x" * 1_000_000
  env.step("tool", "```python\n" + flood + "\n```", tool_output=flood)
  plan = env.observe("plan")
  assert "####" in plan.system and "Parsed actions: none" in plan.user and len(plan.user) < 10_000
  single = registry.make_env(name, seed=2, mode="single").observe("solver")
  assert "####" in single.system and env.game.rules() in single.user
  assert env.game.render().count("\n") >= 3  # one line per grid row


@pytest.mark.parametrize("name", list(GAMES))
def test_compact_prompts_keep_the_state_and_the_tool_output(name):
  """The compact style: short system prompts and rules, the same state; the plan agent sees the
  tool's output and parsed actions but not its program."""
  full = registry.make_env(name, seed=2)
  env = registry.make_env(name, seed=2, prompt="compact")
  tool, long_tool = env.observe("tool"), full.observe("tool")
  assert env.game.render() in tool.user and "**Actions List**" in tool.system
  assert env.game.short_rules() in tool.user
  assert len(tool.system) + len(tool.user) < len(long_tool.system) + len(long_tool.user)
  answer = env.game.format_actions(env.game.oracle())
  env.step("tool", "```python\nprint(SECRET_PROGRAM_TEXT)\n```",
           tool_output="**Actions List**: " + answer)
  plan = env.observe("plan")
  assert "SECRET_PROGRAM_TEXT" not in plan.user and "####" in plan.system
  assert "**Actions List**: " + answer in plan.user and f"Parsed actions: {answer}" in plan.user
  with pytest.raises(ValueError, match="unknown prompt style 'tiny'"):
    registry.make_env(name, seed=2, prompt="tiny")


# ---------------------------------------------------------------- demonstrations (warm-start)

def test_plan_path_demonstrations_solve_through_the_sandbox():
  """The tool agent's demonstration is a search program: run in the sandbox on random grids of
  both sizes (start, goal and walls only in the program's text), it prints the oracle's path, and
  the plan agent's demonstration then solves the episode."""
  from marl_jax.envs import actions
  from marl_jax.sandbox import runner
  envs = [registry.make_env("plan_path", seed=seed, max_turns=1, **size)
          for seed in range(6) for size in ({}, dict(height=4, width=4))]
  programs = [actions.extract_code(env.demonstration("tool")) for env in envs]
  assert all("deque" in p and "oracle" not in p for p in programs)
  results = runner.run_many(programs, timeout_s=10.0, memory_mb=256)
  for env, result in zip(envs, results):
    assert result.ok, result.error
    want = env.game.oracle()
    assert actions.parse_tool_output(result.stdout) == want
    assert json.dumps(want) not in env.demonstration("tool").replace("'", '"')  # searched
    env.step("tool", env.demonstration("tool"), tool_output=result.stdout)
    assert env.demonstration("plan") == "#### " + json.dumps(want)
    assert env.step("plan", env.demonstration("plan")).done and env.solved


def test_games_without_a_solver_program_demonstrate_no_tool_reply():
  for name in ("sokoban", "sudoku"):
    env = registry.make_env(name, seed=0)
    assert env.demonstration("tool") is None
    assert env.demonstration("plan") == "#### " + env.game.format_actions(env.game.oracle())
  with pytest.raises(ValueError, match="unknown agent 'solver'"):
    registry.make_env("plan_path", seed=0).demonstration("solver")
