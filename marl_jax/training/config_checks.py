"""The checks of a run config that `config.build` runs before any compute, one rule each; a rule
that ties fields of two sections lives with the dataclass it concerns (`policy_config.check_team`,
`train_config.check_update_rules`, `rollout.check_decision_rewards`) and is called from here.
Every check raises ValueError naming the field (`config.section.field`) and what was expected;
`config.build` turns them into UserInputError.
"""

from __future__ import annotations

import math
import os
from typing import Any

import ml_collections

from marl_jax.algos import batch as batch_lib
from marl_jax.algos import critic as critic_lib
from marl_jax.algos.advantage_config import STATE_GROUPINGS, AdvantageConfig
from marl_jax.algos.losses import LossConfig
from marl_jax.models import config as model_config
from marl_jax.models import precision as precision_lib
from marl_jax.parallel import layouts, policy_config
from marl_jax.sampling.params import SamplingParams
from marl_jax.training import refill
from marl_jax.workflows.spec import WorkflowSpec


def dataclass_of(cls, section_cfg: ml_collections.ConfigDict, name: str,
                 field_first: bool = False):
  """`cls(**section)` with its refusals naming the section: `config.<name>: <error>`, or for a
  dataclass whose refusals name their field first (`field_first`, `TrainSettings`)
  `config.<name>.<field>=...; expected ...`."""
  try:
    return cls(**section_cfg.to_dict())
  except TypeError as e:  # an unknown field in a config file
    raise ValueError(f"config.{name}: {e}") from None
  except ValueError as e:
    raise ValueError(f"config.{name}{'.' if field_first else ': '}{e}") from None


def prefixed(rule, *args) -> None:
  """`rule(*args)` with its ValueError naming config fields (`config.` + the fields it names)."""
  try:
    rule(*args)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None


def one_of(value, allowed, field: str) -> None:
  if value not in allowed:
    raise ValueError(f"config.{field}={value!r}; expected one of {list(allowed)}")


# The one number field where inf means something (`AdvantageConfig.clamp`: no clip).
_INF_ALLOWED = frozenset({"algo.clamp"})


def check_finite(values: Any, field: str = "config") -> None:
  """Every float anywhere in `values` (a config's dict, lists included) is finite: NaN or inf in
  lr, a coefficient or a clip value passed every range check written as `x < 0` and trained to
  exit 0 with NaN weights. inf only where it means something (`_INF_ALLOWED`)."""
  if isinstance(values, dict):
    for key, value in values.items():
      check_finite(value, f"{field}.{key}")
  elif isinstance(values, (list, tuple)):
    for i, value in enumerate(values):
      check_finite(value, f"{field}[{i}]")
  elif isinstance(values, float) and not math.isfinite(values):
    if math.isinf(values) and field.removeprefix("config.") in _INF_ALLOWED:
      return
    raise ValueError(f"{field}={values!r}; expected a finite number")


def values(c: ml_collections.ConfigDict) -> None:
  """Single fields: the seed, models that exist, counts, coefficients, limits, temperatures and
  sampling knobs, each in its range."""
  check_finite(c.to_dict())
  if not isinstance(c.seed, int) or isinstance(c.seed, bool) or not 0 <= c.seed < 2**63:
    raise ValueError(f"config.seed={c.seed!r}; expected an integer in [0, 2**63) (a "
                     "jax.random.key seed)")
  for field, name in [("model", c.model)] + [(f"policy.models[{i}]", m)
                                             for i, m in enumerate(c.policy.models)]:
    if not (isinstance(name, str) and (name in model_config.PRESETS or os.path.exists(name))):
      raise ValueError(f"config.{field}={name!r} is neither a known preset "
                       f"({sorted(model_config.PRESETS)}) nor an existing file or directory")
  for field in ("rollout.k", "rollout.problems_per_step", "env.max_turns", "eval.every",
                "eval.num_problems", "eval.k", "checkpoint.every_steps", "checkpoint.max_to_keep"):
    value = _field(c, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"config.{field}={value!r}; expected an integer >= 1")
  for field, low in (("rollout.max_refills", 0), ("logging.samples_every", 0),
                     ("logging.samples_episodes", 1)):
    value = _field(c, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"config.{field}={value!r}; expected an integer >= {low}"
                       + (" (0: never)" if field == "logging.samples_every" else ""))
  kl_coef = c.loss.kl_coef
  if not _number(kl_coef) or not 0 <= kl_coef < math.inf:
    raise ValueError(f"config.loss.kl_coef={kl_coef!r}; expected a finite number >= 0 (0: no KL "
                     "term)")
  for field in ("rollout.tool_timeout_s", "rollout.tool_memory_mb"):
    value = _field(c, field)
    if not _number(value) or not math.isfinite(value) or value <= 0:
      raise ValueError(f"config.{field}={value!r}; expected a finite number > 0")
  for name in ("temperature", "top_p", "top_k", "max_new_tokens", "stop"):
    sampling_rule("sampling", name, c.sampling[name])
  for name in ("temperature", "top_p"):
    if c.eval[name] is not None:  # eval.top_p None: sampling.top_p
      sampling_rule("eval", name, c.eval[name])


