"""AT-GRPO game settings (PAPERS.md section 1): the rows of the game table as config variants.

`get_config("VARIANT[,cpu]")` for the env named by the calling config file. Variants:
  single       single agent, no RL (evaluation only)
  sa_grpo      single agent + GRPO
  mas_norl     the two-agent team without RL (evaluation only)
  mas_shared   MAS + AT-GRPO, one shared model with role prompts  (default)
  mas_lora     MAS + AT-GRPO, one LoRA adapter per role (rank 16, alpha 32)
  mas_full     MAS + AT-GRPO, one full model per role
Defaults are the paper's: Qwen3-1.7B (pass `--config.model=/path/to/Qwen3-1.7B`), 32 problems x
K=8 tree branches, 200 steps, response 2048 tokens, lr 1e-6 constant, clip 0.2/0.2, dual-clip 3,
token-mean loss, grad clip 1.0, weight decay 0.01, lowest-mean 50% group filtering, validation
every 10 steps on 100 held-out seeds. `cpu` shrinks everything to the embedded SmolLM2-135M on a
2-core machine.
"""

from __future__ import annotations

import ml_collections

from marl_jax.training.config import base_config

VARIANTS = ("single", "sa_grpo", "mas_norl", "mas_shared", "mas_lora", "mas_full")
EVAL_ONLY = ("single", "mas_norl")


def game_config(env_name: str, env_kwargs: dict, max_turns: int,
                preset: str | None) -> ml_collections.ConfigDict:
  parts = [p for p in (preset or "mas_shared").split(",") if p]
  variants = [p for p in parts if p in VARIANTS]
  unknown = [p for p in parts if p not in VARIANTS and p != "cpu"]
  if unknown or len(variants) > 1:
    raise ValueError(f"config preset {preset!r}: expected one of {list(VARIANTS)}, optionally "
                     "followed by ',cpu'")
  variant = variants[0] if variants else "mas_shared"
  c = base_config()
  c.name = f"atgrpo_{env_name}_{variant}"
  c.model = "qwen3-1.7b"
  c.env.name = env_name
  c.env.kwargs = ml_collections.ConfigDict(env_kwargs)
  c.env.max_turns = max_turns
  c.env.workflow = "single" if variant in ("single", "sa_grpo") else "mas"
  c.policy.kind = {"mas_lora": "lora", "mas_full": "stacked"}.get(variant, "shared")
  c.policy.per_role = variant in ("mas_lora", "mas_full")
  c.lora.rank, c.lora.alpha = 16, 32.0
  c.rollout.mode = "independent" if variant == "sa_grpo" else "tree"
  c.algo.estimator = "grpo" if variant == "sa_grpo" else "at_grpo"
  c.algo.std_ddof = 1  # PettingLLMs' GRPO advantage is verl's: unbiased torch.std
  c.train.eval_only = variant in EVAL_ONLY
  if "cpu" in parts:  # README's main job: about 10 minutes on a 2-core CPU
    c.model = "smollm2-135m-instruct"
    c.rollout.problems_per_step = 2
    c.rollout.k = 2
    c.sampling.max_new_tokens = 64
    c.optim.lr = 1e-5
    c.train.steps = 2
    c.eval.every = 2
    c.eval.num_problems = 4
    c.eval.at_start = False
    c.train.remat = True  # per-layer rematerialisation: a 1k-token batch fits in a few GiB
    c.checkpoint.every_steps = 1
  return c
