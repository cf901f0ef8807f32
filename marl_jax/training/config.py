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
import typing
from collections.abc import Sequence
from typing import Any

import ml_collections
from flax import traverse_util
from ml_collections import config_dict

from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.errors import UserInputError
from marl_jax.models.lora import LoraConfig
from marl_jax.parallel import layouts
from marl_jax.parallel.policy_config import LAYOUTS, PolicyConfig
from marl_jax.parallel.train_config import TrainSettings, check_update_rules
from marl_jax.sampling import registry as engines
from marl_jax.sampling.engine import EngineOptions
from marl_jax.training import checkpoint, metrics
from marl_jax.training import config_checks as checks
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


# The settings an agent may override under `sampling.per_agent.<agent>` (placeholder types).
PER_AGENT_SAMPLING = {"temperature": float, "top_p": float, "max_new_tokens": int,
                      "stop": tuple}


def per_agent_sampling() -> ml_collections.ConfigDict:
  """`sampling.per_agent`: for every agent name a registered workflow declares
  (`registry.agent_names`), its `PER_AGENT_SAMPLING` fields as typed placeholders (None = the
  global `sampling` value). Declared up front: a locked config takes only existing fields from
  the command line."""
  return ml_collections.ConfigDict({
      agent: {name: config_dict.placeholder(kind) for name, kind in PER_AGENT_SAMPLING.items()}
      for agent in registry.agent_names()})


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
      kind="shared", share=(), models=(), critic=config_dict.placeholder(tuple),
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
  # engine: what samples the replies (marl_jax/sampling/engine.py): "static" (every pending
  # request in one padded batch per wave) or "continuous" (slots over a paged K/V pool, requests
  # admitted as others finish, cached prompt pages reused, episodes advancing independently). The
  # same requests get the same tokens from either (each request draws with its own key). Static
  # is the default: on 2 CPU cores it was 1.1-1.6x faster on the papers' multi-turn workloads,
  # whose replies mostly run to the budget, and continuous 1.86x faster on heavy-tailed reply
  # lengths (RESULTS.md, `experiments.bench_engine`). `config.engine` sizes the continuous one.
  c.rollout = ml_collections.ConfigDict(dict(mode="tree", k=8, problems_per_step=32,
                                             tool_timeout_s=5.0, tool_memory_mb=512,
                                             allow_unsandboxed=False, max_refills=4,
                                             engine="static"))
  c.engine = section(EngineOptions())
  # Rollout sampling. stop: stop strings, a reply ends at the first one (its text excludes it).
  # per_agent.<agent>.{temperature, top_p, max_new_tokens, stop}: one agent's own setting, None =
  # the value above; a section exists for every agent of every registered workflow, and setting
  # one for an agent the run's workflow lacks is refused (`--config.sampling.per_agent.verifier.
  # temperature=0.7`). The learner divides each agent's logits by that agent's sampling
  # temperature (unless train.learner_temperature is set). Evaluation keeps config.eval's
  # temperature and top_p for every agent (it measures the policy, not its exploration), but
  # uses each agent's max_new_tokens and stop (its reply format and budget).
  c.sampling = ml_collections.ConfigDict(dict(temperature=1.0, top_p=1.0, top_k=0,
                                              max_new_tokens=2048, stop=(),
                                              per_agent=per_agent_sampling()))
  c.algo = section(AdvantageConfig(estimator="at_grpo", filter="lowest_mean"))
  # loss.kl_coef > 0: KL to a frozen reference. LoRA: the base without adapters (no extra
  # memory). Full models (shared/stacked/mapped): a frozen copy of the params RL starts from
  # (pretrained, warm-started or init_from's), as many bytes as those params (logged); not
  # checkpointed, rebuilt on resume (`trainer` module doc).
  c.loss = section(LossConfig())
  c.optim = section(OptimConfig())
  c.name = "run"
  # How the run trains (steps, micro-batches, mini-batches, epochs, old log-probs, ...): every
  # field is documented on marl_jax/parallel/train_config.TrainSettings. `agents`: the agents RL
  # trains ("" = all); a model that acts for none of them (per-role layouts) is frozen in RL: no
  # update, no weight decay, no optimizer moments (`setup.policy_config`).
  c.train = section(TrainSettings())
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
  train: TrainSettings
  lora: LoraConfig | None
  critic: tuple[int, ...] | None
  critic_optim: OptimConfig
  engine: EngineOptions


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


