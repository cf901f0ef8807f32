"""The shard_map train step: exact across meshes and micro-batches, LoRA isolation, guards, errors.

The reference is written here independently of the step: GRPO advantages in NumPy, response
log-probs from a full-sequence `decoder.forward` (not the step's response-only slicing), and the
PPO dual-clip token-mean loss, differentiated with `jax.grad` on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax.algos import logprobs
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, TrainBatch, make_batch
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.models import decoder
from marl_jax.models.config import get_preset
from marl_jax.models.lora import LoraConfig
from marl_jax.parallel import policies
from marl_jax.parallel import layouts
from marl_jax.parallel.mesh import make_mesh
from marl_jax.parallel.train_config import TrainConfig, TrainSettings
from marl_jax.parallel.train_step import make_train_step
from host import FAST_COMPILE, cpu_devices

MODEL = get_preset("tiny-llama")
N, TP, R, A, K = 16, 6, 4, 2, 4  # samples, prompt len, response len, agents, samples per group
SPACE = GroupSpace(num_problems=N // K, num_agents=A, max_turns=K // A, num_trajs=N // K)
# eps large enough that Adam's first step is a smooth function of the gradient, so updated params
# can be compared at float32 precision; clip at 1.0 exercises the global norm over shards.
OPTIM = OptimConfig(lr=1e-3, eps=1e-2, max_grad_norm=1.0)


def assert_close(got, want, rtol=1e-5):
  """rtol relative to each array's scale (elements near zero need an absolute floor)."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * max(np.max(np.abs(w)), 1e-30))


def device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def assert_state_split_like_params(state):
  """The optimizer state (`recording`'s last gradients + AdamW's two moments, 3 params-shaped
  trees, and a few scalars) takes 3x the params' bytes on a device, not 3x the whole params."""
  whole = sum(x.nbytes for x in jax.tree.leaves(state.params))
  assert device_bytes(state.params) < whole / 2
  assert device_bytes(state.opt_state) <= 3 * device_bytes(state.params) + 1024