def _field(c: ml_collections.ConfigDict, field: str) -> Any:
  group, name = field.split(".")
  return c[group][name]


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


# Fields a newer version replaced: a config (file or override) that still sets one is refused
# with what to set instead.
RENAMED_FIELDS = {
    "dtype": "config.dtype was split into config.compute_dtype (auto|float32|bfloat16: matmuls "
             "and attention; auto = bfloat16 on GPU/TPU, float32 on CPU) and config.param_dtype "
             "(storage of trainable params, float32); expected --config.compute_dtype=bfloat16",
}


def precision(c: ml_collections.ConfigDict) -> None:
  """Storage and compute dtypes (`models/precision.py`), and no field of an older schema."""
  for old, pointer in RENAMED_FIELDS.items():
    if old in c:
      raise ValueError(pointer)
  one_of(c.param_dtype, precision_lib.PARAM_DTYPES, "param_dtype")
  one_of(c.compute_dtype, precision_lib.COMPUTE_DTYPES, "compute_dtype")
  if not isinstance(c.allow_bf16_params, bool):
    raise ValueError(f"config.allow_bf16_params={c.allow_bf16_params!r}; expected a bool")
  if c.param_dtype == "bfloat16" and not c.allow_bf16_params:
    raise ValueError("config.param_dtype='bfloat16' stores trainable params and AdamW moments "
                     "in bf16, where updates below 2^-8 of a weight round away (one AdamW step "
                     "at lr 1e-6 changed 1.7% of Qwen3-0.6B's weights); expected "
                     "param_dtype='float32' with compute_dtype='bfloat16', or "
                     "allow_bf16_params=True to accept it")


def sft(c: ml_collections.ConfigDict) -> None:
  """The warm-start's sizes and learning rate (its env support: `preflight.check`)."""
  for name, low in (("steps", 0), ("problems_per_step", 1), ("seed_offset", 0)):
    value = c.sft[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"config.sft.{name}={value!r}; expected an integer >= {low}")
  lr = c.sft.lr
  if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
    raise ValueError(f"config.sft.lr={lr!r}; expected a finite number > 0")
  rate = c.sft.mistake_rate
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
    raise ValueError(f"config.sft.mistake_rate={rate!r}; expected a number in [0, 1]")
  if rate and not c.sft.steps:
    raise ValueError(f"config.sft.mistake_rate={rate} without a warm-start (config.sft.steps=0); "
                     "expected sft.steps > 0 or mistake_rate 0")
  if c.sft.steps and c.policy.critic is not None:
    raise ValueError(f"config.sft.steps={c.sft.steps} with config.policy.critic set: the "
                     "warm-start has no target for MARFT's value head; expected sft.steps=0")


def team(c: ml_collections.ConfigDict, spec: WorkflowSpec) -> None:
  """Per-policy models of a mapped team, and the MARFT critic with what it needs."""
  models, num = tuple(c.policy.models), spec.num_policies
  layout = layouts.of(c.policy)
  default = num if layout.per_policy_models else 1  # () = config.model for every model
  critic, estimator = c.policy.critic, c.algo.estimator
  critic_lib.check_critic(estimator, critic, estimator_field="config.algo.estimator",
                          critic_field="config.policy.critic")
  prefixed(policy_config.check_team, c.policy.kind, num, len(models) or default, critic)
  if critic is not None and c.rollout.mode != "independent":  # a critic estimator (checked)
    raise ValueError(f"config.rollout.mode={c.rollout.mode!r} puts K samples in one "
                     f"(trajectory, turn, agent) step; estimator {estimator!r} needs "
                     "'independent' rollouts")


