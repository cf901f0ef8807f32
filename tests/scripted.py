"""Scripted policies that play the AT-GRPO games, to test the engine without a model.

They read the state a prompt was built from (`Request.env`) instead of the prompt text: they
exist to test the engine, tree sampling and rewards.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from marl_jax.workflows.rollout import Generation, Request


def _reply(request: Request, moves: Sequence[Any]) -> str:
  listing = request.env.game.format_actions(moves)
  if request.agent == "tool":
    return f"```python\nprint('**Actions List**: ' + {listing!r})\n```"
  return f"Following the plan.\n#### {listing}"


def oracle_generate(requests: Sequence[Request], policy_id: int, params: Any) -> list[Generation]:
  """Answers every prompt with the game's own solver (BFS / backtracking) from that state."""
  del policy_id, params
  return [Generation(_reply(r, r.env.game.oracle() or [])) for r in requests]


def make_random_generate(seed: int, moves: Sequence[Any], length: int = 10):
  """A policy that answers `length` moves drawn uniformly from `moves` (a weak baseline)."""
  rng = random.Random(seed)

  def generate(requests: Sequence[Request], policy_id: int, params: Any) -> list[Generation]:
    del policy_id, params
    return [Generation(_reply(r, [rng.choice(moves) for _ in range(length)])) for r in requests]

  return generate
