"""PPO mini-batches and epochs, old log-probs recomputed by the learner, truncated IS weights and
the learner temperature.

References are written here: GRPO advantages of the whole rollout and the dual-clip PPO loss in
NumPy, log-probs from a full-sequence `decoder.forward` (log_softmax(logits / T) in NumPy).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, TrainBatch, make_batch
from marl_jax.algos.losses import LossConfig, tis_weight
from marl_jax.algos.optim import OptimConfig
from marl_jax.models import decoder
from marl_jax.models.config import get_preset
from marl_jax.models.lora import LoraConfig
from marl_jax.parallel import layouts, policies, update
from marl_jax.parallel.mesh import make_mesh
from marl_jax.parallel.train_config import TrainConfig, TrainSettings
from marl_jax.parallel.train_step import make_train_step
from host import FAST_COMPILE, cpu_devices

MODEL = get_preset("tiny-llama")
N, TP, R, A, K = 16, 6, 4, 2, 4  # samples, prompt len, response len, agents, samples per group
SPACE = GroupSpace(num_problems=N // K, num_agents=A, max_turns=K // A, num_trajs=N // K)
init_params = jax.jit(policies.init_params, static_argnums=0, compiler_options=FAST_COMPILE)


@jax.jit  # (FAST_COMPILE is not needed: one small forward)
def logits_of(params, prompt, prompt_mask, response):
  """Logits [N, R, V] that emit each response token: one full forward over prompt + response."""
  tokens = jnp.concatenate([prompt, response], axis=1)
  mask = jnp.concatenate([prompt_mask, jnp.ones(response.shape, bool)], axis=1)
  logits, _ = decoder.forward(params, tokens, decoder.positions_from_mask(mask), MODEL,
                              attn_mask=mask)
  return logits[:, TP - 1:-1]


def ref_logp(params, b: TrainBatch, temperature=1.0) -> np.ndarray:
  """log_softmax(logits / T) at the response tokens, in NumPy (float64)."""
  z = np.asarray(logits_of(params, b.prompt, b.prompt_mask, b.response), np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return np.take_along_axis(logp, np.asarray(b.response)[..., None], -1)[..., 0]


def grpo_advantages(b: TrainBatch) -> np.ndarray:
  """[N] GRPO advantages over the whole rollout (groups = problems, std with ddof 0)."""
  s = b.samples
  r, g = np.asarray(s.rewards, np.float64), np.asarray(s.problem_id)
  return np.array([(r[i] - r[g == g[i]].mean()) / (r[g == g[i]].std() + 1e-6)
                   for i in range(len(r))])


def ppo_terms(logp, old_logp, adv, mask, w=None, clip=0.2, dual=3.0):
  """(token-mean dual-clip PPO loss, mean ratio, clip fraction) over `mask`, NumPy."""
  ratio = np.exp(logp - old_logp)
  adv = np.broadcast_to(adv[:, None], ratio.shape)
  plain, clipped = -adv * ratio, -adv * np.clip(ratio, 1 - clip, 1 + clip)
  per_token = np.maximum(plain, clipped)
  per_token = np.where(adv < 0, np.minimum(per_token, -dual * adv), per_token)
  if w is not None:
    per_token = per_token * w
  return (per_token[mask].mean(), ratio[mask].mean(), (clipped > plain)[mask].mean())


def make_batch_at(params, seed=0, noise=0.0, policy_of_agent=(0, 0)) -> TrainBatch:
  """N samples, K per problem; old log-probs = the params' own (+ noise: a mismatched sampler)."""
  rng = np.random.default_rng(seed)
  agent = np.arange(N) % A
  pad = rng.integers(0, 3, N)
  prompt_mask = np.arange(TP)[None] >= pad[:, None]
  prompt = np.where(prompt_mask, rng.integers(1, MODEL.vocab_size, (N, TP)), 0).astype(np.int32)
  response = rng.integers(1, MODEL.vocab_size, (N, R)).astype(np.int32)
  token_mask = np.arange(R)[None] < rng.integers(1, R + 1, N)[:, None]
  samples = jax.tree.map(np.asarray, make_batch(
      rng.normal(size=N).astype(np.float32), problem_id=np.arange(N) // K, agent_id=agent,
      policy_id=np.asarray(policy_of_agent)[agent], token_mask=token_mask,
      traj_id=np.arange(N) // K, turn=(np.arange(N) % K) // A,
      token_values=rng.normal(size=(N, R)).astype(np.float32)))
  b = TrainBatch(prompt=prompt, prompt_mask=prompt_mask, response=response,
                 old_logp=np.zeros((N, R), np.float32), samples=samples)
  logp = ref_logp(params, b) + noise * rng.normal(size=(N, R))
  return b.replace(old_logp=np.where(token_mask, logp, 0.0).astype(np.float32))