def rollout_modes(c: ml_collections.ConfigDict, spec: WorkflowSpec,
                  advantage: AdvantageConfig) -> None:
  """Tree sizes, and rollout/estimator pairs whose every advantage would be 0 (nothing to learn)."""
  mode, k, turns, algo = c.rollout.mode, c.rollout.k, spec.max_turns, c.algo
  try:
    batch_lib.id_layout(mode, k, turns)
  except ValueError as e:
    raise ValueError(f"config.rollout: {e}") from None
  record = advantage.record
  if record.siblings and algo.baseline != "none":  # advantages relative to sibling nodes
    node = f"{algo.estimator!r} node"
    if mode == "tree":
      raise ValueError(f"config.rollout.mode='tree' continues one joint action per turn, so every "
                       f"{node} is its siblings' only member and every advantage is 0; expected "
                       "rollout.mode='magrpo_tree' (or 'independent' for one turn)")
    if mode == "independent" and turns > 1:
      raise ValueError(f"config.rollout.mode='independent' with {turns} turns gives every {node} "
                       "after turn 0 no sibling, so its advantage is 0; expected "
                       "rollout.mode='magrpo_tree' (G joint actions from every node)")
    if k < 2:
      raise ValueError(f"config.rollout.k={k} gives every {node} no sibling, so every "
                       "advantage is 0; expected k >= 2")
  group_by = advantage.resolved().group_by
  if group_by in STATE_GROUPINGS and spec.num_states == 1:
    raise ValueError(f"config.algo.group_by={group_by!r} splits groups by the state each agent "
                     f"observed; workflow {c.env.workflow!r} declares none (num_states 1); "
                     "expected 'problem_turn_agent'")
  if group_by == "turn_agent_state" and refill.enabled(c, advantage):
    raise ValueError(f"config.algo.group_by={group_by!r} pools the step's problems, so DAPO "
                     "dynamic sampling has no problem of its own group to keep; expected "
                     "config.rollout.max_refills=0 or a group_by with a problem factor")
  if (k < 2 and group_by in ("problem_turn_agent", "problem_turn_agent_state")
      and record.singleton_zero):
    raise ValueError(f"config.rollout.k={k} puts one sample in every (problem, turn, agent) group "
                     f"of estimator {algo.estimator!r}, so every advantage is 0; expected k >= 2")


def sampling(c: ml_collections.ConfigDict, spec: WorkflowSpec) -> None:
  """Each `sampling.per_agent` override: set only for an agent of the run's workflow, each value
  in its field's range (the global fields: `values`)."""
  for agent, section in c.sampling.per_agent.items():
    for name, value in section.items():
      if value is None:
        continue
      if agent not in spec.agents:
        raise ValueError(f"config.sampling.per_agent.{agent}.{name}={value!r} names agent "
                         f"{agent!r}, which workflow {c.env.workflow!r} of {c.env.name!r} does "
                         f"not have; expected an agent of {list(spec.agents)}")
      sampling_rule(f"sampling.per_agent.{agent}", name, value)


# A sampling config field -> the `SamplingParams` field whose check is its rule.
_SAMPLING_PARAMS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "max_new_tokens": "max_new_tokens", "stop": "stop_strings"}


def sampling_rule(section: str, name: str, value: Any) -> None:
  """Config field `section.name` checked by `SamplingParams`' own rule (sampling/params.py, the
  one home of the sampling rules), its refusal naming the config field."""
  param = _SAMPLING_PARAMS[name]
  try:
    SamplingParams(**{param: value})
  except ValueError as e:
    raise ValueError(f"config.{section}.{name}{str(e).removeprefix(param)}") from None


def learner_temperature(c: ml_collections.ConfigDict,
                        temperatures: dict[str, tuple[float, float]], loss: LossConfig) -> None:
  """PPO ratios start at 1 only when each agent's learner temperature is the one its samples were
  drawn at (`temperatures`: agent -> (learner, sampling)), unless the learner recomputes the old
  log-probs itself."""
  if not loss.record.ratio or c.train.recompute_old_logp:
    return
  for agent, (learner, sampled) in temperatures.items():
    if learner != sampled:
      section = c.sampling.per_agent.get(agent)
      where = (f" of agent {agent!r} (config.sampling.per_agent.{agent}.temperature)"
               if section is not None and section.temperature is not None else "")
      raise ValueError(f"config.train.learner_temperature={c.train.learner_temperature} differs "
                       f"from the sampling temperature {sampled}{where}, so PPO ratios would "
                       "not start at 1; set config.train.recompute_old_logp=True (old log-probs "
                       "from the learner)")
