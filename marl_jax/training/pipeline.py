"""Asynchronous RL with bounded staleness (`config.train.max_staleness` = k > 0): a producer
thread rolls out while the learner updates.

    with Producer(run, first_step, steps, k) as producer:
      for step in ...: run.train_step(step, producer.take(step)); producer.publish(step + 1, ...)

Schedule. Version v is the params after v RL steps. Step s trains on a rollout sampled with
version max(first, s - k), `first` being the step the run (re)started at: with k = 1, rollout
s + 1 runs (with version s) while the learner computes step s's update, so neither waits for
the other when an update takes no longer than a rollout. The producer runs the rollouts in step
order, each as soon as its version is published; it never runs more than k rollouts ahead of
the learner, because the version a later rollout needs does not exist yet. The lag is fixed,
not "whatever is newest": which version serves a rollout never depends on timing, so an
asynchronous run is as reproducible as a synchronous one (per-request keys,
`training/llm_policy.py`), and in the steady state the newest version is the fixed lag's anyway
(the learner is waiting for rollouts, or they for it).

Weights only change between rollouts, so every episode, and every group, is served by a single
version: a group never mixes versions (each sample still records its own,
`Generation.policy_version`). The learner trains on a sample only if it is at most k versions
old (`admit`; an older one stays in its group's statistics without a token in the loss, as
`trainer.trained_samples` leaves out a sample) and corrects the lag by decoupled PPO: the
ratio against its own log-probs of the update's start (the proximal policy,
`train.recompute_old_logp`, required) times the truncated weight min(proximal / behaviour,
`train.tis_cap`) (AReaL's decoupled objective with verl's cap), per agent.

Hand-off. A published version is the sampler's copy of the params on this process's devices
(`Run.params`); the leaves the learner's next update would donate are copied on device, so no
version takes a host round trip. The producer drops a version once no later rollout needs it:
at most k + 1 versions are alive.

Resume. A checkpoint stores the data position of the rollouts trained on; the in-flight ones
are dropped and rolled out again after a restart, from the restored version (staleness 0 for
the first k steps, then k again), so no sample is trained on twice and none older than k.
Evaluations and rollouts share the engines, so they take turns (`Run.engine_lock`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.workflows.rollout import Sample

__all__ = ["Producer", "admit", "own_copy", "served_version", "staleness_metrics"]


def served_version(step: int, first: int, max_staleness: int) -> int:
  """The params version that serves step `step`'s rollout: max(first, step - max_staleness)."""
  return max(first, step - max_staleness)


def admit(samples: Sequence[Sample], version: int, max_staleness: int
          ) -> tuple[list[Sample], int]:
  """(samples, how many were too stale): a sample whose policy version is more than
  `max_staleness` behind the learner's `version` keeps its reward and ids (it still counts in
  its group's statistics) but is marked `trained=False`, so no loss term reads it."""
  out, stale = [], 0
  for s in samples:
    if version - s.generation.policy_version > max_staleness:
      stale += s.trained
      s = dataclasses.replace(s, trained=False)
    out.append(s)
  return out, stale


def staleness_metrics(samples: Sequence[Sample], version: int, max_staleness: int
                      ) -> dict[str, float]:
  """The rollout's staleness histogram against the learner's `version`: `staleness/frac_<j>`
  the fraction of samples j versions old for j in 0..max_staleness, `staleness/older` those
  older, and the mean."""
  ages = np.asarray([version - s.generation.policy_version for s in samples], np.float64)
  if ages.size == 0:
    return {}
  out = {f"staleness/frac_{j}": float(np.mean(ages == j)) for j in range(max_staleness + 1)}
  out["staleness/older"] = float(np.mean(ages > max_staleness))
  out["staleness/mean"] = float(ages.mean())
  return out


def own_copy(sampler_params: Any, stored_params: Any) -> Any:
  """`sampler_params` with every leaf that may alias `stored_params`'s (the same dtype: the
  sampler's compute copy passes such leaves through, `policies.sampler_copy`) copied on device,
  so the learner's next update, which donates its params, leaves this version intact."""
  return jax.tree.map(lambda s, t: jnp.copy(s) if s.dtype == t.dtype else s,
                      sampler_params, stored_params)


@dataclasses.dataclass
class _Failed:
  error: BaseException


class Producer:
  """The rollout thread of an asynchronous run: rollouts of steps [first, steps) in order, each
  with its version (`served_version`) once `publish` has it; `take(step)` returns step `step`'s
  `Rolled` (`Run.rollout`) and re-raises the thread's error, if it failed. A context manager:
  leaving it stops the thread after its current rollout."""

  def __init__(self, run: Any, first: int, steps: int, max_staleness: int, params: Any):
    """`params`: version `first`, `run.params` as the run (re)starts."""
    self._run, self._first, self._steps, self._lag = run, first, steps, max_staleness
    self._versions = {first: params}
    self._ready = threading.Condition()
    self._closed = False
    self._out: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)

  def __enter__(self) -> Producer:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    with self._ready:
      self._closed = True
      self._ready.notify_all()
    self._thread.join()

  def needed(self, version: int) -> bool:
    """Whether a rollout still to come is served by `version` (else publishing it is waste):
    a later version v serves step v + k alone (`served_version`), the first one steps first..k."""
    return version + self._lag < self._steps if version > self._first else version < self._steps

  def publish(self, version: int, params: Any) -> None:
    """Hands version `version`'s sampler params (`own_copy`'d) to the producer."""
    with self._ready:
      self._versions[version] = params
      self._ready.notify_all()

  def take(self, step: int) -> Any:
    """Step `step`'s rollout, waiting for it."""
    item = self._out.get()
    if isinstance(item, _Failed):
      raise RuntimeError(f"the rollout producer failed before step {step}'s rollout: "
                         f"{item.error!r}") from item.error
    if item.step != step:
      raise RuntimeError(f"the producer rolled out step {item.step}; the learner expected {step}")
    return item

  def _wait(self, version: int) -> Any:
    with self._ready:
      while version not in self._versions and not self._closed:
        self._ready.wait()
      if self._closed:
        return None
      for v in [v for v in self._versions if v < version]:  # no later rollout needs them
        del self._versions[v]
      return self._versions[version]

  def _produce(self) -> None:
    seed = self._run.next_seed
    try:
      for step in range(self._first, self._steps):
        version = served_version(step, self._first, self._lag)
        params = self._wait(version)
        if params is None:
          return
        rolled = self._run.rollout(step, seed, params, version)
        seed = rolled.next_seed
        self._out.put(rolled)
    except BaseException as e:  # noqa: BLE001  (handed to the learner, which re-raises it)
      self._out.put(_Failed(e))
