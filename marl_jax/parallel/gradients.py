"""The per-device body of the train step (inside shard_map): advantages, losses, gradients, metrics.

`local_grads` wires the parts, each a function of its own:
  0. `rollout_targets` runs first, once per rollout over the WHOLE batch: advantages on device
     (the estimator psums its segment statistics over ('data', 'fsdp'), so groups split across
     devices get exact global statistics), returns and the group filter's kept samples (groups
     span mini-batches, so none of them can be computed from one); `learner_old_logp` then adds
     the learner's old log-probs and IS weights of the rows the updates train on, when
     configured. They are held fixed across every update of the rollout and reach `local_grads`
     as `RolloutTargets` (`parallel/update.py`);
  1. `advantages_and_denominators`: the update's rows' targets, then every loss term's global
     denominators (they depend on masks only, so they are evaluated once at the behaviour
     log-probs): a micro-batch's loss is its numerators over the *global* denominators, and
     micro-batches and devices add up to exactly the update's loss;
  2. `micro_batch_loss` (policy loss per (policy, agent) segment plus `critic_loss`) and
     `micro_batch_grads` (its gradient, or with per-agent gradient norms `agent_vjp_grads`),
     accumulated over micro-batches by `accumulate_grads` and all-reduced once;
  3. `step_metrics`: the reported scalars and per-agent vectors.

Loss normalisation is per policy: each policy's loss is its own samples' numerators over its own
denominators (Dr. MAS: "each model is updated on its own sub-batch"); a shared policy is one
policy, so this is the usual batch mean. The critic's value loss is a mean over the whole batch.

Per-agent gradient norm (Dr. MAS's instability signal, `agent_grad_norms=True`): the norm of the
gradient of agent a's policy loss share, normalised by agent a's own denominators (the loss agent
a's own model would see). One forward serves all agents: the micro-batch loss is the vector
[total loss, share_0, ..., share_{A-1}] and its VJP is taken for each basis vector, i.e. A extra
backward passes and A extra gradient trees (cheap for adapters and tiny models, which is why it
is an option).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from marl_jax.algos import losses
from marl_jax.algos.advantage_config import AdvantageConfig, AdvantageOutput, estimate
from marl_jax.algos.batch import mixed_reward
from marl_jax.parallel import layouts, policies
from marl_jax.parallel.mesh import BATCH_AXES, FSDP
from marl_jax.parallel.train_config import TrainConfig


def reduce_axes(spec: P) -> tuple[str, ...]:
  """Batch axes a param leaf is replicated over: its gradient is summed over them."""
  return tuple(a for a in BATCH_AXES if a not in tuple(spec))


def is_spec(x) -> bool:
  return isinstance(x, P)


def vary(x: jax.Array) -> jax.Array:
  """Marks x as varying over every batch axis (uniform types for scan carries and VJPs)."""
  have = jax.typeof(x).manual_axis_type.varying
  missing = tuple(a for a in BATCH_AXES if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def psum_nd(x: losses.NumDen) -> losses.NumDen:
  return losses.NumDen(jax.lax.psum(x.num, BATCH_AXES), jax.lax.psum(x.den, BATCH_AXES))


def flat_field(cfg: TrainConfig, batch: Any, name: str) -> Any:
  """Field `name` of every TrainBatch of the layout, as flat samples [n, ...]."""
  layout = layouts.of(cfg.policy)
  return layout.flatten(cfg.policy, layout.groups(cfg.policy, batch, lambda g: getattr(g, name)))


def segment_terms(cfg: TrainConfig, logp, old_logp, advantages, token_mask, ref_logp, entropy,
                  seg, num_segments, is_weight=None):
  """`losses.policy_loss` with every (num, den) split by segment (policy, agent): leaves [S]."""

  def one(s):
    return losses.policy_loss(logp, old_logp, advantages, token_mask & (seg == s)[:, None],
                              cfg.loss, ref_logp=ref_logp, entropy=entropy, is_weight=is_weight)

  return jax.vmap(one)(jnp.arange(num_segments))


def value_inputs(advantage: AdvantageConfig, values, samples, returns, token_mask):
  """(values, old values, returns, mask) of the value loss, where the estimator's record puts the
  critic's values (`Estimator.critic`): per token, or one per sample from the state before the
  response."""
  if advantage.record.critic == "token":
    return values, samples.token_values, returns, token_mask
  count = jnp.sum(token_mask, axis=1, keepdims=True)
  ret = jnp.sum(jnp.where(token_mask, returns, 0.0), axis=1, keepdims=True) / jnp.maximum(count, 1)
  return values[:, :1], samples.values[:, None], ret, count > 0


def per_agent_moments(x, weight, ids, num):
  """Global per-agent (mean, std) of x [n, R] under a bool weight [n, R]."""
  w = weight.astype(jnp.float32)
  seg = lambda v: jax.lax.psum(jax.ops.segment_sum(v, ids, num_segments=num), BATCH_AXES)
  mean = losses.NumDen(seg((w * x).sum(1)), seg(w.sum(1))).value()
  var = losses.NumDen(seg((w * jnp.square(x - mean[ids][:, None])).sum(1)), seg(w.sum(1)))
  return mean, jnp.sqrt(var.value())


def _segments(cfg: TrainConfig, samples) -> jax.Array:
  """Loss segment [n] of each sample: its (policy, agent) pair."""
  return samples.policy_id * cfg.space.num_agents + samples.agent_id


@flax.struct.dataclass
class RolloutTargets:
  """What a rollout fixes for all of its updates (flat samples here; the step takes them in the
  batch's layout: `layout.unflatten` of this, e.g. one per policy name for "mapped")."""
  advantages: jax.Array  # [n, R] f32
  returns: jax.Array | None  # [n, R] f32 critic targets (gae_*), else None
  sample_mask: jax.Array  # [n] bool samples kept by the group filter
  is_weight: jax.Array | None  # [n, R] f32 truncated IS weight per token, None: off


def split_micro_map(cfg: TrainConfig, fn, tree: Any) -> Any:
  """`fn` over `cfg.train.micro_batches` micro-batches of `tree` (one at a time: lax.map), its
  results put back on the sample axis; without gradients one micro-batch's activations are
  live at a time."""
  if cfg.train.micro_batches == 1:
    return fn(tree)
  out = jax.lax.map(fn, split_micro(cfg, tree))
  ax = cfg.policy.sample_axis
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, ax).reshape(
      x.shape[1:ax + 1] + (-1,) + x.shape[ax + 2:]), out)


