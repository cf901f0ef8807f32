"""Every entry point ends bad input in ONE `error: ...` line (non-zero exit, no traceback), and
before any model loads where the bad value is known before loading.

"Before loading" is shown without timing: the configs name an existing but empty model directory,
which passes the config check and would fail loading with a different error, so a run that reports
our line instead never reached the loader.
"""

from __future__ import annotations

import pytest

from entry_points import error_line, run

GAME = "--config=configs/atgrpo_plan_path.py:mas_shared,cpu"
MATH = "--config=configs/drmas_math.py:cpu"

@pytest.fixture
def empty_model(tmp_path) -> str:
  path = tmp_path / "empty_model"
  path.mkdir()
  return f"--config.model={path}"


# ------------------------------------------------------------------------------ flags and configs

@pytest.mark.parametrize("module", ["train", "evaluate"])
def test_config_flag_errors(module, tmp_path):
  workdir = f"--workdir={tmp_path / 'run'}"
  error_line(run(module, GAME, workdir, "--config.train.stepz=3"),
             "--config.train.stepz", "'stepz'", 'Did you mean "steps"')
  error_line(run(module, "--config=configs/atgrpo_plan_path.py:nopreset", workdir),
             "nopreset", "unknown option 'nopreset'")
  error_line(run(module, "--config=configs/no_such_file.py", workdir),
             "configs/no_such_file.py", "expected configs/NAME.py[:PRESET]")
  error_line(run(module, GAME, workdir, "--config.train.steps=abc"), "--config.train.steps=abc")


def test_train_bad_values_stop_before_the_model_loads(tmp_path, empty_model):
  workdir = f"--workdir={tmp_path / 'run'}"
  error_line(run("train", GAME, workdir, empty_model, "--config.rollout.tool_timeout_s=-1"),
             "config.rollout.tool_timeout_s=-1.0", "expected a finite number > 0")
  error_line(run("train", GAME, workdir, empty_model, "--config.rollout.tool_memory_mb=0"),
             "config.rollout.tool_memory_mb=0", "expected a finite number > 0")
  error_line(run("train", GAME, workdir, empty_model, "--config.train.mesh=(16,1,1)"),
             "config.train.mesh=(16, 1, 1)", "8 available devices")
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  error_line(run("train", GAME, f"--workdir={a_file}", empty_model),
             f"workdir '{a_file}' is a file", "expected a directory")
  error_line(run("train", GAME, f"--workdir={a_file}/run", empty_model),
             f"workdir '{a_file}/run' is not writable", "expected a directory")


@pytest.mark.parametrize("override, named", [
    ("--config.optim.lr=nan", "config.optim.lr=nan; expected a finite number"),
    ("--config.optim.lr=inf", "config.optim.lr=inf; expected a finite number"),
    ("--config.loss.clip_high=nan", "config.loss.clip_high=nan; expected a finite number"),
    ("--config.env.kwargs.height=-3", "height=-3; expected an integer in [1, 50]"),
    ("--config.seed=1180591620717411303424", "config.seed=1180591620717411303424"),
])
def test_train_bad_numbers_stop_before_the_model_loads(tmp_path, empty_model, override, named):
  error_line(run("train", GAME, f"--workdir={tmp_path / 'run'}", empty_model, override), named)


def test_binary_flagfile_is_one_line(tmp_path):
  flagfile = tmp_path / "flags.bin"
  flagfile.write_bytes(bytes(range(128, 256)) * 4)
  for module in ("train", "generate"):
    error_line(run(module, f"--flagfile={flagfile}"), f"--flagfile={flagfile}",
               "not UTF-8 text")


def test_train_bad_datasets_name_file_and_line(tmp_path, empty_model):
  workdir = f"--workdir={tmp_path / 'run'}"
  directory = tmp_path / "rows.jsonl"
  directory.mkdir()
  error_line(run("train", MATH, workdir, empty_model, f"--config.env.kwargs.path={directory}"),
             f"data file '{directory}' is a directory", "expected a .jsonl file")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "1+1", "answer": "2"}\n\n{"question": oops}\n')
  error_line(run("train", MATH, workdir, empty_model, f"--config.env.kwargs.path={bad}"),
             f"{bad}:3: not valid JSON")


def test_evaluate_missing_checkpoint_and_eval_only_train(tmp_path, empty_model):
  error_line(run("evaluate", GAME, f"--workdir={tmp_path / 'run'}", empty_model, "--checkpoint=5"),
             "--checkpoint=5", "no such checkpoint", "[]")
  error_line(run("train", "--config=configs/atgrpo_plan_path.py:mas_norl,cpu",
                 f"--workdir={tmp_path / 'run'}"), "evaluation-only", "experiments.evaluate")


# ------------------------------------------------------------------------------ other entry points

@pytest.mark.parametrize("prompt", ["", "   "])
def test_generate_refuses_an_empty_prompt(prompt):
  error_line(run("generate", f"--prompt={prompt}", "--model=/no/such/model"), "--prompt=",
             "is empty", "expected the user message text")


def test_generate_refuses_a_seed_jax_cannot_take_and_non_utf8_prompts():
  error_line(run("generate", "--prompt=hi", "--model=/no/such/model",
                 f"--seed={2**70}"), f"--seed={2**70}", "range [0, 9223372036854775807]")
  error_line(run("generate", "--prompt=caf\udcc3\udca9 \udcff", "--model=/no/such/model"),
             "--prompt is not valid UTF-8 text")


def test_reproduce_bad_flags_and_rows(tmp_path):
  error_line(run("reproduce", f"--root={tmp_path}", "--rows=bogus"), "--rows", "['bogus']",
             "expected a subset of")
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  error_line(run("reproduce", f"--root={a_file}"), f"--root='{a_file}' is a file")
  # A row's config is checked before its model loads.
  error_line(run("reproduce", f"--root={tmp_path / 'repro'}", "--rows=mas_shared",
                 "--games=plan_path", "--model=/no/such/model"),
             "config.model='/no/such/model'", "neither a known preset")
