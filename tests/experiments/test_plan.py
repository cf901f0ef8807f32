"""experiments/plan.py against reality on tiny models: the abstract plan's state, memory and FLOPs
vs the trainer's real step, an independent FLOPs derivation, FSDP sharding and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import atgrpo_plan_path
from experiments import plan
from marl_jax.errors import UserInputError
from marl_jax.models import decoder, precision
from marl_jax.models.config import get_preset
from marl_jax.parallel import layouts, policies
from marl_jax.parallel.train_step import make_train_step
import host
from host import cpu_devices

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = 32


def tiny_config(preset: str = "mas_shared,cpu"):
  """Plan-Path, 4 problems x K=2 tree branches x 1 turn x 2 agents of tiny-llama: 16 samples of
  32 prompt + 16 response tokens."""
  c = atgrpo_plan_path.get_config(preset)
  c.model = "tiny-llama"
  c.rollout.problems_per_step = 4
  c.sampling.max_new_tokens = 16
  return c


def planned_step(s: plan.Setup):
  """(abstract state, frozen, batch, targets, step fn, analysis) of the plan's train step."""
  trainable, frozen = plan.abstract_params(s.policy, s.mesh)
  fns = make_train_step(s.train, s.mesh)
  state = plan.abstract_state(fns, trainable, s.mesh)
  batch = plan.abstract_batch(s, share_prompts=False)
  targets = plan.abstract_targets(s, fns, batch)
  return state, frozen, batch, targets, fns.update, plan.analyse(fns.update, state, frozen,
                                                                  batch, targets, donate=(0,))


def real_samples(s: plan.Setup, vocab: int, seed: int = 0):
  """The plan's stand-in samples with random tokens, log-probs and rewards."""
  rng = np.random.default_rng(seed)
  out = []
  for x in s.samples:
    g = x.generation
    gen = dataclasses.replace(g, prompt_ids=rng.integers(0, vocab, len(g.prompt_ids)).tolist(),
                              token_ids=rng.integers(0, vocab, len(g.token_ids)).tolist(),
                              logprobs=(-rng.random(len(g.token_ids)) - 3.0).tolist())
    out.append(dataclasses.replace(x, generation=gen, reward=float(rng.random())))
  return out


def on_device0(tree) -> int:
  """Bytes of `tree`'s arrays actually allocated on the first device."""
  d0 = jax.devices()[0]
  return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
             if shard.device == d0)