def rollout_targets(cfg: TrainConfig, batch) -> tuple[Any, RolloutTargets, dict[str, jax.Array]]:
  """Per-device body of the once-per-rollout pass (module docstring, step 0): (the batch, its
  targets, the global advantage metrics). The advantages read only the samples' rewards and ids;
  the learner's old log-probs, when configured, are `learner_old_logp`'s, on the rows the
  updates train on (`parallel/update.py`)."""
  layout = layouts.of(cfg.policy)
  adv = estimate(flat_field(cfg, batch, "samples"), cfg.advantage, cfg.space,
                 axis_name=BATCH_AXES)
  targets = layout.unflatten(cfg.policy, RolloutTargets(
      advantages=adv.advantages, returns=adv.returns, sample_mask=adv.sample_mask,
      is_weight=None), batch)
  return batch, targets, adv.metrics


def learner_old_logp(cfg: TrainConfig, params, frozen, specs, batch, targets: Any
                     ) -> tuple[Any, Any, dict[str, jax.Array]]:
  """Per-device body: the batch with `old_logp` replaced by the learner's (a teacher-forced
  forward at `cfg.temperature`: the proximal policy of decoupled PPO), `targets`
  (`RolloutTargets` in the batch's layout) with the truncated IS weights when `cfg.tis_cap` is
  set, and the global per-agent [A] statistics of the importance weights
  w = exp(learner - sampler log-prob) over trained tokens (`importance_metrics`)."""
  layout = layouts.of(cfg.policy)
  samples = flat_field(cfg, batch, "samples")
  logp = split_micro_map(cfg, lambda b: policies.token_logprobs(
      cfg.policy, params, frozen, specs, b, temperature=cfg.temperature,
      logits_chunk=cfg.train.logits_chunk)[0], batch)
  flat_logp, behaviour = layout.flatten(cfg.policy, logp), flat_field(cfg, batch, "old_logp")
  trained = samples.token_mask & samples.sample_mask[:, None]
  metrics = importance_metrics(flat_logp, behaviour, trained, samples.agent_id,
                               cfg.space.num_agents, cfg.train.tis_cap, cfg.loss.log_ratio_limit)
  if cfg.train.tis_cap is not None:
    is_weight = jnp.where(samples.token_mask, losses.tis_weight(
        flat_logp, behaviour, cfg.train.tis_cap, cfg.loss.log_ratio_limit), 1.0)
    weights = layout.unflatten(cfg.policy, is_weight, batch)
    targets = jax.tree.map(lambda t, w: t.replace(is_weight=w), targets, weights,
                           is_leaf=lambda x: isinstance(x, RolloutTargets))
  batch = jax.tree.map(lambda b, lp: b.replace(old_logp=jnp.where(
      b.samples.token_mask, lp, 0.0)), batch, logp, is_leaf=lambda x: hasattr(x, "old_logp"))
  return batch, targets, metrics