def build(mesh_shape=(1, 1, 1), kind="shared", P=1, estimator="grpo", lr=1e-3, loss=None,
          **cfg_kw):
  policy = policies.PolicyConfig(kind=kind, models=(MODEL,), num_policies=P,
                                 optim=(OptimConfig(lr=lr, eps=1e-2, max_grad_norm=1e9),),
                                 **({"lora": LoraConfig(rank=4, alpha=8.0), "critic": (16,)}
                                    if kind == "lora" else {}))
  train = {k: cfg_kw.pop(k) for k in list(cfg_kw) if k in TrainSettings.__dataclass_fields__}
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig(estimator),
                    loss=loss or LossConfig(), space=SPACE, train=TrainSettings(**train),
                    **cfg_kw)
  devices = cpu_devices(int(np.prod(mesh_shape)))
  return cfg, make_train_step(cfg, make_mesh(*mesh_shape, devices=devices),
                              compiler_options=FAST_COMPILE)


def start(fns, trainable, frozen, batch):
  trainable, frozen = fns.shard_params(*jax.tree.map(np.asarray, (trainable, frozen)))
  return fns.init(trainable), frozen, fns.shard_batch(batch)


def host(tree):
  return jax.tree.map(np.array, jax.device_get(tree))


def test_the_batch_is_checked_once_per_rollout_not_per_update(monkeypatch):
  """`check` checks the rollout batch on the host once; the 2 x 2 updates cut from it do not
  copy and check every id again."""
  cfg, fns = build(mini_batch_size=8, epochs=2)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  b = make_batch_at(trainable["policy"])
  state, frozen_s, batch = start(fns, trainable, frozen, b)
  checked = []
  real = layouts.validate_batch
  monkeypatch.setattr(layouts, "validate_batch", lambda *a: checked.append(1) or real(*a))
  state, out = update.run(fns, cfg, state, frozen_s, batch, np.random.default_rng(0))
  assert out["updates"] == 4 and len(checked) == 1


def test_per_agent_means_count_only_updates_in_which_the_agent_acted():
  """Three updates, three agents: agent 0 acts in updates 1-2, agent 1 in update 2 only, agent 2
  never (a step reports 0 for an agent's num / den pairs when it has no rows). Scalars and
  agent/samples are plain means over the 3 updates; per-agent metrics average the updates in
  which the agent had samples, and a never-acting agent stays 0."""
  host = [{"loss": 1.0, "agent/samples": np.array([4.0, 0.0, 0.0]),
           "agent/policy": np.array([2.0, 0.0, 0.0])},
          {"loss": 3.0, "agent/samples": np.array([2.0, 3.0, 0.0]),
           "agent/policy": np.array([4.0, -6.0, 0.0])},
          {"loss": 5.0, "agent/samples": np.array([0.0, 0.0, 0.0]),
           "agent/policy": np.array([0.0, 0.0, 0.0])}]
  out = update.mean_metrics(host)
  assert out["loss"] == 3.0
  np.testing.assert_array_equal(out["agent/samples"], [2.0, 1.0, 0.0])
  np.testing.assert_array_equal(out["agent/policy"], [3.0, -6.0, 0.0])


def test_plan_covers_every_kept_row_once_per_epoch():
  kept = [np.array([1, 1, 0, 1, 1, 1, 0, 1], bool), np.array([1, 0, 0, 0, 1, 0, 0, 0], bool)]
  mbs = update.plan(kept, 4, np.random.default_rng(0))
  assert len(mbs) == 2  # block 0 has 6 kept rows: ceil(6 / 4)
  for b, k in enumerate(kept):
    rows = np.concatenate([idx[b][valid[b]] for idx, valid in mbs])
    np.testing.assert_array_equal(np.sort(rows), np.flatnonzero(k))
  assert [v[1].sum() for _, v in mbs] == [2, 0]  # block 1's second mini-batch is all padding


