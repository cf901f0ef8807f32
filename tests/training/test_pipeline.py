"""Asynchronous RL with bounded staleness (`training/pipeline.py`, `train.max_staleness`).

The schedule is derived here from its definition (step s trains on a rollout sampled with the
params of step max(first, s - k)) and checked against what the trainer's rollout thread did:
which seeds each rollout took, which params version served it, and the final params against a
plain loop that follows the same schedule by hand, bit for bit. The importance-weight statistics
are re-derived in NumPy; lag 0 through the pipeline is the synchronous trainer bit for bit.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import host
import toy_task
from marl_jax.parallel import gradients
from marl_jax.parallel import mesh as mesh_lib
from marl_jax.parallel.train_config import TrainSettings
from marl_jax.training import config as config_lib
from marl_jax.training import pipeline, trainer
from marl_jax.training.checkpoint import Checkpointer, saved_steps
from marl_jax.training.metrics import read_metrics
from marl_jax.workflows.rollout import Generation, Sample

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

STEPS, PROBLEMS = 4, 2  # toy_config rolls out 2 problems per step


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  toy_task.register()  # conftest's registration may have been replaced by another module's
  return tiny_model_dir


def _config(model_dir: str, lag: int, steps: int = STEPS):
  c = toy_task.toy_config(model_dir, steps)
  c.train.recompute_old_logp, c.train.tis_cap = True, 2.0
  c.train.max_staleness = lag
  c.eval.every = 100  # one evaluation, after the last step
  return c


@pytest.fixture
def recorded(monkeypatch):
  """Every rollout the trainer makes: (first seed, the version that stamped its replies)."""
  log = []
  real = trainer.rollout

  def rollout(problems, spec, policy, params, cfg):
    result = real(problems, spec, policy, params, cfg)
    log.append((problems[0].kwargs["seed"],
                {s.generation.policy_version for s in result.samples}))
    return result

  monkeypatch.setattr(trainer, "rollout", rollout)
  return log


def _final_params(workdir) -> list[np.ndarray]:
  with Checkpointer(workdir / "checkpoints") as source:
    return jax.tree.leaves(source.restore(STEPS).state["train"]["params"])


def _by_step(workdir) -> dict[int, dict]:
  return {r["step"]: r for r in read_metrics(str(workdir))}


def _by_hand(model_dir, workdir, lag: int) -> list[np.ndarray]:
  """The schedule followed in a plain loop, no thread: rollout s sampled with version
  max(0, s - lag) (params kept aside after each step) from data position s * PROBLEMS."""
  run = trainer.Run(_config(model_dir, lag), str(workdir))
  versions = {0: run.published_params()}
  for step in range(STEPS):
    version = max(0, step - lag)
    run.train_step(step, run.rollout(step, step * PROBLEMS, versions[version], version))
    versions[step + 1] = run.published_params()
  return jax.tree.leaves(jax.device_get(run.state.params))


def test_lag_one_follows_its_schedule(model_dir, tmp_path, recorded):
  trainer.train(_config(model_dir, lag=1), str(tmp_path / "async"))
  # Each step's rollout: fresh consecutive seeds, served by the params one step behind.
  assert recorded[:STEPS] == [(s * PROBLEMS, {max(0, s - 1)}) for s in range(STEPS)]
  metrics = _by_step(tmp_path / "async")
  for step in range(1, STEPS + 1):  # logged as step + 1
    age = 0 if step == 1 else 1
    assert metrics[step][f"staleness/frac_{age}"] == 1.0, (step, metrics[step])
    assert metrics[step]["staleness/mean"] == age
    assert metrics[step]["staleness/dropped"] == 0.0
  # The importance weights: the first step's samples are the learner's own policy (fp32: the
  # sampler's and learner's log-probs agree to rounding), later ones a step behind it.
  assert metrics[1]["is/ess/writer"] > 1 - 1e-6
  assert all(metrics[s]["is/ess/writer"] < 1 - 1e-4 for s in range(2, STEPS + 1))
  assert "eval/accuracy" in metrics[STEPS]
  # The first rollout cannot overlap an update: the learner waits for all of it.
  assert metrics[1]["time/rollout_wait_s"] >= 0.9 * metrics[1]["time/rollout_s"] > 0
  # The thread's timing never changes a number: the same schedule by hand gives the same params.
  by_hand = _by_hand(model_dir, tmp_path / "by_hand", lag=1)
  for a, b in zip(_final_params(tmp_path / "async"), by_hand, strict=True):
    np.testing.assert_array_equal(a, b)


def test_lag_zero_through_the_pipeline_is_the_synchronous_trainer(model_dir, tmp_path):
  """The producer at lag 0 serves step s with version s: the synchronous schedule, bit for bit
  (the trainer itself never starts it at max_staleness 0)."""
  c = _config(model_dir, lag=0)
  sync = trainer.Run(c, str(tmp_path / "sync"))
  for step in range(STEPS):
    sync.train_step(step)
  run = trainer.Run(c, str(tmp_path / "piped"))
  with pipeline.Producer(run, 0, STEPS, 0, run.published_params()) as producer:
    for step in range(STEPS):
      run.train_step(step, producer.take(step))
      assert producer.needed(step + 1) == (step + 1 < STEPS)
      producer.publish(step + 1, run.published_params())
  for a, b in zip(jax.tree.leaves(jax.device_get(sync.state.params)),
                  jax.tree.leaves(jax.device_get(run.state.params)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_rollouts_on_devices_of_their_own(model_dir, tmp_path):
  """train.rollout_devices=4 of 8: the learner's state lives on the first four devices, each
  version's sampler params are handed to the last four (the engine follows its params there),
  and those devices sample what a run whose rollouts share the learner's devices samples."""
  devices = host.cpu_devices(8)
  c = _config(model_dir, lag=1, steps=2)
  c.train.rollout_devices = 4
  trainer.train(c, str(tmp_path / "split"))  # end to end: the rollout thread and the hand-offs
  metrics = _by_step(tmp_path / "split")
  assert metrics[2]["staleness/frac_1"] == 1.0 and "eval/accuracy" in metrics[2]
  split = trainer.Run(c, str(tmp_path / "split_run"))
  shared = trainer.Run(_config(model_dir, lag=1, steps=2), str(tmp_path / "shared"))
  assert dict(split.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 1}
  assert all(x.devices() <= set(devices[:4]) for x in jax.tree.leaves(split.state))
  params = split.published_params()
  assert all(x.devices() <= set(devices[4:]) for x in jax.tree.leaves(params))
  ours = split.rollout(0, 0, params, 0).samples
  theirs = shared.rollout(0, 0, shared.published_params(), 0).samples
  # The same replies, their log-probs to fp32 rounding: FSDP over 4 devices instead of 8 splits
  # the weights' contractions into other partial sums.
  assert [s.generation.token_ids for s in ours] == [s.generation.token_ids for s in theirs]
  np.testing.assert_allclose(np.concatenate([s.generation.logprobs for s in ours]),
                             np.concatenate([s.generation.logprobs for s in theirs]),
                             rtol=1e-5, atol=1e-6)


