"""Metric writers (JSONL, console, fan-out, wandb modes), curve plots, summary tables, bars."""
from __future__ import annotations

import json
import math
import time

from absl import logging as absl_logging
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from marl_jax.training import metrics, plots, progress


def _config(**overrides):
  cfg = metrics.default_config()
  cfg.update(overrides)
  return cfg


def test_jsonl_round_trip_with_array_scalars(tmp_path):
  writer = metrics.JsonlWriter(tmp_path)
  writer.write_scalars(1, {"train/reward": jnp.float32(0.5), "train/n": np.int64(3),
                           "train/loss": 1.25})
  writer.write_scalars(2, {"train/reward": np.float32(0.75), "eval/accuracy": math.nan})
  writer.flush()

  records = metrics.read_metrics(tmp_path)
  assert records[0] == {"step": 1, "train/reward": 0.5, "train/n": 3, "train/loss": 1.25}
  assert records[1]["train/reward"] == 0.75 and math.isnan(records[1]["eval/accuracy"])
  steps, values = metrics.metric_series(records, "train/loss")
  np.testing.assert_array_equal(steps, [1])
  np.testing.assert_array_equal(values, [1.25])
  writer.close()


def test_jsonl_rejects_non_scalars(tmp_path):
  writer = metrics.JsonlWriter(tmp_path)
  with pytest.raises(ValueError, match=r"metric 'x' has shape \(2,\); expected a scalar"):
    writer.write_scalars(0, {"x": np.zeros(2)})
  writer.close()


def test_jsonl_resume_drops_steps_after_the_checkpoint(tmp_path):
  writer = metrics.JsonlWriter(tmp_path)
  for step in range(1, 6):
    writer.write_scalars(step, {"r": step / 10})
  writer.close()
  # A kill mid-write leaves a truncated last line; reading tolerates it, resume removes it.
  with (tmp_path / metrics.METRICS_FILE).open("a") as f:
    f.write('{"step": 6, "r": 0.')

  resumed = metrics.JsonlWriter(tmp_path, resume_step=3)
  resumed.write_scalars(4, {"r": 0.45})
  resumed.close()
  assert metrics.read_metrics(tmp_path) == [
      {"step": 1, "r": 0.1}, {"step": 2, "r": 0.2}, {"step": 3, "r": 0.3}, {"step": 4, "r": 0.45}]
  metrics.JsonlWriter(tmp_path, resume_step=0).close()  # a restart that found no checkpoint
  assert metrics.read_metrics(tmp_path) == []


def test_read_metrics_reports_a_bad_line(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match=r"m.jsonl:2 is not a JSON object"):
    metrics.read_metrics(path)


def test_summary_and_hparams_files(tmp_path):
  writer = metrics.JsonlWriter(tmp_path)
  writer.write_hparams({"train": {"lr": 1e-6, "algo": "at_grpo"}})
  writer.write_summary({"eval/accuracy": jnp.float32(0.25), "steps": 10})
  writer.write_summary({"eval/accuracy": 0.5})
  writer.close()
  assert json.loads((tmp_path / metrics.HPARAMS_FILE).read_text())["train"]["algo"] == "at_grpo"
  assert json.loads((tmp_path / metrics.SUMMARY_FILE).read_text()) == {
      "eval/accuracy": 0.5, "steps": 10}


def test_console_writer_logs_one_compact_line(monkeypatch):
  lines = []
  monkeypatch.setattr(absl_logging, "info", lambda fmt, *args: lines.append(fmt % args))
  metrics.ConsoleWriter().write_scalars(12, {"train/reward": np.float32(0.51234567), "n": 4})
  assert lines == ["step 12 | train/reward 0.5123 | n 4"]


def test_make_writer_fans_out_on_process_zero_only(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "disabled")
  lines = []
  monkeypatch.setattr(absl_logging, "info", lambda fmt, *args: lines.append(fmt % args))
  other = metrics.make_writer(_config(), tmp_path / "p1", is_main_process=False)
  assert isinstance(other, metrics.NoOpWriter)
  other.write_scalars(1, {"r": 1.0})
  assert not (tmp_path / "p1").exists() and not lines

  writer = metrics.make_writer(_config(), tmp_path / "p0", is_main_process=True)
  assert [type(w) for w in writer.writers] == [metrics.JsonlWriter, metrics.ConsoleWriter]
  writer.write_scalars(1, {"r": 1.0})
  writer.close()
  assert metrics.read_metrics(tmp_path / "p0") == [{"step": 1, "r": 1.0}]
  assert lines == ["step 1 | r 1"]


