"""Synchronous vs asynchronous RL steps on one workload, as JSON: the same config, seed and start
point trained for `--steps` RL steps with `train.max_staleness` 0 and then k, in one process.

    python -m experiments.bench_async --config=configs/atgrpo_plan_path.py:mas_shared,cpu,rl \
        --init_from=/runs/plan_path:0 --steps=4 --max_staleness=1 --root=/tmp/bench_async

`--init_from` (a run's checkpoint, e.g. its warm-start, `WORKDIR:STEP`) starts both arms from
the same params without a warm-start of their own; evaluations are left out (one after the last
step, untimed). A step's time is what the learner's loop spends on it: the rollout (synchronous)
or the wait for it (asynchronous, `time/rollout_wait_s`) plus the updates (`time/train_s`).
The first step of each arm compiles, so the figures are over steps 2..N: seconds per step and
RL steps per minute per arm, and their ratio. On a 2-core CPU the two threads share the cores,
so the overlap can only win where a rollout waits on the host (sandboxed programs, env steps);
on an accelerator the learner's device time and the rollout's host time overlap whole.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from experiments.bench_common import cpu_header
from marl_jax.training import trainer
from marl_jax.training.metrics import read_metrics

_CONFIG = config_flags.DEFINE_config_file("config", None, "The workload's config "
                                          "(configs/NAME.py[:PRESET]).", lock_config=True)
_INIT_FROM = flags.DEFINE_string("init_from", "", "WORKDIR:STEP both arms start from "
                                 "(config.init_from); empty: the config's own start.")
_STEPS = flags.DEFINE_integer("steps", 4, "RL steps per arm (>= 2: the first compiles).")
_LAG = flags.DEFINE_integer("max_staleness", 1, "The asynchronous arm's train.max_staleness.")
_TIS = flags.DEFINE_float("tis_cap", 2.0, "The asynchronous arm's train.tis_cap.")
_ROOT = flags.DEFINE_string("root", "/tmp/bench_async", "Workdirs ROOT/sync, ROOT/async_k<K>; "
                            "must not hold earlier runs.")


def arm(c, workdir: str) -> dict:
  """Trains `c` in `workdir`; the per-step seconds of its learner loop, from its metrics."""
  start = time.perf_counter()
  trainer.train(c, workdir)
  wall = time.perf_counter() - start
  rows = [r for r in read_metrics(workdir) if r["step"] >= 1]
  waits = [r.get("time/rollout_wait_s", r["time/rollout_s"]) for r in rows]
  steps = [w + r["time/train_s"] for w, r in zip(waits, rows)]
  timed = steps[1:]
  return {"max_staleness": c.train.max_staleness, "step_s": steps,
          "rollout_s": [r["time/rollout_s"] for r in rows], "wait_s": waits,
          "train_s": [r["time/train_s"] for r in rows],
          "mean_step_s": sum(timed) / len(timed), "steps_per_min": 60 * len(timed) / sum(timed),
          "wall_s_with_setup_and_eval": wall}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _STEPS.value < 2 or _LAG.value < 1:
    raise app.UsageError(f"--steps={_STEPS.value}, --max_staleness={_LAG.value}; expected "
                         "--steps >= 2 (the first compiles) and --max_staleness >= 1")
  for name in ("sync", f"async_k{_LAG.value}"):
    if os.path.exists(os.path.join(_ROOT.value, name)):
      raise app.UsageError(f"{os.path.join(_ROOT.value, name)} exists; expected a fresh --root "
                           "(a workdir there would resume)")
  logging.set_verbosity(logging.WARNING)
  report = {**cpu_header(), "steps": _STEPS.value, "init_from": _INIT_FROM.value, "arms": []}
  for lag in (0, _LAG.value):
    c = _CONFIG.value.copy_and_resolve_references()
    c.train.steps, c.train.max_staleness = _STEPS.value, lag
    c.eval.at_start, c.eval.every = False, _STEPS.value
    c.logging.progress, c.logging.learning_curve, c.logging.wandb_mode = False, False, "disabled"
    if _INIT_FROM.value:
      c.init_from, c.sft.steps = _INIT_FROM.value, 0
    if lag:
      c.train.recompute_old_logp, c.train.tis_cap = True, _TIS.value
    report["arms"].append(arm(c, os.path.join(_ROOT.value, f"async_k{lag}" if lag else "sync")))
    print(json.dumps(report["arms"][-1]), flush=True)
  sync, piped = report["arms"]
  report["async_over_sync_steps_per_min"] = piped["steps_per_min"] / sync["steps_per_min"]
  report["load_avg_after"] = os.getloadavg()
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main)
