"""experiments.reproduce: every table's paper-scale commands, collection of finished runs into
mean +- standard error over seeds, beside docs/papers.md's numbers (nothing is run here)."""

from __future__ import annotations

import json
import math
import os
import shlex

import pytest

from experiments import reproduce
from marl_jax.training import eval_results
from entry_points import error_line, run


def _write_eval(root, table, config, row, seed, values, split=None, options=()):
  """A finished evaluation as experiments.evaluate leaves it (step 2), and an older one (step 1)
  that collection must skip."""
  path = reproduce.workdir(str(root), table, config, row, seed, options)
  prefix = split or "eval"
  for step, scale in ((1, 0.5), (2, 1.0)):
    eval_results.write(path, step, split, {"config": f"{config}_{row}", "step": step,
                                           **{f"{prefix}/{k}": scale * v
                                              for k, v in values.items()}})


@pytest.mark.parametrize("table", sorted(reproduce.TABLES))
def test_paper_scale_prints_every_cells_commands(table, tmp_path):
  """Nothing runs at paper scale: each missing cell's train (RL rows) and evaluate commands are
  printed, with the model, seed and the papers' data files under --data_dir."""
  t = reproduce.TABLES[table]
  result = run("reproduce", f"--table={table}", "--scale=paper", f"--root={tmp_path}",
               "--seeds=2", "--model=/ckpt/model", "--data_dir=/data")
  assert result.returncode == 0, result.stderr
  lines = [line for line in result.stdout.splitlines() if line.startswith("python -m")]
  want = set()
  for row in t.rows:
    for column in t.paper_columns:
      for seed in (0, 1):
        want.update(reproduce.commands(table, column, row, seed, str(tmp_path), "/ckpt/model",
                                       "/data", row in t.eval_only))
  assert set(lines) == want and len(lines) == len(want)
  trains = [shlex.split(line) for line in lines if "experiments.train" in line]
  rl_rows = [r for r in t.rows if r not in t.eval_only]
  configs = {c.config for c in t.paper_columns}
  assert len(trains) == len(rl_rows) * len(configs) * 2  # one training run per (row, config, seed)
  for argv in trains:
    assert "--config.model=/ckpt/model" in argv
    assert any(a.startswith("--config.seed=") for a in argv)
  for column in t.paper_columns:
    for key, name in column.eval_data:
      value = os.path.join("/data", name) if name in reproduce.PAPER_DATA.values() else name
      assert any(f"--config.eval.env_kwargs.{key}={value}" in shlex.split(line) for line in lines)
  assert not os.path.exists(os.path.join(tmp_path, table))  # no workdir was created


def test_collects_finished_runs_with_standard_errors(tmp_path):
  """Three seeds of MAS + AT-GRPO on Plan-Path and the AIME24 split of a math run are collected
  into mean +- SE beside the paper's numbers; a cell with fewer seeds says so."""
  for seed, acc in enumerate((0.5, 0.75, 1.0)):
    _write_eval(tmp_path, "atgrpo_games", "atgrpo_plan_path", "mas_shared", seed,
                {"accuracy": acc})
  _write_eval(tmp_path, "atgrpo_games", "atgrpo_sudoku", "mas_shared", 0, {"accuracy": 0.25})
  result = run("reproduce", "--table=atgrpo_games", "--scale=paper", f"--root={tmp_path}",
               "--seeds=3", "--rows=mas_shared", "--games=sudoku,plan_path")
  assert result.returncode == 0, result.stderr
  se = 100 * math.sqrt(0.0625 / 3)
  row = next(line for line in result.stdout.splitlines()
             if line.startswith("| MAS + AT-GRPO shared"))
  assert row == (f"| MAS + AT-GRPO shared | 25.00 (1/3 seeds) | 99.00 | 75.00 +- {se:.2f} | "
                 "96.00 |")
  assert (tmp_path / "atgrpo_games_paper.md").read_text().count("MAS + AT-GRPO shared") == 1

  _write_eval(tmp_path, "atgrpo_math_code", "atgrpo_math", "mas_full", 0, {"accuracy": 0.1},
              split="aime24")
  result = run("reproduce", "--table=atgrpo_math_code", "--scale=paper", f"--root={tmp_path}",
               "--rows=mas_full", "--columns=AIME24", "--paper_model=qwen3-8b")
  assert result.returncode == 0, result.stderr
  assert "| MAS + AT-GRPO per-role | 10.00 | 57.00 |" in result.stdout
  assert "command(s) to run" not in result.stdout


