"""Where evaluation results live in a workdir: `eval/step<N>.json` for the run's own evaluation
set, `eval/<split>_step<N>.json` for a named one (`experiments.evaluate --split`). The evaluate
CLI writes them and `experiments.reproduce` collects them; both go through this module."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

from marl_jax.errors import UserInputError

_SPLIT = re.compile(r"[A-Za-z0-9_]+")


def check_split(split: str | None) -> None:
  """A split names files and metric prefixes: letters, digits and '_', not 'eval' or 'step'."""
  if split is not None and (not _SPLIT.fullmatch(split) or split in ("eval", "step")):
    raise UserInputError(f"--split={split!r}; expected a name of letters, digits and '_' other "
                         "than 'eval' and 'step'")


def _prefix(split: str | None) -> str:
  return f"{split}_step" if split else "step"


def path(workdir: str, step: int, split: str | None = None) -> str:
  return os.path.join(workdir, "eval", f"{_prefix(split)}{step}.json")


def write(workdir: str, step: int, split: str | None, result: dict[str, Any]) -> str:
  out = path(workdir, step, split)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  return out


def latest(workdir: str, split: str | None = None) -> dict[str, Any] | None:
  """The newest evaluation of `split` (None: the run's own set) in a workdir, or None."""
  pattern = re.compile(rf"{re.escape(_prefix(split))}(\d+)\.json$")
  found = [(int(m.group(1)), f) for f in glob.glob(os.path.join(workdir, "eval", "*.json"))
           if (m := pattern.match(os.path.basename(f)))]
  if not found:
    return None
  with open(max(found)[1]) as f:
    return json.load(f)