def test_a_failed_rollout_stops_the_run_with_its_error(model_dir, tmp_path, monkeypatch):
  """The producer's error reaches the learner, which stops; what was trained is checkpointed,
  and a resume restarts the pipeline from the checkpoint's version and data position."""
  real = trainer.Run.rollout

  def failing(self, step, seed, params, version):
    if step == 2:
      raise OSError("disk full")
    return real(self, step, seed, params, version)

  monkeypatch.setattr(trainer.Run, "rollout", failing)
  with pytest.raises(RuntimeError, match=r"rollout producer failed before step 2's rollout: "
                                         r"OSError\('disk full'\)"):
    trainer.train(_config(model_dir, lag=1), str(tmp_path))
  monkeypatch.setattr(trainer.Run, "rollout", real)
  seen = []
  monkeypatch.setattr(trainer.Run, "rollout", lambda self, step, seed, params, version: (
      seen.append((step, seed, version)) or real(self, step, seed, params, version)))
  trainer.train(_config(model_dir, lag=1), str(tmp_path))
  # Steps 0-1 were trained and saved; step 2 starts again from seed 4 with version 2 (the
  # restored params: nothing older), step 3 one behind.
  assert seen == [(2, 2 * PROBLEMS, 2), (3, 3 * PROBLEMS, 2)]
  with Checkpointer(tmp_path / "checkpoints") as ckpt:
    assert ckpt.restore(STEPS).host_state["next_seed"] == STEPS * PROBLEMS