def recording(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Wraps an optimizer so its state keeps the last gradients it was given."""

  def init(params):
    return (jax.tree.map(jnp.zeros_like, params), inner.init(params))

  def update(grads, state, params=None):
    updates, inner_state = inner.update(grads, state[1], params)
    return updates, (grads, inner_state)

  return optax.GradientTransformation(init, update)


def _full_logp(params, prompt, prompt_mask, response):
  """Reference log-probs [N, R]: full forward over prompt + response, read at each position."""
  tokens = jnp.concatenate([prompt, response], axis=1)
  mask = jnp.concatenate([prompt_mask, jnp.ones(response.shape, bool)], axis=1)
  logits, _ = decoder.forward(params, tokens, decoder.positions_from_mask(mask), MODEL,
                              attn_mask=mask)
  logp = jax.nn.log_softmax(logits[:, TP - 1:-1], axis=-1)
  return jnp.take_along_axis(logp, response[..., None], axis=-1)[..., 0]


def _ppo_loss(params, prompt, prompt_mask, response, old_logp, adv, mask, clip=0.2, dual=3.0):
  """PPO with dual clip, token mean over `mask`."""
  ratio = jnp.exp(_full_logp(params, prompt, prompt_mask, response) - old_logp)
  per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip, 1 + clip))
  per_token = jnp.where(adv < 0, jnp.minimum(per_token, -dual * adv), per_token)
  return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)


full_logp = jax.jit(_full_logp, compiler_options=FAST_COMPILE)
_ppo_value_and_grad = jax.jit(jax.value_and_grad(_ppo_loss), compiler_options=FAST_COMPILE)


def grpo_advantages(rewards, problem, valid):
  adv = np.zeros_like(rewards)
  for g in np.unique(problem[valid]):
    idx = valid & (problem == g)
    adv[idx] = (rewards[idx] - rewards[idx].mean()) / (rewards[idx].std() + 1e-6)
  return adv


def reference(params, batch: TrainBatch, loss_mask=None):
  """(loss, grads) of the PPO token mean over `loss_mask` samples (default: all valid), with
  GRPO advantages (NumPy) from the whole batch."""
  s = batch.samples
  adv = grpo_advantages(np.asarray(s.rewards), np.asarray(s.problem_id), np.asarray(s.sample_mask))
  loss_mask = np.asarray(s.sample_mask) if loss_mask is None else np.asarray(loss_mask)
  mask = np.asarray(s.token_mask) & loss_mask[:, None]
  return _ppo_value_and_grad(params, batch.prompt, batch.prompt_mask, batch.response,
                             batch.old_logp, adv[:, None], mask)


def make_flat_batch(params, seed=0, policy_of_agent=(0, 0), shared=False) -> TrainBatch:
  """N samples: K per problem, agents alternating, left-padded prompts, ragged responses.
  `shared`: the K samples of a problem share one prompt, and the batch says so (num_prompts:
  N / K distinct prompts)."""
  rng = np.random.default_rng(seed)
  agent = np.arange(N) % A
  pad = rng.integers(0, 3, N)
  prompt_mask = np.arange(TP)[None] >= pad[:, None]
  prompt = np.where(prompt_mask, rng.integers(1, MODEL.vocab_size, (N, TP)), 0).astype(np.int32)
  if shared:  # the first sample's prompt, padding included, for its whole problem
    prompt, prompt_mask = prompt[::K].repeat(K, axis=0), prompt_mask[::K].repeat(K, axis=0)
  response = rng.integers(1, MODEL.vocab_size, (N, R)).astype(np.int32)
  lengths = rng.integers(1, R + 1, N)
  token_mask = np.arange(R)[None] < lengths[:, None]
  samples = make_batch(rng.normal(size=N).astype(np.float32), problem_id=np.arange(N) // K,
                       agent_id=agent, policy_id=np.asarray(policy_of_agent)[agent],
                       token_mask=token_mask)
  logp = np.asarray(full_logp(params, prompt, prompt_mask, response))
  old_logp = (logp + 0.3 * rng.normal(size=logp.shape)).astype(np.float32)  # ratios ~ e^+-0.3
  samples = jax.tree.map(np.asarray, samples)
  return TrainBatch(prompt=prompt, prompt_mask=prompt_mask, response=response,
                    old_logp=old_logp, samples=samples, num_prompts=N // K if shared else None)


def _pad_rows(b: TrainBatch, rows: np.ndarray, size: int, policy: int) -> TrainBatch:
  """Rows `rows` of host batch `b`, padded to `size` with masked-out samples of `policy`."""
  pad = size - len(rows)

  def take(x):
    x = np.asarray(x)[rows]
    return np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x

  out = jax.tree.map(take, b)
  if pad:
    out = out.replace(samples=out.samples.replace(
        policy_id=np.concatenate([out.samples.policy_id[:len(rows)],
                                  np.full(pad, policy, np.int32)]),
        parent_node=np.concatenate([out.samples.parent_node[:len(rows)],
                                    np.full(pad, -1, np.int32)])))
  return out


def arrange(policy, flat: TrainBatch, multiple: int):
  """A flat host batch -> one block per policy (stacked or keyed by name by the layout), each
  padded to a multiple of `multiple` (devices x micro-batches) with masked-out samples."""
  pid = np.asarray(flat.samples.policy_id)
  rows = [np.flatnonzero(pid == p) for p in range(policy.num_policies)]
  size = max(multiple, -(-max(len(r) for r in rows) // multiple) * multiple)
  blocks = [_pad_rows(flat, r, size, p) for p, r in enumerate(rows)]
  return layouts.of(policy).join(policy, blocks)


# Jitted: eager random inits compile one small program per parameter shape.
init_params = jax.jit(policies.init_params, static_argnums=0, compiler_options=FAST_COMPILE)


def build(kind="shared", P=1, mesh_shape=(1, 1, 1), micro_batches=1, estimator="grpo",
          agent_grad_norms=False, logits_chunk=None, model=MODEL, **policy_kw):
  policy = policies.PolicyConfig(kind=kind, models=(model,) * (P if kind == "mapped" else 1),
                                 num_policies=P, optim=(OPTIM,), **policy_kw)
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig(estimator), loss=LossConfig(),
                    space=SPACE, train=TrainSettings(micro_batches=micro_batches,
                                                     agent_grad_norms=agent_grad_norms,
                                                     logits_chunk=logits_chunk))
  devices = cpu_devices(int(np.prod(mesh_shape)))
  fns = make_train_step(cfg, make_mesh(*mesh_shape, devices=devices),
                        optimizer=recording(policies.make_optimizer(policy)),
                        compiler_options=FAST_COMPILE)
  return cfg, fns


def one_update(fns, state, frozen, batch):
  """One update on the whole rollout `batch` (the one update path's single mini-batch): its
  host checks, its targets, the step."""
  fns.check(batch)
  batch, targets, _ = fns.prepare(fns.shard_batch(batch))
  return fns.step(state, frozen, batch, targets)


def run_step(fns, trainable, frozen, batch):
  # Host copies: placing host arrays needs no resharding programs, and the fixtures' arrays
  # survive the step's buffer donation.
  trainable, frozen = fns.shard_params(*jax.tree.map(np.asarray, (trainable, frozen)))
  state, metrics = one_update(fns, fns.init(trainable), frozen, batch)
  return state.opt_state[0], state, jax.device_get(metrics)  # (grads, state, metrics)


@pytest.fixture(scope="module")
def shared_setup():
  cfg, fns = build(agent_grad_norms=True)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  batch = make_flat_batch(trainable["policy"])
  grads, state, metrics = run_step(fns, trainable, frozen, batch)
  return dict(cfg=cfg, fns=fns, trainable=trainable, batch=batch, grads=grads, state=state,
              metrics=metrics)


def test_one_device_matches_reference(shared_setup):
  s = shared_setup
  params, batch = s["trainable"]["policy"], s["batch"]
  loss, grads = reference(params, batch)
  np.testing.assert_allclose(s["metrics"]["loss"], loss, rtol=1e-5)
  assert_close(s["grads"]["policy"], grads)
  assert 0 < s["metrics"]["clip_frac"] < 1  # the clipped branch is exercised
  # Per-agent gradient norm: agent a's loss share over its own tokens only.
  for a in range(A):
    _, g = reference(params, batch, batch.samples.agent_id == a)
    np.testing.assert_allclose(s["metrics"]["agent/grad_norm"][a], optax.global_norm(g),
                               rtol=1e-5)
  # The optimizer saw the gradient and clipped it to norm 1 before AdamW.
  np.testing.assert_allclose(s["metrics"]["grad_norm"], optax.global_norm(grads), rtol=1e-5)
  assert s["metrics"]["grad_norm"] > 1.0


def test_bf16_compute_step_tracks_the_fp32_step(shared_setup):
  """Mixed precision (fp32 params, bf16 compute, `models/precision.py`) on the batch of the fp32
  step: fp32 params, gradients and AdamW moments; loss and gradient norm within what bf16
  rounding can move them.

  The tolerance is a first-order error bound. bf16 keeps 8 significant bits: every rounding
  has relative error <= u = 2^-8. Along one layer's longest chain the forward rounds 22 times
  (a projection's two operands and its output: 3 each for q/k/v, the scores, probs @ v, o, gate/
  up and down; the probabilities, the two residual adds and silu * up: 1 each), so with the
  embedding's cast an L-layer forward accumulates at most n = 22 L + 1 relative errors of u and
  the backward as many again: the loss may move by n u and the gradient norm by 2 n u, relative.
  The check that the two differ at all keeps the bf16 path from being silently the fp32 one."""
  s = shared_setup
  bf16 = MODEL.replace(compute_dtype="bfloat16")
  _, fns = build(agent_grad_norms=True, model=bf16)
  grads, state, metrics = run_step(fns, s["trainable"], {}, s["batch"])
  floats = [x for x in jax.tree.leaves((state.params, grads, state.opt_state[1]))
            if jnp.issubdtype(x.dtype, jnp.floating)]  # (not the optimizer's step counts)
  assert floats and all(x.dtype == jnp.float32 for x in floats)
  n = 22 * MODEL.num_hidden_layers + 1
  u = 2.0 ** -8
  want_loss, want_norm = float(s["metrics"]["loss"]), float(s["metrics"]["grad_norm"])
  loss_err = abs(float(metrics["loss"]) - want_loss) / abs(want_loss)
  norm_err = abs(float(metrics["grad_norm"]) - want_norm) / want_norm
  assert loss_err <= n * u, (loss_err, n * u)
  assert norm_err <= 2 * n * u, (norm_err, 2 * n * u)
  assert max(loss_err, norm_err) > 1e-5  # bf16 really computed (fp32 rounding is ~1e-7)


@pytest.mark.parametrize("mesh_shape, micro_batches, logits_chunk", [
    ((8, 1, 1), 1, None), ((2, 4, 1), 2, None), ((1, 8, 1), 1, None), ((1, 1, 1), 4, None),
    ((1, 1, 1), 1, 3), ((2, 4, 1), 2, 1)])  # LM head in slices of 3 (R = 4: ragged) and 1
def test_meshes_and_micro_batches_match_one_device(shared_setup, mesh_shape, micro_batches,
                                                   logits_chunk):
  s = shared_setup
  _, fns = build(mesh_shape=mesh_shape, micro_batches=micro_batches, agent_grad_norms=True,
                 logits_chunk=logits_chunk)
  grads, state, metrics = run_step(fns, s["trainable"], {}, s["batch"])
  np.testing.assert_allclose(metrics["loss"], s["metrics"]["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["agent/grad_norm"], s["metrics"]["agent/grad_norm"],
                             rtol=1e-5)
  assert_close(grads, s["grads"])
  assert_close(state.params, s["state"].params)
  if mesh_shape[1] > 1:  # FSDP: kernels really are sharded along 'fsdp', and so is the state
    kernel = state.params["policy"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert "fsdp" in tuple(kernel.sharding.spec)
    assert_state_split_like_params(state)


@pytest.mark.parametrize("mesh_shape, micro_batches", [((1, 1, 1), 2), ((1, 2, 1), 1)])
def test_shared_prompts_match_reference(mesh_shape, micro_batches, monkeypatch):
  """Each distinct prompt computed once per device and micro-batch (TrainBatch.num_prompts = 4
  for 16 rows): loss and gradients equal the reference's full forward per sample, on one device
  with 2 micro-batches and on an FSDP mesh (8 rows, 2 prompts, per shard or micro-batch)."""
  shared_calls = []
  inner = logprobs._shared_prompt_hidden
  monkeypatch.setattr(logprobs, "_shared_prompt_hidden", lambda *a, **k: shared_calls.append(
      a[-1]) or inner(*a, **k))  # records num_prompts at trace time
  cfg, fns = build(mesh_shape=mesh_shape, micro_batches=micro_batches)
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  batch = make_flat_batch(trainable["policy"], shared=True)
  grads, _, metrics = run_step(fns, trainable, frozen, batch)
  assert shared_calls and set(shared_calls) == {4}  # 8 local rows ran 4 prompt rows
  loss, want = reference(trainable["policy"], batch)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  assert_close(grads["policy"], want)


@pytest.mark.parametrize("kind, shared", [("stacked", False), ("mapped", False),
                                          ("stacked", True)])
def test_separate_models_on_fsdp_mesh(kind, shared):
  """P full models (stacked / mapped) on an FSDP mesh with micro-batches: policy p's gradient is
  the reference gradient of its own agent's samples, normalised by its own token count. Shared:
  one device, each block's 8 rows computing their 4 prompts once."""
  names = ("solver", "verifier") if kind == "mapped" else ()
  mesh_shape, micro_batches = ((1, 1, 1), 1) if shared else ((2, 4, 1), 2)
  cfg, fns = build(kind, P=2, mesh_shape=mesh_shape, micro_batches=micro_batches, names=names)
  one = jax.jit(decoder.init_params, static_argnums=0, compiler_options=FAST_COMPILE)(
      MODEL, jax.random.key(0))
  base = {k: one for k in names} if kind == "mapped" else one
  trainable, frozen = init_params(cfg.policy, jax.random.key(1), base=base)
  flat = make_flat_batch(one, policy_of_agent=(0, 1), shared=shared)
  # Pads each block to 16 rows (8 devices x 2 micro-batches), or keeps its 8 on one device.
  batch = arrange(cfg.policy, flat, multiple=1 if shared else 8 * 2)
  grads, state, metrics = run_step(fns, trainable, frozen, batch)
  if not shared:
    assert_state_split_like_params(state)
  want = [reference(one, flat, flat.samples.agent_id == a) for a in range(A)]
  np.testing.assert_allclose(metrics["loss"], sum(loss for loss, _ in want), rtol=1e-5)
  for p, (_, g) in enumerate(want):
    got = jax.tree.map(lambda x: x[p], grads["policy"]) if kind == "stacked" else (
        grads["policy"][names[p]])
    assert_close(got, g)


def test_critic_on_fsdp_mesh_matches_one_device():
  """MARFT: per-agent LoRA + value head over the FSDP-sharded frozen base, gae_token advantages
  and the value loss; the same loss and gradients on one device and on (2, 4, 1)."""
  runs = []
  for mesh_shape in ((1, 1, 1), (2, 4, 1)):
    cfg, fns = build("lora", P=2, mesh_shape=mesh_shape, estimator="gae_token",
                     lora=LoraConfig(rank=4, alpha=8.0), critic=(16,))
    trainable, frozen = init_params(cfg.policy, jax.random.key(0))
    batch = make_flat_batch(frozen["base"], policy_of_agent=(0, 1))
    rng = np.random.default_rng(3)
    batch = batch.replace(samples=batch.samples.replace(  # one trajectory per problem
        traj_id=batch.samples.problem_id, turn=(np.arange(N) % K) // A,
        token_values=rng.normal(size=(N, R)).astype(np.float32)))
    runs.append(run_step(fns, trainable, frozen, batch))
  (g1, _, m1), (g8, _, m8) = runs
  assert set(g1) == {"policy", "critic"} and m1["value_abs_err"] > 0
  np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
  assert_close(g8, g1)


def test_lora_isolation_and_frozen_base():
  """Adapter p's gradient comes only from policy p's samples; the base is never written."""
  cfg, fns = build("lora", P=2, mesh_shape=(2, 4, 1), estimator="drmas",
                   lora=LoraConfig(rank=4, alpha=8.0))
  trainable, frozen = init_params(cfg.policy, jax.random.key(0))
  # Non-zero B so that both A and B receive gradients.
  rng = np.random.default_rng(1)
  trainable = jax.tree.map(lambda x: np.asarray(x) + 0.01 * rng.normal(size=x.shape).astype(
      np.float32), trainable)
  base_before = jax.tree.map(np.array, frozen)
  batch = make_flat_batch(frozen["base"], policy_of_agent=(0, 1))
  grads, _, _ = run_step(fns, trainable, frozen, batch)
  agent1 = batch.samples.agent_id == 1
  masked = batch.replace(samples=batch.samples.replace(
      sample_mask=batch.samples.sample_mask & ~agent1))
  changed = batch.replace(  # policy 1's samples: new tokens, log-probs and rewards
      response=np.where(agent1[:, None], rng.integers(1, 256, (N, R)), batch.response
                        ).astype(np.int32),
      old_logp=np.where(agent1[:, None], batch.old_logp - 0.1, batch.old_logp),
      samples=batch.samples.replace(rewards=np.where(agent1, -batch.samples.rewards,
                                                     batch.samples.rewards)))
  grads_masked, _, _ = run_step(fns, trainable, frozen, masked)
  grads_changed, _, _ = run_step(fns, trainable, frozen, changed)
  p0 = lambda g: jax.tree.map(lambda x: np.asarray(x)[:, 0], g["policy"])
  p1 = lambda g: jax.tree.map(lambda x: np.asarray(x)[:, 1], g["policy"])
  for leaf in jax.tree.leaves(p1(grads_masked)):
    assert not np.any(leaf)  # no samples of policy 1: exactly zero gradient
  assert all(np.any(leaf) for leaf in jax.tree.leaves(p1(grads)))
  assert_close(p0(grads_masked), p0(grads), rtol=1e-6)
  assert_close(p0(grads_changed), p0(grads), rtol=1e-6)
  assert not np.allclose(jax.tree.leaves(p1(grads_changed))[0], jax.tree.leaves(p1(grads))[0])
  assert set(grads) == {"policy"}  # the base has no gradient and no optimizer state
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, frozen), base_before)