def test_abstract_plan_matches_the_trainers_real_step():
  cpu_devices(8)  # the configs' meshes (conftest's 8 devices)
  c = tiny_config()
  s = plan.setup(c, (2, 4, 1), PROMPT)
  state_abs, frozen_abs, batch_abs, _, step, planned = planned_step(s)

  fns = make_train_step(s.train, s.mesh)
  trainable, frozen = policies.init_params(s.policy, jax.random.key(0))
  trainable, frozen = fns.shard_params(trainable, frozen)
  state = fns.init(trainable)
  batch = fns.shard_batch(layouts.build_batch(s.policy, real_samples(s, 256), s.shape, [0]))
  batch, targets, _ = fns.prepare(batch)
  # The abstract state is the trainer's: shapes, dtypes and shardings.
  for a, r in zip(jax.tree.leaves(state_abs), jax.tree.leaves(state), strict=True):
    assert (a.shape, a.dtype) == (r.shape, r.dtype)
    assert a.sharding.is_equivalent_to(r.sharding, r.ndim), (a.sharding, r.sharding)
  # Exact per-device bytes of params and optimizer state; the step's arguments are those plus
  # the batch and target fields it reads (jit drops the unused ones, e.g. the critic's values).
  assert plan.device_bytes(state_abs.params) == on_device0(state.params)
  assert plan.device_bytes(state_abs.opt_state) == on_device0(state.opt_state)
  assert plan.device_bytes((state_abs, frozen_abs)) == on_device0((state, frozen))
  used = on_device0((state, frozen, batch.prompt, batch.prompt_mask, batch.response))
  assert used <= planned["argument_bytes"] <= on_device0((state, frozen, batch, targets))
  # Lowered from real arrays, the step compiles to the same program.
  concrete = plan.analyse(step, state, frozen, batch, targets, donate=(0,))
  for key in ("flops", "xla_flops", "temp_bytes", "argument_bytes", "output_bytes"):
    assert concrete[key] == planned[key], key
  # The plan's step is the trainer's step: one update from the same state gives the same result.
  ours, our_metrics = jax.jit(step)(state, frozen, batch, targets)
  theirs, their_metrics = fns.step(state, frozen, batch, targets)
  assert float(their_metrics["grad_norm"]) > 0
  np.testing.assert_allclose(our_metrics["loss"], their_metrics["loss"], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_train_step_flops_match_a_derivation():
  """Per device: 3 x forward (backward = 2 x forward) of the matmuls over prompt + response[:-1]:
  2 x (dense params) x tokens, causal attention computed as full T x T scores and values
  (4 x T^2 x Hq x Dh per layer and row), and the LM head on the R response positions only."""
  cpu_devices(8)  # the configs' meshes (conftest's 8 devices)
  c = tiny_config()
  c.train.remat = False  # remat recomputes (most of) the forward: 4x, not 3x
  s = plan.setup(c, (8, 1, 1), PROMPT)
  _, _, batch, _, _, planned = planned_step(s)
  m = get_preset("tiny-llama")
  L, D, F, V = m.num_hidden_layers, m.hidden_size, m.intermediate_size, m.vocab_size
  Hq, Hkv, Dh = m.num_attention_heads, m.num_key_value_heads, m.head_dim
  rows, Tp = batch.prompt.shape
  R = batch.response.shape[1]
  n, T = rows // 8, Tp + R - 1  # rows per device; the forward's tokens
  dense = L * (D * Hq * Dh + 2 * D * Hkv * Dh + Hq * Dh * D + 3 * D * F)
  forward = 2 * dense * n * T + L * 4 * n * T * T * Hq * Dh + 2 * n * R * D * V
  # Equal when written; 1% leaves room for a reshaped but equivalent loss (e.g. a chunked head).
  np.testing.assert_allclose(planned["flops"], 3 * forward, rtol=0.01)
  # The "6 x params x tokens" rule alone (dense part, embedding excluded) misses the attention
  # and the head: here they are a fifth of the total.
  assert 0.7 < 6 * dense * n * T / planned["flops"] < 0.9
  # XLA's own count sees each layer-scan body once, so it is well below.
  assert planned["xla_flops"] < 0.8 * planned["flops"]


def test_mini_batches_plan_one_update_and_count_every_update():
  """16 samples in mini-batches of 8 over 2 epochs: the planned step holds 8 rows and counts 4
  updates, i.e. the FLOPs of 2 full-batch updates (linear in rows); memory is one mini-batch's."""
  cpu_devices(8)  # the configs' meshes (conftest's 8 devices)
  target = plan.parse_target("h100", None, 0.4)
  reports = {}
  for mini in (None, 8):
    c = tiny_config()
    c.train.mini_batch_size, c.train.epochs, c.train.share_prompts = mini, 2, False
    reports[mini] = plan.plan(c, (8, 1, 1), target, prompt_tokens=PROMPT)
  assert reports[8]["train_batch"]["response"][0] == 8
  assert reports[None]["train_batch"]["response"][0] == 16
  full, mini = (reports[k]["programs"]["train_step"] for k in (None, 8))
  np.testing.assert_allclose(mini["flops"], full["flops"], rtol=0.01)
  assert mini["temp_bytes"] < full["temp_bytes"]


def test_matmul_flops_count_scan_trip_counts():
  w = jax.ShapeDtypeStruct((5, 16, 24), jnp.float32)
  x = jax.ShapeDtypeStruct((3, 16), jnp.float32)

  def f(w, x):
    return jax.lax.scan(lambda h, wi: (h, h @ wi), x, w)[1]

  assert plan.matmul_flops(jax.make_jaxpr(f)(w, x)) == 5 * 2 * 3 * 16 * 24


def test_fsdp_splits_the_params_across_devices():
  cpu_devices(8)  # the configs' meshes (conftest's 8 devices)
  c = tiny_config()
  s = plan.setup(c, (1, 8, 1), PROMPT)
  trainable, _ = plan.abstract_params(s.policy, s.mesh)
  nbytes = lambda x: x.size * x.dtype.itemsize
  total = sum(map(nbytes, jax.tree.leaves(trainable)))
  # The norm scales ([L, D] and [D], under 1024 elements per layer) stay replicated.
  scales = sum(nbytes(x) for path, x in jax.tree_util.tree_leaves_with_path(trainable)
               if "scale" in jax.tree_util.keystr(path))
  assert 0 < scales < total / 100
  assert plan.device_bytes(trainable) == (total - scales) / 8 + scales
  assert plan.device_bytes(trainable) < 1.03 * total / 8


@pytest.mark.parametrize("args,needle", [
    (("gpu9", None, 0.4), "--device='gpu9'"),
    (("h100", None, 0.0), "--mfu=0.0"),
    (("12", None, 0.4), "--peak_tflops=None"),
])
def test_bad_targets_are_refused(args, needle):
  with pytest.raises(UserInputError, match=needle.replace("(", r"\(")):
    plan.parse_target(*args)


def test_bad_rollout_splits_are_refused_before_planning():
  cpu_devices(8)
  c = tiny_config()
  c.train.rollout_devices = 8
  h100 = plan.parse_target("h100", None, 0.4)
  with pytest.raises(UserInputError, match=r"rollout_devices=8; expected 0 .* or 1..7 of the 8 "):
    plan.plan(c, (1, -1, 1), h100, prompt_tokens=PROMPT)
  c.train.rollout_devices = 2
  custom = plan.parse_target("12", 100.0, 0.4)
  with pytest.raises(UserInputError, match=r"rollout_devices=2 needs .* expected --link_gbps"):
    plan.plan(c, (1, -1, 1), custom, prompt_tokens=PROMPT)
  with pytest.raises(UserInputError, match=r"--hbm_gbps=0.0; expected a positive GB/s"):
    plan.parse_target("h100", None, 0.4, hbm_gbps=0.0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "experiments.plan", "--config=configs/atgrpo_plan_path.py:cpu",
       "--config.model=tiny-llama", "--config.sampling.max_new_tokens=16", "--devices=4",
       f"--prompt_tokens={PROMPT}", *args], cwd=REPO, capture_output=True, text=True,
      timeout=300, env=os.environ | {"XLA_FLAGS": host.SUITE_XLA_FLAGS, "PYTHONPATH": REPO})