def test_plan_trims_mini_batches_to_the_kept_rows():
  """A mini-batch holds `size` rows, or fewer when the fullest block keeps fewer samples:
  round_rows of its count (powers of two below 8, then multiples of 8), a multiple of the
  pieces; the same rows either way."""
  kept = [np.array([1, 0, 1, 1, 0, 0, 0, 0], bool), np.array([0, 1, 0, 0, 0, 0, 0, 0], bool)]
  for multiple, rows in ((1, 4), (2, 4), (8, 8)):
    (idx, valid), = update.plan(kept, 16, np.random.default_rng(0), multiple)
    assert [len(i) for i in idx] == [rows, rows] and [v.sum() for v in valid] == [3, 1]
    np.testing.assert_array_equal(np.sort(idx[0][valid[0]]), [0, 2, 3])
  five = [np.arange(10) < 5]
  assert [len(i[0]) for i, _ in update.plan(five, 16, np.random.default_rng(0))] == [8]
  assert [len(i[0]) for i, _ in update.plan(five, 4, np.random.default_rng(0))] == [4, 4]


def test_one_update_over_fewer_kept_samples_than_the_mini_batch():
  """mini_batch_size 32 over a 16-sample rollout: one update on a 16-row mini-batch (not 32
  rows, 16 of them padding) whose loss is NumPy's PPO loss of the whole rollout."""
  cfg, fns = build(mini_batch_size=32)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  b = make_batch_at(trainable["policy"])
  state, frozen_s, batch = start(fns, trainable, frozen, b)
  rows = []

  def step(state, frozen, mb, mt):
    rows.append(mb.prompt.shape[0])
    return fns.step(state, frozen, mb, mt)

  _, out = update.run(fns._replace(step=step), cfg, state, frozen_s, batch,
                      np.random.default_rng(0))
  assert rows == [N] and out["updates"] == 1
  loss, ratio, _ = ppo_terms(ref_logp(trainable["policy"], b), b.old_logp, grpo_advantages(b),
                             b.samples.token_mask)
  np.testing.assert_allclose(out["loss"], loss, rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(out["ratio"], ratio, rtol=1e-5)


def test_two_mini_batches_two_epochs_ppo_against_numpy():
  """2 mini-batches x 2 epochs, shuffled: advantages of the whole rollout, old log-probs of the
  rollout; from the second update on the ratio is not 1 and each update's loss, ratio and clip
  fraction match NumPy on that update's own log-probs. `update.run` runs the same updates."""
  cfg, fns = build(mini_batch_size=8, epochs=2, lr=0.05)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  b = make_batch_at(trainable["policy"])
  adv = grpo_advantages(b)
  state, frozen_s, batch = start(fns, trainable, frozen, b)
  full, targets, adv_metrics = fns.prepare(batch)
  kept = [np.asarray(targets.sample_mask)]
  rng = np.random.default_rng(7)
  seen, ratios, losses = [], [], []
  for epoch in range(2):
    for idx, valid in update.plan(kept, 8, rng):
      rows = idx[0][valid[0]]
      seen.append(rows)
      params = host(state.params["policy"])
      mb, mt = fns.shard_batch(update.select_rows(cfg, full, targets, idx, valid))
      state, m = fns.step(state, frozen_s, mb, mt)
      sub = jax.tree.map(lambda x: np.asarray(x)[rows], b)
      loss, ratio, clip_frac = ppo_terms(ref_logp(params, sub), sub.old_logp, adv[rows],
                                         sub.samples.token_mask)
      np.testing.assert_allclose(m["loss"], loss, rtol=2e-4, atol=1e-6)
      np.testing.assert_allclose(m["ratio"], ratio, rtol=1e-5)
      np.testing.assert_allclose(m["clip_frac"], clip_frac, atol=1e-6)
      ratios.append(ratio), losses.append(float(m["loss"]))
  assert len(seen) == 4 and all(len(r) == 8 for r in seen)
  assert sorted(np.concatenate(seen[:2])) == list(range(N))  # one epoch = every sample once
  assert not np.array_equal(seen[0], seen[2])  # reshuffled each epoch
  # Groups span the mini-batches: the first one's advantages are not those of its rows alone.
  assert len(set(b.samples.problem_id[seen[0]])) > 2
  np.testing.assert_allclose(ratios[0], 1.0, atol=1e-5)
  assert abs(ratios[1] - 1.0) > 1e-3
  # The driver: same updates from the same shuffle seed -> same params, mean metrics.
  state2, _, _ = start(fns, trainable, frozen, b)
  state2, out = update.run(fns, cfg, state2, frozen_s, fns.shard_batch(b),
                           np.random.default_rng(7))
  assert out["updates"] == 4 and out["policy_skipped"] == 0
  np.testing.assert_allclose(out["loss"], np.mean(losses), rtol=1e-5)
  np.testing.assert_allclose(out["ratio"], np.mean(ratios), rtol=1e-5)
  assert out["clip_frac"] > 0  # lr 0.05: later updates leave the clip range
  assert adv_metrics and all(np.allclose(out[f"adv/{k}"], v) for k, v in adv_metrics.items())
  for x, y in zip(jax.tree.leaves(host(state2.params)), jax.tree.leaves(host(state.params))):
    np.testing.assert_array_equal(x, y)


def test_target_kl_skips_policy_but_trains_critic():
  """MARFT: an update whose approximate KL exceeds target_kl leaves the policy bitwise unchanged
  while the critic still trains; the first update (ratio 1, KL 0) updates both."""
  cfg, fns = build(kind="lora", P=2, estimator="gae_token", lr=0.05, mini_batch_size=8,
                   epochs=2, target_kl=1e-4, loss=LossConfig(dual_clip=None))
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  b = make_batch_at(frozen["base"], policy_of_agent=(0, 1))  # adapters start at B = 0: base
  state, frozen_s, batch = start(fns, trainable, frozen, b)
  full, targets, _ = fns.prepare(batch)
  kls, skipped = [], 0
  for _ in range(2):
    for idx, valid in update.plan([np.asarray(targets.sample_mask)], 8,
                                  np.random.default_rng(1)):
      before = host(state.params)
      mb, mt = fns.shard_batch(update.select_rows(cfg, full, targets, idx, valid))
      state, m = fns.step(state, frozen_s, mb, mt)
      after = host(state.params)
      kls.append(float(m["approx_kl"]))
      same = [np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before["policy"]),
                                                   jax.tree.leaves(after["policy"]))]
      assert not any(np.array_equal(x, y) for x, y in zip(
          jax.tree.leaves(before["critic"]), jax.tree.leaves(after["critic"])))
      if kls[-1] > 1e-4:
        assert all(same) and not m["policy_updated"]
        skipped += 1
      else:
        assert not all(same) and m["policy_updated"]
  assert kls[0] < 1e-6 and skipped >= 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recompute_old_logp_and_tis_weight(temperature):
  """Recomputed old log-probs = a teacher-forced forward at the learner temperature; the TIS
  weight is min(exp(learner - sampler), cap) per token, and the first update's loss is the
  PPO loss (ratio 1) weighted by it."""
  cap = 1.2
  cfg, fns = build(mesh_shape=(2, 1, 1), recompute_old_logp=True, tis_cap=cap,
                   temperature=temperature, micro_batches=2)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  b = make_batch_at(trainable["policy"], noise=0.3)  # the sampler differs from the learner
  state, frozen_s, batch = start(fns, trainable, frozen, b)
  full, targets, _ = fns.prepare(batch)
  full, targets, _ = fns.recompute(state.params, frozen_s, full, targets)
  mask = b.samples.token_mask
  learner = ref_logp(trainable["policy"], b, temperature)
  np.testing.assert_allclose(np.asarray(full.old_logp), np.where(mask, learner, 0.0),
                             atol=2e-5)
  w = np.minimum(np.exp(learner - b.old_logp), cap)
  assert (w[mask] == cap).any() and (w[mask] < cap).any()  # both sides of the cap
  np.testing.assert_allclose(np.asarray(targets.is_weight)[mask], w[mask], rtol=1e-4)
  _, m = fns.step(state, frozen_s, full, targets)
  loss, ratio, _ = ppo_terms(learner, learner, grpo_advantages(b), mask, w=w)
  np.testing.assert_allclose(m["loss"], loss, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m["ratio"], 1.0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_uses_learner_temperature(temperature):
  """REINFORCE (MAGRPO): the loss differentiates log_softmax(logits / T_learner)."""
  loss_cfg = LossConfig(policy_loss="reinforce", aggregation="token_mean")
  cfg, fns = build(loss=loss_cfg, temperature=temperature)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  b = make_batch_at(trainable["policy"])
  # No tokens for each group's first sample: the trained advantages no longer sum to 0, so the
  # loss depends on the log-probs' level, not only on their spread.
  tm = b.samples.token_mask.copy()
  tm[::K] = False
  b = b.replace(samples=b.samples.replace(token_mask=tm))
  state, frozen_s, batch = start(fns, trainable, frozen, b)
  _, m = update.run(fns, cfg, state, frozen_s, batch, np.random.default_rng(0))
  logp, mask = ref_logp(trainable["policy"], b, temperature), b.samples.token_mask
  want = (-logp * grpo_advantages(b)[:, None])[mask].mean()
  np.testing.assert_allclose(m["loss"], want, rtol=1e-4)
  other = ref_logp(trainable["policy"], b, 1.7 - temperature)  # the other temperature
  # (A tiny random model's logits are nearly flat, so T moves the loss little: still 10x the
  # tolerance above.)
  assert abs((-other * grpo_advantages(b)[:, None])[mask].mean() - want) > 10 * 1e-4 * abs(want)


@pytest.mark.parametrize("kind", ["shared", "stacked"])
def test_each_agent_rows_at_its_own_temperature(kind):
  """A per-agent learner temperature (T_0, T_1) = (0.6, 1.5), as the trainer gives agents that
  sample at their own temperatures (`config.sampling.per_agent`): the recomputed old log-probs
  and the KL reference's log-probs of every agent-0 row are log_softmax(logits / 0.6), of every
  agent-1 row log_softmax(logits / 1.5) (NumPy over a full forward), and not the other agent's;
  the REINFORCE loss differentiates those. Stacked: agent a is policy a's block (the lax.map
  over blocks)."""
  temps = (0.6, 1.5)
  P = 1 if kind == "shared" else 2
  policy = policies.PolicyConfig(kind=kind, models=(MODEL,), num_policies=P,
                                 optim=(OptimConfig(lr=1e-3, eps=1e-2, max_grad_norm=1e9),))
  loss = LossConfig(policy_loss="reinforce", aggregation="token_mean", kl_coef=0.1)
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig("grpo"), loss=loss, space=SPACE,
                    agent_policies=(0, 0) if P == 1 else None, temperature=temps,
                    train=TrainSettings(recompute_old_logp=True))
  fns = make_train_step(cfg, make_mesh(2, 1, 1, devices=cpu_devices(2)),
                        compiler_options=FAST_COMPILE)
  one = jax.jit(decoder.init_params, static_argnums=0)(MODEL, jax.random.key(0))
  trainable, frozen = init_params(policy, jax.random.key(1), base=one)
  flat = make_batch_at(one, policy_of_agent=(0, 0) if P == 1 else (0, 1))
  agent = np.asarray(flat.samples.agent_id)
  if kind == "shared":
    blocks, batch = [flat], flat
  else:
    blocks = [jax.tree.map(lambda x, a=a: np.asarray(x)[agent == a], flat) for a in range(A)]
    batch = jax.tree.map(lambda *x: np.stack(x), *blocks)
  state, frozen_s, sharded = start(fns, trainable, frozen, batch)
  reference = fns.reference_params(state.params)
  full, targets, _ = fns.prepare(sharded)
  full, _, _ = fns.recompute(state.params, frozen_s, full, targets)
  full = host(fns.ref_logp(reference, frozen_s, full))
  got_blocks = [full] if kind == "shared" else [jax.tree.map(lambda x, p=p: x[p], full)
                                                for p in range(A)]
  checked = set()
  for b, got in zip(blocks, got_blocks):
    rows = np.asarray(b.samples.agent_id)
    at = {t: ref_logp(one, b, t) for t in temps}
    for a, t in enumerate(temps):
      mask = b.samples.token_mask & (rows == a)[:, None]
      if not mask.any():  # a stacked block holds one agent's rows
        continue
      checked.add(a)
      for name in ("old_logp", "ref_logp"):
        np.testing.assert_allclose(getattr(got, name)[mask], at[t][mask], atol=2e-5)
        other = temps[1 - a]
        assert np.abs(getattr(got, name)[mask] - at[other][mask]).max() > 1e-2
  assert checked == {0, 1}
  # The loss: -mean(logp_T(agent) * A) over the trained tokens (a REINFORCE step of the same
  # rows; a stacked team sums each policy's token mean), with a KL term of 0 (the reference is
  # the params themselves).
  _, m = update.run(fns, cfg, state, frozen_s, sharded, np.random.default_rng(0), reference)
  adv = grpo_advantages(flat)
  logp = np.where((agent == 0)[:, None], ref_logp(one, flat, temps[0]),
                  ref_logp(one, flat, temps[1]))
  term = -logp * adv[:, None]
  mask = flat.samples.token_mask
  want = (term[mask].mean() if kind == "shared" else
          sum(term[mask & (agent == a)[:, None]].mean() for a in range(A)))
  np.testing.assert_allclose(m["loss"], want, rtol=1e-4, atol=1e-6)
  one_t = -ref_logp(one, flat, temps[0]) * adv[:, None]  # every row at agent 0's temperature
  wrong = (one_t[mask].mean() if kind == "shared" else
           sum(one_t[mask & (agent == a)[:, None]].mean() for a in range(A)))
  assert abs(wrong - want) > 10 * 1e-4 * abs(want)