def test_sigkill_and_restart(model_dir, tmp_path):
  """A lag-1 run killed by SIGKILL after a checkpoint (its rollout thread mid-rollout) resumes
  from it: the in-flight rollout is dropped and made again from the checkpoint's data position
  and version, so every step trains on fresh consecutive seeds and no sample is older than 1."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled",
             XLA_FLAGS=host.SUITE_XLA_FLAGS, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  workdir = tmp_path / "run"
  start = lambda: toy_task.start_worker(model_dir, workdir, STEPS, "--max_staleness=1", env=env)
  toy_task.kill_after_checkpoint(start(), workdir, 2)
  resumed_at = saved_steps(workdir)[-1]
  assert resumed_at < STEPS
  resumed = start()
  assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-2000:]
  metrics = _by_step(workdir)
  assert sorted(metrics) == list(range(1, STEPS + 1))
  for step in range(resumed_at + 1, STEPS + 1):  # logged as step + 1
    age = 0 if step == resumed_at + 1 else 1  # the restored version serves the first rollout
    assert metrics[step][f"staleness/frac_{age}"] == 1.0, (step, resumed_at, metrics[step])
  with Checkpointer(workdir / "checkpoints") as ckpt:
    for step in saved_steps(workdir):
      assert ckpt.restore(step).host_state["next_seed"] == step * PROBLEMS


def _sample(version: int, trained: bool = True) -> Sample:
  return Sample(0, 0, 0, "a", 0, 0, 0, -1, [], Generation("", policy_version=version),
                trained=trained)


def test_admit_and_staleness_metrics():
  samples = [_sample(5), _sample(4), _sample(3), _sample(2), _sample(2, trained=False)]
  kept, stale = pipeline.admit(samples, 5, 2)
  assert [s.trained for s in kept] == [True, True, True, False, False]
  assert stale == 1  # the sample already left out is not counted again
  assert [s.generation for s in kept] == [s.generation for s in samples]
  assert pipeline.staleness_metrics(samples, 5, 2) == {
      "staleness/frac_0": 0.2, "staleness/frac_1": 0.2, "staleness/frac_2": 0.2,
      "staleness/older": 0.4, "staleness/mean": (0 + 1 + 2 + 3 + 3) / 5}
  assert [pipeline.served_version(s, 3, 2) for s in range(3, 8)] == [3, 3, 3, 4, 5]


def test_importance_metrics_match_numpy():
  """Per-agent ESS, mean weight and capped fraction, rows split over two devices (psum)."""
  rng = np.random.default_rng(0)
  n, r, agents, cap = 8, 5, 3, 1.5
  learner = rng.normal(-2, 0.5, (n, r)).astype(np.float32)
  sampler = learner + rng.normal(0, 0.4, (n, r)).astype(np.float32)
  mask = rng.random((n, r)) < 0.7
  agent = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.int32)  # agent 2 has no tokens
  mesh = mesh_lib.make_mesh(2, 1, 1, devices=jax.devices()[:2])
  rows = P(mesh_lib.BATCH_AXES)
  got = jax.jit(jax.shard_map(
      lambda *a: gradients.importance_metrics(*a, agents, cap, 20.0), mesh=mesh,
      in_specs=(rows, rows, rows, rows), out_specs=P()))(learner, sampler, mask, agent)
  w = np.exp(learner.astype(np.float64) - sampler)
  for a in range(2):
    wa = w[(agent[:, None] == a) & mask]
    np.testing.assert_allclose(got["ess"][a], wa.sum() ** 2 / (len(wa) * (wa ** 2).sum()),
                               rtol=1e-5)
    np.testing.assert_allclose(got["weight_mean"][a], wa.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["capped"][a], np.mean(wa > cap), rtol=1e-6)
  assert [float(got[k][2]) for k in ("ess", "weight_mean", "capped")] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("field,value,message", [
    ("max_staleness", -1, r"max_staleness=-1; expected an integer >= 0 \(0: synchronous\)"),
    ("max_staleness", 1.5, r"max_staleness=1.5; expected an integer >= 0"),
    ("max_staleness", True, r"max_staleness=True; expected an integer >= 0"),
    ("rollout_devices", -1, r"rollout_devices=-1; expected an integer >= 0 \(0: rollouts and "),
    ("rollout_devices", 2.0, r"rollout_devices=2.0; expected an integer >= 0"),
])
def test_max_staleness_values_are_checked(field, value, message):
  with pytest.raises(ValueError, match=message):
    TrainSettings(**{field: value, "recompute_old_logp": True})


def test_split_devices():
  devices = ["d0", "d1", "d2", "d3"]
  assert config_lib.split_devices(0, devices) == (devices, devices)
  assert config_lib.split_devices(1, devices) == (devices[:3], devices[3:])
  with pytest.raises(config_lib.UserInputError,
                     match=r"^config.train.rollout_devices=4; expected 0 \(rollouts and updates "
                           r"share the devices\) or 1..3 of the 4 devices$"):
    config_lib.split_devices(4, devices)
  with pytest.raises(config_lib.UserInputError,
                     match=r"rollout_devices=1 runs in one process, got 2; expected 0"):
    config_lib.split_devices(1, devices, processes=2)


def test_stale_samples_need_the_proximal_ratio():
  c = config_lib.base_config()
  c.train.max_staleness, c.train.recompute_old_logp = 1, False
  with pytest.raises(config_lib.UserInputError,
                     match=r"max_staleness=1 needs recompute_old_logp=True"):
    config_lib.build(c)
  c.train.recompute_old_logp, c.loss.policy_loss = True, "reinforce"
  c.train.mini_batch_size, c.train.epochs = None, 1
  with pytest.raises(config_lib.UserInputError,
                     match=r"train.max_staleness=1 corrects stale samples through the PPO "
                           r"ratio; expected loss.policy_loss in"):
    config_lib.build(c)
