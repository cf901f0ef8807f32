"""Checks of a run's inputs that need no model: the config, the device mesh, the workdir and the
datasets the env kwargs name.

`check` runs first thing in `trainer.Run`, so a bad value stops a run with one line
(`UserInputError`) in seconds instead of a traceback after the model has loaded.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import jax
import ml_collections

from marl_jax.errors import UserInputError
from marl_jax.parallel import train_step
from marl_jax.training import config as config_lib
from marl_jax.training import refill, sft
from marl_jax.workflows import registry, rollout


def check(c: ml_collections.ConfigDict, workdir: str) -> config_lib.Built:
  """Everything about the run's inputs that can be checked before loading; returns the built
  config. Raises UserInputError naming the bad value."""
  built = config_lib.build(c)
  procs = jax.process_count()
  learner, _ = config_lib.split_devices(c.train.rollout_devices, jax.devices(), procs)
  check_mini_batch(c, config_lib.mesh_shape(tuple(c.train.mesh), len(learner)))
  if refill.enabled(c, built.advantage) and procs > 1:
    raise UserInputError(f"DAPO dynamic sampling (config.rollout.max_refills="
                         f"{c.rollout.max_refills} with algo.filter='zero_variance') runs on one "
                         f"process only, got {procs}; set config.rollout.max_refills=0")
  check_workdir(workdir)
  # Problem 0 reads (and caches) every local dataset the env kwargs name, evaluation's too, and
  # its env checks their values (sizes, ranges).
  env, _ = (_problem_env(c, for_eval) for for_eval in (False, True))
  try:
    rollout.check_decision_rewards(env, c.env.name, c.rollout.mode)
  except ValueError as e:
    raise UserInputError(f"config.{e}") from None
  if c.sft.steps:  # the warm-start's demonstrations come from the training problems' envs
    sft.check_env(env, built.spec.agents, c.env.name, c.sft.mistake_rate)
  return built


def _problem_env(c: ml_collections.ConfigDict, for_eval: bool) -> object:
  """The env of problem 0; a value the env refuses is the user's (one line naming the kwargs)."""
  kwargs = config_lib.env_kwargs(c, for_eval)
  try:
    return registry.make_env(c.env.name, **registry.problem_kwargs(
        c.env.name, c.env.workflow, c.env.max_turns, 0, kwargs))
  except UserInputError:
    raise
  except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
    field = "config.eval.env_kwargs" if for_eval else "config.env.kwargs"
    raise UserInputError(f"{field} {kwargs}: {c.env.name!r} refuses them: {e}") from None


def check_mini_batch(c: ml_collections.ConfigDict, mesh: tuple[int, int, int]) -> None:
  """The train step's mini-batch split (`train_step.check_mini_batch`) on the (data, fsdp,
  tensor) mesh sizes, before the step is built."""
  try:
    train_step.check_mini_batch(c.train.mini_batch_size, mesh[0], mesh[1], c.train.micro_batches,
                                field="config.train.mini_batch_size")
  except ValueError as e:
    raise UserInputError(str(e)) from None


def check_workdir(workdir: str | os.PathLike[str]) -> None:
  """The workdir is, or can be created as, a directory this process can write."""
  if not str(workdir):
    raise UserInputError("workdir is empty; expected a directory path")
  path = pathlib.Path(workdir)
  if path.exists() and not path.is_dir():
    raise UserInputError(f"workdir {str(workdir)!r} is a file; expected a directory (existing or "
                         "to be created) for checkpoints, metrics and traces")
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise UserInputError(f"workdir {str(workdir)!r} is not writable ({e.strerror}); expected a "
                         "directory this user can create and write") from None
