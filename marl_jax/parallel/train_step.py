"""The learner's jitted functions, shard_map'ed over the ('data', 'fsdp', 'tensor') mesh.

    fns = make_train_step(TrainConfig(...), mesh)
    trainable, frozen = fns.shard_params(trainable, frozen)
    state = fns.init(trainable)                          # TrainState (takes ownership)
    batch = fns.shard_batch(batch)
    state, metrics = update.run(fns, cfg, state, frozen, batch, rng)   # every update of a rollout

`parallel/update.py` is the one path every config takes through them: `check` (the batch's
host-side checks), `old_values` (a critic's values, MARFT), `prepare` (the rollout's targets:
advantages, returns and the group filter's kept samples, over the whole batch, since groups span
mini-batches), `ref_logp` (the KL reference's log-probs) and `recompute` (the learner's old
log-probs and truncated IS weights) of the rows the updates train on, then `step` once per
mini-batch of every epoch, each taking its rows' `RolloutTargets`. A single full-batch update is
the case of one epoch of one mini-batch.

`step` is `apply_update`: inside the shard_map each device holds a slice of the samples and FSDP
shards of the params, and `gradients.local_grads` computes the global loss denominators,
gradients accumulated over micro-batches (log-probs recomputed by a teacher-forced forward,
params gathered layer by layer inside the layer scan; autodiff turns the FSDP gathers into
reduce-scatters) and metrics. Then, outside the shard_map but in the same jit,
`guarded_update` applies the optax update (the optimizer state is split like the params: `init`
places it so, the step keeps its shardings) behind the guards: if the loss or any gradient is
not finite, params and optimizer state come back bitwise unchanged and `state.skipped` counts
it; with `target_kl`, a policy step whose approximate KL exceeds it is skipped (the critic still
trains), as MARFT does. `make_train_step` only wires these with the mesh, the shardings and the
host-side batch checks (`check`: `layouts.validate_batch`, once per rollout).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from marl_jax.algos import optim
from marl_jax.algos.batch import TrainBatch
from marl_jax.models import precision
from marl_jax.parallel import gradients, layouts, policies, sharding
from marl_jax.parallel.mesh import BATCH_AXES, DATA, FSDP, batch_shards
from marl_jax.parallel.train_config import TrainConfig, TrainState

__all__ = ["TrainFns", "apply_update", "guarded_update", "make_train_step"]


class TrainFns(NamedTuple):
  init: Callable[[Any], TrainState]
  # (state, frozen, batch, targets) -> (state, metrics): one update (`apply_update`), jitted,
  # state donated; `targets`: the batch's rows of `prepare`'s RolloutTargets.
  step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  # trainable -> a TrainState of PartitionSpecs: the shardings `init` gives the state (params
  # with their FSDP specs, optimizer moments split like their params), which `step` keeps.
  state_specs: Callable[[Any], TrainState]
  # (state, frozen, batch, targets) -> (state, metrics): `step`'s computation, not jitted, to
  # lower for other shapes or devices (experiments/plan.py).
  update: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  shard_params: Callable[[Any, Any], tuple[Any, Any]]  # (trainable, frozen) -> on the mesh
  shard_batch: Callable[[Any], Any]
  # batch -> None, or ValueError naming what is wrong with its ids, masks or layout
  # (`layouts.validate_batch`): the host-side checks, once per rollout, before `prepare`.
  check: Callable[[Any], None]
  # batch -> (batch, RolloutTargets, advantage metrics): the rollout's targets
  # (`gradients.rollout_targets`).
  prepare: Callable[[Any], tuple[Any, gradients.RolloutTargets, Any]]
  # (trainable, frozen, batch, targets) -> (batch, targets, importance metrics) with the
  # learner's old log-probs and truncated IS weights (`gradients.learner_old_logp`); None unless
  # train.recompute_old_logp.
  recompute: Callable[[Any, Any, Any, Any], tuple[Any, Any, Any]] | None
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
  if cfg.train.target_kl is not None:
    apply["policy"] = finite & (metrics["approx_kl"] <= cfg.train.target_kl)

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
                                     temperature=cfg.temperature,
                                     logits_chunk=cfg.train.logits_chunk)
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
  """`step(state, frozen, batch, targets)` jitted once per state structure and shardings, state
  donated.

  The new state keeps the old state's shardings (those `init` chose), so every step after the
  first hits the compilation cache and callers see stable array shardings.
  """
  step_jits: dict[Any, Any] = {}

  def run(state, frozen, batch, targets):
    shardings = jax.tree.map(lambda x: x.sharding, state)
    key = (jax.tree.structure(state), tuple(jax.tree.leaves(shardings)))
    if key not in step_jits:
      step_jits[key] = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None),
                               compiler_options=compiler_options)
    return step_jits[key](state, frozen, batch, targets)

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


def apply_update(cfg: TrainConfig, tx: optax.GradientTransformation,
                 parts: dict[str, optax.GradientTransformation] | None, grads_fn: Callable,
                 state: TrainState, frozen: Any, batch: Any, targets: gradients.RolloutTargets
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One update on `batch` (the device part of `TrainFns.step`): the global gradients and
  metrics of `gradients.local_grads` (`grads_fn`: it shard_map'ed over the mesh), then
  `guarded_update`."""
  grads, metrics = grads_fn(state.params, frozen, (batch, targets))
  return guarded_update(cfg, tx, parts, state, grads, metrics)