def test_non_finite_guard(shared_setup):
  s = shared_setup
  fns, batch = s["fns"], s["batch"]
  # NaN where no token is trained is harmless...
  nan_masked = batch.replace(old_logp=np.where(batch.samples.token_mask, batch.old_logp, np.nan))
  _, _, metrics = run_step(fns, s["trainable"], {}, nan_masked)
  assert metrics["finite"] and np.isfinite(metrics["loss"])
  # ...a NaN reward of a trained sample skips the update, leaving everything bitwise unchanged.
  bad = batch.replace(samples=batch.samples.replace(
      rewards=batch.samples.rewards.copy()))
  bad.samples.rewards[3] = np.nan
  trainable, _ = fns.shard_params(jax.tree.map(np.asarray, s["trainable"]), {})
  state = fns.init(trainable)
  before = jax.tree.map(np.array, (state.params, state.opt_state))
  state, metrics = one_update(fns, state, {}, bad)
  assert not metrics["finite"] and int(state.skipped) == 1 and int(state.step) == 1
  after = jax.tree.map(np.asarray, (state.params, state.opt_state))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  state, metrics = one_update(fns, state, {}, batch)
  assert metrics["finite"] and int(state.skipped) == 1 and int(state.step) == 2
  assert_close(state.params, s["state"].params)


