"""The training step: one jitted function, shard_map'ed over the ('data', 'fsdp', 'tensor') mesh.

    fns = make_train_step(TrainConfig(...), mesh)
    trainable, frozen = fns.shard_params(trainable, frozen)
    state = fns.init(trainable)                             # TrainState (takes ownership)
    batch = fns.shard_batch(batch)
    batch = fns.old_values(state.params, frozen, batch)     # critic configs only (MARFT)
    state, metrics = fns.step(state, frozen, batch)

Inside the shard_map each device holds a slice of the samples and FSDP shards of the params:
  1. advantages on device: the estimator psums its segment statistics over ('data', 'fsdp'), so
     groups split across devices get exact global statistics;
  2. loss denominators first (they depend on masks only): every loss term is a (numerator,
     denominator) pair (algos/losses.py), so a micro-batch's loss is its numerators over the
     *global* denominators, and micro-batches and devices add up to exactly the full-batch loss;
  3. gradients by a `lax.scan` over micro-batches: log-probs recomputed by a teacher-forced
     forward (policies.token_logprobs, params gathered layer by layer inside the layer scan),
     gradients accumulated locally and all-reduced once (autodiff turns the FSDP gathers into
     reduce-scatters);
then, outside the shard_map but in the same jit, the optax update (XLA shards it like the params)
and the guards: if the loss or any gradient is not finite, params and optimizer state come back
bitwise unchanged and `state.skipped` counts it; with `target_kl`, a policy step whose approximate
KL exceeds it is skipped (the critic still trains), as MARFT does.

Loss normalisation is per policy: each policy's loss is its own samples' numerators over its own
denominators (Dr. MAS: "each model is updated on its own sub-batch"); a shared policy is one
policy, so this is the usual batch mean. The critic's value loss is a mean over the whole batch.

Per-agent gradient norm (Dr. MAS's instability signal, `agent_grad_norms=True`): the norm of the
gradient of agent a's policy loss share, normalised by agent a's own denominators (the loss agent
a's own model would see). One forward serves all agents: the micro-batch function returns the
vector [total loss, share_0, ..., share_{A-1}] and its VJP is taken for each basis vector, i.e.
A extra backward passes and A extra gradient trees (cheap for adapters and tiny models, which is
why it is an option).
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

from marl_jax.algos import advantages as adv_lib
from marl_jax.algos import losses, optim, policies
from marl_jax.algos.batch import GroupSpace
from marl_jax.parallel import sharding, train_batch
from marl_jax.parallel.mesh import BATCH_AXES, FSDP, batch_shards
from marl_jax.parallel.train_batch import TrainBatch, groups

__all__ = ["CRITIC_ESTIMATORS", "TrainBatch", "TrainConfig", "TrainFns", "TrainState",
           "make_train_step"]

CRITIC_ESTIMATORS = ("gae_action", "gae_token")  # MARFT: advantages from the critic's values


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
    temperature: sampling temperature (log-probs are those of logits / temperature).
    micro_batches: gradient accumulation steps per device.
    remat: rematerialise each layer in the backward pass instead of keeping its activations
      (SmolLM2-135M, 8 x 256 tokens, one CPU core: peak RSS 3.2 GB instead of 7.5 GB for ~3%
      more step time).
    with_entropy: compute per-token entropies (for an entropy bonus, else only the metric).
    agent_grad_norms: report per-agent gradient norms (A extra backward passes).
    target_kl: skip the policy update when the approximate KL exceeds this (MARFT); None: off.
  """
  policy: policies.PolicyConfig
  advantage: adv_lib.AdvantageConfig
  loss: losses.LossConfig
  space: GroupSpace
  agent_policies: tuple[int, ...] | None = None
  temperature: float = 1.0
  micro_batches: int = 1
  remat: bool = False
  with_entropy: bool = True
  agent_grad_norms: bool = False
  target_kl: float | None = None

  def __post_init__(self):
    A, Pn = self.space.num_agents, self.policy.num_policies
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
    needs_critic = self.advantage.estimator in CRITIC_ESTIMATORS
    if needs_critic != (self.policy.critic is not None):
      raise ValueError(f"estimator {self.advantage.estimator!r} "
                       f"{'needs' if needs_critic else 'does not use'} a critic, but the policy "
                       f"config has critic={self.policy.critic!r}")
    if self.entropy_needed and not self.with_entropy:
      raise ValueError(f"entropy_coef={self.loss.entropy_coef} needs with_entropy=True")
    if self.target_kl is not None and self.loss.policy_loss != "ppo":
      raise ValueError("target_kl uses PPO's approximate KL; policy_loss is "
                       f"{self.loss.policy_loss!r}")
    if self.micro_batches < 1 or not self.temperature > 0:
      raise ValueError(f"micro_batches must be >= 1 and temperature > 0, got "
                       f"{self.micro_batches}, {self.temperature}")

  @property
  def entropy_needed(self) -> bool:
    return self.loss.entropy_coef != 0.0


