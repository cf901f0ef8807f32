"""The training step: one jitted function, shard_map'ed over the ('data', 'fsdp', 'tensor') mesh.

    fns = make_train_step(TrainConfig(...), mesh)
    trainable, frozen = fns.shard_params(trainable, frozen)
    state = fns.init(trainable)                             # TrainState (takes ownership)
    batch = fns.shard_batch(batch)
    batch = fns.old_values(state.params, frozen, batch)     # critic configs only (MARFT)
    batch = fns.ref_logp(reference, frozen, batch)          # loss.kl_coef > 0 only
    state, metrics = fns.step(state, frozen, batch)         # one update per rollout, or:
    batch, targets, adv_metrics = fns.prepare(state.params, frozen, batch, recompute=False)
    rows = fns.ref_logp(reference, frozen, rows)            # the same, on the trained rows only
    batch, targets = fns.recompute(state.params, frozen, rows, their_targets)  # if configured
    state, metrics = fns.step(state, frozen, mini_batch, targets_of_mini_batch)  # per update

PPO mini-batches and epochs, and updates on the trained rows only (`parallel/minibatch.py`
drives the updates), need the rollout's advantages fixed before the first update: `prepare`
computes them over the whole rollout (`gradients.rollout_targets`), `ref_logp` and `recompute`
the reference's and the learner's old log-probs of the rows the updates train on, and each
update's step takes them as `RolloutTargets`.

Inside the shard_map each device holds a slice of the samples and FSDP shards of the params, and
`parallel/gradients.local_grads` computes advantages, global loss denominators, gradients
accumulated over micro-batches (log-probs recomputed by a teacher-forced forward, params gathered
layer by layer inside the layer scan; autodiff turns the FSDP gathers into reduce-scatters) and
metrics. Then, outside the shard_map but in the same jit, `guarded_update` applies the optax
update (the optimizer state is split like the params: `init` places it so, the step keeps its
shardings) behind the guards: if the loss or any gradient is not finite, params and optimizer
state come back bitwise unchanged and `state.skipped` counts it;
with `target_kl`, a policy step whose approximate KL exceeds it is skipped (the critic still
trains), as MARFT does. `make_train_step` only wires these with the mesh, the shardings and the
host-side batch checks (`layouts.validate_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from marl_jax.algos import critic as critic_lib
from marl_jax.algos import losses, optim
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, TrainBatch
from marl_jax.models import precision
from marl_jax.parallel import gradients, layouts, policies, sharding
from marl_jax.parallel.mesh import BATCH_AXES, DATA, FSDP, batch_shards

__all__ = ["TrainConfig", "TrainFns", "TrainState", "guarded_update", "make_train_step"]


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32 steps taken (skipped ones included)
  params: Any  # trainable params: {'policy': ..., 'critic': ...}
  opt_state: Any  # {'policy': ..., 'critic': ...}
  skipped: jax.Array  # [] int32 updates skipped by the non-finite guard


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything static about the step.

  Attributes:
    policy: the policy layout (and critic).
    advantage: estimator and options.
    loss: loss terms and aggregation.
    space: id ranges of the batch (static segment counts).
    agent_policies: policy of each agent (len = space.num_agents); None: every agent uses
      policy 0 when there is one policy, agent i uses policy i when there is one per agent.
    temperature: the learner's temperature: its log-probs are log_softmax(logits / temperature).
      The paper configs say which they use (verl-based AT-GRPO / Dr. MAS: the sampling one;
      CoMLRL's MAGRPO and MARFT: 1).
    micro_batches: gradient accumulation steps per device.
    remat: rematerialise each layer in the backward pass instead of keeping its activations
      (SmolLM2-135M, 8 x 256 tokens, one CPU core: peak RSS 3.2 GB instead of 7.5 GB for ~3%
      more step time; 8 x (256 + 256) tokens, two cores: 4.8 GB and 32.5 s instead of 13.7 GB
      and 35.4 s, faster for moving less memory).
    logits_chunk: response positions per LM-head slice in every learner forward (the loss, the
      old-log-prob and KL-reference passes): the [B, R, V] fp32 logits exist one [B, chunk, V]
      slice at a time, forward and backward. None: whole.
    with_entropy: compute per-token entropies (for an entropy bonus, else only the metric).
    agent_grad_norms: report per-agent gradient norms (A extra backward passes).
    target_kl: skip the policy update when the approximate KL exceeds this (MARFT); None: off.
    mini_batch_size: samples per optimizer update (per policy block for stacked / mapped
      teams): each epoch shuffles the rollout's kept samples and updates once per
      mini-batch (`parallel/minibatch.py`); None: the whole rollout batch in one update.
    epochs: passes over the rollout batch (PPO epochs).
    recompute_old_logp: before the first update, replace the sampler's log-probs by the
      learner's (a teacher-forced forward at `temperature`; verl's default), so the PPO ratio
      measures only the policy's change.
    tis_cap: truncated importance-sampling weight min(exp(learner - sampler log-prob), tis_cap)
      on every token's policy loss, for the sampler/learner mismatch (verl, Tunix); needs
      `recompute_old_logp`. None: off.
    reference_policies: the policies whose rows the KL reference pass sees (sorted ids; the
      trainer: those acting for `config.train.agents`, whose rows alone the updates keep,
      `parallel/minibatch.py`). A stacked team's reference copies only their blocks and refuses
      a batch with another policy's block; the other layouts copy every policy (a mapped batch
      keeps a block per model). None: every policy.
  """
  policy: policies.PolicyConfig
  advantage: AdvantageConfig
  loss: losses.LossConfig
  space: GroupSpace
  agent_policies: tuple[int, ...] | None = None
  temperature: float = 1.0
  micro_batches: int = 1
  remat: bool = False
  logits_chunk: int | None = None
  with_entropy: bool = True
  agent_grad_norms: bool = False
  target_kl: float | None = None
  mini_batch_size: int | None = None
  epochs: int = 1
  recompute_old_logp: bool = False
  tis_cap: float | None = None
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
    if self.entropy_needed and not self.with_entropy:
      raise ValueError(f"entropy_coef={self.loss.entropy_coef} needs with_entropy=True")
    if self.target_kl is not None and self.loss.policy_loss != "ppo":
      raise ValueError("target_kl uses PPO's approximate KL; policy_loss is "
                       f"{self.loss.policy_loss!r}")
    if self.micro_batches < 1 or not self.temperature > 0:
      raise ValueError(f"micro_batches must be >= 1 and temperature > 0, got "
                       f"{self.micro_batches}, {self.temperature}")
    if self.logits_chunk is not None and self.logits_chunk < 1:
      raise ValueError(f"logits_chunk must be >= 1 (or None), got {self.logits_chunk}")
    if self.epochs < 1 or (self.mini_batch_size is not None and self.mini_batch_size < 1):
      raise ValueError(f"epochs must be >= 1 and mini_batch_size >= 1 (or None), got "
                       f"{self.epochs}, {self.mini_batch_size}")
    if self.loss.policy_loss == "reinforce" and (self.epochs > 1 or self.mini_batch_size):
      raise ValueError(f"policy_loss 'reinforce' is on-policy (one update per rollout); got "
                       f"epochs={self.epochs}, mini_batch_size={self.mini_batch_size}, "
                       "expected 1 and None")
    if self.tis_cap is not None and not (self.recompute_old_logp and self.tis_cap > 0):
      raise ValueError(f"tis_cap={self.tis_cap} needs recompute_old_logp=True (the learner's "
                       "log-probs to weigh against the sampler's) and a cap > 0")

  @property
  def entropy_needed(self) -> bool:
    return self.loss.entropy_coef != 0.0

  @property
  def uses_targets(self) -> bool:
    """Whether updates take the rollout's targets from `prepare` (else one plain step)."""
    return (self.mini_batch_size is not None or self.epochs > 1 or self.recompute_old_logp)


