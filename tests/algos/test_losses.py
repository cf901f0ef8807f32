"""Loss terms vs NumPy, exact reduction over micro-batches and devices, and bad inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from marl_jax.algos import losses as losses_lib
from marl_jax.algos.losses import (LossConfig, NumDen, aggregate, policy_loss, total_loss,
                                   value_loss)
from marl_jax.parallel.train_config import TrainSettings, check_update_rules
from marl_jax.registry import Registry
from host import cpu_devices

TOL = dict(rtol=1e-5, atol=1e-6)
N, T = 8, 6


def make_inputs(seed=0):
  rng = np.random.default_rng(seed)
  mask = rng.random((N, T)) < 0.75
  mask[3] = False  # an empty response: counts in no denominator
  mask[:, 0] |= np.arange(N) != 3
  logp = -np.abs(rng.normal(size=(N, T))).astype(np.float32)
  old = (logp + 0.5 * rng.normal(size=(N, T))).astype(np.float32)  # ratios well outside the clip
  adv_tok = rng.normal(size=(N, T)).astype(np.float32)
  adv_seq = np.repeat(rng.normal(size=(N, 1)), T, axis=1).astype(np.float32)
  ref = (logp + 0.3 * rng.normal(size=(N, T))).astype(np.float32)
  ent = np.abs(rng.normal(size=(N, T))).astype(np.float32)
  return dict(logp=logp, old=old, adv_tok=adv_tok, adv_seq=adv_seq, ref=ref, ent=ent, mask=mask)


def np_aggregate(x, m, mode):
  seqs = [i for i in range(len(m)) if m[i].any()]
  if mode == "token_mean":
    return x[m].sum() / m.sum()
  if mode == "seq_mean_token_mean":
    return np.mean([x[i][m[i]].mean() for i in seqs])
  return np.mean([x[i][m[i]].sum() for i in seqs])


def np_ppo(logp, old, adv, m, lo, hi, c, level):
  """Per-token PPO loss, written as the negated (dual-clip) objective."""
  logp, old, adv = (x.astype(np.float64) for x in (logp, old, adv))
  if level == "token":
    r = np.exp(logp - old)
  else:
    r = np.repeat(np.exp(np.where(m, logp - old, 0).sum(1, keepdims=True)), T, axis=1)
    adv = np.repeat(np.array([[adv[i][m[i]].mean() if m[i].any() else 0.0] for i in range(N)]),
                    T, axis=1)
  obj = np.minimum(r * adv, np.clip(r, 1 - lo, 1 + hi) * adv)
  dual = np.zeros_like(obj, bool)
  if c is not None:
    dual = (adv < 0) & (obj < c * adv)
    obj = np.where(adv < 0, np.maximum(obj, c * adv), obj)
  clipped = np.clip(r, 1 - lo, 1 + hi) * adv < r * adv
  return -obj, r, clipped, dual


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum"])
def test_ppo_token_level_matches_numpy(aggregation):
  x = make_inputs()
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation=aggregation)
  terms, metrics = policy_loss(x["logp"], x["old"], x["adv_tok"], x["mask"], cfg)
  loss, r, clipped, dual = np_ppo(x["logp"], x["old"], x["adv_tok"], x["mask"], 0.2, 0.28, 3.0,
                                  "token")
  m = x["mask"]
  np.testing.assert_allclose(terms["policy"].value(), np_aggregate(loss, m, aggregation), **TOL)
  np.testing.assert_allclose(metrics["clip_frac"].value(), clipped[m].mean(), **TOL)
  np.testing.assert_allclose(metrics["dual_clip_frac"].value(), dual[m].mean(), **TOL)
  np.testing.assert_allclose(metrics["approx_kl"].value(), (r - 1 - np.log(r))[m].mean(), **TOL)
  np.testing.assert_allclose(metrics["ratio"].value(), r[m].mean(), **TOL)
  assert 0 < clipped[m].mean() < 1 and dual[m].any()  # both clip branches are exercised


def test_ppo_without_dual_clip_matches_numpy():
  x = make_inputs(1)
  cfg = LossConfig(dual_clip=None)
  terms, _ = policy_loss(x["logp"], x["old"], x["adv_tok"], x["mask"], cfg)
  loss, *_ = np_ppo(x["logp"], x["old"], x["adv_tok"], x["mask"], 0.2, 0.2, None, "token")
  np.testing.assert_allclose(terms["policy"].value(), np_aggregate(loss, x["mask"], "token_mean"),
                             **TOL)


def test_ppo_sequence_level_ratio_matches_numpy():
  x = make_inputs(2)
  x["old"] = x["logp"] + 0.1 * (x["old"] - x["logp"])  # summed log-ratios stay moderate
  cfg = LossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean")
  terms, metrics = policy_loss(x["logp"], x["old"], x["adv_seq"], x["mask"], cfg)
  loss, _, clipped, _ = np_ppo(x["logp"], x["old"], x["adv_seq"], x["mask"], 0.2, 0.2, 3.0,
                               "sequence")
  m = x["mask"]
  np.testing.assert_allclose(terms["policy"].value(), np_aggregate(loss, m, "seq_mean_token_mean"),
                             **TOL)
  np.testing.assert_allclose(metrics["clip_frac"].value(), clipped[m].mean(), **TOL)


def test_reinforce_seq_sum_matches_numpy():
  """MAGRPO: -(sum of the response's token log-probs) * A, averaged over responses."""
  x = make_inputs(3)
  cfg = LossConfig(policy_loss="reinforce", aggregation="seq_sum")
  terms, metrics = policy_loss(x["logp"], None, x["adv_seq"], x["mask"], cfg)
  m = x["mask"]
  want = np.mean([-x["logp"][i][m[i]].sum() * x["adv_seq"][i, 0] for i in range(N) if m[i].any()])
  np.testing.assert_allclose(terms["policy"].value(), want, **TOL)
  assert metrics == {}


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_entropy_and_total_match_numpy(estimator):
  x = make_inputs(4)
  cfg = LossConfig(kl_coef=0.05, kl_estimator=estimator, entropy_coef=0.01,
                   aggregation="seq_mean_token_mean")
  terms, _ = policy_loss(x["logp"], x["old"], x["adv_tok"], x["mask"], cfg, ref_logp=x["ref"],
                         entropy=x["ent"])
  m = x["mask"]
  logp, ref = x["logp"].astype(np.float64), x["ref"].astype(np.float64)
  kl = logp - ref if estimator == "k1" else np.exp(ref - logp) - (ref - logp) - 1
  want_kl = np_aggregate(kl, m, "seq_mean_token_mean")
  want_ent = np_aggregate(x["ent"], m, "seq_mean_token_mean")
  np.testing.assert_allclose(terms["kl"].value(), want_kl, **TOL)
  np.testing.assert_allclose(terms["entropy"].value(), want_ent, **TOL)
  loss, *_ = np_ppo(x["logp"], x["old"], x["adv_tok"], m, 0.2, 0.2, 3.0, "token")
  want = np_aggregate(loss, m, "seq_mean_token_mean") + 0.05 * want_kl - 0.01 * want_ent
  np.testing.assert_allclose(total_loss(terms, cfg), want, **TOL)


@pytest.mark.parametrize("value_clip", [0.2, None])
def test_clipped_huber_value_loss_matches_numpy(value_clip):
  rng = np.random.default_rng(5)
  v, old, ret = (rng.normal(size=(N, T)).astype(np.float32) * s for s in (1.0, 1.0, 8.0))
  m = make_inputs()["mask"]
  cfg = LossConfig(value_clip=value_clip, huber_delta=2.0)
  term, metrics = value_loss(v, old, ret, m, cfg)

  def huber(e):
    return np.where(np.abs(e) <= 2.0, 0.5 * e**2, 2.0 * (np.abs(e) - 1.0))

  want = huber(ret - v)
  if value_clip is not None:
    want = np.maximum(want, huber(ret - (old + np.clip(v - old, -0.2, 0.2))))
  np.testing.assert_allclose(term.value(), np_aggregate(want, m, "token_mean"), **TOL)
  np.testing.assert_allclose(metrics["value_abs_err"].value(), np.abs(ret - v)[m].mean(), **TOL)
  assert (metrics["value_clip_frac"].value() > 0) == (value_clip is not None)


def _loss_fn(logp, x, cfg, sl, dens=None):
  terms, _ = policy_loss(logp, x["old"][sl], x["adv_tok"][sl], x["mask"][sl], cfg,
                         ref_logp=x["ref"][sl], entropy=x["ent"][sl])
  return total_loss(terms, cfg, dens), terms


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum"])
def test_micro_batches_sum_to_full_batch(aggregation):
  x = make_inputs(6)
  cfg = LossConfig(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
  full_sl, parts = slice(None), (slice(0, 3), slice(3, N))  # uneven split, one empty response
  (full_loss, full_terms), full_grad = jax.value_and_grad(_loss_fn, has_aux=True)(
      x["logp"], x, cfg, full_sl)
  part_terms = [_loss_fn(x["logp"][sl], x, cfg, sl)[1] for sl in parts]
  for name, term in full_terms.items():
    summed = part_terms[0][name] + part_terms[1][name]
    np.testing.assert_allclose(summed.num, term.num, **TOL)
    np.testing.assert_allclose(summed.den, term.den, **TOL)
    np.testing.assert_allclose(summed.value(), term.value(), **TOL)
  # Gradients: each micro-batch loss over the *global* denominators.
  dens = {k: t.den for k, t in full_terms.items()}
  grads = [jax.grad(lambda lp, sl=sl: _loss_fn(lp, x, cfg, sl, dens)[0])(x["logp"][sl])
           for sl in parts]
  np.testing.assert_allclose(np.concatenate(grads), full_grad, **TOL)
  parts_loss = sum(_loss_fn(x["logp"][sl], x, cfg, sl, dens)[0] for sl in parts)
  np.testing.assert_allclose(parts_loss, full_loss, **TOL)


def test_device_psum_equals_full_batch():
  x = make_inputs(7)
  cfg = LossConfig(aggregation="seq_mean_token_mean")
  mesh = Mesh(np.array(cpu_devices(8)), ("data",))

  def per_device(logp, old, adv, mask):
    terms, metrics = policy_loss(logp, old, adv, mask, cfg)
    return jax.tree.map(lambda v: jax.lax.psum(v, "data"), (terms, metrics))

  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P())
  terms, metrics = jax.jit(sharded)(x["logp"], x["old"], x["adv_tok"], x["mask"])
  full_terms, full_metrics = policy_loss(x["logp"], x["old"], x["adv_tok"], x["mask"], cfg)
  np.testing.assert_allclose(terms["policy"].value(), full_terms["policy"].value(), **TOL)
  for k in full_metrics:
    np.testing.assert_allclose(metrics[k].value(), full_metrics[k].value(), **TOL)


def test_masked_garbage_never_reaches_loss_or_gradient():
  x = make_inputs(8)
  m = x["mask"]
  cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
  dirty = {k: np.where(m, v, np.nan) if k != "mask" else v for k, v in x.items()}
  (clean_loss, _), clean_grad = jax.value_and_grad(_loss_fn, has_aux=True)(x["logp"], x, cfg,
                                                                           slice(None))
  (loss, _), grad = jax.value_and_grad(_loss_fn, has_aux=True)(dirty["logp"], dirty, cfg,
                                                               slice(None))
  np.testing.assert_array_equal(loss, clean_loss)
  np.testing.assert_array_equal(grad, clean_grad)
  assert np.all(np.asarray(grad)[~m] == 0)


def test_empty_numden_is_zero():
  assert float(NumDen(jnp.float32(0.0), jnp.float32(0.0)).value()) == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(aggregation="mean"), r"unknown aggregation 'mean'; expected one of \['token_mean'"),
    (dict(policy_loss="grpo"), "unknown policy_loss 'grpo'"),
    (dict(ratio_level="word"), "unknown ratio_level 'word'"),
    (dict(kl_estimator="k2"), "unknown kl_estimator 'k2'"),
    (dict(dual_clip=1.0), "dual_clip must be > 1"),
    (dict(clip_low=1.0), "clip range"),
])
def test_bad_config_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**kwargs)


