"""Learning-curve PNG and Markdown summary table from a run's metrics JSONL.

The curve is meant to be read at a glance: held-out success, held-out reward per agent, the
reward per agent the estimator trained on and the gradient norm, each against the RL step, with the
supervised warm-start and the RL phase shaded. A run with a warm-start logs its pretrained
evaluation as `pretrained/<metric>` at step 0 beside `eval/<metric>` (after the warm-start); the
plot puts the pretrained value left of step 0, across the warm-start band, and joins it to the
same line, so "before warm-start -> after warm-start -> after each RL step" is one curve.

Series are picked by metric-name prefixes, so the trainer only has to follow the naming
convention `<split>/<metric>[/<agent or policy>]` (`eval/accuracy`, `rollout/reward/tool`,
`train/grad_norm`). A series with a single point is drawn as a short labelled level, never as a
lone dot.

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global backend state).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
import numpy as np

from marl_jax.training.metrics import metric_series, read_metrics

# Before a warm-start the trainer evaluates into this split; `eval/` at step 0 is after it.
PRETRAINED = "pretrained/"


class Series(NamedTuple):
  """Every metric whose name starts with `prefix`, labelled `label` ("{rest}": what follows the
  prefix, e.g. the agent's name)."""
  prefix: str
  label: str = "{rest}"


class Panel(NamedTuple):
  """One subplot and the series it draws."""
  title: str
  series: tuple[Series, ...]
  log_scale: bool = False  # when all values are > 0; gradient norms span orders of magnitude


CURVE_PANELS = (
    Panel("held-out success", (Series("eval/accuracy", "held-out (avg@k)"),
                               Series("eval/pass@", "held-out pass@{rest}"),
                               Series("rollout/success", "training rollouts"))),
    Panel("held-out reward per agent (its own env reward)", (Series("eval/reward/"),)),
    Panel("training reward per agent (team + own, as the estimator sees it)",
          (Series("agent/reward/"),)),
    Panel("gradient norm (before clipping)", (Series("train/grad_norm", "whole update"),
                                              Series("agent/grad_norm/", "{rest}'s loss share")),
          log_scale=True),
)

_WARM = dict(color="tab:orange", alpha=0.12)
_RL = dict(color="tab:blue", alpha=0.06)


def panel_keys(records: Sequence[Mapping[str, Any]],
               panels: Sequence[Panel] = CURVE_PANELS) -> list[tuple[Panel, list[str]]]:
  """(panel, the metric names it draws, in series order) for each panel with at least one."""
  names = sorted({k for r in records for k in r if k != "step"})
  found = [(p, [n for s in p.series for n in names if n.startswith(s.prefix)]) for p in panels]
  return [(p, keys) for p, keys in found if keys]


def plot_learning_curves(records_or_path: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
                         out_path: str | os.PathLike[str],
                         panels: Sequence[Panel] = CURVE_PANELS,
                         title: str = "") -> Path:
  """Writes `learning_curve_figure(...)` as a PNG at `out_path`.

  Args:
    records_or_path: metric records, or a metrics JSONL file / workdir.
    out_path: PNG path.
    panels: which metrics go into which subplot; see `CURVE_PANELS`.
    title: figure title; default: the run's phases read from its metrics.
  """
  fig = learning_curve_figure(_records(records_or_path), panels, title)
  out_path = Path(out_path)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out_path, dpi=110)
  return out_path


def learning_curve_figure(records: Sequence[Mapping[str, Any]],
                          panels: Sequence[Panel] = CURVE_PANELS, title: str = "") -> Figure:
  """A grid of `panels` (module doc) against the RL step, two panels a row.

  Raises:
    ValueError: no metric matches any panel (nothing to draw).
  """
  keys = panel_keys(records, panels)
  if not keys:
    wanted = sorted({s.prefix for p in panels for s in p.series})
    raise ValueError(f"no metric name starts with any of {wanted}; nothing to plot")
  last = max(int(r["step"]) for r in records)
  warm = _warm_start_steps(records)
  pre_x = -max(1.0, last / 6) if warm is not None else None  # where the pretrained points sit
  cols = min(2, len(keys))
  rows = math.ceil(len(keys) / cols)
  fig = Figure(figsize=(6.4 * cols, 4.2 * rows), constrained_layout=True)
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  for ax, (panel, names) in zip(axes, keys):
    _draw_panel(ax, panel, names, records, pre_x, last)
  for ax in axes[len(keys):]:
    ax.set_visible(False)
  fig.suptitle(title or _phases_title(warm, last))
  return fig


