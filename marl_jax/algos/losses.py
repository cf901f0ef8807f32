"""Policy and value losses as (numerator, denominator) pairs.

A mean over a batch split into micro-batches and devices is only exact if the parts are summed
before dividing, so every term and metric is returned as `NumDen(num, den)`: sum the pairs over
micro-batches (and `psum` them over devices), then take `value()`. For gradients with micro-batch
accumulation, compute the global denominators first (they depend only on masks: `aggregate` of
zeros gives them) and differentiate `total_loss(terms, cfg, denominators)` per micro-batch; the
gradients then add up to the full-batch gradient. Micro-batches split the sample axis.

All inputs are [N, T] per token; `token_mask` marks response tokens, and masked positions are
excluded with `where`, so garbage (even NaN) there never reaches the loss or its gradient.

Every policy loss is one `PolicyLoss` record in `POLICY_LOSSES`: its per-token function and the
properties the update rules read (`parallel/train_config.py`, `training/config_checks.py`); a new
loss is its function, its record and one `register` line (docs/design.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from marl_jax.registry import Registry

RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum")
KL_ESTIMATORS = ("k1", "k3")


@flax.struct.dataclass
class NumDen:
  """A mean kept as its two sums, so partial means combine exactly by adding both parts."""
  num: jax.Array
  den: jax.Array

  def __add__(self, other: NumDen) -> NumDen:
    return NumDen(self.num + other.num, self.den + other.den)

  def value(self) -> jax.Array:
    """num / den, 0 when nothing was counted."""
    return jnp.where(self.den > 0, self.num / jnp.where(self.den > 0, self.den, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Loss options.

  Attributes:
    policy_loss: "ppo" (clipped surrogate), "reinforce" (on-policy `-logp * A`, MAGRPO) or
      "nll" (`-logp`, advantages unused: supervised fine-tuning on demonstrations,
      `training/sft.py`).
    clip_low, clip_high: PPO ratio clip range [1 - clip_low, 1 + clip_high].
    dual_clip: c > 1 bounding the loss of negative advantages at `-c * A` (None: off).
    ratio_level: "token" (per-token ratio) or "sequence" (ratio of the whole response: exp of the
      summed token log-ratios, MARFT action level; pair with "seq_mean_token_mean").
    aggregation: "token_mean" (mean over all tokens), "seq_mean_token_mean" (mean over
      responses of their token mean) or "seq_sum" (mean over responses of their token sum).
    kl_coef: weight of the KL to the frozen reference (needs `ref_logp`).
    kl_estimator: "k1" (`logp - ref`) or "k3" (`exp(ref - logp) - (ref - logp) - 1`, >= 0).
    entropy_coef: weight of the entropy bonus (needs `entropy`).
    value_clip: clip of the value change around the old value in the value loss (None: off).
    huber_delta: Huber threshold of the value loss.
    log_ratio_limit: log-ratios are clipped to +-limit before `exp`, so a sequence-level ratio
      cannot overflow.
  """
  policy_loss: str = "ppo"
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = 3.0
  ratio_level: str = "token"
  aggregation: str = "token_mean"
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  value_clip: float | None = 0.2
  huber_delta: float = 10.0
  log_ratio_limit: float = 20.0

  def __post_init__(self):
    POLICY_LOSSES.get(self.policy_loss)  # refuses an unknown name, listing the known ones
    for field, allowed in (("ratio_level", RATIO_LEVELS), ("aggregation", AGGREGATIONS),
                           ("kl_estimator", KL_ESTIMATORS)):
      if getattr(self, field) not in allowed:
        raise ValueError(f"unknown {field} {getattr(self, field)!r}; expected one of "
                         f"{list(allowed)}")
    if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
      raise ValueError(f"clip range needs 0 <= clip_low < 1 and clip_high >= 0, got "
                       f"({self.clip_low}, {self.clip_high})")
    if self.dual_clip is not None and not self.dual_clip > 1.0:
      raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
    if self.value_clip is not None and not self.value_clip > 0.0:
      raise ValueError(f"value_clip must be > 0 (or None), got {self.value_clip}")
    if not self.huber_delta > 0.0:
      raise ValueError(f"huber_delta must be > 0, got {self.huber_delta}")
    if not self.log_ratio_limit > 0.0:
      raise ValueError(f"log_ratio_limit must be > 0, got {self.log_ratio_limit}")

  @property
  def record(self) -> PolicyLoss:
    """The registered record of `policy_loss`."""
    return POLICY_LOSSES.get(self.policy_loss)


