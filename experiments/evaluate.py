r"""Evaluates a team on held-out problems: accuracy (avg@k) and pass@k.

    python -m experiments.evaluate --config=configs/drmas_math.py:rl,cpu --workdir=runs/main \
        [--checkpoint=STEP] [--split=NAME]

Loads the checkpoint of STEP (default: the latest in the workdir; when the workdir has none, step
0: the base model, warm-started first when the config has `sft.steps`), rolls out
`config.eval.k` independent episodes on each of `config.eval.num_problems` held-out seeds, writes
`eval/step{STEP}.json` and the episode traces `traces/evaluate_step{STEP}.jsonl` into the workdir
and prints a table. It samples with the keys of the run's own evaluations (`Run.evaluate`: one
key stream per seed), so its `eval/...` metrics repeat the trainer's at that step.
`--split=NAME` names an evaluation set given by `--config.eval.env_kwargs...` (e.g. a test file):
metrics `NAME/...` in `eval/NAME_step{STEP}.json`, traces `traces/NAME_step{STEP}`. It may run
beside a live trainer: it reads the checkpoint read-only, holds it against the trainer's
rotation, and never writes the trainer's files (`eval`, `pretrained` and `evaluate` are not
split names). Bad input ends in one `error: ...` line before the model loads.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import cli

cli.check_flagfiles(sys.argv)  # config_flags reads flag files at definition
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file with optional preset: configs/NAME.py[:PRESET].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding the checkpoints; results "
                               "are written there.")
_CHECKPOINT = flags.DEFINE_integer("checkpoint", None, "Checkpoint step to evaluate (default: the "
                                   "latest; step 0, the policy RL starts from, if the workdir has "
                                   "none).")
_SPLIT = flags.DEFINE_string("split", None, "Name of the evaluation set (letters, digits, '_'; "
                             "not eval, pretrained or evaluate): results go to "
                             "eval/SPLIT_stepN.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Imported after flag parsing, so --help stays fast.
  from marl_jax.training import eval_results, evaluation, plots
  result = evaluation.evaluate_checkpoint(_CONFIG.value, _WORKDIR.value, _CHECKPOINT.value,
                                       _SPLIT.value)
  print(plots.markdown_table([{"metric": k, "value": v} for k, v in result.items()]))
  print(f"wrote {eval_results.path(_WORKDIR.value, result['step'], _SPLIT.value)}")


if __name__ == "__main__":
  cli.run(main)
