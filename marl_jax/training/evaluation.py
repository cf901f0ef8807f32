"""Evaluating a run's checkpoint (`experiments.evaluate`, `experiments.reproduce`): its held-out
evaluation, or a named evaluation set, written where `eval_results` says. The metrics themselves
are `eval_metrics`'."""

from __future__ import annotations

from typing import Any

import ml_collections

from marl_jax.envs.base import GradesAnswers
from marl_jax.errors import UserInputError
from marl_jax.training import eval_results, preflight, progress, setup, trainer
from marl_jax.training.checkpoint import holding, saved_steps
from marl_jax.workflows.rollout import Problem


def evaluate_checkpoint(c: ml_collections.ConfigDict, workdir: str, step: int | None = None,
                        split: str | None = None) -> dict[str, Any]:
  """Evaluates checkpoint `step` of `workdir` (default: the latest) on the run's evaluation
  problems, or on the set `split` names (its files given by `config.eval.env_kwargs`); writes the
  result where `eval_results` says and returns it. Bad input (split name, missing step) is refused
  before the model loads. A reader beside a live trainer (`workdir_lock`): it holds the step it
  restores against the trainer's rotation and writes only its own files (`eval_results`). Its
  progress is a bar of the replies sampled (`config.logging.progress`), also in `reproduce`'s
  cells.

  A workdir without checkpoints evaluates step 0, the policy RL would start from: the base model,
  after the config's warm-start when `sft.steps` > 0 (as `train` evaluates step 0), or the
  params of `config.init_from`. So a table's
  rows without RL are the RL rows' starting point, also where a cpu preset warm-starts."""
  eval_results.check_split(split)
  if step is not None:
    preflight.check_workdir(workdir)
    steps = saved_steps(workdir)
    if step not in steps:
      raise UserInputError(f"--checkpoint={step}: no such checkpoint in {workdir}; expected one "
                           f"of the saved steps {steps}")
  run = trainer.Run(c, workdir, trains=False)
  warm_start = {}
  if step is not None or saved_steps(workdir):
    with holding(workdir, step) as step:
      restored = run.checkpointer.restore(step, target={"train": run.state, "rng": run.run_key})
    run.state = restored.state["train"]
  elif c.init_from:
    run.start_from_checkpoint()
  elif c.sft.steps:
    warm_start = run.warm_start()
  step = step or 0
  with progress.reply_bar(f"evaluate step {step}",
                          enabled=c.logging.progress and run.is_main) as bar:
    run.eval_policy = progress.CountedPolicy(run.eval_policy, bar)
    metrics = run.evaluate(step, split or eval_results.OWN_SET_TRACES)
  if split is None:  # the run's own set: the trainer's metric names, evaluate's own trace files
    metrics = {"eval/" + name.split("/", 1)[1]: v for name, v in metrics.items()}
  result = {"config": c.name, "step": step,
            **answer_grader(setup.problems(c, c.eval.seed_offset, 1, for_eval=True)[0]),
            **warm_start, **metrics}
  eval_results.write(workdir, step, split, result)
  return result


def answer_grader(problem: Problem) -> dict[str, str]:
  """{"grader": name} when the problem's env grades answers with a named grader (the math envs:
  `envs/math/grading.py`), so an evaluation says how its accuracy was graded; {} otherwise."""
  env = problem.make()
  return {"grader": env.grader} if isinstance(env, GradesAnswers) else {}