def aggregate(x: jax.Array, token_mask: jax.Array, mode: str) -> NumDen:
  """Reduces per-token values x: [N, T] over response tokens as a (num, den) pair.

  Denominators: tokens ("token_mean") or responses with at least one token (the others).
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {list(AGGREGATIONS)}")
  x = jnp.where(token_mask, x, 0.0)
  m = token_mask.astype(jnp.float32)
  if mode == "token_mean":
    return NumDen(jnp.sum(x), jnp.sum(m))
  n_tok = jnp.sum(m, axis=1)
  per_seq = jnp.sum(x, axis=1)
  if mode == "seq_mean_token_mean":
    per_seq = per_seq / jnp.maximum(n_tok, 1.0)
  return NumDen(jnp.sum(per_seq), jnp.sum((n_tok > 0).astype(jnp.float32)))


def _token_mean(x: jax.Array, token_mask: jax.Array) -> NumDen:
  return aggregate(x.astype(jnp.float32), token_mask, "token_mean")


def _kl(logp: jax.Array, ref_logp: jax.Array, cfg: LossConfig) -> jax.Array:
  """Per-token estimate of KL(pi || ref) from samples of pi."""
  if cfg.kl_estimator == "k1":
    return logp - ref_logp
  x = jnp.clip(ref_logp - logp, -cfg.log_ratio_limit, cfg.log_ratio_limit)
  return jnp.exp(x) - x - 1.0


def tis_weight(learner_logp: jax.Array, sampler_logp: jax.Array, cap: float,
               log_ratio_limit: float = 20.0) -> jax.Array:
  """Truncated importance-sampling weight [N, T] of each token for the sampler/learner mismatch:
  `min(exp(learner_logp - sampler_logp), cap)` (verl's and Tunix's TIS). The sampler's numerics
  (bf16, fused kernels) make its log-probs differ from the learner's; the weight re-targets the
  policy gradient at the learner's distribution and the cap bounds its variance."""
  log_ratio = jnp.clip(learner_logp - sampler_logp, -log_ratio_limit, log_ratio_limit)
  return jnp.minimum(jnp.exp(log_ratio), cap)


def _ppo(logp: jax.Array, old_logp: jax.Array, adv: jax.Array, token_mask: jax.Array,
         cfg: LossConfig) -> tuple[jax.Array, dict[str, NumDen]]:
  """The clipped surrogate `max(-A r, -A clip(r))` with dual-clip, per token or per sequence."""
  log_ratio = logp - old_logp
  if cfg.ratio_level == "sequence":
    n_tok = jnp.maximum(jnp.sum(token_mask, axis=1, keepdims=True), 1)
    log_ratio = jnp.sum(log_ratio, axis=1, keepdims=True)
    adv = jnp.sum(adv, axis=1, keepdims=True) / n_tok  # the response's (constant) advantage
  log_ratio = jnp.clip(log_ratio, -cfg.log_ratio_limit, cfg.log_ratio_limit)
  ratio = jnp.exp(log_ratio)
  loss_plain = -adv * ratio
  loss_clip = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  per_token = jnp.maximum(loss_plain, loss_clip)
  dual = jnp.zeros_like(per_token, dtype=bool)
  if cfg.dual_clip is not None:
    bound = -adv * cfg.dual_clip
    dual = (adv < 0) & (per_token > bound)
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, bound), per_token)
  shape = token_mask.shape
  metrics = dict(
      clip_frac=_token_mean(jnp.broadcast_to(loss_clip > loss_plain, shape), token_mask),
      dual_clip_frac=_token_mean(jnp.broadcast_to(dual, shape), token_mask),
      approx_kl=_token_mean(jnp.broadcast_to(ratio - 1.0 - log_ratio, shape), token_mask),
      ratio=_token_mean(jnp.broadcast_to(ratio, shape), token_mask),
  )
  return jnp.broadcast_to(per_token, shape), metrics


