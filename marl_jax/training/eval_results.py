"""Where evaluation results live in a workdir: `eval/step<N>.json` for the run's own evaluation
set, `eval/<split>_step<N>.json` for a named one (`experiments.evaluate --split`). The evaluate
CLI writes them and `experiments.reproduce` collects them; both go through this module.

A split also names the evaluation's trace files, `traces/<split>_step<N>.jsonl`. The trainer's own
evaluations write `eval_step<N>` and `pretrained_step0` there, so `evaluate` never uses those
names: on the run's own set it writes `OWN_SET_TRACES` (`traces/evaluate_step<N>.jsonl`; its
metrics keep the trainer's names, `eval/...`), and no `--split` may take any of them."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

from marl_jax.errors import UserInputError

_SPLIT = re.compile(r"[A-Za-z0-9_]+")
OWN_SET_TRACES = "evaluate"
_RESERVED = ("eval", "pretrained", OWN_SET_TRACES, "step")  # the trainer's, evaluate's, files'


def check_split(split: str | None) -> None:
  """A split names files and metric prefixes: letters, digits and '_', none of the names the
  trainer and `evaluate` write under themselves (module doc)."""
  if split is not None and (not _SPLIT.fullmatch(split) or split in _RESERVED):
    raise UserInputError(f"--split={split!r}; expected a name of letters, digits and '_' other "
                         f"than {', '.join(map(repr, _RESERVED))}")


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
