r"""Trains a team of LLM agents.

    python -m experiments.train --config=configs/drmas_math.py:rl,cpu --workdir=runs/main \
        [--config.seed=1 --config.train.steps=10 ...]

A run started on a workdir that holds checkpoints resumes from the latest intact one by itself.
Bad input (config, workdir, datasets, mesh) ends in one `error: ...` line before the model loads.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from marl_jax.errors import UserInputError
from marl_jax.parallel.distributed import initialize_distributed

cli.check_flagfiles(sys.argv)  # config_flags reads flag files at definition
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, optionally with a preset: configs/NAME.py[:PRESET]. "
    "Any field can be overridden with --config.FIELD=VALUE.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, traces, "
                               "plots. An existing run there is resumed.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from marl_jax.training import trainer  # after flag parsing: --help stays fast
  config = _CONFIG.value
  if config.train.eval_only:
    raise UserInputError(f"config {config.name!r} is an evaluation-only row (no RL); run "
                         "python -m experiments.evaluate with it instead")
  initialize_distributed()
  trainer.train(config, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
