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
  """An engine-backed policy (`reseed`, `serve`) whose replies also advance `bar`: an
  evaluation's progress."""

  def __init__(self, policy: Any, bar: tqdm):
    self.policy, self.bar = policy, bar

  def reseed(self, key: Any, version: int = 0) -> None:
    self.policy.reseed(key, version)

  def serve(self, params: Any) -> _Counted:
    return _Counted(self.policy.serve(params), self.bar)


class _Counted:
  """A Responder (`workflows/rollout.py`) that counts the replies it hands back on `bar`."""

  def __init__(self, responder: Any, bar: tqdm):
    self.responder, self.bar, self.streams = responder, bar, responder.streams

  @property
  def pending(self) -> int:
    return self.responder.pending

  def submit(self, tickets: Sequence[Any]) -> None:
    self.responder.submit(tickets)

  def collect(self) -> list[Any]:
    replies = self.responder.collect()
    self.bar.update(len(replies))
    return replies
