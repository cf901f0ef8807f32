"""See the samples: a table of a few episodes of a training step, for people.

Every `config.logging.samples_every` steps the trainer shows the first
`config.logging.samples_episodes` episodes (trajectories, in (problem, trajectory) order) of the
step's rollout: per agent and turn the tail of its prompt, its reply, the action the environment
parsed from it (`envs.base.parsed_action`; empty: nothing parsed), its reward, and its advantage
over the whole rollout, as the update computed it (`parallel/update.run`'s `on_targets` hook: no
estimator runs twice). The table goes to the metrics writer (a wandb table, `write_table`) and to
`<workdir>/samples/step{N}.md`.

    capture = Capture(policy, samples, episodes)   # the samples the batch was built from
    update.run(..., on_targets=capture)
    publish(capture.table(), step, workdir, writer)

Advantage of a sample: the mean of its advantages over its response tokens (one value for the
sequence-level estimators, GRPO and the like; the token mean for `gae_token`); "in loss" says
whether an update trains on it (the group filter kept it and RL trains its agent,
`config.train.agents`). Multi-host: every process runs the hook (its host copy of the targets is
a collective); the table holds process 0's samples, which are the first rows of every block of
the global batch (`parallel/distributed.py`).
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from marl_jax.envs.base import truncate
from marl_jax.parallel import layouts, update
from marl_jax.parallel.policy_config import PolicyConfig
from marl_jax.training.metrics import MetricWriter
from marl_jax.workflows.rollout import Sample

SAMPLES_DIR = "samples"
TABLE = "samples"  # the writer's table name
COLUMNS = ("problem", "trajectory", "turn", "agent", "branch", "selected", "prompt_tail",
           "reply", "action", "reward", "team_reward", "advantage", "in_loss")
PROMPT_TAIL_CHARS = 300
REPLY_CHARS = 2000


def due(logging_cfg: ml_collections.ConfigDict, step: int) -> bool:
  """Whether step `step` (1-based, as the metrics count it) shows its samples."""
  every = logging_cfg.samples_every
  return bool(every) and step % every == 0


def episodes_of(samples: Sequence[Sample], count: int) -> list[tuple[int, int]]:
  """The (problem, trajectory) ids of the first `count` episodes of `samples`."""
  return sorted({(s.problem_id, s.traj_id) for s in samples})[:count]


class Capture:
  """`update.run`'s `on_targets` hook: the advantage of each shown sample, from the rollout's
  targets. `samples`: this process's samples exactly as the batch was built from them (row i of
  block b is `layouts.blocks(...)[b][i]`)."""

  def __init__(self, policy: PolicyConfig, samples: Sequence[Sample], episodes: int):
    self.policy = policy
    self.samples = list(samples)
    self.shown = set(episodes_of(self.samples, episodes))
    self.values: dict[int, tuple[float, bool]] = {}  # id(sample) -> (advantage, in loss)

  def __call__(self, batch: Any, targets: Any) -> None:
    del batch
    layout = layouts.of(self.policy)
    host = jax.tree.map(update.host_copy, targets)  # collective: every process calls it
    if jax.process_index() != 0:  # its rows lie further down the blocks; process 0 shows
      return
    for block, t in zip(layout.blocks(self.policy, self.samples),
                        layout.split(self.policy, host)):
      adv, kept = np.asarray(t.advantages), np.asarray(t.sample_mask)
      for row, s in enumerate(block):
        if (s.problem_id, s.traj_id) in self.shown:
          n = max(1, len(s.generation.token_ids))
          self.values[id(s)] = (float(adv[row, :n].mean()), bool(kept[row]) and s.trained)

  def table(self) -> list[tuple[Any, ...]]:
    """Rows in `COLUMNS` order: the shown episodes' samples by (problem, trajectory, turn,
    acting order, branch); process 0 only. Raises RuntimeError when the hook has not run."""
    if not self.values and self.shown:
      raise RuntimeError("Capture.table before update.run called the hook (on_targets)")
    shown = [(i, s) for i, s in enumerate(self.samples) if id(s) in self.values]
    shown.sort(key=lambda x: (x[1].problem_id, x[1].traj_id, x[1].turn, x[0]))
    rows = []
    for _, s in shown:
      advantage, in_loss = self.values[id(s)]
      prompt = s.messages[-1]["content"] if s.messages else ""
      rows.append((s.problem_id, s.traj_id, s.turn, s.agent, s.branch, s.selected,
                   prompt[-PROMPT_TAIL_CHARS:], truncate(s.generation.text, REPLY_CHARS),
                   s.action, float(s.reward), float(s.team_reward), advantage, in_loss))
    return rows


def publish(rows: Sequence[Sequence[Any]], step: int, workdir: str,
            writer: MetricWriter) -> str:
  """The table of step `step` to the writer and to `samples/step{step}.md`; returns the page's
  path (process 0 calls it)."""
  writer.write_table(step, TABLE, COLUMNS, rows)
  path = os.path.join(workdir, SAMPLES_DIR, f"step{step}.md")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(markdown(rows, step))
  logging.info("samples of step %d: %s", step, path)
  return path


def cell(value: Any) -> str:
  """One Markdown table cell: HTML-escaped (a reply's `<answer>` stays visible), backslashes as
  `&#92;` so that the only backslashes escape pipes (`\\|`), newlines as `<br>`."""
  if value is None:
    return ""
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    return f"{value:.6g}"
  text = html.escape(str(value), quote=False).replace("\\", "&#92;").replace("|", "\\|")
  return text.replace("\r\n", "\n").replace("\n", "<br>")


def markdown(rows: Sequence[Sequence[Any]], step: int) -> str:
  """The page: one section and table per episode."""
  lines = [f"# Samples of step {step}", "",
           "The first episodes of the step's rollout (in a multi-host run, process 0's): per "
           "agent and turn the tail of its prompt, its reply, the action the environment parsed "
           "from it (empty: nothing parsed), its reward and team reward, and its advantage over "
           "the whole rollout (the mean over its response tokens). in loss: no when the group "
           "filter dropped the sample or RL does not train its agent. Tree rollouts show every "
           "candidate of a turn (branch); selected: its state was continued.", ""]
  columns = COLUMNS[2:]
  episode = None
  for row in rows:
    if row[:2] != episode:
      episode = row[:2]
      lines += ["", f"## problem {row[0]}, trajectory {row[1]}", "",
                "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines.append("| " + " | ".join(cell(v) for v in row[2:]) + " |")
  return "\n".join(lines) + "\n"
