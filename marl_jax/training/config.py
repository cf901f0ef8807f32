"""The experiment config: every field a run reads, with defaults, and its validation.

Config files under `configs/` start from `base_config()` and change what their paper setting
needs; the command line overrides any field (`--config.algo.estimator=drmas`). The `algo`, `loss`
and `optim` sections mirror the frozen dataclasses of `marl_jax.algos` field for field (built by
`section`), so there is one place that defines each option and its check. `build` turns a config
into those objects and checks the rest before any compute: a typo or a bad value stops the run
with one line naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import typing
from typing import Any

import ml_collections
from flax import traverse_util
from ml_collections import config_dict

from marl_jax.algos import critic as critic_lib
from marl_jax.algos.advantage_config import STATE_GROUPINGS, AdvantageConfig
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.errors import UserInputError
from marl_jax.models import config as model_config
from marl_jax.models import precision
from marl_jax.models.lora import LoraConfig
from marl_jax.parallel import layouts
from marl_jax.parallel.policies import PolicyConfig
from marl_jax.training import checkpoint, metrics
from marl_jax.workflows import registry, rollout
from marl_jax.workflows.spec import WorkflowSpec

# The value head's optimizer defaults (MARFT: gradients clipped at 0.5), from PolicyConfig.
_CRITIC_OPTIM = {f.name: f.default for f in dataclasses.fields(PolicyConfig)}["critic_optim"]


def section(obj: Any) -> ml_collections.ConfigDict:
  """A config section holding every field of the dataclass instance `obj`.

  Optional fields left at None become typed placeholders so the command line can still set them.
  """
  hints = typing.get_type_hints(type(obj))
  out = ml_collections.ConfigDict()
  for field in dataclasses.fields(obj):
    value = getattr(obj, field.name)
    if value is None:
      hint = hints[field.name]
      args = [a for a in typing.get_args(hint) if a is not type(None)]
      value = config_dict.placeholder(args[0] if args else hint)
    out[field.name] = value
  return out


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # A preset name with embedded/local weights, a .gguf file or an HF checkpoint directory.
  c.model = "smollm2-135m-instruct"
  # Start a fresh run from another run's trained params instead of `model`'s: "WORKDIR" (its
  # newest checkpoint) or "WORKDIR:STEP", e.g. step 0, which a run with a warm-start saves right
  # after it. The same team and optimizer layout; a fresh optimizer state; no warm-start of its
  # own (sft.steps = 0). A fork: one warm-start, then RL under two reward weights.
  c.init_from = ""
  # Precision (marl_jax/models/precision.py): trainable params and AdamW moments are stored in
  # `param_dtype`, float32 (bfloat16 rounds away updates below 2^-8 of a weight, most of them at
  # the papers' learning rates, so it needs `allow_bf16_params=True`); matmuls and attention run
  # in `compute_dtype`: "auto" = bfloat16 on GPU and TPU, float32 on CPU.
  c.param_dtype = "float32"
  c.compute_dtype = "auto"
  c.allow_bf16_params = False
  # Team policies: "shared" (one model, role prompts), "lora" (one adapter per role over a frozen
  # base), "stacked" (one full model per role), "mapped" (one full model per role, each its own
  # architecture and tokenizer: `models` lists one name or path per policy in agent order; empty
  # = `model` for every policy). `share`: groups of agents of a per-role team that act with one
  # policy, each "a+b+..." (workflows/registry.py), e.g. ("worker_1+worker_2",). `critic`:
  # hidden sizes of MARFT's value head over the frozen LoRA base (e.g. (1024, 512)); None = no
  # critic.
  c.policy = ml_collections.ConfigDict(dict(
      kind="shared", per_role=False, share=(), models=(), critic=config_dict.placeholder(tuple),
      critic_optim=section(_CRITIC_OPTIM)))
  c.lora = section(LoraConfig())
  # The environment, its workflow variant (workflows/registry.py) and extra make_env kwargs.
  c.env = ml_collections.ConfigDict(dict(name="plan_path", workflow="mas", max_turns=4,
                                         kwargs=ml_collections.ConfigDict()))
  # allow_unsandboxed: run model-written code without bubblewrap isolation when none works here
  # (as the calling user, see marl_jax/sandbox/runner.py); otherwise such a run stops at start-up.
  # mode: "tree" (AT-GRPO), "magrpo_tree" (MAGRPO's joint-action tree, k^max_turns leaves per
  # problem) or "independent" (k trajectories per problem); see workflows/rollout.py.
  # max_refills: with algo.filter="zero_variance" (DAPO dynamic sampling), at most this many
  # extra rollouts of problems_per_step fresh problems per step until problems_per_step problems
  # have a group with non-zero reward variance (training/refill.py); 0 = no refill. Single-process
  # runs only. Unused by the other filters.
  c.rollout = ml_collections.ConfigDict(dict(mode="tree", k=8, problems_per_step=32,
                                             tool_timeout_s=5.0, tool_memory_mb=512,
                                             allow_unsandboxed=False, max_refills=4))
  c.sampling = ml_collections.ConfigDict(dict(temperature=1.0, top_p=1.0, top_k=0,
                                              max_new_tokens=2048))
  c.algo = section(AdvantageConfig(estimator="at_grpo", filter="lowest_mean"))
  # loss.kl_coef > 0: KL to a frozen reference. LoRA: the base without adapters (no extra
  # memory). Full models (shared/stacked/mapped): a frozen copy of the params RL starts from
  # (pretrained, warm-started or init_from's), as many bytes as those params (logged); not
  # checkpointed, rebuilt on resume (`trainer` module doc).
  c.loss = section(LossConfig())
  c.optim = section(OptimConfig())
  c.name = "run"
  # eval_only: the table rows without RL (experiments.train refuses them; evaluate runs them).
  # target_kl: skip a policy update whose approximate KL exceeds it (MARFT); None = never.
  # mini_batch_size: samples per optimizer update (per policy for stacked / mapped teams; a
  # multiple of devices x micro_batches), None = the whole rollout in one update; epochs: PPO
  # passes over the rollout (parallel/minibatch.py). recompute_old_logp: the learner's log-probs
  # replace the sampler's before the first update (verl's default); tis_cap: truncated IS weight
  # min(exp(learner - sampler log-prob), cap) per token (needs recompute_old_logp), None = off.
  # learner_temperature: the loss's log-probs are log_softmax(logits / T); None = the sampling
  # temperature (1 when sampling greedily). logits_chunk: response positions per LM-head slice in
  # the learner's forwards (the [B, R, V] logits never exist whole), None = whole.
  # share_prompts: the learner computes each distinct prompt of a batch once and its keys/values
  # serve every sample that shares it (a group's G samples), forward and backward.
  # agent_grad_norms: log `agent/grad_norm/<agent>`, the norm of the gradient of each agent's own
  # loss share (Dr. MAS's instability signal; one extra backward pass per agent).
  # agents: comma-separated agents that RL trains ("" = all). The others' samples still enter
  # the advantage statistics, so the trained agents' groups are unchanged, but carry no tokens
  # into any loss (e.g. `coordinator`: learn a decision over fixed workers,
  # `trainer.trained_samples`), and the update leaves their rows out (`minibatch.trained_rows`).
  # A model that acts for none of the trained agents (per-role layouts) is frozen in RL: no
  # update, no weight decay, no optimizer moments (`trainer.policy_config`).
  c.train = ml_collections.ConfigDict(dict(steps=200, micro_batches=1, remat=False, agents="",
                                           logits_chunk=config_dict.placeholder(int),
                                           share_prompts=False,
                                           mesh=(-1, 1, 1), eval_only=False,
                                           target_kl=config_dict.placeholder(float),
                                           mini_batch_size=config_dict.placeholder(int),
                                           epochs=1, recompute_old_logp=False,
                                           tis_cap=config_dict.placeholder(float),
                                           learner_temperature=config_dict.placeholder(float),
                                           agent_grad_norms=False))
  # eval.top_p: nucleus of evaluation sampling; None = sampling.top_p. eval.env_kwargs: env
  # kwargs of evaluation only, set over env.kwargs (a test split: `--config.eval.env_kwargs.path=
  # test.jsonl`; configs declare the fields with `configs.common.data_fields`). Evaluation problem
  # i has seed seed_offset + i, so on a local dataset of R rows it reads row (seed_offset + i) % R:
  # num_problems = R evaluates every row once.
  c.eval = ml_collections.ConfigDict(dict(every=10, num_problems=100, seed_offset=1_000_000,
                                          k=1, temperature=0.0, at_start=True,
                                          top_p=config_dict.placeholder(float),
                                          env_kwargs=ml_collections.ConfigDict()))
  # Supervised warm-start before RL (training/sft.py): `steps` updates (0 = none), each on the
  # demonstrations of `problems_per_step` problems of seeds seed_offset + ... (disjoint from
  # training's and evaluation's, one set per run seed), AdamW from `lr` decaying linearly to 0
  # (config.optim's other settings), then a fresh optimizer state for RL. Needs an env whose
  # agents have demonstrations. mistake_rate: the fraction of demonstration episodes that open
  # with the env's mistake (never trained on) and recover from it (needs env.mistake).
  c.sft = ml_collections.ConfigDict(dict(steps=0, problems_per_step=8, lr=1e-5,
                                         seed_offset=2_000_000, mistake_rate=0.0))
  c.checkpoint = checkpoint.default_config()  # every_steps, max_to_keep, async_save
  c.logging = metrics.default_config()  # wandb mode/project, jsonl, console
  c.logging.progress = True
  return c


@dataclasses.dataclass(frozen=True)
class Built:
  """The checked objects a run is made of."""

  spec: WorkflowSpec
  advantage: AdvantageConfig
  loss: LossConfig
  optim: OptimConfig
  lora: LoraConfig | None
  critic: tuple[int, ...] | None
  critic_optim: OptimConfig


def _dataclass(cls, section_cfg: ml_collections.ConfigDict, name: str):
  try:
    return cls(**section_cfg.to_dict())
  except TypeError as e:  # an unknown field in a config file
    raise ValueError(f"config.{name}: {e}") from None
  except ValueError as e:
    raise ValueError(f"config.{name}: {e}") from None


def _one_of(value, allowed, field: str) -> None:
  if value not in allowed:
    raise ValueError(f"config.{field}={value!r}; expected one of {list(allowed)}")


def _user_errors(check):
  """The config checks raise ValueError (their own or the dataclasses'); every one of them is about
  a value the user gave, so callers get UserInputError (one line at the entry points)."""

  @functools.wraps(check)
  def checked(*args, **kwargs):
    try:
      return check(*args, **kwargs)
    except UserInputError:
      raise
    except ValueError as e:
      raise UserInputError(str(e)) from None

  return checked


def trained_agents(c: ml_collections.ConfigDict, spec: WorkflowSpec) -> frozenset[str]:
  """The agents RL trains: `config.train.agents` ("" = every agent of the workflow)."""
  names = [n.strip() for n in (c.train.agents or "").split(",") if n.strip()]
  unknown = sorted(set(names) - set(spec.agents))
  if unknown:
    raise ValueError(f"config.train.agents={c.train.agents!r} names {unknown}; expected "
                     f"comma-separated agents of {list(spec.agents)} ('' = all)")
  return frozenset(names or spec.agents)


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


@_user_errors
def build(c: ml_collections.ConfigDict) -> Built:
  """Checks a whole config before any compute; raises UserInputError naming the field and value."""
  check_finite(c.to_dict())
  if not isinstance(c.seed, int) or isinstance(c.seed, bool) or not 0 <= c.seed < 2**63:
    raise ValueError(f"config.seed={c.seed!r}; expected an integer in [0, 2**63) (a "
                     "jax.random.key seed)")
  _one_of(c.policy.kind, layouts.LAYOUTS.names(), "policy.kind")
  layout = layouts.of(c.policy)
  _one_of(c.env.name, registry.TASKS.names(), "env.name")
  try:
    spec = registry.workflow_spec(c.env.name, c.env.workflow, c.env.max_turns)
  except ValueError as e:
    raise ValueError(f"config.env: {e}") from None
  try:
    spec = dataclasses.replace(spec, policy_of=registry.policy_map(
        spec.agents, c.policy.per_role, tuple(c.policy.share)))
  except ValueError as e:
    raise ValueError(f"config.policy: {e}") from None
  _one_of(c.rollout.mode, rollout.MODES, "rollout.mode")
  if c.algo.estimator == "remax":
    raise ValueError("config.algo.estimator='remax' needs greedy baseline samples (is_greedy), "
                     "which no rollout produces, so it would train on nothing; use 'rloo', "
                     "'dr_grpo', or 'magrpo' with config.algo.baseline='max'")
  _check_precision(c)
  for field, name in [("model", c.model)] + [(f"policy.models[{i}]", m)
                                             for i, m in enumerate(c.policy.models)]:
    if not (isinstance(name, str) and (name in model_config.PRESETS or os.path.exists(name))):
      raise ValueError(f"config.{field}={name!r} is neither a known preset "
                       f"({sorted(model_config.PRESETS)}) nor an existing file or directory")
  for field in ("rollout.k", "rollout.problems_per_step", "train.steps", "env.max_turns",
                "eval.every", "eval.num_problems", "eval.k", "train.micro_batches", "train.epochs",
                "checkpoint.every_steps", "checkpoint.max_to_keep", "sampling.max_new_tokens"):
    group, name = field.split(".")
    value = c[group][name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"config.{field}={value!r}; expected an integer >= 1")
  _check_sft(c)
  init_from(c)
  refills = c.rollout.max_refills
  if not isinstance(refills, int) or isinstance(refills, bool) or refills < 0:
    raise ValueError(f"config.rollout.max_refills={refills!r}; expected an integer >= 0")
  kl_coef = c.loss.kl_coef
  if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not 0 <= kl_coef < math.inf:
    raise ValueError(f"config.loss.kl_coef={kl_coef!r}; expected a finite number >= 0 (0: no KL term)")
  if kl_coef and c.policy.kind == "lora" and (c.sft.steps or c.init_from):
    raise ValueError(f"config.loss.kl_coef={kl_coef} with LoRA adapters that RL starts from "
                     "trained (sft.steps or init_from): the KL reference is the base without "
                     "adapters, not that policy; expected kl_coef 0, or full models")
  for field in ("rollout.tool_timeout_s", "rollout.tool_memory_mb"):
    group, name = field.split(".")
    value = c[group][name]
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        or value <= 0):
      raise ValueError(f"config.{field}={value!r}; expected a finite number > 0")
  for field in ("sampling.temperature", "eval.temperature"):
    group, name = field.split(".")
    value = c[group][name]
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        or value < 0):
      raise ValueError(f"config.{field}={value!r}; expected a finite number >= 0 (0: greedy)")
  _check_updates(c)
  top_k = c.sampling.top_k
  if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
    raise ValueError(f"config.sampling.top_k={top_k!r}; expected an integer >= 0 (0: off)")
  for field in ("sampling.top_p", "eval.top_p"):
    group, name = field.split(".")
    value = c[group][name]
    if value is not None and (isinstance(value, bool) or not 0.0 < value <= 1.0):
      raise ValueError(f"config.{field}={value!r}; expected a number in (0, 1]")
  if not layout.per_role and spec.num_policies > 1:
    raise ValueError(f"config.policy.kind={c.policy.kind!r} puts every role on one model; "
                     "per_role=True needs kind 'lora', 'stacked' or 'mapped'")
  if layout.per_role and spec.num_policies < 2:
    raise ValueError(f"config.policy.kind={c.policy.kind!r} needs one policy per role, but the "
                     f"{c.env.workflow!r} workflow of {c.env.name!r} has "
                     f"{'one agent' if len(spec.agents) == 1 else 'per_role=False'}; use "
                     "kind='shared' or set config.policy.per_role=True")
  _check_team(c, spec)
  trained_agents(c, spec)
  advantage = _dataclass(AdvantageConfig, c.algo, "algo")
  _check_rollout(c, spec, advantage)
  unknown = sorted(set(c.eval.env_kwargs) - set(c.env.kwargs))
  if unknown:
    raise ValueError(f"config.eval.env_kwargs sets {unknown}, which config.env.kwargs does not "
                     f"declare; expected a subset of {sorted(c.env.kwargs)}")
  mesh = tuple(c.train.mesh)
  sizes_ok = all(isinstance(s, int) and not isinstance(s, bool) and (s >= 1 or s == -1)
                 for s in mesh)
  if len(mesh) != 3 or not sizes_ok:
    raise ValueError(f"config.train.mesh={mesh}; expected (data, fsdp, tensor) sizes, integers "
                     ">= 1 or -1 for 'all remaining devices'")
  return Built(spec=spec, advantage=advantage,
               loss=_dataclass(LossConfig, c.loss, "loss"),
               optim=_dataclass(OptimConfig, c.optim, "optim"),
               lora=_dataclass(LoraConfig, c.lora, "lora") if layout.adapters else None,
               critic=None if c.policy.critic is None else tuple(c.policy.critic),
               critic_optim=_dataclass(OptimConfig, c.policy.critic_optim,
                                       "policy.critic_optim"))


# Fields a newer version replaced: a config (file or override) that still sets one is refused
# with what to set instead.
RENAMED_FIELDS = {
    "dtype": "config.dtype was split into config.compute_dtype (auto|float32|bfloat16: matmuls "
             "and attention; auto = bfloat16 on GPU/TPU, float32 on CPU) and config.param_dtype "
             "(storage of trainable params, float32); expected --config.compute_dtype=bfloat16",
}


def _check_precision(c: ml_collections.ConfigDict) -> None:
  """Storage and compute dtypes (`models/precision.py`), and no field of an older schema."""
  for old, pointer in RENAMED_FIELDS.items():
    if old in c:
      raise ValueError(pointer)
  _one_of(c.param_dtype, precision.PARAM_DTYPES, "param_dtype")
  _one_of(c.compute_dtype, precision.COMPUTE_DTYPES, "compute_dtype")
  if not isinstance(c.allow_bf16_params, bool):
    raise ValueError(f"config.allow_bf16_params={c.allow_bf16_params!r}; expected a bool")
  if c.param_dtype == "bfloat16" and not c.allow_bf16_params:
    raise ValueError("config.param_dtype='bfloat16' stores trainable params and AdamW moments "
                     "in bf16, where updates below 2^-8 of a weight round away (one AdamW step "
                     "at lr 1e-6 changed 1.7% of Qwen3-0.6B's weights); expected "
                     "param_dtype='float32' with compute_dtype='bfloat16', or "
                     "allow_bf16_params=True to accept it")


def init_from(c: ml_collections.ConfigDict) -> tuple[str, int] | None:
  """(workdir, checkpoint step) of `config.init_from`, checked to exist; None when unset."""
  value = c.init_from
  if not value:
    return None
  workdir, _, tail = str(value).rpartition(":")
  if not (workdir and tail.isdigit()):
    workdir, tail = str(value), ""
  steps = checkpoint.saved_steps(workdir)
  step = int(tail) if tail else (steps[-1] if steps else None)
  if step not in steps:
    raise ValueError(f"config.init_from={value!r}: {workdir} has "
                     f"{'no checkpoint' if not steps else f'checkpoints {steps}, not {step}'}; "
                     "expected a run's workdir, optionally with :STEP of a saved checkpoint")
  if c.sft.steps:
    raise ValueError(f"config.init_from={value!r} starts from trained params, so it has no "
                     f"warm-start of its own; expected config.sft.steps=0, got {c.sft.steps}")
  return workdir, step


def _check_sft(c: ml_collections.ConfigDict) -> None:
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


def _check_team(c: ml_collections.ConfigDict, spec: WorkflowSpec) -> None:
  """Per-policy models of a mapped team, and the MARFT critic with what it needs."""
  kind, models, num = c.policy.kind, tuple(c.policy.models), spec.num_policies
  layout = layouts.of(c.policy)
  if models and not layout.per_policy_models:
    raise ValueError(f"config.policy.models lists {len(models)} per-policy models, which only "
                     f"kind 'mapped' uses; got config.policy.kind={kind!r}")
  if layout.per_policy_models and len(models) not in (0, num):
    raise ValueError(f"config.policy.models has {len(models)} entries but the "
                     f"{c.env.workflow!r} workflow of {c.env.name!r} has {num} policies "
                     f"(agents {spec.agents}); give one per policy in agent order, or () to "
                     "use config.model for every policy")
  critic, estimator = c.policy.critic, c.algo.estimator
  critic_lib.check_critic(estimator, critic, estimator_field="config.algo.estimator",
                          critic_field="config.policy.critic")
  if critic is not None:
    if not critic or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1
                             for h in critic):
      raise ValueError(f"config.policy.critic={tuple(critic)!r}; expected hidden sizes, "
                       "integers >= 1")
    if not layout.adapters:
      raise ValueError(f"config.policy.critic needs config.policy.kind='lora' (the frozen base "
                       f"model is the critic's trunk), got {kind!r}")
  if critic is not None and c.rollout.mode != "independent":  # a critic estimator (checked)
    raise ValueError(f"config.rollout.mode={c.rollout.mode!r} puts K samples in one "
                     f"(trajectory, turn, agent) step; estimator {estimator!r} needs "
                     "'independent' rollouts")
  target_kl = c.train.target_kl
  if target_kl is not None and (not target_kl > 0 or c.loss.policy_loss != "ppo"):
    raise ValueError(f"config.train.target_kl={target_kl!r} needs a value > 0 and "
                     f"config.loss.policy_loss='ppo' (got {c.loss.policy_loss!r})")


def _check_rollout(c: ml_collections.ConfigDict, spec: WorkflowSpec,
                   advantage: AdvantageConfig) -> None:
  """Tree sizes, and rollout/estimator pairs whose every advantage would be 0 (nothing to learn)."""
  mode, k, turns, algo = c.rollout.mode, c.rollout.k, spec.max_turns, c.algo
  try:
    rollout.id_layout(mode, k, turns)
  except ValueError as e:
    raise ValueError(f"config.rollout: {e}") from None
  if algo.estimator == "magrpo" and algo.baseline != "none":
    if mode == "tree":
      raise ValueError("config.rollout.mode='tree' continues one joint action per turn, so every "
                       "MAGRPO node is its siblings' only member and every advantage is 0; "
                       "expected rollout.mode='magrpo_tree' (or 'independent' for one turn)")
    if mode == "independent" and turns > 1:
      raise ValueError(f"config.rollout.mode='independent' with {turns} turns gives every MAGRPO "
                       "node after turn 0 no sibling, so its advantage is 0; expected "
                       "rollout.mode='magrpo_tree' (G joint actions from every node)")
    if k < 2:
      raise ValueError(f"config.rollout.k={k} gives every MAGRPO node no sibling, so every "
                       "advantage is 0; expected k >= 2")
  group_by = advantage.resolved().group_by
  if group_by in STATE_GROUPINGS and spec.num_states == 1:
    raise ValueError(f"config.algo.group_by={group_by!r} splits groups by the state each agent "
                     f"observed; workflow {c.env.workflow!r} declares none (num_states 1); "
                     "expected 'problem_turn_agent'")
  if group_by == "turn_agent_state" and dynamic_sampling(c, advantage):
    raise ValueError(f"config.algo.group_by={group_by!r} pools the step's problems, so DAPO "
                     "dynamic sampling has no problem of its own group to keep; expected "
                     "config.rollout.max_refills=0 or a group_by with a problem factor")
  if (k < 2 and group_by in ("problem_turn_agent", "problem_turn_agent_state")
      and algo.estimator in ("grpo", "at_grpo", "dr_grpo", "rloo")):
    raise ValueError(f"config.rollout.k={k} puts one sample in every (problem, turn, agent) group "
                     f"of estimator {algo.estimator!r}, so every advantage is 0; expected k >= 2")


def dynamic_sampling(c: ml_collections.ConfigDict, advantage: AdvantageConfig) -> bool:
  """Whether the run refills its rollouts (DAPO dynamic sampling, `training/refill.py`)."""
  return advantage.filter == "zero_variance" and c.rollout.max_refills > 0


# What a resumed run may change: how far it runs, how it is named, logged, checkpointed and
# evaluated. Anything else would continue the checkpoint under a different computation.
RESUMABLE = ("name", "train.steps", "eval.", "logging.", "checkpoint.")


def check_resume(saved: dict[str, Any], c: ml_collections.ConfigDict) -> None:
  """Refuses to resume a run whose saved config (`config.json`, as JSON) differs from `c` in a
  key outside `RESUMABLE`; keys only one side has (a newer or older schema) are not compared.

  Raises UserInputError naming the first such keys with both values.
  """
  current = traverse_util.flatten_dict(json.loads(c.to_json_best_effort()), sep=".")
  saved = traverse_util.flatten_dict(saved, sep=".")
  changed = [k for k in sorted(saved.keys() & current.keys())
             if saved[k] != current[k]
             and not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)]
  if changed:
    shown = "; ".join(f"{k}: {saved[k]!r} -> {current[k]!r}" for k in changed[:3])
    raise UserInputError(f"the workdir's checkpoint was trained under another config ({shown}"
                         f"{'; ...' if len(changed) > 3 else ''}); resume with the saved "
                         "config.json or use a new workdir (a resume may change only "
                         f"{', '.join(RESUMABLE)})")


def env_kwargs(c: ml_collections.ConfigDict, for_eval: bool = False) -> dict[str, Any]:
  """The make_env kwargs the config gives every problem: config.env.kwargs, and for evaluation
  with config.eval.env_kwargs's set values (not None) over them."""
  kwargs = c.env.kwargs.to_dict()
  if for_eval:
    kwargs.update({k: v for k, v in c.eval.env_kwargs.to_dict().items() if v is not None})
  return kwargs


def learner_temperature(c: ml_collections.ConfigDict) -> float:
  """The learner's temperature: config.train.learner_temperature, else the sampling one (1 for
  greedy sampling)."""
  if c.train.learner_temperature is not None:
    return c.train.learner_temperature
  return _sampling_temperature(c)


def _sampling_temperature(c: ml_collections.ConfigDict) -> float:
  """The temperature the samples were drawn at; 1 for greedy sampling (temperature 0)."""
  return c.sampling.temperature if c.sampling.temperature > 0 else 1.0


def _check_updates(c: ml_collections.ConfigDict) -> None:
  """Mini-batches, logit slices, epochs, old log-probs, TIS and the learner temperature (one line
  each)."""
  t = c.train
  for name in ("mini_batch_size", "logits_chunk"):
    size = t[name]
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
      raise ValueError(f"config.train.{name}={size!r}; expected an integer >= 1 or None")
  size = t.mini_batch_size
  if c.loss.policy_loss == "reinforce" and (t.epochs > 1 or size is not None):
    raise ValueError(f"config.loss.policy_loss='reinforce' is on-policy (one update per "
                     f"rollout); got config.train.epochs={t.epochs}, mini_batch_size={size}, "
                     "expected 1 and None")
  for name in ("recompute_old_logp", "share_prompts", "agent_grad_norms"):
    if not isinstance(t[name], bool):
      raise ValueError(f"config.train.{name}={t[name]!r}; expected a bool")
  if t.tis_cap is not None and (not t.tis_cap > 0 or not t.recompute_old_logp):
    raise ValueError(f"config.train.tis_cap={t.tis_cap!r} needs a value > 0 and "
                     "config.train.recompute_old_logp=True (the learner's log-probs to weigh "
                     "against the sampler's)")
  temp = t.learner_temperature
  if temp is not None and (isinstance(temp, bool) or not math.isfinite(temp) or not temp > 0):
    raise ValueError(f"config.train.learner_temperature={temp!r}; expected a finite number > 0 "
                     "or None (the sampling temperature)")
  sampling = _sampling_temperature(c)
  if (c.loss.policy_loss == "ppo" and not t.recompute_old_logp
      and learner_temperature(c) != sampling):
    raise ValueError(f"config.train.learner_temperature={temp} differs from the sampling "
                     f"temperature {sampling}, so PPO ratios would not start at 1; set "
                     "config.train.recompute_old_logp=True (old log-probs from the learner)")


@_user_errors
def mesh_shape(requested: tuple[int, int, int], num_devices: int) -> tuple[int, int, int]:
  """Resolves one -1 entry of (data, fsdp, tensor) to the devices left over."""
  sizes = list(requested)
  if sizes.count(-1) > 1:
    raise ValueError(f"config.train.mesh={tuple(requested)}: at most one -1")
  known = 1
  for s in sizes:
    known *= s if s != -1 else 1
  if -1 in sizes:
    sizes[sizes.index(-1)] = num_devices // known
  if sizes[0] * sizes[1] * sizes[2] != num_devices:
    raise ValueError(f"config.train.mesh={tuple(requested)} does not multiply to the "
                     f"{num_devices} available devices; expected sizes whose product is "
                     f"{num_devices} (or -1 for one of them)")
  return tuple(sizes)
