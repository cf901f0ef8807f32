"""Evaluates a team on held-out problems: accuracy (avg@k) and pass@k.

    python -m experiments.evaluate --config=configs/atgrpo_plan_path.py:cpu --workdir=/tmp/run \
        [--checkpoint=STEP] [--split=NAME]

Loads the checkpoint of STEP (default: the latest in the workdir; the base model when the workdir
has none), rolls out `config.eval.k` independent episodes on each of `config.eval.num_problems`
held-out seeds, writes `eval/step{STEP}.json` and the episode traces into the workdir and prints a
table. `--split=NAME` names an evaluation set given by `--config.eval.env_kwargs...` (e.g. a
test file): metrics `NAME/...` in `eval/NAME_step{STEP}.json`, traces `traces/NAME_step{STEP}`. Bad input ends in one `error: ...` line before the model loads.
"""

from __future__ import annotations

import json
import os
import re

from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from marl_jax.errors import UserInputError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file with optional preset: configs/NAME.py[:PRESET].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding the checkpoints; results "
                               "are written there.")
_CHECKPOINT = flags.DEFINE_integer("checkpoint", None, "Checkpoint step to evaluate (default: the "
                                   "latest; the untrained model if the workdir has none).")
_SPLIT = flags.DEFINE_string("split", None, "Name of the evaluation set (letters, digits, '_'): "
                             "results go to eval/SPLIT_stepN.json.")
flags.mark_flags_as_required(["config", "workdir"])


def run_evaluation(config, workdir: str, step: int | None, split: str | None = None) -> dict:
  from marl_jax.training import plots, preflight, trainer
  from marl_jax.training.checkpoint import saved_steps
  if split is not None and (not re.fullmatch(r"[A-Za-z0-9_]+", split) or split in ("eval", "step")):
    raise UserInputError(f"--split={split!r}; expected a name of letters, digits and '_' other "
                         "than 'eval' and 'step'")
  if step is not None:  # before the model loads
    preflight.check_workdir(workdir)
    steps = saved_steps(workdir)
    if step not in steps:
      raise UserInputError(f"--checkpoint={step}: no such checkpoint in {workdir}; expected one "
                           f"of the saved steps {steps}")
  run = trainer.Run(config, workdir)
  if step is not None or run.checkpointer.latest_step() is not None:
    restored = run.checkpointer.restore(step, target={"train": run.state, "rng": run.run_key})
    run.state, step = restored.state["train"], restored.step
  step = step or 0
  metrics = run.evaluate(step, split or "eval")
  result = {"config": config.name, "step": step, **metrics}
  out = os.path.join(workdir, "eval", f"{split}_step{step}.json" if split else f"step{step}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=2)
  print(plots.markdown_table([{"metric": k, "value": v} for k, v in result.items()]))
  print(f"wrote {out}")
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  run_evaluation(_CONFIG.value, _WORKDIR.value, _CHECKPOINT.value, _SPLIT.value)


if __name__ == "__main__":
  cli.run(main)