def importance_metrics(learner_logp, sampler_logp, mask, agent_id, num_agents: int,
                       cap: float | None, log_ratio_limit: float) -> dict[str, jax.Array]:
  """Per-agent [A] statistics of the untruncated weights w = exp(learner - sampler log-prob)
  [n, R] over the tokens of `mask` (psum over the batch axes): `ess`, the effective sample size
  per token (sum w)^2 / (n sum w^2) in (0, 1] (1: the samples are as good as on-policy;
  asynchronous RL's staleness and the sampler's numerics lower it), `weight_mean`, and with a
  cap `capped`, the fraction of tokens whose weight `tis_cap` truncates. Agents without tokens
  get 0."""
  w = jnp.exp(jnp.clip(learner_logp - sampler_logp, -log_ratio_limit, log_ratio_limit))
  m = mask.astype(jnp.float32)
  seg = lambda v: jax.lax.psum(jax.ops.segment_sum(jnp.sum(v * m, axis=1), agent_id,
                                                   num_segments=num_agents), BATCH_AXES)
  n, s1, s2 = seg(jnp.ones_like(w)), seg(w), seg(w * w)
  safe = lambda num, den: jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
  out = {"ess": safe(s1 * s1, n * s2), "weight_mean": safe(s1, n)}
  if cap is not None:
    out["capped"] = safe(seg((w > cap).astype(jnp.float32)), n)
  return out


class Prepass(NamedTuple):
  """What every micro-batch needs from the whole local batch."""
  adv: AdvantageOutput  # advantages / returns [n, R], kept samples [n]
  tmask: jax.Array  # [n, R] bool response tokens of kept samples
  dens: dict[str, jax.Array]  # global denominators: policy terms [P, A], 'value' []
  terms0: Any  # loss terms at the behaviour log-probs (accumulator shapes)
  metrics0: Any
  value_metrics0: Any
  is_weight: jax.Array | None = None  # [n, R] truncated IS weights (RolloutTargets)


def advantages_and_denominators(cfg: TrainConfig, batch: Any, targets: Any) -> Prepass:
  """The rollout's advantages for this batch's rows (`targets`, `rollout_targets`'s) and every
  loss term's global denominators over this batch (a mini-batch: over the mini-batch)."""
  A, Pn = cfg.space.num_agents, cfg.policy.num_policies
  samples = flat_field(cfg, batch, "samples")
  old_logp = flat_field(cfg, batch, "old_logp")
  chex.assert_rank(old_logp, 2)
  chex.assert_equal_shape([old_logp, samples.token_mask])
  t = layouts.of(cfg.policy).flatten(cfg.policy, targets)
  adv = AdvantageOutput(advantages=t.advantages, returns=t.returns,
                        sample_mask=t.sample_mask & samples.sample_mask, metrics={})
  is_weight = t.is_weight
  tmask = samples.token_mask & adv.sample_mask[:, None]
  # Denominators depend on masks only: evaluate the terms once at the behaviour log-probs.
  ent0 = jnp.zeros_like(old_logp) if cfg.with_entropy else None
  terms0, metrics0 = segment_terms(cfg, old_logp, old_logp, adv.advantages, tmask,
                                   flat_field(cfg, batch, "ref_logp"), ent0,
                                   _segments(cfg, samples), Pn * A)
  dens = {k: jax.lax.psum(t.den, BATCH_AXES).reshape(Pn, A) for k, t in terms0.items()}
  value_metrics0 = {}
  if cfg.policy.critic is not None:
    zeros = jnp.zeros_like(old_logp)
    v0, value_metrics0 = losses.value_loss(
        *value_inputs(cfg.advantage, zeros, samples, zeros, tmask), cfg.loss)
    dens["value"] = jax.lax.psum(v0.den, BATCH_AXES)
  return Prepass(adv, tmask, dens, terms0, metrics0, value_metrics0, is_weight)


