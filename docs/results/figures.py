"""The figures of RESULTS.md's claims whose runs predate per-run learning curves.

Each figure draws the per-seed numbers recorded in the experiment log (docs/experiments/, the
section named beside each entry) as points, with their mean +- standard error (unbiased std /
sqrt(seeds)), so a claim's spread is visible at a glance. The main job's figures come from its
runs' metrics instead (`marl_jax.training.plots.plot_seed_curves`, command in
docs/experiments/main_job.md).

    python -m docs.results.figures    # from the repository root: rewrites the PNGs beside this file
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np

from marl_jax.training.plots import mean_se

HERE = Path(__file__).parent

# name: (title, y label, {condition: per-seed values}), from the experiment log's tables.
POINTS = {
    # atgrpo_plan_path.md, "AT-GRPO game table at CPU scale"
    "atgrpo_game_table": ("Plan-Path 4x4, held-out success after one RL step (3 seeds)",
                          "success (%)", {
                              "single agent": [18.75, 0.0, 6.25],
                              "SA + GRPO": [18.75, 0.0, 18.75],
                              "MAS (no RL)": [81.25, 87.5, 87.5],
                              "MAS + AT-GRPO shared": [81.25, 87.5, 87.5],
                              "per-role LoRA": [87.5, 87.5, 87.5],
                              "per-role full": [87.5, 87.5, 87.5],
                              "GRPO groups": [81.25, 87.5, 87.5]}),
    # drmas_math.md, "Dr. MAS vs GRPO on math at CPU scale, warm-started with mistakes"
    "drmas_vs_grpo_math": ("Dr. MAS vs GRPO on math, after 8 RL steps (3 seeds)",
                           "held-out accuracy (8 problems)", {
                               "drmas": [0.25, 0.0, 0.125], "grpo": [0.1875, 0.0, 0.125]}),
    # orchestration.md, "Learned stopping at CPU scale"
    "stop_verifier_rounds": ("Learned stopper vs the verifier rule: rounds per episode (3 seeds)",
                             "solver rounds", {
                                 "learned": [1.0, 1.0, 1.0], "verifier rule": [1.34, 1.06, 1.0]}),
    # orchestration.md, "Learned spawning at CPU scale"
    "spawn_cost": ("Solvers spawned per episode after 4 RL steps (3 seeds)", "solvers", {
        "step 0": [2.21, 2.79, 2.13], "cost 0": [2.46, 2.50, 1.71],
        "cost 0.5": [1.00, 1.92, 1.13]}),
    # orchestration.md, "Learned stopping where extra rounds help: per-role models"
    "stop_per_role": ("Coordinator-only stopper, per-role models: accuracy (3 seeds)",
                      "accuracy (%)", {
                          "learned": [45.3, 37.5, 56.3], "verifier rule": [46.9, 37.5, 57.8],
                          "3 rounds": [48.4, 43.8, 70.3]}),
    # orchestration.md, "Learned spawning with the solvers held fixed"
    "spawn_fixed_solvers": ("Dispatcher alone learns the count: accuracy (3 seeds)",
                            "accuracy (%)", {
                                "step 0": [52.1, 45.8, 35.4], "cost 0, step 4": [60.4, 52.1, 54.2],
                                "cost 0.5, step 4": [52.1, 39.6, 39.6]}),
    # orchestration.md, "Pooled state groups with a KL anchor"
    "stop_program_checker": ("Program-checked stopper after 32 steps: accuracy - 0.1 x rounds",
                             "reward", {
                                 "learned": [0.817, 0.723, 0.777], "rule": [0.833, 0.750, 0.800],
                                 "3 rounds": [0.700, 0.606, 0.669],
                                 "2 rounds": [0.800, 0.659, 0.769]}),
    # main_job_before_39.md, "Seconds per RL step, before and after (issue #12)"
    "rl_step_seconds": ("Seconds per RL step, same workload (3 runs x steps 1, 2)", "seconds", {
        "25dd96c": [38.95, 36.79, 41.61, 37.80, 39.83, 36.62],
        "709faf3": [17.81, 19.36, 17.88, 18.67, 17.33, 18.45],
        "94247d7": [12.00, 13.31, 12.49, 13.61, 13.06, 13.90]}),
}

# name: (title, y label, x positions, {condition: per-seed curves}).
CURVES = {
    # main_job_before_39.md, "The main job learns (README command 1)"
    "plan_path_warm_start": ("Plan-Path main job before issue 39: held-out success (3 seeds)",
                             "success", ["pretrained", "warm-started", "1 RL step"], {
                                 "MAS + AT-GRPO": [[0, 0.8125, 0.8125], [0, 0.875, 0.875],
                                                   [0, 0.875, 0.875]]}),
    # atgrpo_plan_path.md, "AT-GRPO groups vs plain GRPO groups"
    "atgrpo_vs_grpo_groups": ("Plan-Path `rl` schedule: held-out success (3 seeds)",
                              "success (%)", ["step 0", "step 4", "step 8"], {
                                  "AT-GRPO groups": [[12.5, 25.0, 18.75], [6.25, 18.75, 18.75],
                                                     [6.25, 6.25, 6.25]],
                                  "plain GRPO groups": [[12.5, 43.75, 12.5], [6.25, 12.5, 0.0],
                                                        [6.25, 0.0, 0.0]]}),
    # magrpo_tldr.md (one seed: no spread)
    "magrpo_tldr": ("MAGRPO TLDR on CPU: held-out joint reward (1 seed)", "joint reward",
                    ["step 0", "step 8", "step 16"], {"seed 0": [[0.89, 1.44, 1.58]]}),
}


def points_figure(title: str, ylabel: str, groups: dict[str, list[float]]) -> Figure:
  fig = Figure(figsize=(1.3 + 1.25 * len(groups), 3.8), constrained_layout=True)
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for i, values in enumerate(groups.values()):
    mean, se = mean_se(values)
    ax.scatter(i + np.linspace(-0.12, 0.12, len(values)), values, s=18, color="tab:blue",
               alpha=0.6, zorder=3)
    ax.errorbar(i, mean, yerr=se, fmt="_", markersize=22, color="black", capsize=6, zorder=4)
  ax.set_xticks(range(len(groups)), list(groups), rotation=20, ha="right", fontsize=9)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3, axis="y")
  return fig


def curves_figure(title: str, ylabel: str, xs: list[str],
                  groups: dict[str, list[list[float]]]) -> Figure:
  fig = Figure(figsize=(6.0, 3.8), constrained_layout=True)
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for color, (name, curves) in zip(("tab:blue", "tab:orange"), groups.items()):
    for curve in curves:
      ax.plot(range(len(xs)), curve, color=color, alpha=0.35, linewidth=1, marker="o",
              markersize=3)
    mean, se = mean_se(curves)
    ax.fill_between(range(len(xs)), mean - se, mean + se, color=color, alpha=0.15, linewidth=0)
    ax.plot(range(len(xs)), mean, color=color, linewidth=2.4, marker="o",
            label=f"{name}: mean +- SE" if len(curves) > 1 else name)
  ax.set_xticks(range(len(xs)), xs)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=9)
  return fig


def main() -> None:
  for name, (title, ylabel, groups) in POINTS.items():
    points_figure(title, ylabel, groups).savefig(HERE / f"{name}.png", dpi=110)
  for name, (title, ylabel, xs, groups) in CURVES.items():
    curves_figure(title, ylabel, xs, groups).savefig(HERE / f"{name}.png", dpi=110)


if __name__ == "__main__":
  main()
