"""Runs the toy training in its own process (the trainer tests kill it with SIGKILL).

    python tests/resume_worker.py MODEL_DIR WORKDIR STEPS [WORKDIR ...]

Further workdirs get the same run again, one after another in this process (its imports and
compiled programs already loaded)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import toy_task  # noqa: E402
from marl_jax.training import trainer  # noqa: E402

if __name__ == "__main__":
  model_dir, workdir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
  toy_task.register()
  for path in (workdir, *sys.argv[4:]):
    trainer.train(toy_task.toy_config(model_dir, steps), path)