class TrainFns(NamedTuple):
  init: Callable[[Any], TrainState]
  # (state, frozen, batch[, targets]) -> (state, metrics)
  step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  # trainable -> a TrainState of PartitionSpecs: the shardings `init` gives the state (params
  # with their FSDP specs, optimizer moments split like their params), which `step` keeps.
  state_specs: Callable[[Any], TrainState]
  # (state, frozen, batch) -> (state, metrics): `step`'s computation, neither checked nor jitted,
  # to lower for other shapes or devices (experiments/plan.py).
  update: Callable[[TrainState, Any, Any], tuple[TrainState, dict[str, jax.Array]]]
  shard_params: Callable[[Any, Any], tuple[Any, Any]]  # (trainable, frozen) -> on the mesh
  shard_batch: Callable[[Any], Any]
  # (trainable, frozen, batch[, recompute=True]) -> (batch, RolloutTargets, advantage metrics):
  # the once-per-rollout pass of `gradients.rollout_targets` (recompute=False: without the
  # learner's old log-probs, which `recompute` then fills on the rows an update trains on).
  prepare: Callable[..., tuple[Any, gradients.RolloutTargets, Any]]
  # (trainable, frozen, batch, targets) -> (batch, targets) with the learner's old log-probs and
  # truncated IS weights (`gradients.learner_old_logp`); None unless cfg.recompute_old_logp.
  recompute: Callable[[Any, Any, Any, Any], tuple[Any, Any]] | None
  # (trainable, frozen, batch) -> the batch with the critic's rollout-time values filled in
  # (`samples.values`, `samples.token_values`); None without a critic.
  old_values: Callable[[Any, Any, Any], Any] | None = None
  # (reference, frozen, batch) -> the batch with `ref_logp` filled in (`fill_ref_logp`); None
  # without a KL term. `reference`: `reference_params(...)` (None for LoRA).
  ref_logp: Callable[[Any, Any, Any], Any] | None = None
  # trainable -> the frozen KL reference: a copy of trainable['policy'] in new buffers (full
  # models; a stacked team: `reference_policies`' blocks), None for LoRA (the base without
  # adapters is the reference).
  reference_params: Callable[[Any], Any] | None = None
  # The pieces a batch's rows split into (data x fsdp devices x micro-batches): a block's rows
  # must be a multiple of it.
  shards: int = 1


