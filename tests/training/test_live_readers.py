"""Readers beside a live trainer (issue 53): an export and an evaluate, then exports in a loop,
against a training run's workdir while it trains; the trainer finishes with the metrics and
evaluation traces of the same run trained alone, and the readers wrote nothing but their own
files.

Before readers were readers, `export` opened the checkpoint store read-write, whose clean-up of
"interrupted" saves deleted the trainer's in-progress step (the trainer died with a
FileNotFoundError), and `evaluate` replaced the trainer's `traces/eval_stepN.jsonl` with its own.

One worker process trains the run twice, alone and then with the readers beside it, so the second
run costs no imports or compilation; readers and trainer still share 2 CPU cores here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import pytest

import toy_task
from marl_jax.training import evaluation, export, workdir_lock
from marl_jax.training.checkpoint import saved_steps
from marl_jax.traces import store

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

STEPS = 16


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def _files(workdir: str) -> set[str]:
  return {os.path.relpath(os.path.join(root, name), workdir)
          for root, _, names in os.walk(workdir) for name in names
          if os.path.relpath(root, workdir).split(os.sep)[0] != "checkpoints"}


def test_exports_and_an_evaluate_beside_a_live_trainer_change_nothing(tmp_path):
  model = str(tmp_path / "model")
  toy_task.write_tiny_model(model)
  toy_task.register()
  alone, live = str(tmp_path / "alone"), str(tmp_path / "live")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")  # evaluate here reuses its programs
  proc = subprocess.Popen([sys.executable, toy_task.WORKER, model, alone, str(STEPS), live],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  exported = []

  def export_latest():
    team = export.restore_team(live)
    export.export_team(team, str(tmp_path / "exports" / str(len(exported))))
    exported.append(team.step)

  try:
    while not saved_steps(live):
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      time.sleep(0.05)
    export_latest()
    result = evaluation.evaluate_checkpoint(toy_task.toy_config(model, STEPS), live)
    while proc.poll() is None:
      export_latest()
  except BaseException:
    proc.kill()
    raise
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  # Each reader held a step while the trainer was still to write its last one.
  assert exported[0] < STEPS and result["step"] < STEPS
  assert _metrics(live) == _metrics(alone)
  c = toy_task.toy_config(model, STEPS)
  for step in range(c.eval.every, STEPS + 1, c.eval.every):  # the trainer's own traces, whole
    path = f"traces/eval_step{step}.jsonl"
    traces = [t for _, t in store.iter_traces(os.path.join(live, path))]
    assert len(traces) == c.eval.num_problems * c.eval.k, path
    assert store.read_content(os.path.join(live, path)) == \
        store.read_content(os.path.join(alone, path)), path
  ours = {f"eval/step{result['step']}.json", f"traces/evaluate_step{result['step']}.jsonl",
          f"traces/evaluate_step{result['step']}.jsonl{store.CONTENT_SUFFIX}"}
  readers = {f"readers/{step}.lock" for step in {result["step"], *exported}}
  assert _files(live) == _files(alone) | ours | readers
  assert saved_steps(live) == saved_steps(alone) and workdir_lock.held_steps(live) == set()
