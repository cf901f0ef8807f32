r"""Reproduces a paper table: runs (cpu scale) or lists and collects (paper scale) every cell, and
prints ours beside the paper's.

    python -m experiments.reproduce --table=atgrpo_games --scale=cpu --root=/tmp/repro --seeds=3
    python -m experiments.reproduce --table=drmas --scale=paper --root=/runs \
        --model=/ckpt/Qwen3-4B --data_dir=/data

Tables: atgrpo_games, atgrpo_math_code (docs/papers.md section 1), drmas (section 2), magrpo
(section 3), marft (section 4). A row is a config preset; a column is what it is evaluated on.
Each (row, config, seed) trains once in `ROOT/<table>/<config>_<row>_seed<s>` (rows without RL
only evaluate, step 0: the policy RL would start from, warm-started where the config has a
warm-start) and writes one evaluation per column (`eval/step<N>.json`, or
`eval/<split>_step<N>.json` when a column names its own evaluation set).

At cpu scale every missing cell runs on the embedded model with generated problems (the columns
that need the papers' datasets are replaced by one generated-problem column per config);
`--options=rl` adds preset options to every cell (`ROW,cpu,rl`: the Plan-Path RL comparison
schedule), in workdirs `<config>_<row>_rl_seed<s>` and a report `<table>_cpu_rl.md`. At paper
scale nothing runs: the exact train and evaluate command of every missing cell is printed (the
papers' data read from `--data_dir` under the file names in PAPER_DATA) and finished runs are
collected. With `--seeds=N` a cell is the mean +- standard error over seeds 0..N-1. Writes
`ROOT/<table>_<scale>.md` and `.csv`. Bad input ends in one `error: ...` line (each cell's config
and workdir are checked before its model loads).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import shlex

from absl import flags

from experiments import cli
from experiments.stats import mean_se
from marl_jax.errors import UserInputError
from marl_jax.training import eval_results


@dataclasses.dataclass(frozen=True)
class Column:
  """One column: evaluations of `config`'s rows, read as `metric` (x100 when `percent`).

  `split` names the evaluation set when it is not the config's own (`eval/<split>_step<N>.json`);
  `eval_data` maps eval env kwargs to file names under --data_dir (paper scale), `train_data` the
  training env kwargs likewise."""

  name: str
  config: str
  metric: str = "accuracy"
  percent: bool = True
  split: str | None = None
  eval_data: tuple[tuple[str, str], ...] = ()
  train_data: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Table:
  title: str
  rows: tuple[str, ...]  # config presets (one option each), in print order
  labels: dict[str, str]
  paper_columns: tuple[Column, ...]
  cpu_columns: tuple[Column, ...]
  eval_only: tuple[str, ...] = ()  # rows that only evaluate (no RL)
  # paper model -> row -> column name -> the paper's number
  paper: dict[str, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)
  note: str = ""


# The papers' datasets as files under --data_dir (paper scale); docs/configs.md says how to
# prepare them.
PAPER_DATA = {
    "polaris": "polaris_53k.parquet", "aime24": "aime24.jsonl", "aime25": "aime25.jsonl",
    "olympiadbench": "olympiadbench.jsonl", "code_train": "codecontests_apps_train.jsonl",
    "livecodebench": "livecodebench_v6.jsonl", "apps": "apps_test.jsonl",
    "codecontests": "codecontests_test.jsonl", "dapo_filter": "dapo_filter.parquet",
    "math500": "math500.jsonl", "search_corpus": "wiki18_corpus.jsonl",
    "search_train": "nq_hotpotqa_train.jsonl", "search_test": "search_r1_test.jsonl",
    "tldr_train": "tldr_train.jsonl", "tldr_test": "tldr_test.jsonl",
    "arxiv_train": "arxiv_train.jsonl", "arxiv_test": "arxiv_test.jsonl",
}

_ATGRPO_ROWS = ("single", "sa_grpo", "mas_norl", "mas_shared", "mas_lora", "mas_full")
_ATGRPO_LABELS = {"single": "Single agent", "sa_grpo": "SA + GRPO", "mas_norl": "MAS (no RL)",
                  "mas_shared": "MAS + AT-GRPO shared",
                  "mas_lora": "MAS + AT-GRPO per-role LoRA", "mas_full": "MAS + AT-GRPO per-role",
                  "mas_grpo": "MAS + GRPO groups (ablation)"}
GAMES = ("sudoku", "sokoban", "plan_path")  # the paper's column order


def _paper_rows(columns: tuple[str, ...], values: dict[str, tuple[float, ...]]
                ) -> dict[str, dict[str, float]]:
  return {row: dict(zip(columns, numbers)) for row, numbers in values.items()}


# Dr. MAS search: the retrieval corpus for training and testing, NQ + HotpotQA to train on.
_SEARCH_TRAIN = (("corpus_path", PAPER_DATA["search_corpus"]),
                 ("questions_path", PAPER_DATA["search_train"]))
_SEARCH_TEST = (("corpus_path", PAPER_DATA["search_corpus"]),
                ("questions_path", PAPER_DATA["search_test"]))
_MATH_CODE = ("LCB", "APPS", "CC", "AIME24", "AIME25", "OlyB")


def _math_code_columns() -> tuple[Column, ...]:
  code_train = (("path", PAPER_DATA["code_train"]),)
  math_train = (("path", PAPER_DATA["polaris"]),)
  return tuple(
      Column(name, config, split=name.lower(), eval_data=(("path", PAPER_DATA[data]),),
             train_data=train)
      for name, config, data, train in (
          ("LCB", "atgrpo_code", "livecodebench", code_train),
          ("APPS", "atgrpo_code", "apps", code_train),
          ("CC", "atgrpo_code", "codecontests", code_train),
          ("AIME24", "atgrpo_math", "aime24", math_train),
          ("AIME25", "atgrpo_math", "aime25", math_train),
          ("OlyB", "atgrpo_math", "olympiadbench", math_train)))


TABLES = {
    "atgrpo_games": Table(
        "AT-GRPO games, accuracy %",
        _ATGRPO_ROWS + ("mas_grpo",), _ATGRPO_LABELS,
        tuple(Column(g, f"atgrpo_{g}") for g in GAMES),
        tuple(Column(g, f"atgrpo_{g}") for g in GAMES),
        eval_only=("single", "mas_norl"),
        paper={"qwen3-1.7b": _paper_rows(GAMES, {
                   "single": (7.00, 0.00, 5.00), "sa_grpo": (29.00, 3.00, 11.00),
                   "mas_norl": (69.00, 0.00, 10.00), "mas_shared": (99.00, 10.00, 96.00),
                   "mas_full": (99.00, 11.50, 97.00)}),
               "qwen3-8b": _paper_rows(GAMES, {
                   "single": (48.00, 9.00, 12.00), "sa_grpo": (54.00, 14.00, 47.00),
                   "mas_norl": (72.00, 16.00, 71.00), "mas_shared": (99.50, 96.00, 93.00),
                   "mas_full": (99.00, 98.00, 96.00)})}),
    "atgrpo_math_code": Table(
        "AT-GRPO code and math, accuracy %",
        _ATGRPO_ROWS + ("mas_grpo",), _ATGRPO_LABELS, _math_code_columns(),
        (Column("code (generated)", "atgrpo_code"), Column("math (generated)", "atgrpo_math")),
        eval_only=("single", "mas_norl"),
        paper={"qwen3-1.7b": _paper_rows(_MATH_CODE, {
                   "single": (11.60, 16.20, 3.60, 13.40, 9.80, 22.20),
                   "sa_grpo": (18.80, 17.00, 3.00, 10.00, 6.70, 23.80),
                   "mas_norl": (19.00, 16.60, 3.60, 13.30, 13.00, 35.90),
                   "mas_shared": (20.90, 17.60, 4.80, 16.70, 16.70, 39.60),
                   "mas_full": (24.00, 18.60, 7.80, 13.30, 18.30, 35.20)}),
               "qwen3-8b": _paper_rows(_MATH_CODE, {
                   "single": (22.80, 30.20, 15.75, 18.30, 20.00, 55.00),
                   "sa_grpo": (25.70, 37.00, 12.12, 18.30, 26.67, 54.80),
                   "mas_norl": (28.00, 44.40, 17.60, 36.60, 30.00, 56.50),
                   "mas_shared": (30.28, 45.80, 18.10, 50.00, 35.20, 56.80),
                   "mas_full": (33.10, 46.50, 18.10, 57.00, 40.00, 56.60)})}),
    "drmas": Table(
        "Dr. MAS vs GRPO: math (MATH500) and search, avg@16 and pass@16 %",
        ("grpo", "drmas"), {"grpo": "GRPO (one baseline per question)",
                            "drmas": "Dr. MAS (per-agent normalisation)"},
        (Column("math avg@16", "drmas_math", split="math500",
                eval_data=(("path", PAPER_DATA["math500"]),),
                train_data=(("path", PAPER_DATA["dapo_filter"]), ("fmt", "plain"))),
         Column("math pass@16", "drmas_math", metric="pass@16", split="math500",
                eval_data=(("path", PAPER_DATA["math500"]),),
                train_data=(("path", PAPER_DATA["dapo_filter"]), ("fmt", "plain"))),
         Column("search avg@16", "drmas_search", split="search", eval_data=_SEARCH_TEST,
                train_data=_SEARCH_TRAIN),
         Column("search pass@16", "drmas_search", metric="pass@16", split="search",
                eval_data=_SEARCH_TEST, train_data=_SEARCH_TRAIN)),
        (Column("math avg@2", "drmas_math"), Column("math pass@2", "drmas_math", metric="pass@2"),
         Column("search avg@2", "drmas_search"),
         Column("search pass@2", "drmas_search", metric="pass@2")),
        note="docs/papers.md section 2 gives Dr. MAS's gain over GRPO, not the absolute numbers: "
             "math +5.6 avg@16 / +4.6 pass@16, search +15.2 avg@16 / +13.1 pass@16 (Qwen3-4B "
             "math, Qwen2.5-3B search; the search test file joins the seven Search-R1 sets)."),
    "magrpo": Table(
        "MAGRPO: writing (joint reward, max 3) and coding (pass %)",
        ("magrpo", "rloo", "remax"), {"magrpo": "MAGRPO (mean baseline)",
                                      "rloo": "MARLOO (leave-one-out)",
                                      "remax": "MAReMax (max baseline)"},
        (Column("TLDR reward", "magrpo_tldr", metric="reward/agent1", percent=False, split="tldr",
                eval_data=(("path", PAPER_DATA["tldr_test"]), ("field", "prompt")),
                train_data=(("path", PAPER_DATA["tldr_train"]), ("field", "prompt"))),
         Column("arXiv reward", "magrpo_arxiv", metric="reward/agent1", percent=False,
                split="arxiv", eval_data=(("path", PAPER_DATA["arxiv_test"]),),
                train_data=(("path", PAPER_DATA["arxiv_train"]),)),
         Column("HumanEval pass", "magrpo_humaneval")),
        (Column("TLDR reward", "magrpo_tldr", metric="reward/agent1", percent=False),
         Column("arXiv reward", "magrpo_arxiv", metric="reward/agent1", percent=False),
         Column("HumanEval pass", "magrpo_humaneval")),
        note="docs/papers.md section 3 records no MAGRPO result numbers; the columns show ours "
             "only. The writing reward is the joint reward both agents receive (agent1's mean)."),
    "marft": Table(
        "MARFT math, accuracy %",
        ("action", "token"), {"action": "MARFT action-level PPO", "token": "MARFT token-level PPO"},
        (Column("math", "marft_math"),), (Column("math", "marft_math"),),
        note="docs/papers.md section 4 cites MARFT-A's gain from a secondary source only (about "
             "+18.45% on MATH), with no absolute numbers to print."),
}

_TABLE = flags.DEFINE_enum("table", "atgrpo_games", sorted(TABLES), "Which table.")
_SCALE = flags.DEFINE_enum("scale", "cpu", ["cpu", "paper"], "cpu: run the embedded SmolLM2 "
                           "presets; paper: print the paper-scale commands and collect results.")
_ROOT = flags.DEFINE_string("root", None, "Directory holding one workdir per cell.")
_ROWS = flags.DEFINE_list("rows", None, "Rows to include (default: all of the table's).")
_COLUMNS = flags.DEFINE_list("columns", None, "Columns (names) to include (default: all).")
_GAMES = flags.DEFINE_list("games", None, f"atgrpo_games only: the games, from {list(GAMES)}.")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Seeds per cell (0..N-1): mean +- standard error.")
_MODEL = flags.DEFINE_string("model", None, "Model override for every cell (paper scale: a local "
                             "checkpoint; pick --columns when a table's configs use different "
                             "models).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Paper scale: directory with the papers' data "
                                "files named as in PAPER_DATA.")
_PAPER_MODEL = flags.DEFINE_string("paper_model", None, "Which paper model's numbers to print "
                                   "beside ours (default: the table's first).")
_OPTIONS = flags.DEFINE_list("options", [], "Cpu scale: preset options added to every cell's "
                             "`ROW,cpu` (e.g. `rl`: atgrpo_games on plan_path with the RL "
                             "comparison schedule, configs/atgrpo_plan_path.py). The cells get "
                             "their own workdirs and report.")
_COLLECT_ONLY = flags.DEFINE_bool("collect_only", False, "Only collect existing evaluations.")
flags.mark_flag_as_required("root")


def workdir(root: str, table: str, config: str, row: str, seed: int,
            options: tuple[str, ...] = ()) -> str:
  return os.path.join(root, table, "_".join((config, row, *options, f"seed{seed}")))


def cpu_preset(row: str, options: tuple[str, ...]) -> str:
  """The config preset of a cpu-scale cell."""
  return ",".join((row, "cpu", *options))


def cell_value(column: Column, result: dict | None) -> float | None:
  if result is None:
    return None
  key = f"{column.split or 'eval'}/{column.metric}"
  if key not in result:
    raise UserInputError(f"evaluation {result.get('config')!r} has no {key!r}; it has "
                         f"{sorted(k for k in result if '/' in k)}")
  return result[key] * (100.0 if column.percent else 1.0)


def commands(table: str, column: Column, row: str, seed: int, root: str, model: str | None,
             data_dir: str | None, eval_only: bool) -> list[str]:
  """The paper-scale commands of one cell: train (RL rows) and evaluate (on the column's set)."""
  path = workdir(root, table, column.config, row, seed)
  data = data_dir or "DATA"
  common = [f"--config=configs/{column.config}.py:{row}", f"--workdir={path}",
            f"--config.seed={seed}"]
  if model:
    common.append(f"--config.model={model}")
  common += [f"--config.env.kwargs.{k}={_data_value(data, v)}" for k, v in column.train_data]
  out = [] if eval_only else [shlex.join(["python", "-m", "experiments.train", *common])]
  evaluate = ["python", "-m", "experiments.evaluate", *common]
  eval_kwargs = {k: _data_value(data, v) for k, v in column.eval_data}
  evaluate += [f"--config.eval.env_kwargs.{k}={v}" for k, v in eval_kwargs.items()]
  rows = _file_rows(column.config, eval_kwargs)
  if rows is not None:
    evaluate.append(f"--config.eval.num_problems={rows}")  # every row once
  if column.split:
    evaluate.append(f"--split={column.split}")
  return out + [shlex.join(evaluate)]


def _data_value(data_dir: str, value: str) -> str:
  return os.path.join(data_dir, value) if value in PAPER_DATA.values() else value


def _file_rows(config: str, eval_kwargs: dict[str, str]) -> int | None:
  """Rows of the local evaluation set (so the command evaluates each once); None when a file is
  absent (the command then keeps the config's eval.num_problems)."""
  paths = [v for v in eval_kwargs.values() if v.endswith(tuple(PAPER_DATA.values()))]
  if not eval_kwargs or not all(os.path.isfile(p) for p in paths):
    return None
  from marl_jax.workflows import registry
  c = _module(config).get_config(None)
  return registry.task(c.env.name, c.env.workflow).dataset_rows(eval_kwargs)


def _module(config: str):
  return __import__(f"configs.{config}", fromlist=["get_config"])


def _check_presets(columns: tuple[Column, ...], rows: tuple[str, ...],
                   options: tuple[str, ...]) -> None:
  """Every cell's cpu preset exists and its config builds (before any cell runs)."""
  from marl_jax.training import config as config_lib
  for column in columns:
    for row in rows:
      try:
        config_lib.build(_module(column.config).get_config(cpu_preset(row, options)))
      except ValueError as e:
        raise UserInputError(f"--options={','.join(options)}: configs/{column.config}.py: "
                             f"{e}") from None


def _run_cell(table: Table, column: Column, row: str, seed: int, path: str,
              options: tuple[str, ...]) -> None:
  """Trains (once per workdir) and evaluates one cell at cpu scale."""
  from marl_jax.training import evaluation, trainer
  from marl_jax.training.checkpoint import saved_steps
  config = _module(column.config).get_config(cpu_preset(row, options))
  config.seed = seed
  if _MODEL.value:
    config.model = _MODEL.value
  if row not in table.eval_only and not (os.path.isdir(path) and
                                         config.train.steps in saved_steps(path)):
    trainer.train(config, path)
  evaluation.evaluate_checkpoint(config, path, None, column.split)


def _selected(name: str, values: list[str] | None, allowed: tuple[str, ...]) -> tuple[str, ...]:
  if values is None:
    return allowed
  bad = sorted(set(values) - set(allowed))
  if bad:
    raise UserInputError(f"--{name} has unknown entries {bad}; expected a subset of "
                         f"{list(allowed)}")
  return tuple(v for v in allowed if v in values)


def main(argv):
  del argv
  name = _TABLE.value
  table = TABLES[name]
  paper_scale = _SCALE.value == "paper"
  columns = table.paper_columns if paper_scale else table.cpu_columns
  rows = _selected("rows", _ROWS.value, table.rows)
  picked = _selected("columns", _COLUMNS.value, tuple(c.name for c in columns))
  if _GAMES.value is not None:
    if name != "atgrpo_games":
      raise UserInputError(f"--games applies to --table=atgrpo_games only; got --table={name}")
    picked = _selected("games", _GAMES.value, GAMES)
  columns = tuple(c for c in columns if c.name in picked)
  options = tuple(_OPTIONS.value)
  if options and paper_scale:
    raise UserInputError(f"--options={','.join(options)} applies to --scale=cpu only (paper scale "
                         "prints each cell's command: add overrides there)")
  if options:
    _check_presets(columns, rows, options)
  if _SEEDS.value < 1:
    raise UserInputError(f"--seeds={_SEEDS.value}; expected an integer >= 1")
  if os.path.exists(_ROOT.value) and not os.path.isdir(_ROOT.value):
    raise UserInputError(f"--root={_ROOT.value!r} is a file; expected a directory for the "
                         "cells' workdirs")
  paper_model = _PAPER_MODEL.value or next(iter(table.paper), None)
  if paper_model is not None and table.paper and paper_model not in table.paper:
    raise UserInputError(f"--paper_model={paper_model!r}; expected one of {sorted(table.paper)}")
  paper = table.paper.get(paper_model, {})
  todo, lines = [], []
  for row in rows:
    line: dict[str, object] = {"row": table.labels[row]}
    for column in columns:
      values = []
      for seed in range(_SEEDS.value):
        path = workdir(_ROOT.value, name, column.config, row, seed, options)
        result = eval_results.latest(path, column.split)
        if result is None and paper_scale:
          todo += commands(name, column, row, seed, _ROOT.value, _MODEL.value, _DATA_DIR.value,
                           row in table.eval_only)
        elif result is None and not _COLLECT_ONLY.value:
          _run_cell(table, column, row, seed, path, options)
          result = eval_results.latest(path, column.split)
        value = cell_value(column, result)
        if value is not None:
          values.append(value)
      line[f"{column.name} (ours)"] = _format(values, _SEEDS.value)
      if paper:
        number = paper.get(row, {}).get(column.name)
        line[f"{column.name} (paper)"] = "-" if number is None else f"{number:.2f}"
    lines.append(line)
  headers = ["row"] + [f"{c.name} ({w})" for c in columns
                       for w in (("ours", "paper") if paper else ("ours",))]
  os.makedirs(_ROOT.value, exist_ok=True)
  stem = os.path.join(_ROOT.value, "_".join((name, _SCALE.value, *options)))
  markdown = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  markdown += ["| " + " | ".join(str(r.get(h, "-")) for h in headers) + " |" for r in lines]
  scale = ",".join((_SCALE.value, *options))
  title = (f"{table.title}: ours ({scale} scale, {_SEEDS.value} seed(s)"
           + (f") vs paper ({paper_model})" if paper else ")"))
  text = "\n".join([title, "", *markdown, *([f"\n{table.note}"] if table.note else [])]) + "\n"
  with open(stem + ".md", "w") as f:
    f.write(text)
  with open(stem + ".csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=headers)
    writer.writeheader()
    writer.writerows([{h: r.get(h, "-") for h in headers} for r in lines])
  print(text)
  todo = list(dict.fromkeys(todo))  # a training run shared by columns is listed once
  if todo:
    print(f"{len(todo)} command(s) to run for the missing cells (then rerun this to collect):")
    print("\n".join(todo))
  print(f"wrote {stem}.md and {stem}.csv")


def _format(values: list[float], seeds: int) -> str:
  if not values:
    return "-"
  mean, se = mean_se(values)
  text = f"{mean:.2f}" if se is None else f"{mean:.2f} +- {se:.2f}"
  return text if len(values) == seeds else f"{text} ({len(values)}/{seeds} seeds)"


if __name__ == "__main__":
  cli.run(main)