def critic_loss(cfg: TrainConfig, params, frozen, specs, b, returns, tmask, dens
                ) -> tuple[jax.Array, dict[str, losses.NumDen]]:
  """MARFT's value loss of micro-batch `b` (flat returns / tmask [n, R]) over its global
  denominator, and the value metrics."""
  layout = layouts.of(cfg.policy)
  values = policies.critic_values(cfg.policy, params, frozen, specs, b, remat=cfg.train.remat)
  vterm, value_metrics = losses.value_loss(
      *value_inputs(cfg.advantage, layout.flatten(cfg.policy, values),
                    flat_field(cfg, b, "samples"), returns, tmask), cfg.loss)
  return losses.total_loss({"value": vterm}, cfg.loss, {"value": dens["value"]}), value_metrics


def micro_batch_loss(cfg: TrainConfig, params, frozen, specs, mb, dens):
  """Loss of one micro-batch `mb = (batch, advantages, tmask, returns, is_weight)` (layout of
  the batch):
  the total [] (or [1 + A]: total, then each agent's share), and (terms, metrics,
  value_metrics)."""
  A, Pn = cfg.space.num_agents, cfg.policy.num_policies
  flat = lambda tree: layouts.of(cfg.policy).flatten(cfg.policy, tree)
  b, adv_mb, tmask_mb, returns_mb, is_weight_mb = mb
  logp, ent = policies.token_logprobs(cfg.policy, params, frozen, specs, b,
                                      temperature=cfg.temperature,
                                      with_entropy=cfg.with_entropy, remat=cfg.train.remat,
                                      logits_chunk=cfg.train.logits_chunk)
  terms, metrics = segment_terms(
      cfg, flat(logp), flat_field(cfg, b, "old_logp"), flat(adv_mb), flat(tmask_mb),
      flat_field(cfg, b, "ref_logp"), None if ent is None else flat(ent),
      _segments(cfg, flat_field(cfg, b, "samples")), Pn * A,
      None if is_weight_mb is None else flat(is_weight_mb))
  nums = {k: t.num.reshape(Pn, A) for k, t in terms.items()}
  total = jnp.sum(losses.total_loss({k: losses.NumDen(n.sum(1), dens[k].sum(1))
                                     for k, n in nums.items()}, cfg.loss))
  shares = losses.total_loss({k: losses.NumDen(n.sum(0), dens[k].sum(0))
                              for k, n in nums.items()}, cfg.loss)  # [A]
  value_metrics = {}
  if cfg.policy.critic is not None:
    value, value_metrics = critic_loss(cfg, params, frozen, specs, b, flat(returns_mb),
                                       flat(tmask_mb), dens)
    total = total + value
  out = jnp.concatenate([total[None], shares]) if cfg.train.agent_grad_norms else total
  return out, (terms, metrics, value_metrics)


def agent_vjp_grads(loss_fn, params, num_agents: int):
  """Gradients of every row of `loss_fn(params)` ([1 + A]: total, agent shares) from one forward:
  its VJP for each basis vector. Returns (grads with leaves [1 + A, ...], loss, aux)."""
  out, vjp_fn, aux = jax.vjp(loss_fn, params, has_aux=True)
  (grads,) = jax.vmap(vjp_fn)(vary(jnp.eye(1 + num_agents)))
  return grads, out, aux


