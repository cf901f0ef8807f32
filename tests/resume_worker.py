"""Runs the toy training in its own process (the trainer tests kill it with SIGKILL).

    python tests/resume_worker.py [--engine=NAME] [--max_staleness=K] MODEL_DIR WORKDIR STEPS
        [WORKDIR ...]

Further workdirs get the same run again, one after another in this process (its imports and
compiled programs already loaded); --engine sets `rollout.engine`, --max_staleness an
asynchronous run's `train.max_staleness` (with the learner's old log-probs and TIS it needs)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import host  # noqa: E402
import toy_task  # noqa: E402
from marl_jax.training import trainer  # noqa: E402

if __name__ == "__main__":
  args = sys.argv[1:]
  options = {}
  while args[0].startswith("--"):
    name, _, value = args.pop(0).removeprefix("--").partition("=")
    options[name] = value
  model_dir, workdir, steps = args[0], args[1], int(args[2])
  toy_task.register()
  host.save_shards_whole()  # as in the suite's own process (conftest.py)
  for path in (workdir, *args[3:]):
    c = toy_task.toy_config(model_dir, steps)
    if "engine" in options:
      c.rollout.engine = options["engine"]
    if "max_staleness" in options:
      c.train.max_staleness = int(options["max_staleness"])
      c.train.recompute_old_logp, c.train.tis_cap = True, 2.0
    trainer.train(c, path)
