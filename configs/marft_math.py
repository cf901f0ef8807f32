"""MARFT math (docs/papers.md section 4): a profiled reasoner -> actor chain fine-tuned by PPO with
a centralised critic.

`get_config("VARIANT[,cpu]")`. Variants:
  action  action-level PPO (APPO): `gae_action` over (step, agent) slots, one ratio per action
          (exp of its summed token log-ratios, MARFT's "sum" mode)  (default)
  token   token-level PPO (TPPO): `gae_token`, one value and one ratio per token
The team: each agent sees its profile, the transcript and the earlier agents' outputs of this step
(Flex-MG's sequential dependency); only the actor's `\\boxed{}` answer is scored (1/0), "The answer
is incorrect." is appended after a wrong one, at most 3 steps. One LoRA per agent (rank 8, alpha
16, q/v projections) over a frozen base that is also the critic's trunk; the critic is an MLP head
hidden -> 1024 -> 512 -> 1 with a clipped Huber loss (clip 0.2, delta 10).
Defaults from MARFT's public code: PPO clip 0.2 without dual clip, entropy 0.01, advantages
z-scored over the batch, the policy step skipped when the approximate KL exceeds 1e-3, gradients
clipped at 0.5, gamma 0.99, lambda 0.95; AdamW lr 1e-6, eps 1e-5, no weight decay (its launch
script); critic Adam lr 5e-5 (launch script), eps 1e-5; 4 parallel episodes per step, 512 new
tokens. Updates as the launch script: one mini-batch (`--num_mini_batch 1`), one PPO epoch
(`--ppo_epoch 1`; its argparse defaults are 5 epochs x 4 mini-batches:
`--config.train.epochs=5 --config.train.mini_batch_size=...`); old log-probs from the learner's
forward at temperature 1 (MARFT scores actions with log_softmax(logits)). The base model is
Qwen2.5-3B-Instruct (pass `--config.model=/path/to/Qwen2.5-3B-Instruct`).
`cpu` shrinks everything to the embedded SmolLM2-135M on a 2-core machine.
"""

from __future__ import annotations

import ml_collections

from configs import common
from marl_jax.training.config import base_config

VARIANTS = {"action": "gae_action", "token": "gae_token"}


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  choice, cpu = common.parse_preset(preset, {"variant": tuple(VARIANTS)})
  variant = choice["variant"]
  c = base_config()
  c.name = f"marft_math_{variant}"
  c.model = "qwen2.5-3b"
  c.env.name, c.env.workflow, c.env.max_turns = "math", "marft", 3
  c.policy.kind = "lora"
  c.lora.rank, c.lora.alpha, c.lora.target_modules = 8, 16.0, ("q_proj", "v_proj")
  c.policy.critic = (1024, 512)
  c.policy.critic_optim.lr = 5e-5
  c.policy.critic_optim.eps = 1e-5
  c.rollout.mode, c.rollout.k, c.rollout.problems_per_step = "independent", 1, 4
  c.sampling.max_new_tokens = 512
  c.algo.estimator, c.algo.filter = VARIANTS[variant], "none"
  c.algo.gamma, c.algo.lam, c.algo.normalize_batch = 0.99, 0.95, True
  c.loss.clip_low = c.loss.clip_high = 0.2
  c.loss.dual_clip = None
  c.loss.entropy_coef = 0.01
  c.loss.value_clip, c.loss.huber_delta = 0.2, 10.0
  if variant == "action":
    c.loss.ratio_level, c.loss.aggregation = "sequence", "seq_mean_token_mean"
  c.optim.lr, c.optim.eps, c.optim.weight_decay, c.optim.max_grad_norm = 1e-6, 1e-5, 0.0, 0.5
  c.train.target_kl = 1e-3
  c.train.mini_batch_size, c.train.epochs = None, 1
  c.train.recompute_old_logp, c.train.learner_temperature = True, 1.0
  common.data_fields(c, **common.MATH_DATA)
  if cpu:
    common.cpu_preset(c)
    c.rollout.k = 1
  return c
