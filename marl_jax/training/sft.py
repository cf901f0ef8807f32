"""Supervised warm-start from demonstrations, before RL (rejection-sampling fine-tuning).

Why: a small model may never write a reply that parses (SmolLM2-135M on the games: every reply
gets the format penalty, every group's rewards are equal, every advantage is 0), so RL has no
signal to start from. The warm-start first teaches each role its part of the team's protocol:

1. Demonstrations are episodes of the run's own workflow in which every agent replies with its
   env's `demonstration(agent)` (games: the tool agent's search program, the plan agent the
   oracle's moves). They run through the same rollout engine as RL, so each reply is trained in
   exactly the prompt RL samples it in, and tool programs run in the sandbox. Only the samples of
   solved episodes are kept (rejection sampling: a demonstration that fails teaches nothing right).
   With `config.sft.mistake_rate` p, a fraction p of the episodes (picked by the CRC-32 of the
   first prompt) instead opens with a mistake, the env's `mistake(agent)` (math: the solver's
   worked steps with a wrong result), and recovers from it: the verifier's demonstration rejects
   it, a coordinator's asks for another round, the solver then demonstrates the right answer.
   The mistake is never trained on (its sample has no tokens); without it every demonstrated
   verdict is "approve" and every decision "stop", and a warm-started verifier approves all.
2. `config.sft.steps` updates minimise the negative log-likelihood of the kept replies (their
   end-of-reply token included), token mean, through the same sharded train step as RL
   (`policy_loss="nll"`) with AdamW from `config.sft.lr` decaying linearly to 0. RL then starts
   from the warm-started params with a fresh optimizer state.

Step s of a run with `config.seed` r trains on the demonstrations of the problems of seeds
`sft.seed_offset + (r * sft.steps + s) * n + i`, i < n = `sft.problems_per_step`: disjoint from
training's (from 0) and evaluation's seeds, and a different set for every run seed, so seeds vary
the warm-start's data. The stage is deterministic, so a run interrupted before its first
checkpoint redoes it exactly.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import ml_collections

from marl_jax.algos import losses
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace
from marl_jax.algos.optim import OptimConfig
from marl_jax.envs.base import Demonstrates, Environment, MakesMistakes
from marl_jax.errors import UserInputError
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.parallel import layouts, multihost
from marl_jax.parallel.policies import PolicyConfig
from marl_jax.parallel.train_config import TrainConfig
from marl_jax.training.llm_policy import prompt_ids
from marl_jax.workflows.rollout import (Generation, Problem, Request, RolloutConfig, Sample,
                                        rollout)
from marl_jax.workflows.spec import WorkflowSpec

# One demonstration episode per problem.
ROLLOUT_MODE, ROLLOUT_K = "independent", 1


def first_seed(c: ml_collections.ConfigDict, step: int) -> int:
  """The seed of warm-start step `step`'s first problem (module docstring)."""
  return c.sft.seed_offset + (c.seed * c.sft.steps + step) * c.sft.problems_per_step


def train_config(rl: TrainConfig, optim: OptimConfig, lr: float, steps: int, space: GroupSpace
                 ) -> TrainConfig:
  """The warm-start's step: RL's model, mesh and memory settings with the "nll" loss (no KL,
  entropy or clipping), AdamW `optim` from `lr` decaying linearly to 0 over the `steps` updates
  (the usual fine-tuning schedule: the last updates settle instead of jumping), one update per
  batch. The step still computes advantages, which "nll" ignores; with no group filter every
  demonstration counts.

  The log-probs are the model's own, at temperature 1, whatever RL samples at: RL divides the
  logits by the sampling temperature because its samples were drawn from that distribution,
  but a demonstration was not drawn from the policy, and fitting it at RL's T = 0.6 would train
  a flatter model whose T = 0.6 samples merely match the demonstrations' spread."""
  optim = dataclasses.replace(optim, lr=lr, schedule="linear", decay_steps=steps,
                              end_lr_ratio=0.0, warmup_steps=0, hold_steps=0)
  policy = dataclasses.replace(rl.policy, optim=(optim,) * len(rl.policy.optim))
  train = dataclasses.replace(rl.train, agent_grad_norms=False, target_kl=None,
                              mini_batch_size=None, epochs=1, recompute_old_logp=False,
                              tis_cap=None, max_staleness=0)
  return dataclasses.replace(
      rl, policy=policy, space=space, loss=losses.LossConfig(policy_loss="nll"),
      advantage=AdvantageConfig(estimator="grpo", filter="none"), with_entropy=False, train=train,
      temperature=1.0)


