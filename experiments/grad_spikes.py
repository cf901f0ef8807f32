r"""Per-agent gradient-norm spikes of finished runs (Dr. MAS's instability signal), as JSON.

    python -m experiments.grad_spikes RUN_DIR [RUN_DIR ...] [--ratio=3]

Reads each run's `metrics.jsonl` (runs logged with `config.train.agent_grad_norms=True`) and its
`hparams.json` (the config the writer recorded beside it, for the run's name). For each agent: `agent/grad_norm/<agent>` over the training steps, the pre-clip
norm of the gradient of that agent's own loss share. A step whose norm is 0 made no update for
the agent (every advantage of its samples was 0) and is left out. A spike is an update whose
norm exceeds `--ratio` times the median of the agent's nonzero norms in the same run: the paper
reports spikes without a threshold, so the threshold is this tool's, relative to the run's own
scale. Also per run: the mean rollout reward per agent (`rollout/reward/<agent>`, its own
reward channel), the mean `rollout/success` and the last `eval/accuracy`. Runs are
grouped by their config name (one group per estimator when the seeds of two configs are given);
each group reports mean +- standard error over its runs.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from absl import flags

from experiments import cli
from experiments.stats import mean_se
from marl_jax.errors import UserInputError
from marl_jax.training.metrics import HPARAMS_FILE, METRICS_FILE, read_metrics

_RATIO = flags.DEFINE_float("ratio", 3.0, "A spike: a norm above ratio x the run's median.")
_PREFIX = "agent/grad_norm/"


def run_spikes(workdir: str, ratio: float) -> dict[str, Any]:
  """One run's per-agent norms, spike counts, rewards and final accuracy."""
  for file in (METRICS_FILE, HPARAMS_FILE):
    if not os.path.isfile(os.path.join(workdir, file)):
      raise UserInputError(f"{workdir!r} has no {file}; expected a training run's workdir")
  with open(os.path.join(workdir, HPARAMS_FILE), encoding="utf-8") as f:
    name = json.load(f)["name"]
  records = read_metrics(workdir)
  agents = sorted({k[len(_PREFIX):] for r in records for k in r if k.startswith(_PREFIX)})
  if not agents:
    raise UserInputError(f"{workdir!r} logged no {_PREFIX}<agent>; expected a run with "
                         "config.train.agent_grad_norms=True")
  out: dict[str, Any] = {"workdir": workdir, "config": name, "agents": {}}
  for agent in agents:
    norms = [r[_PREFIX + agent] for r in records if _PREFIX + agent in r]
    updates = [n for n in norms if n > 0]
    median = statistics.median(updates) if updates else 0.0
    rewards = [r[f"rollout/reward/{agent}"] for r in records if f"rollout/reward/{agent}" in r]
    out["agents"][agent] = {
        "steps": len(norms), "updates": len(updates), "median": median,
        "max": max(updates, default=0.0),
        "spikes": sum(n > ratio * median for n in updates),
        "reward": sum(rewards) / len(rewards) if rewards else None}
  accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
  out["eval_accuracy"] = accuracy[-1] if accuracy else None
  success = [r["rollout/success"] for r in records if "rollout/success" in r]
  out["rollout_success"] = sum(success) / len(success) if success else None
  return out


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Mean +- SE over the runs of each config: spikes and updates per agent, reward, accuracy."""
  groups: dict[str, Any] = {}
  for name in sorted({r["config"] for r in runs}):
    mine = [r for r in runs if r["config"] == name]
    group: dict[str, Any] = {"runs": len(mine)}
    for agent in sorted({a for r in mine for a in r["agents"]}):
      stats = [r["agents"][agent] for r in mine if agent in r["agents"]]
      for key in ("spikes", "updates", "reward"):
        values = [s[key] for s in stats if s[key] is not None]
        group[f"{agent}/{key}"] = mean_se(values) if values else None
    for key in ("eval_accuracy", "rollout_success"):
      values = [r[key] for r in mine if r[key] is not None]
      group[key] = mean_se(values) if values else None
    groups[name] = group
  return groups


def main(argv: list[str]) -> None:
  workdirs = argv[1:]
  if not workdirs:
    raise UserInputError("no run directories given; expected RUN_DIR [RUN_DIR ...]")
  if not _RATIO.value > 1:
    raise UserInputError(f"--ratio={_RATIO.value}; expected a number > 1")
  runs = [run_spikes(w, _RATIO.value) for w in workdirs]
  print(json.dumps({"ratio": _RATIO.value, "runs": runs, "groups": summarize(runs)}, indent=1))


if __name__ == "__main__":
  cli.run(main)