def guarded_update(cfg: TrainConfig, tx: optax.GradientTransformation,
                   parts: dict[str, optax.GradientTransformation] | None, state: TrainState,
                   grads: Any, metrics: dict[str, jax.Array]
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
  """The optimizer update behind the guards (module docstring). `parts`: one optimizer per
  trainable key (each key skipped on its own: target_kl); None: `tx` updates everything."""
  grad_norm = optax.global_norm(grads)  # inf or NaN iff a gradient is
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
  apply = {k: finite for k in state.params}
  if cfg.target_kl is not None:
    apply["policy"] = finite & (metrics["approx_kl"] <= cfg.target_kl)

  def update(tx, grads, params, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # lax.cond, not a select of new and old values: a select reads the old params and moments
  # again after the update and defeats in-place updates (measured: 2x the update's time).
  keep = lambda p, s: (p, s)
  if parts is None:
    params, opt_state = jax.lax.cond(finite, functools.partial(update, tx, grads), keep,
                                     state.params, state.opt_state)
  else:
    new = {k: jax.lax.cond(apply[k], functools.partial(update, parts[k], grads[k]), keep,
                           state.params[k], state.opt_state[k]) for k in parts}
    params, opt_state = ({k: v[0] for k, v in new.items()}, {k: v[1] for k, v in new.items()})
  metrics = dict(metrics, grad_norm=grad_norm, finite=finite, policy_updated=apply["policy"])
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                         skipped=state.skipped + (~finite).astype(jnp.int32))
  return new_state, metrics


def fill_old_values(cfg: TrainConfig, params, frozen, specs, batch):
  """The batch with the critic's values of its states before the update (the old values GAE and
  the clipped value loss need), inside shard_map. One forward of the frozen base over the whole
  local batch: with no gradients kept it needs a layer's activations at a time, so no
  micro-batching."""

  def fill(tb):
    values = policies.critic_values(cfg.policy, params, frozen, specs, tb)  # [n, R]
    s = tb.samples
    return tb.replace(samples=s.replace(
        values=jnp.where(s.sample_mask, values[:, 0], 0.0),  # state before the action
        token_values=jnp.where(s.token_mask & s.sample_mask[:, None], values, 0.0)))

  return layouts.of(cfg.policy).groups(cfg.policy, batch, fill)


def fill_ref_logp(cfg: TrainConfig, reference, frozen, specs, batch):
  """The batch with the frozen reference's log-probs of its response tokens (`ref_logp`, the KL
  term's input), inside shard_map. Like `fill_old_values`: one forward without gradients.
  `reference`: {'policy': the reference copy} (`_reference_copy`), `specs[0]` computed from it;
  the batch's blocks name the reference's (`Layout.reference_rows`)."""
  logp = policies.reference_logprobs(cfg.policy, reference, frozen, specs, batch,
                                     temperature=cfg.temperature, logits_chunk=cfg.logits_chunk)
  return jax.tree.map(lambda b, lp: b.replace(ref_logp=jnp.where(b.samples.token_mask, lp, 0.0)),
                      batch, logp, is_leaf=lambda x: isinstance(x, TrainBatch))


def _batch_specs(spec: P, batch: Any) -> Any:
  """`spec` for every leaf of `batch` (all batch arrays split along the sample axis)."""
  return jax.tree.map(lambda _: spec, batch)


def _sharded(mesh: Mesh, pcfg: policies.PolicyConfig, fsdp: int,
             batch_specs: Callable[[Any], Any], body: Callable, out_specs: Callable) -> Callable:
  """`body(params, frozen, specs, batch)` (local shards) shard_map'ed over the mesh;
  `out_specs(specs, batch)` gives its output specs."""

  def run(params, frozen, batch):
    specs = policies.param_specs(pcfg, params, frozen, fsdp)
    return jax.shard_map(lambda p, f, b: body(p, f, specs, b), mesh=mesh,
                         in_specs=(specs[0], specs[1], batch_specs(batch)),
                         out_specs=out_specs(specs, batch))(params, frozen, batch)

  return run


def _cached_step_jit(step: Callable, compiler_options: dict[str, Any] | None) -> Callable:
  """`step(state, frozen, batch)` jitted once per state structure and shardings, state donated.

  The new state keeps the old state's shardings (those `init` chose), so every step after the
  first hits the compilation cache and callers see stable array shardings.
  """
  step_jits: dict[Any, Any] = {}

  def run(state, frozen, batch):
    shardings = jax.tree.map(lambda x: x.sharding, state)
    key = (jax.tree.structure(state), tuple(jax.tree.leaves(shardings)))
    if key not in step_jits:
      step_jits[key] = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None),
                               compiler_options=compiler_options)
    return step_jits[key](state, frozen, batch)

  return run


