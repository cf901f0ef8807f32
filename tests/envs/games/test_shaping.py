"""Potential-based shaping: the papers' undiscounted sum (the default) pays cycles; the
"discounted" option telescopes, so oscillating or stalling never beats reaching the goal."""

from __future__ import annotations

import pytest

from configs import atgrpo_plan_path
from marl_jax.envs.games import plan_path, sokoban
from marl_jax.envs.games.base import potential_term
from marl_jax.errors import UserInputError
from marl_jax.training import preflight

BACK = {"U": "D", "D": "U", "L": "R", "R": "L"}
SEED = 2  # a 4x4 instance whose goal is 6 moves away (the grid's longest shortest path)


def _game(shaping: str) -> plan_path.PlanPath:
  game = plan_path.generate(SEED, height=4, width=4, shaping=shaping)
  assert game.optimal_steps == 6
  return game


def _return(game, moves) -> float:
  branch = game.clone()
  return branch.step(moves).reward


def _oscillation(game, moves: int) -> list[str]:
  first = game.oracle()[0]
  return [first, BACK[first]] * (moves // 2)


def test_paper_shaping_pays_the_oscillation_more_than_the_optimal_plan():
  """The measured exploit the README documents: the default keeps the papers' formula."""
  game = _game("paper")
  optimal = _return(game, game.oracle())
  assert optimal == pytest.approx(7.59)
  assert _return(game, _oscillation(game, game.max_steps)) == pytest.approx(9.0)


@pytest.mark.parametrize("moves", [2, 20, 100, 200])
def test_discounted_shaping_no_oscillation_beats_the_optimal_plan(moves):
  game = _game("discounted")
  optimal = _return(game, game.oracle())
  oscillation = _oscillation(game, moves)
  assert _return(game, oscillation) < optimal
  assert _return(game, oscillation + game.oracle()) < optimal  # a detour before the goal
  assert _return(game, ["X"] * moves) < optimal  # invalid moves in place


def test_discounted_shaping_telescopes():
  """Summed over any moves, the discounted terms are lambda (gamma^T phi_T - phi_0) (the rest of
  each move's reward is the papers': step or invalid cost)."""
  game = _game("discounted")
  rw = game.rewards
  moves = _oscillation(game, 36) + ["X", "L", "L", "U"]
  branch = game.clone()
  outcome = branch.step(moves)
  costs = 0.0
  replay = game.clone()
  for move in moves:
    before = replay.pos
    replay.step([move])
    costs += rw.step if replay.pos != before else rw.invalid
  d0 = sum(abs(a - b) for a, b in zip(game.start, game.goal))
  d_end = sum(abs(a - b) for a, b in zip(branch.pos, game.goal))
  telescoped = rw.lambda_pot * (rw.gamma ** len(moves) * -d_end - -d0)
  assert not branch.solved
  assert outcome.reward == pytest.approx(costs + telescoped)


def test_potential_term_modes():
  assert potential_term("paper", 1.0, 0.99, -3.0, -3.0, 50) == pytest.approx(0.03)
  assert potential_term("discounted", 1.0, 0.99, -3.0, -3.0, 50) == pytest.approx(
      0.03 * 0.99 ** 50)
  with pytest.raises(ValueError,
                     match=r"shaping='nope'; expected one of \['paper', 'discounted'\]"):
    plan_path.generate(0, shaping="nope")


def test_sokoban_discounted_shaping_stalls_pay_nothing_more():
  paper = sokoban.generate(0, shaping="paper")
  discounted = sokoban.generate(0, shaping="discounted")
  stall = ["X"] * 100  # invalid moves in place, far from the targets
  gain = lambda g: g.clone().step(stall).reward - 100 * g.rewards.invalid
  assert gain(paper) > 0  # (1 - gamma) * |phi| * lambda per stalled move
  assert 0 < gain(discounted) < paper.rewards.lambda_pot * sokoban.box_distance(
      discounted.boxes, discounted.targets)


def test_the_option_reaches_the_env_from_the_config(tmp_path):
  c = atgrpo_plan_path.get_config("cpu")
  assert c.env.kwargs.shaping == "paper"
  c.model = str(tmp_path)
  c.env.kwargs.shaping = "discounted"
  preflight.check(c, str(tmp_path / "run"))
  c.env.kwargs.shaping = "undiscounted"
  with pytest.raises(UserInputError, match="shaping='undiscounted'; expected one of"):
    preflight.check(c, str(tmp_path / "run"))