def test_missing_inputs_raise():
  x = make_inputs()
  args = (x["logp"], x["old"], x["adv_tok"], x["mask"])
  with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
    policy_loss(*args, LossConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="entropy_coef=0.01 needs the per-token entropy"):
    policy_loss(*args, LossConfig(entropy_coef=0.01))
  with pytest.raises(ValueError, match="'ppo' needs old_logp"):
    policy_loss(x["logp"], None, x["adv_tok"], x["mask"], LossConfig())
  with pytest.raises(ValueError, match=r"unknown aggregation 'sum'"):
    aggregate(x["logp"], x["mask"], "sum")
  with pytest.raises(ValueError, match=r"unknown loss terms \['aux'\]"):
    total_loss({"aux": NumDen(jnp.float32(1.0), jnp.float32(1.0))}, LossConfig())


def test_nll_is_the_token_mean_negative_log_likelihood():
  """Supervised warm-start: -log p of every response token, advantages unused."""
  x = make_inputs(5)
  cfg = LossConfig(policy_loss="nll")
  terms, metrics = policy_loss(x["logp"], None, x["adv_tok"], x["mask"], cfg)
  m = x["mask"]
  np.testing.assert_allclose(terms["policy"].value(), -x["logp"][m].mean(), **TOL)
  assert float(terms["policy"].den) == m.sum() and metrics == {}
  other, _ = policy_loss(x["logp"], None, -3 * x["adv_tok"], x["mask"], cfg)
  assert float(other["policy"].value()) == float(terms["policy"].value())