@_user_errors
def build(c: ml_collections.ConfigDict) -> Built:
  """Checks a whole config before any compute; raises UserInputError naming the field and value
  (the checks: `config_checks`)."""
  checks.values(c)
  checks.one_of(c.policy.kind, LAYOUTS.names(), "policy.kind")
  layout = layouts.of(c.policy)
  checks.one_of(c.env.name, registry.TASKS.names(), "env.name")
  try:
    spec = registry.workflow_spec(c.env.name, c.env.workflow, c.env.max_turns)
  except ValueError as e:
    raise ValueError(f"config.env: {e}") from None
  try:
    spec = dataclasses.replace(spec, policy_of=registry.policy_map(
        spec.agents, layout.per_role, tuple(c.policy.share)))
  except ValueError as e:
    raise ValueError(f"config.policy: {e}") from None
  checks.one_of(c.rollout.mode, rollout.MODES, "rollout.mode")
  engine = engine_options(c)
  checks.precision(c)
  train = checks.dataclass_of(TrainSettings, c.train, "train", field_first=True)
  checks.sft(c)
  init_from(c)
  if c.loss.kl_coef and layout.adapters and (c.sft.steps or c.init_from):
    raise ValueError(f"config.loss.kl_coef={c.loss.kl_coef} with LoRA adapters that RL starts "
                     "from trained (sft.steps or init_from): the KL reference is the base "
                     "without adapters, not that policy; expected kl_coef 0, or full models")
  if layout.per_role and spec.num_policies < 2:
    raise ValueError(f"config.policy.kind={c.policy.kind!r} gives every role its own policy, but "
                     f"the {c.env.workflow!r} workflow of {c.env.name!r} leaves "
                     f"{spec.num_policies} (agents {list(spec.agents)}, config.policy.share="
                     f"{tuple(c.policy.share)}); expected kind='shared'")
  advantage = checks.dataclass_of(AdvantageConfig, c.algo, "algo")  # before the rules it names
  checks.team(c, spec)
  trained_agents(c, spec)
  checks.rollout_modes(c, spec, advantage)
  unknown = sorted(set(c.eval.env_kwargs) - set(c.env.kwargs))
  if unknown:
    raise ValueError(f"config.eval.env_kwargs sets {unknown}, which config.env.kwargs does not "
                     f"declare; expected a subset of {sorted(c.env.kwargs)}")
  loss = checks.dataclass_of(LossConfig, c.loss, "loss")
  checks.prefixed(check_update_rules, train, loss)
  checks.sampling(c, spec)
  checks.learner_temperature(c, {a: (learner_temperature(c, a), sampling_temperature(c, a))
                                  for a in spec.agents}, loss)
  return Built(spec=spec, advantage=advantage, loss=loss, train=train,
               optim=checks.dataclass_of(OptimConfig, c.optim, "optim"),
               lora=checks.dataclass_of(LoraConfig, c.lora, "lora") if layout.adapters else None,
               critic=None if c.policy.critic is None else tuple(c.policy.critic),
               critic_optim=checks.dataclass_of(OptimConfig, c.policy.critic_optim,
                                                "policy.critic_optim"),
               engine=engine)


def engine_options(c: ml_collections.ConfigDict) -> EngineOptions:
  """`config.engine` checked against `rollout.engine`: the static engine reads only
  `top_candidates`, so sizing any other field for it is refused."""
  checks.one_of(c.rollout.engine, sorted(engines.ENGINES), "rollout.engine")
  options = checks.dataclass_of(EngineOptions, c.engine, "engine", field_first=True)
  if c.rollout.engine == "static":
    default = EngineOptions()
    changed = [f.name for f in dataclasses.fields(options) if f.name != "top_candidates"
               and getattr(options, f.name) != getattr(default, f.name)]
    if changed:
      raise ValueError(f"config.engine.{changed[0]}={getattr(options, changed[0])!r} sizes the "
                       "continuous engine, but config.rollout.engine='static'; expected "
                       "rollout.engine='continuous' or the field's default")
  return options


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


