"""The progress bar over training steps (tqdm), shown by process 0 only.

A resumed run's step bar starts at the restored step, so its rate and ETA count only the steps
this process runs.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tqdm.auto import tqdm

from marl_jax.training.metrics import to_scalar


def step_bar(total_steps: int, start_step: int = 0, *, enabled: bool = True) -> tqdm:
  """The outer bar over training steps `start_step + 1 .. total_steps`."""
  return tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
              disable=not enabled, dynamic_ncols=True, position=0)


def show_metrics(bar: tqdm, scalars: Mapping[str, Any], keys: tuple[str, ...] = ()) -> None:
  """Puts a few metrics (default: all) on the bar as `name=value`."""
  chosen = {k: v for k, v in scalars.items() if not keys or k in keys}
  bar.set_postfix({k: f"{to_scalar(k, v):.4g}" for k, v in chosen.items()}, refresh=False)