def _checked(check: Callable[[Any], None], fn: Callable) -> Callable:
  """`fn(params, frozen, batch)` after `check(batch)` (the batch layout validation)."""

  def run(params, frozen, batch):
    check(batch)
    return fn(params, frozen, batch)

  return run


def _reference_copy(cfg: TrainConfig) -> Callable[[Any], Any]:
  """trainable -> the KL reference: None with adapters (LoRA: the base is the reference), else
  trainable['policy'] (a stacked team: `cfg.reference_policies`' blocks) in new buffers sharded
  like the params (a jitted copy; an identity would hand back the inputs)."""
  layout = layouts.of(cfg.policy)

  def part(policy):
    # Stored as a compute copy (`models/precision.py`): the same values the learner computes
    # with, in half the bytes under bf16 compute; jnp.copy makes new buffers when no cast does.
    reference = layout.reference_policy(cfg.policy, policy, cfg.reference_policies)
    return jax.tree.map(jnp.copy, precision.compute_copy(reference, cfg.policy.compute_dtype,
                                                          head=False))

  def reference_params(trainable):
    if layout.adapters:
      return None
    policy = trainable["policy"]
    return jax.jit(part, out_shardings=jax.tree.map(lambda x: x.sharding, policy))(policy)

  return reference_params


def _make_init(pcfg: policies.PolicyConfig, tx: optax.GradientTransformation, mesh: Mesh,
               fsdp: int, compiler_options: dict[str, Any] | None
               ) -> tuple[Callable[[Any], TrainState], Callable[[Any], TrainState]]:
  """The `init` and `state_specs` of `TrainFns`."""

  def init_state(trainable):
    return TrainState(step=jnp.zeros((), jnp.int32), params=trainable,
                      opt_state=tx.init(trainable), skipped=jnp.zeros((), jnp.int32))

  def state_specs(trainable) -> TrainState:
    """The optimizer's moments are split like their params (`sharding.state_specs`): left to
    XLA, the zeros they start from carry no sharding and would be whole on every device."""
    specs = policies.trainable_specs(pcfg, trainable, fsdp)
    return TrainState(step=P(), params=specs, skipped=P(), opt_state=sharding.state_specs(
        jax.eval_shape(tx.init, trainable), trainable, specs))

  init_jits: dict[Any, Any] = {}  # one compiled init per state structure and specs

  def init(trainable):
    """The first TrainState (params placed with their FSDP specs; takes ownership of them)."""
    specs = state_specs(trainable)
    key = (jax.tree.structure(trainable), tuple(jax.tree.leaves(specs, is_leaf=sharding.is_spec)))
    if key not in init_jits:
      init_jits[key] = jax.jit(init_state, out_shardings=sharding.named(mesh, specs),
                               compiler_options=compiler_options)
    return init_jits[key](sharding.put(trainable, mesh, specs.params))

  return init, state_specs