# What a resumed run may change: how far it runs, how it is named, logged, checkpointed and
# evaluated, and which engine samples (every engine draws the same tokens for a request).
# Anything else would continue the checkpoint under a different computation.
RESUMABLE = ("name", "train.steps", "eval.", "logging.", "checkpoint.", "rollout.engine",
             "engine.")


class _Absent:
  """A key neither the config nor the base config has."""

  def __repr__(self) -> str:
    return "(absent)"


def _flat_json(tree: dict[str, Any]) -> dict[str, Any]:
  return traverse_util.flatten_dict(tree, sep=".")


def check_resume(saved: dict[str, Any], c: ml_collections.ConfigDict) -> None:
  """Refuses to resume a run whose saved config (its checkpoint's identity, as JSON) differs from
  `c` in a key outside `RESUMABLE`. Both key sets are compared: a key only one side has stands
  for the base config's default there (a field added since the run was saved, at its default,
  changes nothing; `--config.env.kwargs.path=...` on a run that had none does), or is
  "(absent)" where the base config has no such field.

  Raises UserInputError naming the first such keys with both values.
  """
  current, saved = _flat_json(json.loads(c.to_json_best_effort())), _flat_json(saved)
  defaults = _flat_json(json.loads(base_config().to_json_best_effort()))
  absent = _Absent()

  def value(side: dict[str, Any], k: str) -> Any:
    return side.get(k, defaults.get(k, absent))

  changed = [k for k in sorted(saved.keys() | current.keys())
             if value(saved, k) != value(current, k)
             and not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)]
  if changed:
    shown = "; ".join(f"{k}: {value(saved, k)!r} -> {value(current, k)!r}" for k in changed[:3])
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


def agent_sampling(c: ml_collections.ConfigDict, agent: str | None, name: str) -> Any:
  """Sampling setting `name` (a `PER_AGENT_SAMPLING` field) of `agent`: its
  `sampling.per_agent` override when set, else the global `sampling.<name>` (also for None, or an
  agent no section declares)."""
  section = c.sampling.per_agent.get(agent) if agent is not None else None
  value = None if section is None else section[name]
  return c.sampling[name] if value is None else value


def learner_temperature(c: ml_collections.ConfigDict, agent: str | None = None) -> float:
  """The learner's temperature for `agent`'s rows: config.train.learner_temperature, else the
  agent's sampling temperature (1 for greedy sampling). `agent` None: the global one."""
  if c.train.learner_temperature is not None:
    return c.train.learner_temperature
  return sampling_temperature(c, agent)


def learner_temperatures(c: ml_collections.ConfigDict, agents: Sequence[str]
                         ) -> tuple[float, ...]:
  """`learner_temperature` of each of `agents` (`TrainConfig.temperature`, in agent-id order)."""
  return tuple(float(learner_temperature(c, a)) for a in agents)


def sampling_temperature(c: ml_collections.ConfigDict, agent: str | None = None) -> float:
  """The temperature `agent`'s samples were drawn at (`agent_sampling`); 1 for greedy sampling
  (temperature 0), whose log-probs the sampler records at temperature 1."""
  temperature = agent_sampling(c, agent, "temperature")
  return temperature if temperature > 0 else 1.0


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


@_user_errors
def split_devices(rollout_devices: int, devices: Sequence[Any], processes: int = 1
                  ) -> tuple[list[Any], list[Any]]:
  """(learner devices, rollout devices) of config.train.rollout_devices = R: the last R devices
  roll out, the others learn (`config.train.mesh` spans them); 0: both use every device."""
  devices = list(devices)
  if rollout_devices == 0:
    return devices, devices
  if processes > 1:
    raise ValueError(f"config.train.rollout_devices={rollout_devices} runs in one process, got "
                     f"{processes}; expected 0 (rollouts and updates share the devices)")
  if not 0 < rollout_devices < len(devices):
    raise ValueError(f"config.train.rollout_devices={rollout_devices}; expected 0 (rollouts and "
                     f"updates share the devices) or 1..{len(devices) - 1} of the "
                     f"{len(devices)} devices")
  return devices[:-rollout_devices], devices[-rollout_devices:]