def test_wandb_mode_from_environment_wins(monkeypatch):
  monkeypatch.delenv("WANDB_MODE", raising=False)
  assert metrics.resolve_wandb_mode("offline") == "offline"
  monkeypatch.setenv("WANDB_MODE", "disabled")
  assert metrics.resolve_wandb_mode("online") == "disabled"
  monkeypatch.setenv("WANDB_MODE", "dryrun")
  with pytest.raises(ValueError, match=r"unknown wandb mode 'dryrun'; expected one of"):
    metrics.resolve_wandb_mode("offline")


def test_wandb_offline_writes_a_local_run_and_resumes_its_id(tmp_path, monkeypatch):
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.setenv("WANDB_API_KEY", "")  # no account: offline must not need one
  cfg = _config(console=False, jsonl=False)
  writer = metrics.make_writer(cfg, tmp_path, is_main_process=True)
  (wandb_writer,) = writer.writers
  assert isinstance(wandb_writer, metrics.WandbWriter)
  writer.write_hparams({"lr": 1e-6})
  writer.write_scalars(1, {"train/reward": jnp.float32(0.5)})
  writer.write_summary({"final": 1})
  writer.close()
  run_id = (tmp_path / metrics.WANDB_RUN_ID_FILE).read_text()
  run_files = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
  assert len(run_files) == 1 and run_files[0].stat().st_size > 0

  again = metrics.make_writer(cfg, tmp_path, is_main_process=True)
  again.close()
  assert (tmp_path / metrics.WANDB_RUN_ID_FILE).read_text() == run_id


def test_wandb_online_without_account_falls_back_to_offline(tmp_path, monkeypatch):
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc credentials either
  cfg = _config(console=False, jsonl=False, wandb_mode="online", wandb_init_timeout_s=5.0)
  start = time.monotonic()
  writer = metrics.make_writer(cfg, tmp_path, is_main_process=True)
  writer.write_scalars(1, {"r": 1.0})
  writer.close()
  assert time.monotonic() - start < 30
  assert list((tmp_path / "wandb").glob("offline-run-*"))


def _fake_run_records():
  """A warm-started run's metrics as the trainer names them: step 0 holds the pretrained
  evaluation, the warm-start's and the evaluation after it; steps 1-10 the RL steps."""
  records = [{"step": 0, "pretrained/accuracy": 0.0, "pretrained/reward/tool": -1.0,
              "sft/steps": 8.0, "sft/loss": 0.1, "eval/accuracy": 0.25,
              "eval/reward/tool": 0.2}]
  for step in range(1, 11):
    record = {"step": step, "agent/reward/planner": 0.1 * step, "agent/reward/tool": -0.05 * step,
              "train/grad_norm": 2.0 ** -step, "train/loss": 1.0 / step,
              "rollout/success": 0.05 * step}
    if step % 5 == 0:
      record.update({"eval/accuracy": step / 20, "eval/reward/tool": 0.2 + step / 100})
    records.append(record)
  return records


def test_learning_curve_panels_join_pretrained_and_mark_the_phases(tmp_path):
  writer = metrics.JsonlWriter(tmp_path)
  for record in _fake_run_records():
    writer.write_scalars(record["step"], {k: v for k, v in record.items() if k != "step"})
  writer.close()
  records = metrics.read_metrics(tmp_path)

  assert [(p.title.split(" (")[0], names) for p, names in plots.panel_keys(records)] == [
      ("held-out success", ["eval/accuracy", "rollout/success"]),
      ("held-out reward per agent", ["eval/reward/tool"]),
      ("training reward per agent", ["agent/reward/planner", "agent/reward/tool"]),
      ("gradient norm", ["train/grad_norm"]),
  ]
  fig = plots.learning_curve_figure(records)
  success = fig.axes[0]
  held_out = {line.get_label(): line for line in success.get_lines()}["held-out (avg@k)"]
  x, y = held_out.get_data()
  # The pretrained value sits left of step 0, across the warm-start band, on the same line.
  assert x[0] < 0 and list(x[1:]) == [0, 5, 10] and list(y) == [0.0, 0.25, 0.25, 0.5]
  assert len(success.patches) == 2  # the warm-start and RL bands
  assert "warm-start: 8 steps" in fig.texts[0].get_text()

  out = plots.plot_learning_curves(tmp_path, tmp_path / "curves.png")
  image = matplotlib.image.imread(out)
  assert image.shape[1] > image.shape[0] > 100  # two panels a row, two rows
  assert image[..., :3].std() > 0.05  # not a blank canvas

  with pytest.raises(ValueError, match=r"no metric name starts with any of \['agent/grad_norm/'"):
    plots.plot_learning_curves([{"step": 1, "loss": 1.0}], tmp_path / "empty.png")