def _draw_panel(ax, panel: Panel, names: Sequence[str], records, pre_x: float | None,
                last: int) -> None:
  _phases(ax, pre_x, last)
  all_positive = True
  for name in names:
    x, values = _curve(records, name, pre_x)
    all_positive &= bool(np.all(values > 0))
    label = _label(panel, name)
    if len(x) == 1:  # a level over one step, labelled with its value: no lone dot
      (line,) = ax.plot([x[0] - 0.5, x[0] + 0.5], [values[0]] * 2, linewidth=2.5, label=label)
      ax.annotate(f"{values[0]:.3g} (step {int(x[0])})", (x[0], values[0]), fontsize=8,
                  xytext=(0, 4), textcoords="offset points", ha="center",
                  color=line.get_color())
    else:
      ax.plot(x, values, marker="o" if len(x) <= 40 else None, markersize=3.5, linewidth=1.6,
              label=label)
  ax.set_title(panel.title, fontsize=11)
  if panel.log_scale and all_positive:
    ax.set_yscale("log")
  ax.legend(fontsize=9, loc="best", framealpha=0.85)


def _curve(records, name: str, pre_x: float | None) -> tuple[np.ndarray, np.ndarray]:
  """(x, values) of metric `name`; an `eval/` metric starts at its pretrained value at `pre_x`
  when the run logged one."""
  steps, values = metric_series(records, name)
  x = steps.astype(np.float64)
  if pre_x is not None and name.startswith("eval/"):
    _, before = metric_series(records, PRETRAINED + name.split("/", 1)[1])
    if len(before):
      x, values = np.concatenate([[pre_x], x]), np.concatenate([before[:1], values])
  return x, values


def _phases(ax, pre_x: float | None, last: int) -> None:
  """The shared x axis: RL steps, and with a warm-start its band and the pretrained tick."""
  ax.set_xlabel("RL step")
  ax.grid(alpha=0.3)
  if pre_x is None:
    return
  end = max(last, 1)
  ax.axvspan(pre_x, 0, **_WARM)
  ax.axvspan(0, end, **_RL)
  for x, text in ((pre_x, " warm-start"), (0, " RL")):
    ax.text(x, 0.98, text, transform=ax.get_xaxis_transform(), ha="left", va="top",
            fontsize=9, color="0.35")
  ticks = [t for t in MaxNLocator(nbins=8, integer=True).tick_values(0, end) if 0 <= t <= end]
  ax.set_xticks([pre_x] + ticks, ["pre-\ntrained"] + [f"{t:g}" for t in ticks])
  ax.set_xlim(pre_x - 0.3, end + 0.6)


def plot_seed_curves(workdirs: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str],
                     metric: str = "eval/accuracy", title: str = "",
                     gain_from: int | None = None) -> Path:
  """Writes `seed_curves_figure` of the runs in `workdirs` (one per seed, each labelled with its
  folder's name) as a PNG."""
  names = [Path(w).name for w in workdirs]
  if len(set(names)) != len(names):
    raise ValueError(f"workdirs {list(map(str, workdirs))} repeat a folder name; expected one "
                     "distinctly named run per seed")
  fig = seed_curves_figure({n: read_metrics(w) for n, w in zip(names, workdirs)}, metric, title,
                           gain_from)
  out_path = Path(out_path)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out_path, dpi=110)
  return out_path