def make_train_step(cfg: TrainConfig, mesh: Mesh,
                    optimizer: optax.GradientTransformation | None = None,
                    compiler_options: dict[str, Any] | None = None) -> TrainFns:
  """The jitted, shard_map'ed learner functions for `cfg` on `mesh` (module docstring).

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
  if optimizer is not None and cfg.train.target_kl is not None:
    raise ValueError("target_kl skips the policy part of the default optimizer; it cannot be "
                     "combined with a custom optimizer")
  tx = optim.by_key(parts) if optimizer is None else optimizer
  fsdp = mesh.shape[FSDP]
  shards = batch_shards(mesh) * cfg.train.micro_batches
  check_mini_batch(cfg.train.mini_batch_size, mesh.shape[DATA], fsdp, cfg.train.micro_batches)
  spec = layouts.batch_spec(pcfg, BATCH_AXES)
  batch_specs = functools.partial(_batch_specs, spec)
  sharded = functools.partial(_sharded, mesh, pcfg, fsdp, batch_specs)
  jit = functools.partial(jax.jit, compiler_options=compiler_options)

  grads_fn = sharded(lambda p, f, specs, bt: gradients.local_grads(cfg, p, f, *bt, specs),
                     lambda specs, bt: (specs[0], P()))
  step = functools.partial(apply_update, cfg, tx, parts, grads_fn)

  def check(batch):
    layouts.validate_batch(pcfg, cfg.space, cfg.agent_policies, batch, shards)

  prepare = jit(jax.shard_map(lambda b: gradients.rollout_targets(cfg, b), mesh=mesh,
                              in_specs=(spec,), out_specs=(spec, spec, P())))
  old_values = jit(sharded(lambda p, f, specs, b: fill_old_values(cfg, p, f, specs, b),
                           lambda specs, batch: batch_specs(batch)))
  recompute = jit(sharded(
      lambda p, f, specs, bt: gradients.learner_old_logp(cfg, p, f, specs, *bt),
      lambda specs, bt: (batch_specs(bt[0]), spec, P())))
  with_ref = lambda batch: jax.tree.map(lambda b: b.replace(ref_logp=b.old_logp), batch,
                                        is_leaf=lambda x: isinstance(x, TrainBatch))
  ref_logp = jit(sharded(lambda r, f, specs, b: fill_ref_logp(cfg, r, f, specs, b),
                         lambda specs, batch: batch_specs(with_ref(batch))))
  kl = cfg.loss.kl_coef != 0.0

  def reference_pass(reference, frozen, batch):
    rows = layouts.of(pcfg).reference_rows(pcfg, batch, cfg.reference_policies)
    out = ref_logp({"policy": reference}, frozen, rows)
    return out if rows is batch else out.replace(policies=batch.policies)

  def shard_params(trainable, frozen):
    specs = policies.param_specs(pcfg, trainable, frozen, fsdp)
    return sharding.put(trainable, mesh, specs[0]), sharding.put(frozen, mesh, specs[1])

  init, state_specs = _make_init(pcfg, tx, mesh, fsdp, compiler_options)
  return TrainFns(
      init=init, step=_cached_step_jit(step, compiler_options), state_specs=state_specs,
      update=step, shard_params=shard_params,
      shard_batch=lambda batch: sharding.put(batch, mesh, batch_specs(batch)),
      old_values=old_values if pcfg.critic is not None else None, check=check, prepare=prepare,
      recompute=((lambda params, frozen, batch, targets: recompute(params, frozen,
                                                                    (batch, targets)))
                 if cfg.train.recompute_old_logp else None),
      ref_logp=reference_pass if kl else None,
      reference_params=_reference_copy(cfg) if kl else None,
      shards=shards)