def test_learning_curve_draws_no_lone_dot():
  """A metric logged once (one RL step's gradient norm) is a labelled level, not one marker."""
  fig = plots.learning_curve_figure([{"step": 0, "eval/accuracy": 0.8},
                                     {"step": 1, "eval/accuracy": 0.8, "train/grad_norm": 0.0}])
  for ax in fig.axes:
    for line in ax.get_lines():
      assert len(line.get_xdata()) >= 2, line.get_label()
  grad = fig.axes[1]
  assert [t.get_text() for t in grad.texts] == ["0 (step 1)"]


def test_summary_rows_and_markdown_table(tmp_path):
  records = _fake_run_records()
  rows = plots.summarize(records, keys=["eval/accuracy", "agent/reward/tool"])
  accuracy = np.array([r["eval/accuracy"] for r in records if "eval/accuracy" in r])
  assert rows[0] == {"metric": "eval/accuracy", "first": accuracy[0], "first_step": 0,
                     "last": accuracy[-1], "last_step": 10, "min": accuracy.min(),
                     "max": accuracy.max(), "count": 3}
  assert rows[1]["min"] == pytest.approx(-0.5) and rows[1]["max"] == pytest.approx(-0.05)

  path = plots.write_summary_table(tmp_path / "summary.md", rows,
                                   columns=["metric", "last", "max"], title="Final")
  assert path.read_text() == ("# Final\n\n| metric | last | max |\n|---|---|---|\n"
                              "| eval/accuracy | 0.5 | 0.5 |\n"
                              "| agent/reward/tool | -0.5 | -0.05 |\n")
  assert plots.markdown_table([{"a": "x|y", "b": math.nan}]) == (
      "| a | b |\n|---|---|\n| x\\|y | nan |\n")
  with pytest.raises(ValueError, match="'missing' is not in the records"):
    plots.summarize(records, keys=["missing"])


def test_progress_bars_show_metrics_and_stay_silent_off_process_zero(capsys):
  bar = progress.step_bar(10, start_step=4)
  assert bar.n == 4
  progress.show_metrics(bar, {"train/reward": jnp.float32(0.123456), "train/loss": 2.0},
                        keys=("train/reward",))
  assert bar.postfix == "train/reward=0.1235"
  bar.update(1)
  bar.close()
  capsys.readouterr()
  quiet = progress.step_bar(3, enabled=False)
  quiet.update(3)
  quiet.close()
  assert "train" not in capsys.readouterr().err


def test_seed_curves_show_each_seed_and_the_mean_with_its_standard_error():
  runs = {f"s{i}": [{"step": 0, "pretrained/accuracy": 0.0, "eval/accuracy": 0.2 + 0.1 * i},
                    {"step": 2, "eval/accuracy": 0.4 + 0.2 * i}] for i in range(3)}
  fig = plots.seed_curves_figure(runs, title="3 seeds")
  (ax,) = fig.axes
  lines = {line.get_label(): line for line in ax.get_lines()}
  x, mean = lines["mean +- SE (3 seeds)"].get_data()
  assert x[0] < 0 and list(x[1:]) == [0, 2]  # pretrained, after the warm-start, after RL
  np.testing.assert_allclose(mean, [0.0, 0.3, 0.6])
  band = ax.collections[0].get_paths()[0].vertices
  se_end = np.std([0.4, 0.6, 0.8], ddof=1) / np.sqrt(3)
  np.testing.assert_allclose(band[:, 1].max(), 0.6 + se_end)
  with pytest.raises(ValueError, match="at least two runs"):
    plots.seed_curves_figure({"s0": runs["s0"]})


def test_seed_gain_curves_pair_each_seed_with_its_own_start():
  """gain_from=0: each seed's change since its own value after the warm-start, so the SE is
  that of the paired gains (0.2, 0.2, 0.5 here), not of the levels."""
  ends = [0.4, 0.6, 1.1]
  runs = {f"s{i}": [{"step": 0, "pretrained/accuracy": 0.0, "eval/accuracy": 0.2 + 0.2 * i},
                    {"step": 2, "eval/accuracy": ends[i]}] for i in range(3)}
  fig = plots.seed_curves_figure(runs, gain_from=0)
  (ax,) = fig.axes
  lines = {line.get_label(): line for line in ax.get_lines()}
  x, mean = lines["mean +- SE (3 seeds)"].get_data()
  gains = np.array(ends) - np.array([0.2, 0.4, 0.6])
  assert list(x) == [0, 2]  # the pretrained point is before the gain's start: not drawn
  np.testing.assert_allclose(mean, [0.0, gains.mean()])
  band = ax.collections[0].get_paths()[0].vertices
  np.testing.assert_allclose(band[:, 1].max(), gains.mean() + gains.std(ddof=1) / np.sqrt(3))
  with pytest.raises(ValueError, match="at step 1"):
    plots.seed_curves_figure(runs, gain_from=1)
