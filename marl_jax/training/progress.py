"""Progress bars (tqdm), shown by process 0 only: over training steps, and over the replies of
an evaluation.

A resumed run's step bar starts at the restored step, so its rate and ETA count only the steps
this process runs. An evaluation is one rollout of every episode, which reports nothing until
it ends, so its bar counts the replies its policy has returned (`CountedPolicy`); the number of
replies an episode takes is not known ahead, so that bar has no total.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def reply_bar(desc: str, *, enabled: bool = True) -> tqdm:
  """A bar counting the replies of `desc` (an evaluation), without a total."""
  return tqdm(desc=desc, unit=" replies", disable=not enabled, dynamic_ncols=True)


class CountedPolicy:
  """A policy (`reseed`, `generate`) whose replies also advance `bar`: an evaluation's
  progress."""

  def __init__(self, policy: Any, bar: tqdm):
    self.policy, self.bar = policy, bar

  def reseed(self, key: Any) -> None:
    self.policy.reseed(key)

  def generate(self, requests: Sequence[Any], policy_id: int, params: Any) -> Sequence[Any]:
    replies = self.policy.generate(requests, policy_id, params)
    self.bar.update(len(replies))
    return replies