def check_mini_batch(size: int | None, data: int, fsdp: int, micro_batches: int,
                     field: str = "mini_batch_size") -> None:
  """A mini-batch of `size` rows splits evenly over the sample shards (data x fsdp devices) and
  each device's micro-batches; `field` names the value in the error."""
  shards = data * fsdp * micro_batches
  if size is not None and size % shards:
    raise ValueError(f"{field}={size} does not split into data x fsdp x micro_batches = {data} x "
                     f"{fsdp} x {micro_batches} = {shards} pieces; expected a multiple of {shards}")


def make_train_step(cfg: TrainConfig, mesh: Mesh,
                    optimizer: optax.GradientTransformation | None = None,
                    compiler_options: dict[str, Any] | None = None) -> TrainFns:
  """The jitted, shard_map'ed training step for `cfg` on `mesh` (see the module docstring).

  Args:
    cfg: the static configuration.
    mesh: a ('data', 'fsdp', 'tensor') mesh (`parallel.mesh.make_mesh`).
    optimizer: replaces the one built from `cfg.policy` (per-policy AdamW); it sees the
      trainable params {'policy': ..., 'critic': ...} with gradients that are already global.
    compiler_options: XLA options for the step's compilation, e.g.
      {"xla_backend_optimization_level": 0} compiles a tiny test model ~3x faster on CPU.
  """
  pcfg = cfg.policy
  parts = policies.make_optimizers(pcfg) if optimizer is None else None
  if optimizer is not None and cfg.target_kl is not None:
    raise ValueError("target_kl skips the policy part of the default optimizer; it cannot be "
                     "combined with a custom optimizer")
  tx = optim.by_key(parts) if optimizer is None else optimizer
  fsdp = mesh.shape[FSDP]
  shards = batch_shards(mesh) * cfg.micro_batches
  check_mini_batch(cfg.mini_batch_size, mesh.shape[DATA], fsdp, cfg.micro_batches)
  spec = layouts.batch_spec(pcfg, BATCH_AXES)
  batch_specs = functools.partial(_batch_specs, spec)
  sharded = functools.partial(_sharded, mesh, pcfg, fsdp, batch_specs)
  jit = functools.partial(jax.jit, compiler_options=compiler_options)

  # `b` is the batch, or (batch, RolloutTargets) of one update of a rollout.
  sharded_grads = sharded(lambda p, f, specs, b: gradients.local_grads(
      cfg, p, f, *((b, None) if not isinstance(b, tuple) else b), specs),
                          lambda specs, batch: (specs[0], P()))

  def step(state: TrainState, frozen: Any, batch: Any):
    grads, metrics = sharded_grads(state.params, frozen, batch)
    return guarded_update(cfg, tx, parts, state, grads, metrics)

  def check(batch):
    layouts.validate_batch(pcfg, cfg.space, cfg.agent_policies, batch, shards)

  cached_step = _cached_step_jit(step, compiler_options)

  def checked_step(state, frozen, batch, targets=None):
    # With targets the batch is a mini-batch that `select_rows` cut from a batch `prepare` already
    # checked (rows of it, slots masked; mini_batch_size splits into the shards, checked above):
    # skip the host copy of every id on each update.
    if targets is None:
      check(batch)
    return cached_step(state, frozen, batch if targets is None else (batch, targets))

  old_values = jit(sharded(lambda p, f, specs, b: fill_old_values(cfg, p, f, specs, b),
                           lambda specs, batch: batch_specs(batch)))
  prepares = {r: jit(sharded(
      lambda p, f, specs, b, r=r: gradients.rollout_targets(cfg, p, f, specs, b, recompute=r),
      lambda specs, batch: (batch_specs(batch), spec, P()))) for r in (True, False)}

  def prepare(params, frozen, batch, recompute=True):
    check(batch)
    return prepares[recompute](params, frozen, batch)

  recompute = jit(sharded(
      lambda p, f, specs, bt: gradients.learner_old_logp(cfg, p, f, specs, *bt),
      lambda specs, bt: (batch_specs(bt[0]), spec)))
  with_ref = lambda batch: jax.tree.map(lambda b: b.replace(ref_logp=b.old_logp), batch,
                                        is_leaf=lambda x: isinstance(x, TrainBatch))
  ref_logp = jit(sharded(lambda r, f, specs, b: fill_ref_logp(cfg, r, f, specs, b),
                         lambda specs, batch: batch_specs(with_ref(batch))))
  kl = cfg.loss.kl_coef != 0.0

  def reference_pass(reference, frozen, batch):
    check(batch)
    rows = layouts.of(pcfg).reference_rows(pcfg, batch, cfg.reference_policies)
    out = ref_logp({"policy": reference}, frozen, rows)
    return out if rows is batch else out.replace(policies=batch.policies)

  def shard_params(trainable, frozen):
    specs = policies.param_specs(pcfg, trainable, frozen, fsdp)
    return sharding.put(trainable, mesh, specs[0]), sharding.put(frozen, mesh, specs[1])

  init, state_specs = _make_init(pcfg, tx, mesh, fsdp, compiler_options)
  return TrainFns(
      init=init, step=checked_step, state_specs=state_specs, update=step,
      shard_params=shard_params,
      shard_batch=lambda batch: sharding.put(batch, mesh, batch_specs(batch)),
      old_values=_checked(check, old_values) if pcfg.critic is not None else None,
      prepare=prepare,
      recompute=((lambda params, frozen, batch, targets: recompute(params, frozen,
                                                                    (batch, targets)))
                 if cfg.recompute_old_logp else None),
      ref_logp=reference_pass if kl else None,
      reference_params=_reference_copy(cfg) if kl else None,
      shards=shards)
