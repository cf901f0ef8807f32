"""What the learner is configured with and what it carries between steps.

`TrainSettings` is a run config's `train` section field for field (built like `algo`, `loss` and
`optim`: `training/config.section`), and checks its own rules; `check_update_rules` holds the
rules that tie it to the loss. `TrainConfig` is everything static about the update (the team,
the estimator, the loss, the batch's id ranges and these settings); `TrainState` is what changes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax

from marl_jax.algos import critic as critic_lib
from marl_jax.algos import losses
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace
from marl_jax.parallel import policies

__all__ = ["TrainConfig", "TrainSettings", "TrainState", "check_update_rules"]


def _int(value: Any, low: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _positive(value: Any) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and value > 0)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """How a run trains: the `train` section of its config.

  Attributes:
    steps: RL steps (rollout + updates) of the run.
    micro_batches: gradient accumulation slices of each device's rows in one update.
    remat: recompute each layer in the backward pass instead of keeping its activations.
    agents: comma-separated agents RL trains ("" = all); the others still count in their
      groups' statistics but carry no token into any loss (`trainer.trained_samples`).
    overlong_filter: DAPO's overlong filtering: a reply cut off by the token budget (finish
      reason "length") still counts in its group's statistics but carries no token into any
      loss (`trainer.trained_samples`), so a truncated reply's reward, which says little about
      the reply, neither reinforces nor punishes running on past the budget.
    logits_chunk: response positions per LM-head slice in every learner forward (the [B, R, V]
      fp32 logits exist one slice at a time); None: whole.
    share_prompts: each distinct prompt of a batch runs once in the learner, its keys/values
      serving every sample that shares it, forward and backward.
    mesh: (data, fsdp, tensor) device counts; one -1 = the devices left over.
    eval_only: an evaluation-only table row (no RL).
    target_kl: skip a policy update whose approximate KL exceeds it (MARFT); None: never.
    mini_batch_size: samples per optimizer update (per policy block for stacked and mapped
      teams; a multiple of devices x micro_batches); None: the whole rollout in one update.
    epochs: passes over the rollout (PPO epochs).
    recompute_old_logp: the learner's log-probs replace the sampler's before the first update
      (verl's default), so the PPO ratio measures only the policy's change.
    tis_cap: truncated IS weight min(exp(learner - sampler log-prob), cap) per token for the
      sampler/learner mismatch (verl, Tunix); needs recompute_old_logp. None: off.
    learner_temperature: the loss's log-probs are log_softmax(logits / T); None: the sampling
      temperature (1 when sampling greedily).
    agent_grad_norms: log each agent's own gradient norm (Dr. MAS's instability signal; one
      extra backward pass per agent).
    max_staleness: asynchronous RL's bound k (`training/pipeline.py`): step s trains on a
      rollout sampled with the params of k steps before (version s - k) while the learner
      updates; 0: synchronous, each rollout sampled with the params it trains.
    rollout_devices: R > 0 puts the rollouts (the engines and the params they sample with) on
      the last R devices and the learner (`mesh`, over the rest) on the others, each version's
      params handed over by `device_put`; 0: both on every device (`training/config.py`
      `split_devices`).
  """
  steps: int = 200
  micro_batches: int = 1
  remat: bool = False
  agents: str = ""
  overlong_filter: bool = False
  logits_chunk: int | None = None
  share_prompts: bool = False
  mesh: tuple[int, ...] = (-1, 1, 1)
  eval_only: bool = False
  target_kl: float | None = None
  mini_batch_size: int | None = None
  epochs: int = 1
  recompute_old_logp: bool = False
  tis_cap: float | None = None
  learner_temperature: float | None = None
  agent_grad_norms: bool = False
  max_staleness: int = 0
  rollout_devices: int = 0

  def __post_init__(self):
    object.__setattr__(self, "mesh", tuple(self.mesh))
    for name in ("steps", "micro_batches", "epochs"):
      if not _int(getattr(self, name), 1):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected an integer >= 1")
    if not _int(self.rollout_devices, 0):
      raise ValueError(f"rollout_devices={self.rollout_devices!r}; expected an integer >= 0 "
                       "(0: rollouts and updates share the devices)")
    if not _int(self.max_staleness, 0):
      raise ValueError(f"max_staleness={self.max_staleness!r}; expected an integer >= 0 "
                       "(0: synchronous)")
    if self.max_staleness and not self.recompute_old_logp:
      raise ValueError(f"max_staleness={self.max_staleness} needs recompute_old_logp=True: the "
                       "PPO ratio is taken against the learner's own (proximal) log-probs and "
                       "the stale sampler's are only weighed against them (decoupled PPO)")
    for name in ("logits_chunk", "mini_batch_size"):
      value = getattr(self, name)
      if value is not None and not _int(value, 1):
        raise ValueError(f"{name}={value!r}; expected an integer >= 1 or None")
    for name in ("remat", "share_prompts", "eval_only", "recompute_old_logp",
                 "agent_grad_norms", "overlong_filter"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected a bool")
    if not isinstance(self.agents, str):
      raise ValueError(f"agents={self.agents!r}; expected comma-separated agent names")
    if len(self.mesh) != 3 or not all(_int(s, 1) or s == -1 for s in self.mesh):
      raise ValueError(f"mesh={self.mesh}; expected (data, fsdp, tensor) sizes, integers >= 1 "
                       "or -1 for 'all remaining devices'")
    if self.target_kl is not None and not _positive(self.target_kl):
      raise ValueError(f"target_kl={self.target_kl!r}; expected a finite number > 0 or None")
    if self.tis_cap is not None and not (_positive(self.tis_cap) and self.recompute_old_logp):
      raise ValueError(f"tis_cap={self.tis_cap!r} needs a value > 0 and recompute_old_logp=True "
                       "(the learner's log-probs to weigh against the sampler's)")
    temp = self.learner_temperature
    if temp is not None and not _positive(temp):
      raise ValueError(f"learner_temperature={temp!r}; expected a finite number > 0 or None "
                       "(the sampling temperature)")


def check_update_rules(train: TrainSettings, loss: losses.LossConfig) -> None:
  """The rules between the train settings and the loss (ValueError naming both fields)."""
  if loss.record.on_policy and (train.epochs > 1 or train.mini_batch_size is not None):
    raise ValueError(f"loss.policy_loss={loss.policy_loss!r} is on-policy (one update per "
                     f"rollout); got train.epochs={train.epochs}, train.mini_batch_size="
                     f"{train.mini_batch_size}, expected 1 and None")
  if train.max_staleness and not loss.record.ratio:
    raise ValueError(f"train.max_staleness={train.max_staleness} corrects stale samples through "
                     f"the PPO ratio; expected loss.policy_loss in "
                     f"{losses.POLICY_LOSSES.having('ratio')}, got {loss.policy_loss!r}")
  if train.target_kl is not None and not loss.record.ratio:
    raise ValueError(f"train.target_kl={train.target_kl} uses the approximate KL of a ratio loss; "
                     f"expected loss.policy_loss in {losses.POLICY_LOSSES.having('ratio')}, got "
                     f"{loss.policy_loss!r}")


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32 updates taken (skipped ones included)
  params: Any  # trainable params: {'policy': ..., 'critic': ...}
  opt_state: Any  # {'policy': ..., 'critic': ...}
  skipped: jax.Array  # [] int32 updates skipped by the non-finite guard


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything static about the update.

  Attributes:
    policy: the policy layout (and critic).
    advantage: estimator and options.
    loss: loss terms and aggregation.
    space: id ranges of the batch (static segment counts).
    train: the run's train settings (micro-batches, remat, mini-batches, epochs, ...).
    agent_policies: policy of each agent (len = space.num_agents); None: every agent uses
      policy 0 when there is one policy, agent i uses policy i when there is one per agent.
    temperature: the learner's temperature: its log-probs are log_softmax(logits / temperature).
      One number for every row, or one per agent (len = space.num_agents, in agent-id order):
      each row's logits are divided by its agent's (`policies.row_temperature`; the trainer's
      are the agents' sampling temperatures, `config.sampling.per_agent`). The paper configs say
      which they use (verl-based AT-GRPO / Dr. MAS: the sampling one; CoMLRL's MAGRPO and
      MARFT: 1).
    with_entropy: compute per-token entropies (for an entropy bonus, else only the metric).
    reference_policies: the policies whose rows the KL reference pass sees (sorted ids; the
      trainer: those acting for `train.agents`, whose rows alone the updates keep,
      `parallel/update.py`). A stacked team's reference copies only their blocks and refuses a
      batch with another policy's block; the other layouts copy every policy (a mapped batch
      keeps a block per model). None: every policy.
  """
  policy: policies.PolicyConfig
  advantage: AdvantageConfig
  loss: losses.LossConfig
  space: GroupSpace
  train: TrainSettings = TrainSettings()
  agent_policies: tuple[int, ...] | None = None
  temperature: float | tuple[float, ...] = 1.0
  with_entropy: bool = True
  reference_policies: tuple[int, ...] | None = None

  def __post_init__(self):
    A, Pn = self.space.num_agents, self.policy.num_policies
    ref = self.reference_policies
    if ref is not None and (not ref or list(ref) != sorted(set(ref))
                            or not set(ref) <= set(range(Pn))):
      raise ValueError(f"reference_policies={ref!r}; expected None or distinct sorted policy ids "
                       f"in [0, {Pn})")
    if ref is not None:
      object.__setattr__(self, "reference_policies", tuple(ref))
    if self.agent_policies is None:
      if Pn not in (1, A):
        raise ValueError(f"{Pn} policies for {A} agents: set agent_policies (one policy id per "
                         "agent)")
      object.__setattr__(self, "agent_policies", tuple(range(A)) if Pn == A else (0,) * A)
    if len(self.agent_policies) != A:
      raise ValueError(f"agent_policies has {len(self.agent_policies)} entries but the group "
                       f"space declares num_agents={A}")
    missing = sorted({p for p in self.agent_policies if not 0 <= p < Pn})
    if missing:
      raise ValueError(f"agent_policies {self.agent_policies} name policy ids {missing} with no "
                       f"params; the policy config holds {Pn} policies")
    critic_lib.check_critic(self.advantage.estimator, self.policy.critic,
                            estimator_field="advantage.estimator", critic_field="policy.critic")
    if self.loss.entropy_coef != 0.0 and not self.with_entropy:
      raise ValueError(f"entropy_coef={self.loss.entropy_coef} needs with_entropy=True")
    temps = self.temperature
    if isinstance(temps, (tuple, list)):
      temps = tuple(temps)
      object.__setattr__(self, "temperature", temps)
      if len(temps) != A:
        raise ValueError(f"temperature has {len(temps)} entries but the group space declares "
                         f"num_agents={A}; expected one per agent (or one number)")
    if not all(_positive(t) for t in (temps if isinstance(temps, tuple) else (temps,))):
      raise ValueError(f"temperature={self.temperature!r}; expected a finite number > 0 (or "
                       "one per agent)")
    check_update_rules(self.train, self.loss)