def _reinforce(logp: jax.Array, old_logp: jax.Array | None, adv: jax.Array,
               token_mask: jax.Array, cfg: LossConfig) -> tuple[jax.Array, dict[str, NumDen]]:
  """On-policy `-logp * A` (MAGRPO)."""
  del old_logp, token_mask, cfg
  return -logp * adv, {}


def _nll(logp: jax.Array, old_logp: jax.Array | None, adv: jax.Array, token_mask: jax.Array,
         cfg: LossConfig) -> tuple[jax.Array, dict[str, NumDen]]:
  """`-logp`: supervised fine-tuning on demonstrations; the advantages are unused."""
  del old_logp, adv, token_mask, cfg
  return -logp, {}


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """One policy loss: its per-token function and what the update rules ask about it.

  Attributes:
    per_token: `(logp, old_logp, advantages, token_mask, cfg) -> (loss [N, T], metrics)`, inputs
      already zeroed off `token_mask`; the loss is aggregated by `cfg.aggregation`.
    ratio: weighs by the ratio to the behaviour policy: it needs `old_logp`, its ratio starts at 1
      only when the learner's temperature is the sampling one (or the learner recomputes the old
      log-probs), and `train.target_kl` (its approximate KL) applies.
    on_policy: valid for one update per rollout only (no mini-batches, no epochs).
  """
  per_token: Callable[..., tuple[jax.Array, dict[str, NumDen]]]
  ratio: bool = False
  on_policy: bool = False


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy_loss")
POLICY_LOSSES.register("ppo", PolicyLoss(_ppo, ratio=True))
POLICY_LOSSES.register("reinforce", PolicyLoss(_reinforce, on_policy=True))
POLICY_LOSSES.register("nll", PolicyLoss(_nll))


def policy_loss(logp: jax.Array, old_logp: jax.Array | None, advantages: jax.Array,
                token_mask: jax.Array, cfg: LossConfig, ref_logp: jax.Array | None = None,
                entropy: jax.Array | None = None, is_weight: jax.Array | None = None
                ) -> tuple[dict[str, NumDen], dict[str, NumDen]]:
  """Policy-gradient terms of one (micro-)batch.

  Args:
    logp: [N, T] log-probs of the sampled tokens under the current policy.
    old_logp: [N, T] behaviour log-probs (PPO; may be None for "reinforce").
    advantages: [N, T] (sample-level advantages broadcast over tokens).
    token_mask: bool[N, T] response tokens that are trained on.
    cfg: loss options.
    ref_logp: [N, T] frozen reference log-probs (adds the "kl" term).
    entropy: [N, T] per-token policy entropy (adds the "entropy" term).
    is_weight: [N, T] importance weight multiplying each token's policy-gradient loss (the
      truncated IS weight `tis_weight`, a constant); None: 1.

  Returns:
    terms: "policy" and, when their inputs are given, "kl" and "entropy", each aggregated with
      `cfg.aggregation` (the loss is `policy + kl_coef * kl - entropy_coef * entropy`).
    metrics: token means: "clip_frac" (clipped branch active), "dual_clip_frac", "approx_kl"
      (k3 estimate of KL(old || new), MARFT's early-stop signal), "ratio".
  """
  if cfg.kl_coef and ref_logp is None:
    raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logp (reference log-probs)")
  if cfg.entropy_coef and entropy is None:
    raise ValueError(f"entropy_coef={cfg.entropy_coef} needs the per-token entropy")
  record = cfg.record
  if record.ratio and old_logp is None:
    raise ValueError(f"policy_loss {cfg.policy_loss!r} needs old_logp (behaviour log-probs)")
  # Zero masked positions *before* any arithmetic: a NaN there would otherwise leak into the
  # gradient through the unselected branch of a later `where`.
  logp, old_logp, adv, ref_logp, entropy = (
      None if x is None else jnp.where(token_mask, x, 0.0)
      for x in (logp, old_logp, advantages, ref_logp, entropy))
  if is_weight is not None:
    is_weight = jax.lax.stop_gradient(jnp.where(token_mask, is_weight, 0.0))
  per_token, metrics = record.per_token(logp, old_logp, adv, token_mask, cfg)
  if is_weight is not None:
    per_token = per_token * is_weight
  terms = {"policy": aggregate(per_token, token_mask, cfg.aggregation)}
  if ref_logp is not None:
    terms["kl"] = aggregate(_kl(logp, ref_logp, cfg), token_mask, cfg.aggregation)
  if entropy is not None:
    terms["entropy"] = aggregate(entropy, token_mask, cfg.aggregation)
  return terms, metrics