def _cfg(**kw):
  args = dict(policy=policies.PolicyConfig(models=(MODEL,)), advantage=AdvantageConfig("grpo"),
              loss=LossConfig(), space=SPACE)
  args.update(kw)
  return TrainConfig(**args)


def test_config_errors():
  with pytest.raises(ValueError, match="unknown estimator 'gppo'"):
    _cfg(advantage=AdvantageConfig("gppo"))
  two = policies.PolicyConfig(kind="stacked", models=(MODEL,), num_policies=2)
  with pytest.raises(ValueError, match=r"policy ids \[2\] with no params"):
    _cfg(policy=two, agent_policies=(0, 2))
  with pytest.raises(ValueError, match="agent_policies has 3 entries .* num_agents=2"):
    _cfg(policy=two, agent_policies=(0, 1, 1))
  three = policies.PolicyConfig(kind="stacked", models=(MODEL,), num_policies=3)
  with pytest.raises(ValueError, match="3 policies for 2 agents"):
    _cfg(policy=three)
  with pytest.raises(ValueError, match="optim has 3 configs"):
    policies.PolicyConfig(kind="stacked", models=(MODEL,), num_policies=2, optim=(OPTIM,) * 3)
  with pytest.raises(ValueError, match="'gae_action' needs a critic"):
    _cfg(advantage=AdvantageConfig("gae_action"))
  with pytest.raises(ValueError,
                     match=r"policy.critic=\(8,\) needs policy.kind='lora' \(the frozen base"):
    policies.PolicyConfig(models=(MODEL,), critic=(8,))
  with pytest.raises(ValueError, match="unknown policy kind"):
    policies.PolicyConfig(kind="per_role", models=(MODEL,))
  with pytest.raises(ValueError, match="entropy_coef=0.01 needs with_entropy"):
    _cfg(loss=LossConfig(entropy_coef=0.01), with_entropy=False)


def test_batch_errors_before_compute(shared_setup):
  """Bad batches fail on the host, naming the culprit, before anything is compiled or run."""
  s = shared_setup
  cfg, fns, batch = s["cfg"], s["fns"], s["batch"]
  bad_policy = batch.replace(samples=batch.samples.replace(
      policy_id=np.where(np.arange(N) == 5, 1, 0).astype(np.int32)))
  with pytest.raises(ValueError, match="sample 5: policy_id=1 .* 1 policies with params"):
    fns.check(bad_policy)
  bad_agent = batch.replace(samples=batch.samples.replace(
      agent_id=np.where(np.arange(N) == 2, 2, batch.samples.agent_id).astype(np.int32)))
  with pytest.raises(ValueError, match="sample 2: agent_id=2 outside"):
    fns.check(bad_agent)
  short = jax.tree.map(lambda x: x[:12], batch)
  _, fns8 = build(mesh_shape=(8, 1, 1))
  with pytest.raises(ValueError, match="12 samples per block do not split into 8"):
    fns8.check(short)
  with pytest.raises(ValueError, match="old_logp has shape"):
    fns.check(batch.replace(old_logp=batch.old_logp[:, :2]))
  del cfg
