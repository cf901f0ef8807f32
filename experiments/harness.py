"""lm-evaluation-harness with the marl_jax model registered: lm-eval's own command line.

    python -m experiments.harness run --model marl_jax \
        --model_args checkpoint=RUN_DIR[,step=N][,policy=NAME] --tasks gsm8k [--include_path DIR]
    python -m experiments.harness run --model marl_jax --model_args model=DIR_OR_NAME --tasks ...

Everything after the module name is lm-eval's (`lm_eval --help`); this only imports
`marl_jax/training/lm_eval_model.py` first, so `--model marl_jax` resolves (lm-eval discovers
models by import, not by entry point), and reports the project's errors (a bad `--model_args`
value, a workdir without checkpoints) in one `error: ...` line, as every entry point does. Needs
the optional dependency: pip install -r requirements-eval.txt. Exported models
(experiments.export) also run under lm-eval's own `hf` model:
`lm_eval --model hf --model_args pretrained=EXPORT_DIR/solver`.
"""

from __future__ import annotations

import sys


def main() -> None:
  try:
    from lm_eval.__main__ import cli_evaluate
  except ImportError as e:
    sys.exit(f"error: the lm-eval harness is not installed ({e}); expected: pip install -r "
             "requirements-eval.txt")
  import marl_jax.training.lm_eval_model  # noqa: F401  (registers --model marl_jax)
  from experiments import cli
  cli.guarded(cli_evaluate)()


if __name__ == "__main__":
  main()