def _huber(err: jax.Array, delta: float) -> jax.Array:
  a = jnp.abs(err)
  return jnp.where(a <= delta, 0.5 * jnp.square(err), delta * (a - 0.5 * delta))


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array,
               token_mask: jax.Array, cfg: LossConfig) -> tuple[NumDen, dict[str, NumDen]]:
  """Clipped Huber value loss (MARFT's critic): `max(huber(R - V), huber(R - V_clipped))`.

  `V_clipped = V_old + clip(V - V_old, -value_clip, value_clip)` keeps one update from moving
  the value far from the one the returns were computed with.

  Args:
    values: [N, T] current critic values ([N, 1] with a [N, 1] mask for one value per sample).
    old_values: [N, T] values at rollout time.
    returns: [N, T] targets (`AdvantageOutput.returns`).
    token_mask: bool[N, T].
    cfg: `value_clip`, `huber_delta` and `aggregation` are used.

  Returns:
    The loss as a (num, den) pair and metrics "value_clip_frac" and "value_abs_err".
  """
  values, old_values, returns = (jnp.where(token_mask, x, 0.0)
                                 for x in (values, old_values, returns))
  err = returns - values
  loss = _huber(err, cfg.huber_delta)
  clipped = jnp.zeros_like(token_mask)
  if cfg.value_clip is not None:
    v_clip = old_values + jnp.clip(values - old_values, -cfg.value_clip, cfg.value_clip)
    loss_clip = _huber(returns - v_clip, cfg.huber_delta)
    clipped = loss_clip > loss
    loss = jnp.maximum(loss, loss_clip)
  metrics = dict(value_clip_frac=_token_mean(clipped, token_mask),
                 value_abs_err=_token_mean(jnp.abs(err), token_mask))
  return aggregate(loss, token_mask, cfg.aggregation), metrics


def total_loss(terms: dict[str, NumDen], cfg: LossConfig,
               denominators: dict[str, jax.Array] | None = None) -> jax.Array:
  """`policy + kl_coef * kl - entropy_coef * entropy` (+ any "value" term, weight 1).

  Args:
    terms: (num, den) pairs, e.g. from `policy_loss` (summed over parts if reduced already).
    cfg: the coefficients.
    denominators: optional global denominator per term; with them the loss of a micro-batch is
      its share of the full-batch loss, so micro-batch gradients sum to the full gradient.
  """
  weights = {"policy": 1.0, "kl": cfg.kl_coef, "entropy": -cfg.entropy_coef, "value": 1.0}
  unknown = sorted(set(terms) - set(weights))
  if unknown:
    raise ValueError(f"unknown loss terms {unknown}; expected a subset of {sorted(weights)}")
  total = jnp.zeros((), jnp.float32)
  for name, term in terms.items():
    if denominators is not None:
      term = NumDen(term.num, denominators[name])
    total = total + weights[name] * term.value()
  return total