def test_a_new_loss_is_its_function_and_record(monkeypatch):
  """A loss registered with its record is computed by its function, and the update rules read
  the record's properties, not its name."""
  table = Registry("policy_loss")
  table.register("ppo", losses_lib.POLICY_LOSSES.get("ppo"))
  table.register("squared", losses_lib.PolicyLoss(
      lambda logp, old_logp, adv, mask, cfg: (jnp.square(logp) * adv, {}), on_policy=True))
  monkeypatch.setattr(losses_lib, "POLICY_LOSSES", table)
  x = make_inputs()
  cfg = LossConfig(policy_loss="squared")
  terms, metrics = policy_loss(jnp.asarray(x["logp"]), None, jnp.asarray(x["adv_tok"]),
                               jnp.asarray(x["mask"]), cfg)
  want = np.sum(np.where(x["mask"], x["logp"].astype(np.float64) ** 2 * x["adv_tok"], 0.0))
  np.testing.assert_allclose(float(terms["policy"].value()), want / x["mask"].sum(), **TOL)
  assert metrics == {}
  with pytest.raises(ValueError, match=r"loss.policy_loss='squared' is on-policy .* expected 1 "
                                       r"and None"):
    check_update_rules(TrainSettings(epochs=2), cfg)
  with pytest.raises(ValueError, match=r"train.target_kl=0.1 uses the approximate KL of a ratio "
                                       r"loss; expected loss.policy_loss in \['ppo'\], got "
                                       r"'squared'"):
    check_update_rules(TrainSettings(target_kl=0.1), cfg)
  with pytest.raises(ValueError, match=r"unknown policy_loss 'reinforce'; expected one of "
                                       r"\['ppo', 'squared'\]"):
    LossConfig(policy_loss="reinforce")
