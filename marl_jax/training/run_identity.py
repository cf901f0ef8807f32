"""Which run a workdir's checkpoints belong to, kept inside the checkpoints themselves.

The resume guard (`config.check_resume`) used to read only `config.json`: deleted or emptied, a
resume with another estimator and lr was accepted; truncated, a JSONDecodeError traceback. Now
every checkpoint's host item carries the run's config (`identity`, under the item's checksum), and
a resume compares the new config with the newest checkpoint that holds one; an edited checkpoint
is a damaged one. `config.json` is only the human-readable copy: rewritten from the checkpoint
when it is missing or differs. Checkpoints written before they carried the identity fall back to
`config.json`, which must then be readable.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import logging
import ml_collections

from marl_jax.errors import UserInputError
from marl_jax.training import config as config_lib
from marl_jax.training.checkpoint import CHECKPOINT_DIR, Checkpointer, saved_steps
from marl_jax.training.checkpoint_integrity import CheckpointDamagedError

CONFIG_FILE = "config.json"


def identity(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """The run's identity: its config as plain JSON (what `config.json` holds)."""
  return json.loads(c.to_json_best_effort())


def check_resume(workdir: str, c: ml_collections.ConfigDict, *, write: bool = True) -> None:
  """Refuses (one line) to resume the workdir's run under a config that changes what it computes;
  nothing to check without checkpoints. With `write` (process 0), restores `config.json` from the
  checkpoint's identity when it was deleted or edited."""
  steps = saved_steps(workdir)
  if not steps:
    return
  saved = _checkpoint_identity(workdir, steps)
  if saved is None:  # checkpoints older than the identity: config.json is all there is
    config_lib.check_resume(_config_json(workdir, steps), c)
    return
  config_lib.check_resume(saved, c)
  if write and _read_config_json(workdir) != saved:
    logging.warning("%s was missing or differed from the run's checkpoints; rewrote it from "
                    "them", os.path.join(workdir, CONFIG_FILE))
    with open(os.path.join(workdir, CONFIG_FILE), "w", encoding="utf-8") as f:
      f.write(json.dumps(saved, indent=2))


def saved_config(workdir: str, step: int) -> ml_collections.ConfigDict:
  """The config checkpoint `step` of the workdir's run was trained under: the identity it
  carries, or `config.json` for a checkpoint older than identities. What a reader (`export`)
  builds the run's team from: `config.json` can be deleted, edited, or half-written by a
  starting trainer. A damaged host item raises CheckpointDamagedError (one line)."""
  with Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), read_only=True) as checkpoints:
    saved = checkpoints.read_host(step).get("identity")
  return ml_collections.ConfigDict(saved if isinstance(saved, dict)
                                   else _config_json(workdir, [step]))


def _checkpoint_identity(workdir: str, steps: list[int]) -> dict[str, Any] | None:
  """The identity in the newest step whose host item is intact; None when that step has none."""
  with Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), read_only=True) as checkpoints:
    for step in reversed(steps):
      try:
        saved = checkpoints.read_host(step).get("identity")
      except CheckpointDamagedError:
        continue  # the resume itself will skip this step the same way
      return saved if isinstance(saved, dict) else None
  return None


def _read_config_json(workdir: str) -> Any:
  try:
    with open(os.path.join(workdir, CONFIG_FILE), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError, RecursionError):
    return None


def _config_json(workdir: str, steps: list[int]) -> dict[str, Any]:
  saved = _read_config_json(workdir)
  if not isinstance(saved, dict) or not saved:
    raise UserInputError(f"workdir {workdir!r} holds checkpoints {steps} but its {CONFIG_FILE} is "
                         "missing, empty or not valid JSON, and these checkpoints are older than "
                         "the config they now carry; expected the run's saved config.json, or a "
                         "new workdir")
  return saved