def test_refusals():
  with pytest.raises(ValueError, match="'reinforce' is on-policy"):
    build(loss=LossConfig(policy_loss="reinforce"), epochs=2)
  with pytest.raises(ValueError, match="tis_cap=2.0 needs a value > 0 and recompute_old_logp"):
    build(tis_cap=2.0)
  with pytest.raises(ValueError, match="mini_batch_size=4 does not split into .* = 8"):
    build(mesh_shape=(8, 1, 1), mini_batch_size=4)
  with pytest.raises(ValueError, match="epochs=0; expected an integer >= 1"):
    build(epochs=0)


def test_tis_weight_matches_numpy():
  rng = np.random.default_rng(0)
  learner, sampler = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
  np.testing.assert_allclose(tis_weight(learner, sampler, 2.0),
                             np.minimum(np.exp(learner - sampler), 2.0), rtol=1e-6)


@pytest.mark.parametrize("kind", ["stacked", "mapped"])
def test_per_policy_blocks_select_and_update(kind):
  """Stacked / mapped teams: each policy block is shuffled and cut on its own; a mini-batch
  holds exactly the host-indexed rows of each block (masked slots beyond them), and the
  updates run: ceil(8 kept rows / 4) = 2 per epoch, the first at ratio 1."""
  names = ("solver", "verifier") if kind == "mapped" else ()
  policy = policies.PolicyConfig(kind=kind, models=(MODEL,) * (2 if names else 1),
                                 num_policies=2, names=names,
                                 optim=(OptimConfig(lr=0.05, eps=1e-2),))
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig("grpo"), loss=LossConfig(),
                    space=SPACE, train=TrainSettings(mini_batch_size=4, epochs=1))
  fns = make_train_step(cfg, make_mesh(2, 1, 1, devices=cpu_devices(2)),
                        compiler_options=FAST_COMPILE)
  one = jax.jit(decoder.init_params, static_argnums=0)(MODEL, jax.random.key(0))
  trainable, frozen = init_params(policy, jax.random.key(1),
                                  base={k: one for k in names} if names else one)
  flat = make_batch_at(one, policy_of_agent=(0, 1))
  agent = np.asarray(flat.samples.agent_id)
  blocks = [jax.tree.map(lambda x, a=a: np.asarray(x)[agent == a], flat) for a in range(A)]
  batch = dict(zip(names, blocks)) if names else jax.tree.map(lambda *x: np.stack(x), *blocks)
  state, frozen_s, sharded = start(fns, trainable, frozen, batch)
  full, targets, _ = fns.prepare(sharded)
  kept = [np.ones(N // A, bool)] * A
  (idx, valid), *rest = update.plan(kept, 4, np.random.default_rng(0))
  assert len(rest) == 1 and all(v.all() for v in valid)
  mb, mt = update.select_rows(cfg, full, targets, idx, valid)
  got = [mb[k] for k in names] if names else [jax.tree.map(lambda x, p=p: x[p], mb)
                                              for p in range(A)]
  for p in range(A):
    np.testing.assert_array_equal(np.asarray(got[p].response), blocks[p].response[idx[p]])
    np.testing.assert_array_equal(np.asarray(got[p].samples.rewards),
                                  blocks[p].samples.rewards[idx[p]])
  state, out = update.run(fns, cfg, state, frozen_s, sharded, np.random.default_rng(0))
  assert out["updates"] == 2 and np.isfinite(out["loss"]) and abs(out["ratio"] - 1.0) > 1e-4


def test_plan_gives_unequal_blocks_their_own_rows():
  """Blocks that need not share a row count (a mapped team's) each take round_rows of their own
  kept rows, a multiple of the pieces; a block with none keeps `multiple` masked rows. size None:
  one mini-batch of every kept row in order."""
  kept = [np.arange(16) % 3 == 0, np.zeros(16, bool), np.arange(16) < 3]  # 6, 0, 3 kept
  for multiple, rows in ((1, [8, 1, 4]), (2, [8, 2, 4]), (8, [8, 8, 8])):
    (idx, valid), = update.plan(kept, None, None, multiple, equal_blocks=False)
    assert [len(i) for i in idx] == rows and [v.sum() for v in valid] == [6, 0, 3]
    for i, v, k in zip(idx, valid, kept):
      np.testing.assert_array_equal(i[v], np.flatnonzero(k))  # in order
  (idx, valid), = update.plan(kept, None, None, 1)  # stacked blocks: the fullest's rows,
  assert [None if i is None else len(i) for i in idx] == [8, None, 8]  # the empty one left out
  assert valid[1] is None and [v.sum() for v in valid[::2]] == [6, 3]
  mbs = update.plan(kept, 4, np.random.default_rng(0), 1, equal_blocks=False)
  assert len(mbs) == 2 and [len(i) for i in mbs[0][0]] == [4, 1, 4]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind", ["shared", "stacked", "mapped"])
def test_updates_leave_out_the_rows_of_agents_rl_does_not_train(kind, recompute):
  """Agent 1 is not trained (its tokens masked, as `trainer.trained_samples` makes them): the
  update on the rollout's targets computes only agent 0's rows (a stacked batch holds policy 0's
  block alone; a mapped team's agent-1 block is `shards` masked rows), and its loss and
  parameter change are those of the step on the whole masked batch. `recompute`: the learner's
  old log-probs and TIS weights (cap 1.2, a sampler off by noise) of agent 0's rows only, against
  `prepare`'s over the whole batch."""
  names = ("solver", "checker") if kind == "mapped" else ()
  P = 1 if kind == "shared" else 2
  policy = policies.PolicyConfig(kind=kind, models=(MODEL,) * (2 if names else 1),
                                 num_policies=P, names=names,
                                 optim=(OptimConfig(lr=1e-3, eps=1e-2, max_grad_norm=1e9),))
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig("grpo"), loss=LossConfig(),
                    space=SPACE, agent_policies=(0, 0) if P == 1 else None,
                    train=TrainSettings(recompute_old_logp=recompute,
                                        tis_cap=1.2 if recompute else None))
  fns = make_train_step(cfg, make_mesh(2, 1, 1, devices=cpu_devices(2)),
                        compiler_options=FAST_COMPILE)
  one = jax.jit(decoder.init_params, static_argnums=0)(MODEL, jax.random.key(0))
  trainable, frozen = init_params(policy, jax.random.key(1),
                                  base={k: one for k in names} if names else one)
  flat = make_batch_at(one, noise=0.3 * recompute, policy_of_agent=(0, 0) if P == 1 else (0, 1))
  agent = np.asarray(flat.samples.agent_id)
  s = flat.samples
  flat = flat.replace(samples=s.replace(token_mask=s.token_mask & (agent == 0)[:, None]))
  if kind == "shared":
    batch = flat
  else:
    blocks = [jax.tree.map(lambda x, a=a: np.asarray(x)[agent == a], flat) for a in range(A)]
    batch = dict(zip(names, blocks)) if names else jax.tree.map(lambda *x: np.stack(x), *blocks)
  rows = []

  def step(state, frozen, b, t=None):
    rows.append([(np.shape(x.response)[:-1], x.policies)
                 for x in ([b[k] for k in names] if names else [b])])
    return fns.step(state, frozen, b, t)

  outs = {}
  for path in ("plain", "rows"):
    state, frozen_s, sharded = start(fns, trainable, frozen, batch)
    before = host(state.params)
    if path == "plain":  # one step on the whole masked batch
      full, targets, _ = fns.prepare(sharded)
      if recompute:
        full, targets, _ = fns.recompute(state.params, frozen_s, full, targets)
      state, out = fns.step(state, frozen_s, full, targets)
    else:
      state, out = update.run(fns._replace(step=step), cfg, state, frozen_s, sharded,
                              np.random.default_rng(0))
    outs[path] = (host(out), jax.tree.map(np.subtract, host(state.params), before))
  # A change is resolved to the ulp of the float32 param it moves: allow 4 of them.
  ulps = [4 * np.spacing(np.abs(x).max()) for x in jax.tree.leaves(before)]
  # agent 0 has N / A = 8 rows; the mapped checker keeps one masked row per device
  assert rows == [{"shared": [((8,), None)], "stacked": [((1, 8), (0,))],
                   "mapped": [((8,), None), ((2,), None)]}[kind]]
  (plain, d_plain), (got, d_got) = outs["plain"], outs["rows"]
  assert got["updates"] == 1 and abs(plain["loss"]) > 1e-4
  np.testing.assert_allclose(got["loss"], plain["loss"], rtol=1e-5)
  moved = 0
  for x, y, ulp in zip(jax.tree.leaves(d_got), jax.tree.leaves(d_plain), ulps):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=ulp)
    moved += int(np.abs(y).max() > 0)
  assert moved