def check_env(env: Environment, agents: Sequence[str], env_name: str, mistake_rate: float = 0.0
              ) -> None:
  """Raises UserInputError unless `env` (a fresh problem) demonstrates a reply for every agent
  and, with `mistake_rate` > 0, has a mistake for one of them."""
  missing = [a for a in agents
             if not isinstance(env, Demonstrates) or env.demonstration(a) is None]
  if missing:
    raise UserInputError(f"config.sft.steps > 0 needs demonstrations, but env {env_name!r} has "
                         f"none for agents {missing}; expected sft.steps=0 for this env")
  if mistake_rate and (not isinstance(env, MakesMistakes)
                       or all(env.mistake(a) is None for a in agents)):
    raise UserInputError(f"config.sft.mistake_rate={mistake_rate} needs an env with mistakes to "
                         f"recover from, but env {env_name!r} has none for agents {list(agents)}; "
                         "expected sft.mistake_rate=0 for this env")


class Demonstrator:
  """A scripted policy replying with each request's env demonstration, tokenised as the sampler
  would have produced it: the chat-templated prompt, then the reply and its end-of-reply token.
  A state with no demonstration gets an empty reply (its episode fails and is dropped). With
  `mistake_rate` > 0 the first-round requests of the picked episodes get the env's mistake, as
  text only: no tokens, so it is never trained on (module docstring)."""

  def __init__(self, policy: PolicyConfig, tokenizers: Sequence[Tokenizer],
               mistake_rate: float = 0.0):
    self.per_policy = layouts.of(policy).per_policy_models
    self.tokenizers = list(tokenizers)
    self.mistake_rate = mistake_rate

  def generate(self, requests: Sequence[Request], policy_id: int, params: Any
               ) -> list[Generation]:
    del params  # scripted
    tokenizer = self.tokenizers[policy_id if self.per_policy else 0]
    out = []
    for request in requests:
      prompt = tuple(prompt_ids(tokenizer, request.messages))
      mistake = self._mistake(request)
      if mistake is not None:
        out.append(Generation(mistake, prompt, (), (), "stop_token"))
        continue
      text = request.env.demonstration(request.agent) or ""
      ids = tuple(tokenizer.encode(text)) + (tokenizer.end_of_reply_id,) if text else ()
      out.append(Generation(text, prompt, ids, (0.0,) * len(ids), "stop_token"))
    return out

  def _mistake(self, request: Request) -> str | None:
    """The env's mistake for this request when its episode is picked and it is the first round;
    else None. An episode is picked when the CRC-32 of its first-round prompt, as a fraction of
    2^32, is below `mistake_rate`: deterministic, and independent of the problem's answer."""
    env = request.env
    if (env.turn != 0 or not isinstance(env, MakesMistakes)
        or zlib.crc32(repr(request.messages).encode()) >= self.mistake_rate * 2**32):
      return None
    return env.mistake(request.agent)


def demonstrations(problems: Sequence[Problem], spec: WorkflowSpec, demonstrator: Demonstrator,
                   rollout_cfg: RolloutConfig) -> tuple[list[Sample], dict[str, float]]:
  """(the samples of the solved demonstration episodes, metrics over every process):
  "sft/solved" (fraction of episodes kept), "sft/mistakes" (fraction that opened with a mistake)
  and "sft/reply_tokens" (mean tokens per kept reply). A sample without tokens (a mistake) is
  not kept."""
  cfg = dataclasses.replace(rollout_cfg, mode=ROLLOUT_MODE, k=ROLLOUT_K, record_traces=False)
  result = rollout(problems, spec, demonstrator.generate, None, cfg)
  solved = {e.traj_id for e in result.episodes if e.solved}
  kept = [s for s in result.samples if s.traj_id in solved and s.generation.token_ids]
  mistaken = {s.traj_id for s in result.samples
              if s.generation.text and not s.generation.token_ids}
  means = multihost.global_means({
      "solved": multihost.sum_count([e.solved for e in result.episodes]),
      "mistakes": multihost.sum_count([e.traj_id in mistaken for e in result.episodes]),
      "reply_tokens": multihost.sum_count([len(s.generation.token_ids) for s in kept])})
  return kept, {f"sft/{k}": v for k, v in means.items()}
