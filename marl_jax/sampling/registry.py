"""The rollout engines by name (`config.rollout.engine`): one line per engine (`engine.py`)."""

from __future__ import annotations

from collections.abc import Callable

from marl_jax.models.config import ModelConfig
from marl_jax.sampling.continuous import ContinuousEngine
from marl_jax.sampling.engine import EngineOptions, RolloutEngine, Tokenizer
from marl_jax.sampling.static import StaticEngine

ENGINES: dict[str, Callable[[ModelConfig, Tokenizer | None, EngineOptions], RolloutEngine]] = {
    "static": lambda c, t, o: StaticEngine(c, t, top_candidates=o.top_candidates),
    "continuous": ContinuousEngine,
}


def make_engine(name: str, config: ModelConfig, tokenizer: Tokenizer | None = None,
                options: EngineOptions = EngineOptions()) -> RolloutEngine:
  """The engine `name` for one model architecture; unknown names are refused in one line."""
  if name not in ENGINES:
    raise ValueError(f"rollout.engine={name!r}; expected one of {sorted(ENGINES)}")
  return ENGINES[name](config, tokenizer, options)