def test_cli_plans_on_fake_devices_and_refuses_what_does_not_fit():
  fits = run_cli("--device=v5e", "--devices=2", "--config.train.rollout_devices=1")
  assert fits.returncode == 0, fits.stderr
  both = json.loads(fits.stdout)
  report, split = both["synchronous"], both["asynchronous"]
  assert report["devices"] == 2 and report["fits"] is True
  assert set(report["programs"]) == {"train_step", "prefill", "decode"}
  # The asynchronous plan: the learner on one device, the rollout on the other.
  assert report["rollout_mesh"] is None and report["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
  assert split["mesh"] == split["rollout_mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
  # v5e (its spec sheet): 819 GB/s of HBM, 400 GB/s of ICI both ways; 16 new tokens per reply.
  for r in (report, split):
    d, t = r["programs"]["decode"], r["schedule"]
    assert d["steps"] == 16
    assert d["hbm_seconds"] == pytest.approx(16 * d["bytes_per_step"] / 819e9, rel=1e-12)
    assert d["seconds"] == max(d["hbm_seconds"], d["flops"] / (0.4 * 197e12))
    # Plan-Path: 1 turn, 2 agents acting one after the other, each wave's rows in one call.
    assert t["rollout_calls"] == 2
    assert t["rollout_seconds"] == 2 * (r["programs"]["prefill"]["seconds"] + d["seconds"])
    assert t["train_seconds"] == r["programs"]["train_step"]["seconds"]
  t = report["schedule"]  # one device set: the two take turns under either schedule
  assert t["handoff_bytes"] == 0
  assert t["asynchronous_seconds"] == t["synchronous_seconds"] == (t["rollout_seconds"]
                                                                   + t["train_seconds"])
  t = split["schedule"]
  assert t["handoff_bytes"] > 0
  assert t["handoff_seconds"] == pytest.approx(t["handoff_bytes"] / 200e9, rel=1e-12)
  assert t["asynchronous_seconds"] == pytest.approx(
      max(t["rollout_seconds"], t["train_seconds"]) + t["handoff_seconds"], rel=1e-12)
  assert both["predicted_speedup"] == pytest.approx(
      report["schedule"]["synchronous_seconds"] / t["asynchronous_seconds"], rel=1e-12)
  # The rollout device holds the sampler's bf16 copy of the whole (shared) model alone; on one
  # device set the train state sits beside the copy.
  copy = jax.eval_shape(lambda: precision.compute_copy(
      decoder.init_params(get_preset("tiny-llama"), jax.random.key(0)), "bfloat16", head=True))
  assert split["programs"]["decode"]["resident_bytes"] == sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(copy))
  assert report["programs"]["decode"]["resident_bytes"] > (
      report["params_bytes"] + report["opt_state_bytes"])
  too_small = run_cli("--device=0.001", "--peak_tflops=1")
  assert too_small.returncode == 1
  last = too_small.stderr.strip().splitlines()[-1]
  assert last.startswith("error: config 'atgrpo_plan_path_mas_shared' needs "), last
  assert "limit is 0.001 GiB" in last and "Traceback" not in too_small.stderr


@pytest.mark.parametrize("preset", ["mas_shared,cpu", "mas_lora,cpu", "mas_full,cpu"])
def test_abstract_params_are_sharded_as_the_trainer_shards_them(preset):
  cpu_devices(8)  # the configs' meshes (conftest's 8 devices)
  s = plan.setup(tiny_config(preset), (1, 8, 1), PROMPT)
  planned = plan.abstract_params(s.policy, s.mesh)
  fns = make_train_step(s.train, s.mesh)
  real = fns.shard_params(*policies.init_params(s.policy, jax.random.key(0)))
  for a, r in zip(jax.tree.leaves(planned), jax.tree.leaves(real), strict=True):
    assert (a.shape, a.dtype) == (r.shape, r.dtype)
    assert a.sharding.is_equivalent_to(r.sharding, r.ndim), (a.sharding, r.sharding)
  assert plan.device_bytes(planned) == on_device0(real)