def seed_curves_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]],
                       metric: str = "eval/accuracy", title: str = "",
                       gain_from: int | None = None) -> Figure:
  """One metric of several seeds of a config: each seed's curve, and their mean +- standard
  error (unbiased std / sqrt(seeds)) at the x positions every seed logged, so a claim's spread
  is on the figure, not only in a table. `gain_from=S` draws each seed's change since its own
  value at RL step S instead (paired by seed, from S on): with S = 0 the RL steps' own gain over
  the warm-start, whose SE is the claim's, free of how far each seed's warm-start got.

  Raises:
    ValueError: fewer than two runs, or a run that never logged `metric` (at step `gain_from`).
  """
  if len(runs) < 2:
    raise ValueError(f"seed_curves_figure needs at least two runs for a spread; got {len(runs)}")
  last = max(int(r["step"]) for records in runs.values() for r in records)
  warm = {_warm_start_steps(records) for records in runs.values()}
  pre_x = -max(1.0, last / 6) if warm != {None} else None
  curves = {}
  for name, records in runs.items():
    x, values = _curve(records, metric, pre_x)
    if not len(x):
      raise ValueError(f"run {name!r} never logged {metric!r}")
    curves[name] = dict(zip(x.tolist(), values.tolist()))
    if gain_from is not None:
      if gain_from not in curves[name]:
        raise ValueError(f"run {name!r} has no {metric!r} at step {gain_from} (gain_from); "
                         f"it logged it at steps {sorted(curves[name])}")
      base = curves[name][gain_from]
      curves[name] = {x: v - base for x, v in curves[name].items() if x >= gain_from}
  fig = Figure(figsize=(7.0, 4.4), constrained_layout=True)
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  _phases(ax, pre_x, last)
  for name, curve in curves.items():
    ax.plot(list(curve), list(curve.values()), linewidth=1.0, alpha=0.55, marker="o",
            markersize=2.5, label=name)
  xs = sorted(set.intersection(*(set(c) for c in curves.values())))
  mean, se = mean_se([[c[x] for x in xs] for c in curves.values()])
  ax.fill_between(xs, mean - se, mean + se, color="black", alpha=0.15, linewidth=0)
  ax.plot(xs, mean, color="black", linewidth=2.4, marker="o", markersize=4,
          label=f"mean +- SE ({len(curves)} seeds)")
  if gain_from is None:
    ax.set_ylabel(metric)
  else:
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_ylabel(f"{metric} - its value at RL step {gain_from}")
  ax.legend(fontsize=9, loc="best", framealpha=0.85)
  fig.suptitle(title or metric)
  return fig


def mean_se(values) -> tuple[np.ndarray, np.ndarray]:
  """Mean and standard error over axis 0 (seeds): the unbiased std / sqrt(seeds), the spread
  RESULTS.md states for every claim; a single seed has no spread (SE 0)."""
  a = np.asarray(values, dtype=np.float64)
  se = a.std(0, ddof=1) / math.sqrt(len(a)) if len(a) > 1 else np.zeros(a.shape[1:])
  return a.mean(0), se


def _label(panel: Panel, name: str) -> str:
  series = next(s for s in panel.series if name.startswith(s.prefix))
  return series.label.format(rest=name[len(series.prefix):].strip("/") or name)


def _warm_start_steps(records: Sequence[Mapping[str, Any]]) -> int | None:
  """The warm-start's step count when the run had one (its step-0 `sft/steps` or a pretrained
  evaluation), else None."""
  step0 = [r for r in records if r.get("step") == 0]
  if not any(k.startswith(PRETRAINED) or k.startswith("sft/") for r in step0 for k in r):
    return None
  return int(next((r["sft/steps"] for r in step0 if "sft/steps" in r), 0))


def _phases_title(warm: int | None, last: int) -> str:
  rl = f"RL: {last} step{'s' if last != 1 else ''} (blue)"
  if warm is None:
    return rl
  return f"supervised warm-start: {warm} steps (orange), then {rl}"


def summarize(records_or_path: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
              keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """One row per metric: first and last logged value (with steps), min, max and count.

  Args:
    records_or_path: metric records, or a metrics JSONL file / workdir.
    keys: metrics to include (default: all, sorted).
  """
  records = _records(records_or_path)
  if keys is None:
    keys = sorted({k for r in records for k in r if k != "step"})
  rows = []
  for key in keys:
    steps, values = metric_series(records, key)
    if not len(steps):
      raise ValueError(f"metric {key!r} is not in the records")
    rows.append({"metric": key, "first": values[0], "first_step": int(steps[0]),
                 "last": values[-1], "last_step": int(steps[-1]), "min": np.nanmin(values),
                 "max": np.nanmax(values), "count": len(values)})
  return rows


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   precision: int = 4) -> str:
  """A GitHub Markdown table; floats are printed with `precision` significant digits."""
  if not rows:
    raise ValueError("markdown_table needs at least one row")
  columns = list(columns or rows[0].keys())
  lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
  for row in rows:
    lines.append("| " + " | ".join(_cell(row.get(c, ""), precision) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def write_summary_table(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]],
                        columns: Sequence[str] | None = None, title: str = "") -> Path:
  """Writes `rows` (e.g. `summarize(workdir)` or evaluation results) as a Markdown file."""
  text = (f"# {title}\n\n" if title else "") + markdown_table(rows, columns)
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text, encoding="utf-8")
  return path


def _records(records_or_path) -> list[Mapping[str, Any]]:
  if isinstance(records_or_path, (str, os.PathLike)):
    return read_metrics(records_or_path)
  return list(records_or_path)


def _cell(value: Any, precision: int) -> str:
  if isinstance(value, (float, np.floating)):
    value = float(value)
    return str(value) if not math.isfinite(value) else f"{value:.{precision}g}"
  return str(value).replace("|", "\\|")