class TrainFns(NamedTuple):
  init: Callable[[Any], TrainState]
  step: Callable[[TrainState, Any, Any], tuple[TrainState, dict[str, jax.Array]]]
  grads: Callable[[Any, Any, Any], tuple[Any, dict[str, jax.Array]]]  # no update
  shard_params: Callable[[Any, Any], tuple[Any, Any]]  # (trainable, frozen) -> on the mesh
  shard_batch: Callable[[Any], Any]
  # (trainable, frozen, batch) -> the batch with the critic's rollout-time values filled in
  # (`samples.values`, `samples.token_values`); None without a critic.
  old_values: Callable[[Any, Any, Any], Any] | None = None


def _reduce_axes(spec: P) -> tuple[str, ...]:
  """Batch axes a param leaf is replicated over: its gradient is summed over them."""
  return tuple(a for a in BATCH_AXES if a not in tuple(spec))


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _vary(x: jax.Array) -> jax.Array:
  """Marks x as varying over every batch axis (uniform types for scan carries and VJPs)."""
  have = jax.typeof(x).manual_axis_type.varying
  missing = tuple(a for a in BATCH_AXES if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _psum_nd(x: losses.NumDen) -> losses.NumDen:
  return losses.NumDen(jax.lax.psum(x.num, BATCH_AXES), jax.lax.psum(x.den, BATCH_AXES))


def _segment_terms(cfg: TrainConfig, logp, old_logp, advantages, token_mask, ref_logp, entropy,
                   seg, num_segments):
  """`losses.policy_loss` with every (num, den) split by segment (policy, agent): leaves [S]."""

  def one(s):
    return losses.policy_loss(logp, old_logp, advantages, token_mask & (seg == s)[:, None],
                              cfg.loss, ref_logp=ref_logp, entropy=entropy)

  return jax.vmap(one)(jnp.arange(num_segments))


def _value_inputs(estimator: str, values, samples, returns, token_mask):
  """(values, old values, returns, mask) of the value loss: per token (gae_token) or one per
  sample from the state before the response (gae_action)."""
  if estimator == "gae_token":
    return values, samples.token_values, returns, token_mask
  count = jnp.sum(token_mask, axis=1, keepdims=True)
  ret = jnp.sum(jnp.where(token_mask, returns, 0.0), axis=1, keepdims=True) / jnp.maximum(count, 1)
  return values[:, :1], samples.values[:, None], ret, count > 0


def _per_agent_moments(x, weight, ids, num):
  """Global per-agent (mean, std) of x [n, R] under a bool weight [n, R]."""
  w = weight.astype(jnp.float32)
  seg = lambda v: jax.lax.psum(jax.ops.segment_sum(v, ids, num_segments=num), BATCH_AXES)
  mean = losses.NumDen(seg((w * x).sum(1)), seg(w.sum(1))).value()
  var = losses.NumDen(seg((w * jnp.square(x - mean[ids][:, None])).sum(1)), seg(w.sum(1)))
  return mean, jnp.sqrt(var.value())


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
  A, Pn, M = cfg.space.num_agents, pcfg.num_policies, cfg.micro_batches
  S = Pn * A  # loss segments: (policy, agent) pairs
  est = cfg.advantage.estimator
  critic = pcfg.critic is not None
  parts = policies.make_optimizers(pcfg) if optimizer is None else None
  if optimizer is not None and cfg.target_kl is not None:
    raise ValueError("target_kl skips the policy part of the default optimizer; it cannot be "
                     "combined with a custom optimizer")
  tx = optim.by_key(parts) if optimizer is None else optimizer
  fsdp = mesh.shape[FSDP]
  flat = lambda tree: policies.flatten(pcfg, tree)
  field = lambda b, name: flat(groups(pcfg, b, lambda g: getattr(g, name)))

  def batch_specs(batch):
    return jax.tree.map(lambda _: P(*((None,) * pcfg.sample_axis + (BATCH_AXES,))), batch)

  def split_micro(tree):
    """Sample axis n -> a leading micro-batch axis [M, ..., n / M, ...]."""
    ax = pcfg.sample_axis
    return jax.tree.map(lambda x: jnp.moveaxis(
        x.reshape(x.shape[:ax] + (M, x.shape[ax] // M) + x.shape[ax + 1:]), ax, 0), tree)

  def local_grads(params, frozen, batch, specs):
    """Per-device body: advantages, denominators, accumulated gradients, metrics."""
    train_specs, _ = specs
    params = jax.tree.map(
        lambda s, x: jax.lax.pcast(x, _reduce_axes(s), to="varying") if _reduce_axes(s) else x,
        train_specs, params, is_leaf=_is_spec)
    samples = field(batch, "samples")
    adv = adv_lib.estimate(samples, cfg.advantage, cfg.space, axis_name=BATCH_AXES)
    tmask = samples.token_mask & adv.sample_mask[:, None]
    seg = samples.policy_id * A + samples.agent_id
    old_logp = field(batch, "old_logp")
    # Denominators depend on masks only: evaluate the terms once at the behaviour log-probs.
    ent0 = jnp.zeros_like(old_logp) if cfg.with_entropy else None
    terms0, metrics0 = _segment_terms(cfg, old_logp, old_logp, adv.advantages, tmask,
                                      field(batch, "ref_logp"), ent0, seg, S)
    dens = {k: jax.lax.psum(t.den, BATCH_AXES).reshape(Pn, A) for k, t in terms0.items()}
    value_metrics0 = {}
    if critic:
      zeros = jnp.zeros_like(old_logp)
      v0, value_metrics0 = losses.value_loss(*_value_inputs(est, zeros, samples, zeros, tmask),
                                             cfg.loss)
      dens["value"] = jax.lax.psum(v0.den, BATCH_AXES)

    def mb_loss(params, mb):
      b, adv_mb, tmask_mb, returns_mb = mb
      logp, ent = policies.token_logprobs(pcfg, params, frozen, specs, b,
                                          temperature=cfg.temperature,
                                          with_entropy=cfg.with_entropy, remat=cfg.remat)
      s = field(b, "samples")
      terms, metrics = _segment_terms(
          cfg, flat(logp), field(b, "old_logp"), flat(adv_mb), flat(tmask_mb),
          field(b, "ref_logp"), None if ent is None else flat(ent),
          s.policy_id * A + s.agent_id, S)
      nums = {k: t.num.reshape(Pn, A) for k, t in terms.items()}
      total = jnp.sum(losses.total_loss({k: losses.NumDen(n.sum(1), dens[k].sum(1))
                                         for k, n in nums.items()}, cfg.loss))
      shares = losses.total_loss({k: losses.NumDen(n.sum(0), dens[k].sum(0))
                                  for k, n in nums.items()}, cfg.loss)  # [A]
      value_metrics = {}
      if critic:
        values = policies.critic_values(pcfg, params, frozen, specs, b, remat=cfg.remat)
        vterm, value_metrics = losses.value_loss(
            *_value_inputs(est, flat(values), s, flat(returns_mb), flat(tmask_mb)), cfg.loss)
        total = total + losses.total_loss({"value": vterm}, cfg.loss, {"value": dens["value"]})
      out = jnp.concatenate([total[None], shares]) if cfg.agent_grad_norms else total
      return out, (terms, metrics, value_metrics)

    def mb_step(mb):
      if cfg.agent_grad_norms:
        out, vjp_fn, aux = jax.vjp(lambda p: mb_loss(p, mb), params, has_aux=True)
        (grads,) = jax.vmap(vjp_fn)(_vary(jnp.eye(1 + A)))  # leaves [1 + A, ...]
      else:
        (out, aux), grads = jax.value_and_grad(mb_loss, has_aux=True)(params, mb)
      return jax.tree.map(_vary, (grads, out, aux))

    mb_inputs = (batch,) + tuple(policies.unflatten(pcfg, x, batch) for x in (
        adv.advantages, tmask, adv.returns))
    if M == 1:  # no accumulators to fill and add
      grads, out, (terms, metrics, value_metrics) = mb_step(mb_inputs)
    else:
      # Accumulators: gradients like params (one per output row), loss terms and metrics like
      # the pre-pass's (their per-segment shapes do not depend on the batch size).
      rows = (1 + A,) if cfg.agent_grad_norms else ()
      acc0 = jax.tree.map(lambda x: _vary(jnp.zeros(x.shape, x.dtype)), (
          jax.tree.map(lambda p: jnp.zeros(rows + p.shape, p.dtype), params),
          jnp.zeros(rows, jnp.float32), (terms0, metrics0, value_metrics0)))
      body = lambda acc, mb: (jax.tree.map(jnp.add, acc, mb_step(mb)), None)
      (grads, out, (terms, metrics, value_metrics)), _ = jax.lax.scan(
          body, acc0, split_micro(mb_inputs))
    # One all-reduce per leaf over the batch axes it is replicated on.
    grads = jax.tree.map(lambda s, g: jax.lax.psum(g, _reduce_axes(s)) if _reduce_axes(s) else g,
                         train_specs, grads, is_leaf=_is_spec)
    out = jax.lax.psum(out, BATCH_AXES)
    report = {"loss": out[0] if cfg.agent_grad_norms else out}
    report.update({f"adv/{k}": v for k, v in adv.metrics.items()})
    for name, nd in {**terms, **metrics}.items():
      nd = jax.tree.map(lambda x: x.reshape(Pn, A).sum(0), _psum_nd(nd))  # per agent
      report[f"agent/{name}"] = nd.value()
      report[name] = losses.NumDen(nd.num.sum(), nd.den.sum()).value()
    report.update({k: _psum_nd(v).value() for k, v in value_metrics.items()})
    agent = jnp.clip(samples.agent_id, 0, A - 1)
    report["agent/adv_mean"], report["agent/adv_std"] = _per_agent_moments(
        adv.advantages, tmask, agent, A)
    reward = (cfg.advantage.alpha * samples.team_rewards + samples.rewards)[:, None]
    report["agent/reward"], _ = _per_agent_moments(reward, samples.sample_mask[:, None], agent, A)
    if cfg.agent_grad_norms:
      report["agent/grad_norm"] = agent_norms(grads, train_specs)
      grads = jax.tree.map(lambda g: g[0], grads)
    return grads, report

  def agent_norms(grads, train_specs):
    """[A] norms of the per-agent gradients (leaves [1 + A, ...], already all-reduced)."""
    total = jnp.zeros((A,))
    for s, g in zip(jax.tree.leaves(train_specs, is_leaf=_is_spec), jax.tree.leaves(grads)):
      sq = jnp.sum(jnp.square(g[1:]).reshape(A, -1), axis=1)
      total = total + (jax.lax.psum(sq, FSDP) if FSDP in tuple(s) else sq)
    return jnp.sqrt(total)

  def param_specs(trainable, frozen):
    return policies.param_specs(pcfg, trainable, frozen, fsdp)

  def sharded_grads(params, frozen, batch):
    specs = param_specs(params, frozen)
    return jax.shard_map(lambda p, f, b: local_grads(p, f, b, specs), mesh=mesh,
                         in_specs=(specs[0], specs[1], batch_specs(batch)),
                         out_specs=(specs[0], P()))(params, frozen, batch)

  def step(state: TrainState, frozen: Any, batch: Any):
    grads, metrics = sharded_grads(state.params, frozen, batch)
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
    metrics.update(grad_norm=grad_norm, finite=finite, policy_updated=apply["policy"])
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           skipped=state.skipped + (~finite).astype(jnp.int32))
    return new_state, metrics

  def sharded_old_values(params, frozen, batch):
    """The critic's values of the batch's states before the update (the old values GAE and the
    clipped value loss need). One forward of the frozen base over the whole local batch: with
    no gradients kept it needs a layer's activations at a time, so no micro-batching."""
    specs = param_specs(params, frozen)

    def fill(p, f, tb):
      values = policies.critic_values(pcfg, p, f, specs, tb)  # [n, R]
      s = tb.samples
      return tb.replace(samples=s.replace(
          values=jnp.where(s.sample_mask, values[:, 0], 0.0),  # state before the action
          token_values=jnp.where(s.token_mask & s.sample_mask[:, None], values, 0.0)))

    return jax.shard_map(lambda p, f, b: groups(pcfg, b, lambda tb: fill(p, f, tb)), mesh=mesh,
                         in_specs=(specs[0], specs[1], batch_specs(batch)),
                         out_specs=batch_specs(batch))(params, frozen, batch)

  jitted_grads = jax.jit(sharded_grads, compiler_options=compiler_options)
  jitted_old_values = jax.jit(sharded_old_values, compiler_options=compiler_options)
  step_jits: dict[Any, Any] = {}

  def check(batch):
    train_batch.validate(pcfg, cfg.space, cfg.agent_policies, batch, batch_shards(mesh) * M)

  def checked_step(state, frozen, batch):
    check(batch)
    # The new state keeps the old state's shardings (those `init` chose), so every step after
    # the first hits the compilation cache and callers see stable array shardings.
    shardings = jax.tree.map(lambda x: x.sharding, state)
    key = (jax.tree.structure(state), tuple(jax.tree.leaves(shardings)))
    if key not in step_jits:
      step_jits[key] = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None),
                               compiler_options=compiler_options)
    return step_jits[key](state, frozen, batch)

  def checked_grads(params, frozen, batch):
    check(batch)
    return jitted_grads(params, frozen, batch)

  def checked_old_values(params, frozen, batch):
    check(batch)
    return jitted_old_values(params, frozen, batch)

  def shard_params(trainable, frozen):
    specs = param_specs(trainable, frozen)
    return sharding.put(trainable, mesh, specs[0]), sharding.put(frozen, mesh, specs[1])

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def init_state(trainable):
    return TrainState(step=jnp.zeros((), jnp.int32), params=trainable,
                      opt_state=tx.init(trainable), skipped=jnp.zeros((), jnp.int32))

  def init(trainable):
    """The first TrainState (params placed with their FSDP specs; takes ownership of them)."""
    return init_state(sharding.put(trainable, mesh,
                                   policies.trainable_specs(pcfg, trainable, fsdp)))

  def shard_batch(batch):
    return sharding.put(batch, mesh, batch_specs(batch))

  return TrainFns(init=init, step=checked_step, grads=checked_grads, shard_params=shard_params,
                  shard_batch=shard_batch, old_values=checked_old_values if critic else None)
