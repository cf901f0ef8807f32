"""Reproduces a paper table: runs (or collects) every row and prints ours beside the paper's.

    python -m experiments.reproduce --table=atgrpo_games --scale=cpu --root=/tmp/repro

For each (game, variant) row the workdir `ROOT/<game>_<variant>` is trained (RL rows) and
evaluated, unless it already holds an evaluation (then it is collected). `--collect_only` never
runs anything. Writes `ROOT/<table>_<scale>.md` and `.csv`. At `--scale=paper` the configs'
paper defaults are used (a Qwen3 checkpoint directory via `--model`). Bad input ends in one
`error: ...` line (each row's config and workdir are checked before its model loads).
"""

from __future__ import annotations

import csv
import glob
import json
import os

from absl import flags

from experiments import cli
from marl_jax.errors import UserInputError

# AT-GRPO, PAPERS.md section 1: accuracy (%) on the games, Qwen3-1.7B and Qwen3-8B.
PAPER = {
    "qwen3-1.7b": {"single": (7.00, 0.00, 5.00), "sa_grpo": (29.00, 3.00, 11.00),
                   "mas_norl": (69.00, 0.00, 10.00), "mas_shared": (99.00, 10.00, 96.00),
                   "mas_full": (99.00, 11.50, 97.00)},
    "qwen3-8b": {"single": (48.00, 9.00, 12.00), "sa_grpo": (54.00, 14.00, 47.00),
                 "mas_norl": (72.00, 16.00, 71.00), "mas_shared": (99.50, 96.00, 93.00),
                 "mas_full": (99.00, 98.00, 96.00)},
}
GAMES = ("sudoku", "sokoban", "plan_path")  # the paper's column order
ROWS = ("single", "sa_grpo", "mas_norl", "mas_shared", "mas_lora", "mas_full")
LABELS = {"single": "Single agent", "sa_grpo": "SA + GRPO", "mas_norl": "MAS (no RL)",
          "mas_shared": "MAS + AT-GRPO shared", "mas_lora": "MAS + AT-GRPO per-role LoRA",
          "mas_full": "MAS + AT-GRPO per-role"}

_TABLE = flags.DEFINE_enum("table", "atgrpo_games", ["atgrpo_games"], "Which table.")
_SCALE = flags.DEFINE_enum("scale", "cpu", ["cpu", "paper"], "cpu: embedded SmolLM2 presets; "
                           "paper: the configs' paper settings.")
_ROOT = flags.DEFINE_string("root", None, "Directory holding one workdir per row.")
_ROWS = flags.DEFINE_list("rows", list(ROWS), f"Rows to include, from {list(ROWS)}.")
_GAMES = flags.DEFINE_list("games", list(GAMES), f"Games to include, from {list(GAMES)}.")
_MODEL = flags.DEFINE_string("model", None, "Model override (paper scale: a local Qwen3 dir).")
_PAPER_MODEL = flags.DEFINE_enum("paper_model", "qwen3-1.7b", sorted(PAPER),
                                 "Which paper rows to print beside ours.")
_COLLECT_ONLY = flags.DEFINE_bool("collect_only", False, "Only collect existing evaluations.")
flags.mark_flag_as_required("root")


def _latest_eval(workdir: str) -> dict | None:
  files = glob.glob(os.path.join(workdir, "eval", "step*.json"))
  if not files:
    return None
  latest = max(files, key=lambda f: int(os.path.basename(f)[4:-5]))
  with open(latest) as f:
    return json.load(f)


def _run_row(game: str, row: str, workdir: str) -> None:
  from configs import atgrpo_games
  from experiments.evaluate import run_evaluation
  from marl_jax.training import trainer
  module = __import__(f"configs.atgrpo_{game}", fromlist=["get_config"])
  config = module.get_config(row + (",cpu" if _SCALE.value == "cpu" else ""))
  if _MODEL.value:
    config.model = _MODEL.value
  if row not in atgrpo_games.EVAL_ONLY:
    trainer.train(config, workdir)
  run_evaluation(config, workdir, None)


def main(argv):
  del argv
  for name, values, allowed in (("rows", _ROWS.value, ROWS), ("games", _GAMES.value, GAMES)):
    bad = sorted(set(values) - set(allowed))
    if bad:
      raise UserInputError(f"--{name} has unknown entries {bad}; expected a subset of "
                           f"{list(allowed)}")
  if os.path.exists(_ROOT.value) and not os.path.isdir(_ROOT.value):
    raise UserInputError(f"--root={_ROOT.value!r} is a file; expected a directory for the rows' "
                         "workdirs")
  paper = PAPER[_PAPER_MODEL.value]
  table = []
  for row in _ROWS.value:
    line = {"row": LABELS[row]}
    for game in _GAMES.value:
      workdir = os.path.join(_ROOT.value, f"{game}_{row}")
      result = _latest_eval(workdir)
      if result is None and not _COLLECT_ONLY.value:
        _run_row(game, row, workdir)
        result = _latest_eval(workdir)
      line[f"{game} (ours)"] = None if result is None else 100 * result["eval/accuracy"]
      if row in paper:
        line[f"{game} (paper)"] = paper[row][GAMES.index(game)]
    table.append(line)
  columns = ["row"] + [f"{g} ({w})" for g in _GAMES.value for w in ("ours", "paper")]
  os.makedirs(_ROOT.value, exist_ok=True)
  stem = os.path.join(_ROOT.value, f"{_TABLE.value}_{_SCALE.value}")
  fmt = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
  markdown = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  markdown += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in table]
  text = "\n".join(markdown) + "\n"
  with open(stem + ".md", "w") as f:
    f.write(f"AT-GRPO games, accuracy %: ours ({_SCALE.value} scale) vs paper "
            f"({_PAPER_MODEL.value})\n\n" + text)
  with open(stem + ".csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows([{c: r.get(c) for c in columns} for r in table])
  print(text)
  print(f"wrote {stem}.md and {stem}.csv")


if __name__ == "__main__":
  cli.run(main)