def micro_batch_grads(cfg: TrainConfig, params, frozen, specs, mb, dens):
  """(gradients, loss, aux) of one micro-batch, marked varying over the batch axes."""
  loss_fn = lambda p: micro_batch_loss(cfg, p, frozen, specs, mb, dens)
  if cfg.train.agent_grad_norms:
    grads, out, aux = agent_vjp_grads(loss_fn, params, cfg.space.num_agents)
  else:
    (out, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return jax.tree.map(vary, (grads, out, aux))


def split_micro(cfg: TrainConfig, tree: Any) -> Any:
  """Sample axis n -> a leading micro-batch axis [M, ..., n / M, ...]."""
  ax, M = cfg.policy.sample_axis, cfg.train.micro_batches
  return jax.tree.map(lambda x: jnp.moveaxis(
      x.reshape(x.shape[:ax] + (M, x.shape[ax] // M) + x.shape[ax + 1:]), ax, 0), tree)


def accumulate_grads(cfg: TrainConfig, params, frozen, specs, mb_inputs, pre: Prepass):
  """Local gradients, loss and aux summed over the `cfg.train.micro_batches` micro-batches (a
  lax.scan)."""
  if cfg.train.micro_batches == 1:  # no accumulators to fill and add
    return micro_batch_grads(cfg, params, frozen, specs, mb_inputs, pre.dens)
  # Accumulators: gradients like params (one per output row), loss terms and metrics like the
  # pre-pass's (their per-segment shapes do not depend on the batch size).
  rows = (1 + cfg.space.num_agents,) if cfg.train.agent_grad_norms else ()
  acc0 = jax.tree.map(lambda x: vary(jnp.zeros(x.shape, x.dtype)), (
      jax.tree.map(lambda p: jnp.zeros(rows + p.shape, p.dtype), params),
      jnp.zeros(rows, jnp.float32), (pre.terms0, pre.metrics0, pre.value_metrics0)))
  body = lambda acc, mb: (jax.tree.map(
      jnp.add, acc, micro_batch_grads(cfg, params, frozen, specs, mb, pre.dens)), None)
  acc, _ = jax.lax.scan(body, acc0, split_micro(cfg, mb_inputs))
  return acc


def agent_grad_norms(grads, train_specs, num_agents: int) -> jax.Array:
  """[A] norms of the per-agent gradients (leaves [1 + A, ...], already all-reduced)."""
  total = jnp.zeros((num_agents,))
  for s, g in zip(jax.tree.leaves(train_specs, is_leaf=is_spec), jax.tree.leaves(grads)):
    sq = jnp.sum(jnp.square(g[1:]).reshape(num_agents, -1), axis=1)
    total = total + (jax.lax.psum(sq, FSDP) if FSDP in tuple(s) else sq)
  return jnp.sqrt(total)


def step_metrics(cfg: TrainConfig, loss, pre: Prepass, samples, terms, metrics, value_metrics
                 ) -> dict[str, jax.Array]:
  """Global scalars (loss, advantage statistics, loss terms) and per-agent [A] vectors."""
  A, Pn = cfg.space.num_agents, cfg.policy.num_policies
  report = {"loss": loss}
  for name, nd in {**terms, **metrics}.items():
    nd = jax.tree.map(lambda x: x.reshape(Pn, A).sum(0), psum_nd(nd))  # per agent
    report[f"agent/{name}"] = nd.value()
    report[name] = losses.NumDen(nd.num.sum(), nd.den.sum()).value()
  report.update({k: psum_nd(v).value() for k, v in value_metrics.items()})
  agent = jnp.clip(samples.agent_id, 0, A - 1)
  report["agent/adv_mean"], report["agent/adv_std"] = per_agent_moments(
      pre.adv.advantages, pre.tmask, agent, A)
  reward = mixed_reward(samples, cfg.advantage.alpha)[:, None]
  report["agent/reward"], _ = per_agent_moments(reward, samples.sample_mask[:, None], agent, A)
  report["agent/samples"] = jax.lax.psum(jax.ops.segment_sum(
      samples.sample_mask.astype(jnp.float32), agent, num_segments=A), BATCH_AXES)
  return report


def local_grads(cfg: TrainConfig, params, frozen, batch, targets: RolloutTargets, specs):
  """Per-device body of one update: the rows' targets and the denominators, accumulated
  gradients, metrics."""
  train_specs, _ = specs
  layout = layouts.of(cfg.policy)
  params = jax.tree.map(
      lambda s, x: jax.lax.pcast(x, reduce_axes(s), to="varying") if reduce_axes(s) else x,
      train_specs, params, is_leaf=is_spec)
  pre = advantages_and_denominators(cfg, batch, targets)
  mb_inputs = (batch,) + tuple(layout.unflatten(cfg.policy, x, batch) for x in (
      pre.adv.advantages, pre.tmask, pre.adv.returns)) + (
          None if pre.is_weight is None else layout.unflatten(cfg.policy, pre.is_weight, batch),)
  grads, out, (terms, metrics, value_metrics) = accumulate_grads(cfg, params, frozen, specs,
                                                                 mb_inputs, pre)
  # One all-reduce per leaf over the batch axes it is replicated on.
  grads = jax.tree.map(lambda s, g: jax.lax.psum(g, reduce_axes(s)) if reduce_axes(s) else g,
                       train_specs, grads, is_leaf=is_spec)
  out = jax.lax.psum(out, BATCH_AXES)
  report = step_metrics(cfg, out[0] if cfg.train.agent_grad_norms else out, pre,
                        flat_field(cfg, batch, "samples"), terms, metrics, value_metrics)
  if cfg.train.agent_grad_norms:
    report["agent/grad_norm"] = agent_grad_norms(grads, train_specs, cfg.space.num_agents)
    grads = jax.tree.map(lambda g: g[0], grads)
  return grads, report