def test_a_stacked_reference_copies_the_blocks_of_its_reference_policies_alone():
  """reference_policies=(1, 2) of a stacked triple whose blocks all differ: the KL reference
  copies blocks 1 and 2 alone (bit for bit, sharded like the params over fsdp = 2); the
  reference pass of a batch of those two blocks gives each its own policy's log-probs (NumPy
  over that block's forward: a block read from the other policy fails), or of policy 2's block
  alone; a reference of policy 2's block alone refuses the batch of both."""
  policy = policies.PolicyConfig(kind="stacked", models=(MODEL,), num_policies=3,
                                 optim=(OptimConfig(lr=1e-3, eps=1e-2),))
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig("grpo"),
                    loss=LossConfig(kl_coef=0.1), space=SPACE, agent_policies=(1, 2),
                    reference_policies=(1, 2))
  fns = make_train_step(cfg, make_mesh(1, 2, 1, devices=cpu_devices(2)),
                        compiler_options=FAST_COMPILE)
  init_one = jax.jit(decoder.init_params, static_argnums=0)
  blocks = [init_one(MODEL, jax.random.key(p)) for p in range(3)]
  trainable = {"policy": jax.tree.map(lambda *x: np.stack(x), *blocks)}
  trainable, frozen = fns.shard_params(trainable, {})
  reference = fns.reference_params(trainable)
  for ref, full in zip(jax.tree.leaves(reference), jax.tree.leaves(trainable["policy"])):
    assert ref.sharding == full.sharding
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(full)[1:])

  flat = make_batch_at(blocks[1], policy_of_agent=(1, 2))
  agent = np.asarray(flat.samples.agent_id)
  parts = [jax.tree.map(lambda x, a=a: np.asarray(x)[agent == a], flat) for a in range(A)]
  pair = jax.tree.map(lambda *x: np.stack(x), *parts).replace(policies=(1, 2))
  out = host(fns.ref_logp(reference, frozen, fns.shard_batch(pair)))
  assert out.policies == (1, 2)
  for j, p in enumerate((1, 2)):
    mask = parts[j].samples.token_mask
    np.testing.assert_allclose(out.ref_logp[j][mask], ref_logp(blocks[p], parts[j])[mask],
                               atol=2e-5)
  assert not np.allclose(ref_logp(blocks[1], parts[1])[mask], ref_logp(blocks[2], parts[1])[mask],
                         atol=1e-3)  # the blocks differ where it is checked
  one = jax.tree.map(lambda x: x[1:], pair).replace(policies=(2,))
  out = host(fns.ref_logp(reference, frozen, fns.shard_batch(one)))
  np.testing.assert_allclose(out.ref_logp[0][mask], ref_logp(blocks[2], parts[1])[mask],
                             atol=2e-5)
  second = make_train_step(dataclasses.replace(cfg, reference_policies=(2,)),
                           make_mesh(1, 2, 1, devices=cpu_devices(2)),
                           compiler_options=FAST_COMPILE)
  with pytest.raises(ValueError, match=r"the KL reference holds the blocks of policies \(2,\) "
                     r"\(reference_policies\); the batch has blocks of policies \(1, 2\)$"):
    second.ref_logp(second.reference_params(trainable), frozen, fns.shard_batch(pair))


@pytest.mark.parametrize("ids", [(), (2, 1), (1, 1), (3,)])
def test_reference_policies_refusals(ids):
  policy = policies.PolicyConfig(kind="stacked", models=(MODEL,), num_policies=3)
  with pytest.raises(ValueError, match=r"reference_policies=.*; expected None or distinct sorted "
                     r"policy ids in \[0, 3\)"):
    TrainConfig(policy=policy, advantage=AdvantageConfig("grpo"), loss=LossConfig(),
                space=SPACE, agent_policies=(1, 2), reference_policies=ids)
