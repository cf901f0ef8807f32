"""Pieces shared by the paper config files: preset parsing, team policies, the CPU preset and the
local-data fields of the env kwargs.

Presets are comma-separated options, one per axis at most, in any order, plus `cpu`:
`get_config("grpo,lora,cpu")`. An axis not named takes its first option, so `get_config()` is the
paper's main setting.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from marl_jax.training.config import base_config

# Team policies: one shared model with role prompts, one LoRA adapter per role over a frozen base,
# or one full model per role.
MODELS = ("shared", "lora", "full")


def parse_preset(preset: str | None,
                 axes: dict[str, tuple[str, ...]]) -> tuple[dict[str, str], bool]:
  """'OPTION[,OPTION...][,cpu]' -> (the chosen option of every axis, whether `cpu` was named)."""
  parts = [p.strip() for p in (preset or "").split(",") if p.strip()]
  chosen: dict[str, str] = {}
  for part in parts:
    if part == "cpu":
      continue
    axis = next((name for name, options in axes.items() if part in options), None)
    if axis is None or axis in chosen:
      expected = "; ".join(f"{name}: {list(options)}" for name, options in axes.items())
      problem = "unknown option" if axis is None else f"a second {axis}"
      raise ValueError(f"config preset {preset!r}: {problem} {part!r}; expected at most one "
                       f"option per axis ({expected}), optionally with 'cpu'")
    chosen[axis] = part
  return {name: chosen.get(name, options[0]) for name, options in axes.items()}, "cpu" in parts


def cpu_only_schedule(preset: str | None, schedule: str, schedules: tuple[str, ...],
                      cpu: bool) -> None:
  """Refuses a schedule other than the default (`schedules[0]`) without `cpu`: the others are
  sized for the embedded model on a 2-core machine."""
  if schedule != schedules[0] and not cpu:
    raise ValueError(f"config preset {preset!r}: the {schedule!r} schedule is a cpu schedule; "
                     "add 'cpu'")


def apply_models(c: ml_collections.ConfigDict, models: str) -> None:
  """Sets config.policy for one of MODELS."""
  if models not in MODELS:
    raise ValueError(f"unknown team models {models!r}; expected one of {list(MODELS)}")
  c.policy.kind = {"shared": "shared", "lora": "lora", "full": "stacked"}[models]


def apply_team(c: ml_collections.ConfigDict, models: str, hetero: tuple[str, ...]) -> None:
  """Sets config.policy for one of MODELS or "hetero": a mapped team, one model per agent
  (`hetero`, in agent order), each with its own architecture and tokenizer."""
  if models == "hetero":
    c.policy.kind, c.policy.models = "mapped", hetero
  else:
    apply_models(c, models)


def data_fields(c: ml_collections.ConfigDict, **fields: str | None) -> None:
  """Declares env kwargs that point at local data, for training and (unset: as in training) for
  evaluation. The trainer's config is locked, so a field the command line sets
  (`--config.env.kwargs.path=train.jsonl`, `--config.eval.env_kwargs.path=test.jsonl`) must
  exist; None makes an unset string placeholder, which the workflow registry ignores (generated
  problems are used)."""
  for name, default in fields.items():
    c.env.kwargs[name] = config_dict.placeholder(str) if default is None else default
    c.eval.env_kwargs[name] = config_dict.placeholder(str)


# The math family's data fields: a local file (`path`, `fmt`) or, unset, generated problems of
# `level` (envs/math/data.py LEVELS; unset: multi_step).
MATH_DATA = dict(path=None, fmt="auto", level=None)

CPU_MAX_NEW_TOKENS = 48


def cpu_preset(c: ml_collections.ConfigDict) -> None:
  """Shrinks a run to the embedded SmolLM2-135M on a 2-core machine: 2 problems x 2 samples,
  48-token replies, 2 steps, one evaluation at the end on 2 problems, per-layer remat, each
  distinct prompt computed once and the LM head in 32-position slices in the learner, a
  checkpoint every step; a mapped team maps that model once per agent."""
  c.model = "smollm2-135m-instruct"
  c.rollout.problems_per_step = 2
  c.rollout.k = 2
  c.sampling.max_new_tokens = CPU_MAX_NEW_TOKENS
  c.optim.lr = 1e-5
  c.train.steps = 2
  c.train.remat = True
  c.train.share_prompts = True
  c.train.logits_chunk = 32
  c.eval.every = 2
  c.eval.num_problems = 2
  c.eval.at_start = False
  c.checkpoint.every_steps = 1
  if c.policy.kind == "mapped":  # the one local model, once per agent
    c.policy.models = (c.model,) * len(c.policy.models)


DRMAS_ESTIMATORS = ("drmas", "grpo")


def drmas_config(env_name: str, estimator: str, *, model: str, max_turns: int, questions: int,
                 k: int, entropy_coef: float) -> ml_collections.ConfigDict:
  """Dr. MAS (docs/papers.md section 2) on `env_name`'s "drmas" workflow with `estimator`: "drmas"
  (group = (question, agent)) or the vanilla "grpo" baseline, estimator `traj_grpo`: each call
  scored with its trajectory's mean reward, normalised over the question's K trajectory values.
  Both divide by the unbiased std (verl's `torch.std`, as Dr. MAS's code) with mean 0 / std 1
  for a singleton group.

  Every call's reward is the team's episode reward minus its own format penalty (alpha = 1), K
  independent trajectories per question, no group filtering; PPO clip 0.2, dual-clip 3,
  token-mean, no KL, grad clip 1.0, lr 1e-6; evaluation avg@16 / pass@16 at temperature 0.6.
  Evaluation samples at top-p 0.95 as the paper's; training at top-p 1. Updates as verl-agent's
  DrMAS scripts: one update per rollout per agent (`ppo_mini_update_num=1`, adaptive
  mini-batch = the agent's whole batch), 1 epoch, old log-probs recomputed by the learner (verl's
  default), learner temperature = the sampling temperature (verl divides the logits by it).
  """
  if estimator not in DRMAS_ESTIMATORS:
    raise ValueError(f"unknown Dr. MAS estimator {estimator!r}; expected one of "
                     f"{list(DRMAS_ESTIMATORS)}")
  c = base_config()
  c.name = f"drmas_{env_name}_{estimator}"
  c.model = model
  c.env.name, c.env.workflow, c.env.max_turns = env_name, "drmas", max_turns
  c.rollout.mode, c.rollout.k, c.rollout.problems_per_step = "independent", k, questions
  c.algo.estimator = {"drmas": "drmas", "grpo": "traj_grpo"}[estimator]
  c.algo.filter, c.algo.alpha, c.algo.std_ddof = "none", 1.0, 1
  c.loss.entropy_coef = entropy_coef
  c.train.mini_batch_size, c.train.epochs = None, 1
  c.train.recompute_old_logp = True
  c.eval.k, c.eval.temperature, c.eval.top_p = 16, 0.6, 0.95
  return c


MAGRPO_ESTIMATORS = ("magrpo", "rloo", "remax")


def magrpo_config(env_name: str, estimator: str, *, model: str, lr: float,
                  env_kwargs: dict[str, str] | None = None) -> ml_collections.ConfigDict:
  """MAGRPO (docs/papers.md section 3) on `env_name`'s one-turn "magrpo" workflow: G = 4 aligned
  joint actions per prompt (independent rollouts), the joint reward minus the mean over the G joint
  actions (no std division, clamp 10), the same advantage for every agent; on-policy REINFORCE
  (`-sum_t log pi * A`, averaged over samples; no ratio, clip or KL), one update per rollout (no
  mini-batches or epochs); the learner's log-probs at temperature 1 (CoMLRL's loss differentiates
  log_softmax(logits) though it samples at 0.7). `estimator` picks the sibling baseline: "magrpo"
  (mean), "rloo" (leave-one-out, CoMLRL's MARLOO) or "remax" (max, CoMLRL's MAReMax). The env's
  local reward already is the joint reward, so alpha = 0.

  docs/papers.md section 3 gives no batch size: one prompt per update (`problems_per_step = 1`).
  """
  if estimator not in MAGRPO_ESTIMATORS:
    raise ValueError(f"unknown MAGRPO estimator {estimator!r}; expected one of "
                     f"{list(MAGRPO_ESTIMATORS)}")
  c = base_config()
  c.name = f"magrpo_{env_name}_{estimator}"
  c.model = model
  c.env.name, c.env.workflow, c.env.max_turns = env_name, "magrpo", 1
  c.env.kwargs = ml_collections.ConfigDict(env_kwargs or {})
  c.rollout.mode, c.rollout.k, c.rollout.problems_per_step = "independent", 4, 1
  c.algo.estimator, c.algo.filter, c.algo.alpha = "magrpo", "none", 0.0
  c.algo.baseline = {"magrpo": "mean", "rloo": "loo", "remax": "max"}[estimator]
  c.loss.policy_loss, c.loss.aggregation = "reinforce", "seq_sum"
  c.optim.lr = lr
  c.sampling.temperature, c.sampling.top_p, c.sampling.max_new_tokens = 0.7, 0.9, 256
  c.train.learner_temperature = 1.0
  c.train.mini_batch_size, c.train.epochs = None, 1
  return c


def writing_config(task: str, preset: str | None,
                   models: tuple[str, ...]) -> ml_collections.ConfigDict:
  """MAGRPO writing (TLDR or arXiv): Qwen3-1.7B per agent, lr 5e-6, 1000 one-document steps
  (the paper's 1000 training examples), evaluation every 100 steps on 100 held-out documents."""
  choice, cpu = parse_preset(preset, {"estimator": MAGRPO_ESTIMATORS, "models": models})
  c = magrpo_config("writing", choice["estimator"], model="qwen3-1.7b", lr=5e-6,
                    env_kwargs=dict(task=task))
  c.name = f"magrpo_{task}_{choice['estimator']}_{choice['models']}"
  apply_models(c, choice["models"])
  data_fields(c, path=None, field=None)
  c.train.steps, c.eval.every = 1000, 100
  if cpu:
    cpu_preset(c)
  return c
