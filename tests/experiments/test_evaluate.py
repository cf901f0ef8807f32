"""Evaluating a checkpoint (experiments.evaluate) on a named evaluation set: train on one file,
evaluate on another in the same workdir, results under the set's name (the split reproduce
collects); on the run's own set, beside the trainer's files, with a progress bar."""

from __future__ import annotations

import json

import pytest

import toy_task
from configs import drmas_math
from marl_jax.errors import UserInputError
from marl_jax.training import evaluation
from marl_jax.traces import store


def test_evaluates_a_named_split_from_its_own_file(tmp_path):
  model = tmp_path / "model"
  toy_task.write_tiny_model(str(model))
  train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
  train.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
  test.write_text("".join(json.dumps({"problem": f"What is {i} + 3?", "answer": str(i + 3)})
                          + "\n" for i in range(3)))
  c = drmas_math.get_config("cpu")
  c.model = str(model)
  c.sampling.max_new_tokens, c.eval.top_p = 8, None
  toy_task.quiet_logging(c)
  c.env.kwargs.path, c.eval.env_kwargs.path, c.eval.num_problems = str(train), str(test), 3
  workdir = tmp_path / "run"
  result = evaluation.evaluate_checkpoint(c, str(workdir), None, "test")
  assert result["step"] == 0 and set(result) >= {"test/accuracy", "test/pass@2"}
  assert result["grader"] == "builtin"  # Dr. MAS's code grades with its own checker
  assert json.loads((workdir / "eval" / "test_step0.json").read_text()) == result
  traces = [t for _, t in store.iter_traces(workdir / "traces" / "test_step0.jsonl")]
  assert len(traces) == 3 * c.eval.k  # every row of the test file, k episodes each
  kwargs = [t["events"][0]["env_kwargs"] for t in traces]
  assert {k["path"] for k in kwargs} == {str(test)}
  assert sorted({k["index"] for k in kwargs}) == [0, 1, 2]


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
  """evaluate on a workdir whose checkpoint holds other arrays (another model's): one line naming
  the step and what was expected, not orbax's traceback; the workdir is left as it was."""
  import jax.numpy as jnp

  from marl_jax.training.checkpoint import CHECKPOINT_DIR, Checkpointer, CheckpointMismatchError
  model = tmp_path / "model"
  toy_task.write_tiny_model(str(model))
  toy_task.register()
  workdir = tmp_path / "run"
  with Checkpointer(workdir / CHECKPOINT_DIR) as writer:
    writer.save(3, {"train": {"embed": jnp.zeros((7, 5))}, "rng": jnp.zeros(2, jnp.uint32)}, {})
  before = sorted(p.name for p in (workdir / CHECKPOINT_DIR).iterdir())
  try:
    evaluation.evaluate_checkpoint(toy_task.toy_config(str(model), steps=1), str(workdir))
  except CheckpointMismatchError as e:
    line = e.report()
  else:
    raise AssertionError("a checkpoint of other arrays was evaluated")
  assert "\n" not in line and "checkpoint step 3" in line and "does not fit this config" in line
  assert sorted(p.name for p in (workdir / CHECKPOINT_DIR).iterdir()) == before


def test_the_runs_own_set_is_evaluated_beside_the_trainers_files_with_a_progress_bar(tmp_path,
                                                                                     capfd):
  """Without --split, evaluate keeps the trainer's metric names (`eval/...`) but writes its own
  trace file (the trainer's `traces/eval_step0.jsonl` is left alone), and its bar counts the
  replies: the toy task's episodes are one reply each."""
  model = tmp_path / "model"
  toy_task.write_tiny_model(str(model))
  toy_task.register()
  c = toy_task.toy_config(str(model), steps=1)
  c.logging.progress = True
  workdir = tmp_path / "run"
  (workdir / "traces").mkdir(parents=True)
  trainers = workdir / "traces" / "eval_step0.jsonl"
  trainers.write_text("the trainer's\n")
  result = evaluation.evaluate_checkpoint(c, str(workdir))
  replies = c.eval.num_problems * c.eval.k
  assert result["step"] == 0 and "eval/accuracy" in result
  assert trainers.read_text() == "the trainer's\n"
  traces = list(store.iter_traces(workdir / "traces" / "evaluate_step0.jsonl"))
  assert len(traces) == replies
  bar = capfd.readouterr().err.replace("\r", "\n").splitlines()
  assert any(line.startswith(f"evaluate step 0: {replies} replies [") for line in bar), bar


@pytest.mark.parametrize("split", ["eval", "pretrained", "evaluate", "step", "a-b"])
def test_split_names_of_the_trainer_and_of_evaluate_are_refused(split):
  with pytest.raises(UserInputError, match=rf"--split='{split}'; expected a name of letters"):
    evaluation.evaluate_checkpoint(None, "/nowhere", None, split)
