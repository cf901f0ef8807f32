"""AT-GRPO game settings (docs/papers.md section 1): the rows of the game table as config variants.

`get_config("VARIANT[,cpu]")` for the env named by the calling config file (parsed by
`parse_game_preset`). Variants:
  single       single agent, no RL (evaluation only)
  sa_grpo      single agent + GRPO as PettingLLMs' single-agent script runs it: tree sampling,
               groups of (problem, turn, agent), lowest-mean filtering (AT-GRPO with one agent)
  mas_norl     the two-agent team without RL (evaluation only)
  mas_shared   MAS + AT-GRPO, one shared model with role prompts  (default)
  mas_lora     MAS + AT-GRPO, one LoRA adapter per role (rank 16, alpha 32)
  mas_full     MAS + AT-GRPO, one full model per role
  mas_grpo     the grouping ablation: the shared team trained with plain GRPO (independent
               rollouts, one group per problem) instead of AT-GRPO's tree groups
The evaluation-only rows evaluate the policy RL would start from: the base model, and at cpu
scale the warm-started one (the cpu presets' warm-start stands in for the paper's base models,
which already play the games where SmolLM2-135M does not), so "no RL" vs "+ RL" is RL's gain.
Defaults are the paper's: Qwen3-1.7B (pass `--config.model=/path/to/Qwen3-1.7B`), 32 problems x
K=8 tree branches, 200 steps, response 2048 tokens, lr 1e-6 constant, clip 0.2/0.2, dual-clip 3,
token-mean loss, grad clip 1.0, weight decay 0.01, lowest-mean 50% group filtering, validation
every 10 steps on 100 held-out seeds. Updates as PettingLLMs' verl trainer: PPO mini-batches of
16 samples, 1 epoch, old log-probs recomputed by the learner before the first update, learner
temperature = the sampling temperature (verl divides the logits by it). `cpu` shrinks everything
to the embedded SmolLM2-135M on a 2-core machine. `task_config` gives the same rows for the math
and code envs.
"""

from __future__ import annotations

import ml_collections

from configs.common import CPU_MAX_NEW_TOKENS, cpu_preset, parse_preset
from marl_jax.training.config import base_config

VARIANTS = ("mas_shared", "single", "sa_grpo", "mas_norl", "mas_lora", "mas_full",
            "mas_grpo")  # default first
EVAL_ONLY = ("single", "mas_norl")


def parse_game_preset(preset: str | None) -> tuple[str, bool]:
  """'VARIANT[,cpu]' -> (the variant, whether `cpu` was named)."""
  choice, cpu = parse_preset(preset, {"variant": VARIANTS})
  return choice["variant"], cpu


SHAPED = ("plan_path", "sokoban")  # games with potential-based shaping (envs/games/base.py)


def game_config(env_name: str, env_kwargs: dict, max_turns: int, variant: str,
                cpu: bool) -> ml_collections.ConfigDict:
  """The game-table row `variant` (one of VARIANTS) on `env_name`, shrunk by `cpu`."""
  c = base_config()
  c.name = f"atgrpo_{env_name}_{variant}"
  c.model = "qwen3-1.7b"
  c.env.name = env_name
  if env_name in SHAPED:  # the papers' shaping; --config.env.kwargs.shaping=discounted: no cycle pays
    env_kwargs = {**env_kwargs, "shaping": "paper"}
  c.env.kwargs = ml_collections.ConfigDict(env_kwargs)
  c.env.max_turns = max_turns
  c.env.workflow = "single" if variant in ("single", "sa_grpo") else "mas"
  c.policy.kind = {"mas_lora": "lora", "mas_full": "stacked"}.get(variant, "shared")
  c.lora.rank, c.lora.alpha = 16, 32.0
  c.rollout.mode = "tree"
  c.algo.estimator, c.algo.filter = "at_grpo", "lowest_mean"
  c.algo.std_ddof = 1  # PettingLLMs' GRPO advantage is verl's: unbiased torch.std
  c.train.mini_batch_size, c.train.epochs = 16, 1  # ppo_mini_batch_size: 16, ppo_epochs: 1
  c.train.recompute_old_logp = True  # multi_agents_ppo_trainer: "recompute old_log_probs"
  c.train.eval_only = variant in EVAL_ONLY
  if variant == "mas_grpo":
    c.algo.estimator, c.rollout.mode = "grpo", "independent"
  if cpu:  # the game table's cpu cells (Plan-Path's was the README's main job until issue 39)
    cpu_preset(c)
    c.sampling.max_new_tokens = 64  # the games keep their own two values; task_config resets them
    c.eval.num_problems = 4
  return c


TASK_VARIANTS = ("mas_shared", "mas_lora", "mas_full", "mas_grpo", "single", "sa_grpo",
                 "mas_norl")


def task_config(env_name: str, team_workflow: str, max_turns: int,
                preset: str | None) -> ml_collections.ConfigDict:
  """AT-GRPO on a math or code env: the game table's rows (same names, hyperparameters and cpu
  preset) with the env's own workflow names, plus `mas_grpo`: the team trained with plain GRPO
  (independent rollouts, one group per problem), the estimator ablation.

  Team rewards follow docs/papers.md section 1 ("final = alpha * global + local"): each agent's
  local reward plus the episode's team reward (alpha = 1). The single-agent rows keep alpha = 0:
  their local reward already is the task reward. The cpu preset runs one turn.
  """
  choice, cpu = parse_preset(preset, {"variant": TASK_VARIANTS})
  variant = choice["variant"]
  c = game_config(env_name, {}, 1 if cpu else max_turns, variant, cpu)
  c.name = f"atgrpo_{env_name}_{variant}"
  single = c.env.workflow == "single"
  c.env.workflow = "single" if single else team_workflow
  if single:
    c.env.max_turns = 1
  c.algo.alpha = 0.0 if single else 1.0
  if cpu:
    c.eval.num_problems = 2
    c.sampling.max_new_tokens = CPU_MAX_NEW_TOKENS
  return c