def test_preset_options_have_their_own_cells_and_report(tmp_path):
  """`--options=rl` collects the `ROW,cpu,rl` cells only, into their own report; the same row's
  cells without the option are not mixed in."""
  for seed, acc in enumerate((0.25, 0.5)):
    _write_eval(tmp_path, "atgrpo_games", "atgrpo_plan_path", "mas_grpo", seed,
                {"accuracy": acc}, options=("rl",))
    _write_eval(tmp_path, "atgrpo_games", "atgrpo_plan_path", "mas_grpo", seed,
                {"accuracy": 1.0})
  result = run("reproduce", "--table=atgrpo_games", "--scale=cpu", f"--root={tmp_path}",
               "--seeds=2", "--rows=mas_grpo", "--games=plan_path", "--options=rl",
               "--collect_only")
  assert result.returncode == 0, result.stderr
  assert "ours (cpu,rl scale, 2 seed(s))" in result.stdout
  assert "| MAS + GRPO groups (ablation) | 37.50 +- 12.50 | - |" in result.stdout
  assert (tmp_path / "atgrpo_games_cpu_rl.md").is_file()
  assert not (tmp_path / "atgrpo_games_cpu.md").exists()
  assert reproduce.cpu_preset("mas_grpo", ("rl",)) == "mas_grpo,cpu,rl"


def test_paper_scale_counts_the_local_evaluation_rows(tmp_path):
  """With the evaluation file present, the command evaluates each of its rows once."""
  (tmp_path / "data").mkdir()
  rows = [{"problem": f"{i} + 1?", "answer": str(i + 1)} for i in range(7)]
  (tmp_path / "data" / "aime24.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
  column = next(c for c in reproduce.TABLES["atgrpo_math_code"].paper_columns
                if c.name == "AIME24")
  cmds = reproduce.commands("atgrpo_math_code", column, "mas_shared", 0, "/runs", None,
                            str(tmp_path / "data"), False)
  assert len(cmds) == 2 and "--config.eval.num_problems=7" in shlex.split(cmds[1])
  assert "--split=aime24" in shlex.split(cmds[1])


def test_bad_flags_are_one_line(tmp_path):
  error_line(run("reproduce", "--table=drmas", f"--root={tmp_path}", "--games=sudoku"),
             "--games applies to --table=atgrpo_games only")
  error_line(run("reproduce", "--table=marft", f"--root={tmp_path}", "--columns=code"),
             "--columns has unknown entries ['code']")
  error_line(run("reproduce", f"--root={tmp_path}", "--seeds=0"), "--seeds=0")
  error_line(run("reproduce", f"--root={tmp_path}", "--paper_model=gpt"), "--paper_model='gpt'")
  error_line(run("reproduce", f"--root={tmp_path}", "--games=sokoban", "--options=rl"),
             "--options=rl: configs/atgrpo_sokoban.py: config preset 'single,cpu,rl': unknown "
             "option 'rl'")
  error_line(run("reproduce", "--table=drmas", f"--root={tmp_path}", "--columns=math avg@2",
                 "--options=rl"),
             "--options=rl: configs/drmas_math.py: config.algo: filter 'zero_variance' applies to")
  error_line(run("reproduce", f"--root={tmp_path}", "--scale=paper", "--options=rl"),
             "--options=rl applies to --scale=cpu only")
  assert not any(tmp_path.iterdir())  # refused before any cell ran
